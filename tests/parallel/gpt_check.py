"""Rank-side checks for the parallel GPT tests: a tiny GPT trained a few steps under a layout, against the same
GPT trained on one process under the same seed (each rank runs that reference itself)."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megakern.models.gpt import GPT, GPTConfig
from megakern.parallel import ParallelDims, parallelize

# fp32 throughout; sums over ranks reorder the arithmetic
RTOL, ATOL = 2e-4, 2e-6

STYLES = {
    # GPT-2 style: learned positions, tied embeddings, LayerNorm with bias, GELU
    "gpt": dict(norm="layernorm", position="learned", activation="gelu", bias=True, tie_embeddings=True),
    # Llama style: rotary, untied, RMSNorm, SwiGLU, grouped-query attention, no bias
    "llama": dict(norm="rmsnorm", position="rotary", activation="swiglu", bias=False, tie_embeddings=False),
}


def tiny_config(style: str, n_layer: int = 2) -> GPTConfig:
    return GPTConfig(n_layer=n_layer, n_embd=64, n_head=4, n_kv_head=2, vocab_size=120, max_seqlen=32,
                     ffn_hidden=96, dropout=0.0, **STYLES[style])


def batches(steps: int, batch: int, seqlen: int, vocab: int):
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        idx = torch.randint(0, vocab, (batch, seqlen), generator=g)
        targets = torch.randint(0, vocab, (batch, seqlen), generator=g)
        targets[0, :3] = -100  # ignored tokens count nowhere
        out.append((idx, targets))
    return out


def full_grad(p: torch.Tensor) -> torch.Tensor:
    """The gradient of this rank's parameter, gathered over FSDP's shards (a collective for DTensors)."""
    g = p.grad
    return g.full_tensor() if isinstance(g, DTensor) else g


def full_param(p: torch.Tensor) -> torch.Tensor:
    return p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()


def expected_slice(full: torch.Tensor, tp_dim, tp: int, tp_rank: int) -> torch.Tensor:
    if tp_dim is None:
        return full
    n = full.shape[tp_dim] // tp
    return full.narrow(tp_dim, tp_rank * n, n)


def compare_to_reference(pmodel, ref: GPT, what: str, grads: bool = True) -> None:
    """Every local parameter (or its gradient) equals this rank's slice of the reference's."""
    ref_params = dict(ref.named_parameters())
    tp, tp_rank = pmodel.tp, pmodel.mesh.tp_rank
    for name, p, tp_dim, _, tied_copy in pmodel._param_table():
        ref_name = "wte.weight" if tied_copy or (name == "lm_head.weight" and ref.lm_head is None) else name
        want_full = ref_params[ref_name].grad if grads else ref_params[ref_name].detach()
        got = full_grad(p) if grads else full_param(p)
        want = expected_slice(want_full, tp_dim, tp, tp_rank)
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{what}: {name} (rank {dist.get_rank()}): {m}")


def check_train(layout: dict, options: dict, style: str = "gpt", n_layer: int = 2, steps: int = 3,
                global_batch: int = 4, seqlen: int = 16, max_norm: float | None = 0.05, meta: bool = False):
    """Train ``steps`` SGD steps (momentum, clipping) under ``layout`` and on one process; assert equal losses,
    clip norms, gradients and parameters. Returns the losses."""
    cfg = tiny_config(style, n_layer)
    torch.manual_seed(0)
    ref = GPT(cfg)
    if meta:  # built without memory, each shard initialized by parallelize as init_weights(gen) would
        with torch.device("meta"):
            model = GPT(cfg)
        gen = torch.Generator().manual_seed(7)
        ref.init_weights(torch.Generator().manual_seed(7))
    else:
        model, gen = copy.deepcopy(ref), None
    pm = ParallelDims(**layout).build("cpu", timeout=60)
    pmodel = parallelize(model, pm, None, generator=gen, **options)
    if meta:
        compare_to_reference(pmodel, ref, "initialization", grads=False)
    opt = pmodel.build_optimizer(torch.optim.SGD, lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    d = pm.dims
    b = global_batch // d.dp
    losses = []
    for step, (idx, targets) in enumerate(batches(steps, global_batch, seqlen, cfg.vocab_size)):
        ref_loss = ref(idx, targets)
        ref_loss.backward()
        mine = slice(pm.dp_rank * b, (pm.dp_rank + 1) * b)
        loss = pmodel.forward_backward(idx[mine], targets[mine])
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"step {step} loss: {m}")
        compare_to_reference(pmodel, ref, f"step {step} gradients")
        if max_norm is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
            norm = pmodel.clip_grad_norm_(max_norm)
            torch.testing.assert_close(norm, ref_norm, rtol=RTOL, atol=ATOL, msg=lambda m: f"step {step} norm: {m}")
            assert ref_norm > max_norm, "the clip must act for the check to mean something"
            compare_to_reference(pmodel, ref, f"step {step} clipped gradients")
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    compare_to_reference(pmodel, ref, "final parameters", grads=False)
    idx, targets = batches(1, global_batch, seqlen, cfg.vocab_size)[0]
    with torch.no_grad():
        ref_eval = ref(idx, targets)
    pmodel.eval()
    mine = slice(pm.dp_rank * b, (pm.dp_rank + 1) * b)
    torch.testing.assert_close(pmodel.eval_loss(idx[mine], targets[mine]), ref_eval, rtol=RTOL, atol=ATOL)
    return losses


def train_and_checkpoint(layout: dict, options: dict, directory: str, *, save: bool, style: str = "gpt",
                         seed: int = 0):
    """save: train 2 AdamW steps, save a DCP checkpoint, then train 2 more. load (save=False): build the model
    from another seed, load the checkpoint, train the same 2 more steps. Returns the losses of those 2 steps and,
    after saving, the saved parameters gathered to full tensors by name (for the single-process load)."""
    import torch.distributed.checkpoint as dcp

    cfg = tiny_config(style, 2)
    torch.manual_seed(seed)
    model = GPT(cfg)
    pm = ParallelDims(**layout).build("cpu", timeout=60)
    pmodel = parallelize(model, pm, None, **options)
    opt = pmodel.build_optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    d = pm.dims
    b = 4 // d.dp
    mine = slice(pm.dp_rank * b, (pm.dp_rank + 1) * b)
    data = batches(4, 4, 16, cfg.vocab_size)

    def step(idx, targets):
        loss = pmodel.forward_backward(idx[mine], targets[mine])
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    if save:
        for idx, targets in data[:2]:
            step(idx, targets)
        dcp.save(pmodel.checkpoint_state(opt), checkpoint_id=directory)
    else:
        state = pmodel.checkpoint_state(opt, for_load=True)
        dcp.load(state, checkpoint_id=directory)
        pmodel.load_checkpoint_state(state, opt)
        assert opt.param_groups[0]["lr"] == 1e-2
    return [step(idx, targets) for idx, targets in data[2:]]
