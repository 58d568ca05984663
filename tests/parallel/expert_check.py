"""Rank-side checks of expert parallelism (megakern.parallel.expert): a 2-layer moe-tiny (block 0 dense, block 1 MoE
with 4 experts; sigmoid router with its balancing bias, aux and z losses on) trained a few SGD steps with clipping
and the training step's MoE statistics under an ep layout, against one process (the local mesh of ones) under the
same seed and micro-batches: losses (and a held-out loss after training), clip norms, every weight (each rank's expert slice against the single model's
experts), the routers' biases and the step's MoE figures. Also: a rank whose experts receive no token, the
checkpoint resharded across ep sizes and between DDP and FSDP2, and the bad layouts."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from gpt_check import batches, expected_slice, full_param
from torch.distributed.tensor import DTensor
from moe_check import _local_mesh, moe_config

from megakern.models.gpt import GPT
from megakern.parallel import ParallelDims, parallelize
from megakern.train.experts import MoEStats

RTOL, ATOL = 2e-4, 2e-6
MAX_NORM = 0.5
CONFIG = dict(n_experts=4, moe_top_k=2)


def _build(mesh, options: dict, config: dict):
    cfg = moe_config(**{**CONFIG, **config})
    with torch.device("meta"):
        model = GPT(cfg)
    return cfg, parallelize(model, mesh, None, generator=torch.Generator().manual_seed(7), **options)


def _train(mesh, options: dict, steps: int, global_batch: int, seqlen: int, config: dict, bias=None):
    cfg, pmodel = _build(mesh, options, config)
    if bias is not None:  # a forced routing: the sigmoid routers' biases
        for g in pmodel.gpts:
            for layer in g.moe_layers():
                layer.router.expert_bias.copy_(bias)
    moe = MoEStats(pmodel, torch.device("cpu"))
    opt = pmodel.build_optimizer(torch.optim.SGD, lr=0.2, momentum=0.9)
    d = mesh.dims
    b = global_batch // d.dp
    mine = slice(mesh.dp_rank * b, (mesh.dp_rank + 1) * b)
    losses, norms, figures = [], [], []
    for idx, targets in batches(steps, global_batch, seqlen, cfg.vocab_size):
        moe.begin()
        loss = pmodel.forward_backward(idx[mine], targets[mine])
        moe.reduce()
        norms.append(float(pmodel.clip_grad_norm_(MAX_NORM)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if pmodel.masters is not None:
            pmodel.masters.copy_to_model()
        if bias is None:
            moe.update_bias(torch.tensor(False))
        losses.append(float(loss))
        figures.append(moe.figures())
    idx, targets = batches(1, global_batch, seqlen, cfg.vocab_size)[0]
    pmodel.eval()
    losses.append(float(pmodel.eval_loss(idx[mine], targets[mine])))  # a forward without gradients dispatches too
    pmodel.train()
    weights = {name: (full_param(p).float().clone(), tp_dim, p in pmodel.expert_params)
               for name, p, tp_dim, _, tied in pmodel._param_table() if not tied}
    biases = {layer.row: layer.router.expert_bias.clone() for g in pmodel.gpts for layer in g.moe_layers()}
    # how the experts are held: DTensor placements over the expert-data-parallel ranks (FSDP2), or "whole"
    placements = sorted({str(p.placements) if isinstance(p, DTensor) else "whole" for p in pmodel.expert_params})
    return losses, norms, weights, biases, torch.stack(figures), placements


def _expected(full: torch.Tensor, tp_dim, expert: bool, pm) -> torch.Tensor:
    if expert:
        n = full.shape[0] // pm.dims.ep
        return full[pm.ep_rank * n:(pm.ep_rank + 1) * n]
    return expected_slice(full, tp_dim, pm.dims.tp, pm.tp_rank)


def check_ep(layout: dict, options: dict, steps: int = 3, global_batch: int = 4, seqlen: int = 32,
             config: dict | None = None, bias: list[float] | None = None, both: dict | None = None,
             rtol: float = RTOL, atol: float = ATOL) -> dict:
    """Training under ``layout`` (with ep) against one process (see the module docstring); ``both``: options of
    both runs (e.g. master_weights). Returns the losses, the first step's MoE figures and how the expert weights are
    held ("whole", or their FSDP2 placements)."""
    global RTOL, ATOL
    RTOL, ATOL = rtol, atol
    config, both = config or {}, both or {}
    bias = None if bias is None else torch.tensor(bias)
    pm = ParallelDims(**layout).build("cpu", timeout=60)
    losses, norms, weights, biases, figures, placements = _train(pm, {**options, **both}, steps, global_batch,
                                                                 seqlen, config, bias)
    m = options.get("microbatches") or (pm.dims.pp if pm.dims.pp > 1 else 1)
    one = _train(_local_mesh(), {"microbatches": m * pm.dims.dp, **both}, steps, global_batch, seqlen, config, bias)
    one_losses, one_norms, one_weights, one_biases, one_figures, _ = one
    rank = dist.get_rank()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one_losses), rtol=RTOL, atol=ATOL,
                               msg=lambda msg: f"losses (rank {rank}): {msg}")
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(one_norms), rtol=RTOL, atol=ATOL,
                               msg=lambda msg: f"clip norms (rank {rank}): {msg}")
    assert max(one_norms) > MAX_NORM, f"the clip must act for the check to mean something: {one_norms}"
    torch.testing.assert_close(figures, one_figures, rtol=RTOL, atol=max(ATOL, 1e-5),
                               msg=lambda msg: f"MoE figures (rank {rank}): {msg}")
    experts = 0
    for name, (w, tp_dim, expert) in weights.items():
        experts += expert
        want = _expected(one_weights[name][0], tp_dim, expert, pm)
        torch.testing.assert_close(w, want, rtol=RTOL, atol=ATOL, msg=lambda msg: f"{name} (rank {rank}): {msg}")
    assert experts == 2 * len(biases), f"expected the w_in / w_out of {len(biases)} MoE layers sharded: {experts}"
    for row, b in biases.items():
        torch.testing.assert_close(b, one_biases[row], rtol=0, atol=max(ATOL / 20, 1e-7),
                                   msg=lambda msg: f"expert bias of MoE layer {row} (rank {rank}): {msg}")
    return {"losses": losses, "first_step_tokens": one_figures[0].tolist(), "placements": placements}


# ---- host reads -----------------------------------------------------------------------------------------------------
def dispatch_host_reads(factor: float | None) -> list[str]:
    """The host reads (tests/host_reads.py) that parallel/expert.py makes in one forward + backward of ep2 over dp2
    with capacity factor ``factor`` (None: dropless)."""
    from host_reads import host_reads

    pm = ParallelDims(dp=2, ep=2).build("cpu", timeout=60)
    cfg, pmodel = _build(pm, dict(dp_shard="ddp"), dict(moe_capacity_factor=factor))
    idx, targets = batches(1, 4, 32, cfg.vocab_size)[0]
    mine = slice(pm.dp_rank * 2, (pm.dp_rank + 1) * 2)
    reads = host_reads(pmodel.forward_backward, idx[mine], targets[mine])
    return [f"{what} at {where}" for what, where in reads if where.startswith("expert.py:")]


# ---- checkpoints across ep sizes -------------------------------------------------------------------------------------
def _state(pmodel, opt, load=False):
    return pmodel.checkpoint_state(opt, for_load=load)


def save_ep(layout: dict, path: str, steps: int = 2, dp_shard: str = "ddp") -> list[float]:
    """Train ``steps`` AdamW steps under ``layout`` and save model and optimizer with DCP; returns the losses."""
    pm = ParallelDims(**layout).build("cpu", timeout=60)
    cfg, pmodel = _build(pm, dict(dp_shard=dp_shard), {})
    opt = pmodel.build_optimizer(torch.optim.AdamW, lr=1e-2)
    b = 4 // pm.dims.dp
    mine = slice(pm.dp_rank * b, (pm.dp_rank + 1) * b)
    losses = []
    for idx, targets in batches(steps, 4, 32, cfg.vocab_size):
        losses.append(float(pmodel.forward_backward(idx[mine], targets[mine])))
        opt.step()
        opt.zero_grad(set_to_none=True)
    dcp.save(_state(pmodel, opt), checkpoint_id=path)
    return losses


def load_ep(layout: dict | None, path: str, dp_shard: str = "ddp") -> dict:
    """Load the checkpoint under ``layout`` (None: one process, its local mesh) and train one more step: returns
    the expert weights' full (E, ...) tensors (gathered over ep) after the load and after the step, and the step's
    loss."""
    pm = _local_mesh() if layout is None else ParallelDims(**layout).build("cpu", timeout=60)
    cfg, pmodel = _build(pm, dict(dp_shard=dp_shard), {})
    opt = pmodel.build_optimizer(torch.optim.AdamW, lr=1e-2)
    state = _state(pmodel, opt, load=True)
    if pm.local:
        dcp.load(state, checkpoint_id=path, no_dist=True)
    else:
        dcp.load(state, checkpoint_id=path)
    pmodel.load_checkpoint_state(state, opt)
    loaded = _full_experts(pmodel, pm)
    idx, targets = batches(3, 4, 32, cfg.vocab_size)[2]
    b = 4 // pm.dims.dp
    mine = slice(pm.dp_rank * b, (pm.dp_rank + 1) * b)
    loss = float(pmodel.forward_backward(idx[mine], targets[mine]))
    opt.step()  # the optimizer's moments were resharded too
    return {"loaded": loaded, "loss": loss, "stepped": _full_experts(pmodel, pm)}


def _full_experts(pmodel, pm) -> dict:
    """Each MoE layer's expert weights as the single model's (E, ...) tensors (gathered over edp (FSDP2) and ep)."""
    out = {}
    for name, p in pmodel.named_parameters():
        if p in pmodel.expert_params:
            mine = full_param(p).contiguous()
            parts = [torch.empty_like(mine) for _ in range(pm.dims.ep)]
            dist.all_gather(parts, mine, group=pm.ep_group)
            out[name] = torch.cat(parts)
        elif name.endswith(("mlp.w_in", "mlp.w_out")):
            out[name] = full_param(p).clone()
    return out


# ---- bad layouts -----------------------------------------------------------------------------------------------------
def bad_layout(layout: dict, options: dict, config: dict) -> str:
    """The ValueError parallelize (or ParallelDims) raises for this layout and model, as text ('' if none)."""
    try:
        pm = ParallelDims(**layout).build("cpu", timeout=60)
        _build(pm, options, config)
    except ValueError as exc:
        return str(exc)
    return ""
