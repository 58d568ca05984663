"""The optimizer's parameter groups and implementation: AdamW groups with weight decay where it belongs
(``param_groups``), optim.fused resolved (``optimizer_impl``: megakern's master-weight AdamW, torch's fused or
foreach) and its arguments, and whether an optimizer skips a bad step by itself on the device (``device_skip``)."""
from __future__ import annotations

import torch

from megakern.config import ConfigError


EMBEDDINGS = ("wte.weight", "wpe.weight")


def param_groups(named_parameters, config, *, tied: bool) -> list[dict]:
    """AdamW groups from (name, parameter) pairs: matrices decayed (the embeddings wte/wpe, and a tied output head,
    only with optim.decay_embeddings), norm weights and biases not. Each parameter once."""
    embeddings = EMBEDDINGS + (("lm_head.weight",) if tied else ())
    decay, no_decay, seen = [], [], set()
    for name, p in named_parameters:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if p.ndim >= 2 and (config.decay_embeddings or name not in embeddings):
            decay.append(p)
        else:
            no_decay.append(p)
    return [{"params": decay, "weight_decay": config.weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def optimizer_impl(config, device: torch.device, precision: str, sharded: bool) -> str:
    """optim.fused resolved: 'auto' takes megakern's master-weight AdamW for bf16 weights with fp32 masters on CUDA
    (Triton) where the masters are whole on each rank (not ``sharded`` by FSDP2 or ZeRO-1), torch's fused kernel
    elsewhere on CUDA, foreach on other devices. 'megakern' where it cannot run is a ConfigError."""
    from megakern import _backend

    impl = config.fused
    if impl == "auto":
        megakern_ok = (device.type == "cuda" and precision == "bf16" and not sharded
                       and not _backend.triton_problem(device))
        return "megakern" if megakern_ok else "fused" if device.type == "cuda" else "foreach"
    if impl == "megakern":
        if precision != "bf16":
            raise ConfigError(f"optim.fused=megakern updates fp32 master weights and writes the bf16 weights: it "
                              f"needs train.precision=bf16 (this run is {precision})")
        if sharded:
            raise ConfigError("optim.fused=megakern updates whole fp32 masters; under FSDP2 or ZeRO-1 the optimizer "
                              "steps on shards: use optim.fused=auto or fused")
        problem = _backend.triton_problem(device)
        if problem:
            raise ConfigError(f"optim.fused=megakern runs a Triton kernel, which cannot run here: {problem}")
    return impl


def optimizer_kwargs(config, impl: str) -> dict:
    """torch.optim.AdamW's arguments for implementation ``impl`` (optimizer_impl's resolution of optim.fused).
    'megakern' builds a fused torch AdamW, which holds the state and hyperparameters MasterAdamW steps with (and
    steps by itself where MasterAdamW does not run, e.g. to initialize state for a checkpoint load)."""
    kwargs = {"fused": True} if impl in ("fused", "megakern") else {"foreach": impl == "foreach"}
    return dict(lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps, **kwargs)



def device_skip(optimizer) -> bool:
    """Whether ``optimizer`` skips a step by itself when its ``found_inf`` attribute holds a nonzero tensor: torch's
    Adam / AdamW with fused=True in every group (what torch.amp.GradScaler relies on)."""
    return (type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
            and all(g.get("fused") for g in optimizer.param_groups))

