"""Rank-side checks for the parallel GPT tests: a tiny GPT trained a few steps under a layout, against the same
GPT trained on one process under the same seed (each rank runs that reference itself)."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import megakern
from megakern.models.gpt import GPT, GPTConfig
from megakern.optim import SumOfSquares
from megakern.parallel import ParallelDims, parallelize

# fp32 throughout; sums over ranks reorder the arithmetic
RTOL, ATOL = 2e-4, 2e-6

STYLES = {
    # GPT-2 style: learned positions, tied embeddings, LayerNorm with bias, GELU
    "gpt": dict(norm="layernorm", position="learned", activation="gelu", bias=True, tie_embeddings=True),
    # Llama style: rotary, untied, RMSNorm, SwiGLU, grouped-query attention, no bias
    "llama": dict(norm="rmsnorm", position="rotary", activation="swiglu", bias=False, tie_embeddings=False),
    # GPT-NeoX style: parallel residual, partial rotary, LayerNorm with bias, the erf GELU, untied
    "neox": dict(norm="layernorm", position="rotary", rotary_pct=0.25, activation="gelu_exact", bias=True,
                 tie_embeddings=False, parallel_residual=True),
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


def check_step(pmodel, ref: GPT, opt, ref_opt, loss, ref_loss, step: int, max_norm: float | None,
               clip_must_act: bool = False) -> None:
    """One training step's checks against the single-process model (its loss already backpropagated): the loss,
    the gradients, the clip norm (when ``max_norm``), then both optimizers step."""
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=ATOL, msg=lambda m: f"step {step} loss: {m}")
    compare_to_reference(pmodel, ref, f"step {step} gradients")
    if max_norm is not None:
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        # the trainer's sum of squares (one Triton launch per dtype) over the same sets of shards
        fast = None
        if not megakern.available_backends(loss.device)["triton"]:
            fast = pmodel.grad_norm(sum_of_squares=SumOfSquares())
        norm = pmodel.clip_grad_norm_(max_norm)
        torch.testing.assert_close(norm, ref_norm, rtol=RTOL, atol=ATOL, msg=lambda m: f"step {step} norm: {m}")
        if fast is not None:
            torch.testing.assert_close(fast, norm, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"step {step} norm by SumOfSquares: {m}")
        if clip_must_act:
            assert ref_norm > max_norm, "the clip must act for the check to mean something"
            compare_to_reference(pmodel, ref, f"step {step} clipped gradients")
    opt.step()
    ref_opt.step()
    opt.zero_grad(set_to_none=True)
    ref_opt.zero_grad(set_to_none=True)


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
        check_step(pmodel, ref, opt, ref_opt, loss, ref_loss, step, max_norm, clip_must_act=True)
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


def packed_offsets(regions: int, size: int, seed: int) -> torch.Tensor:
    """cu_seqlens of ``regions`` consecutive blocks of ``size`` tokens, each cut into random documents (some longer
    than a row, so they cross rows); a block (a dp rank's micro-batch) is never crossed."""
    g = torch.Generator().manual_seed(seed)
    offsets = [0]
    for r in range(regions):
        end = r * size
        while end < (r + 1) * size:  # documents of 3..24 tokens (rows are 16), the last one cut at the block's end
            end = min(end + int(torch.randint(3, 25, (1,), generator=g)), (r + 1) * size)
            offsets.append(end)
    return torch.tensor(offsets, dtype=torch.int32)


def check_packed(layout: dict, options: dict, style: str = "gpt", steps: int = 2, global_batch: int = 4,
                 seqlen: int = 16, max_norm: float = 0.05, n_layer: int = 2):
    """Like check_train, with packed documents: the global batch's cu_seqlens for the single model, each dp rank's
    share (re-based) for the parallel one; documents of any length (3..24 tokens, rows of 16) crossing rows, never a
    micro-batch. Under context parallelism each micro-batch goes in the THD layout (documents padded to 2*cp chunks),
    under a pipeline its packing travels with the micro-batch. Also the refusals of packed batches. Returns the
    losses and the refusals' messages."""
    cfg = tiny_config(style, n_layer)
    torch.manual_seed(0)
    ref = GPT(cfg)
    model = copy.deepcopy(ref)
    pm = ParallelDims(**layout).build("cpu", timeout=60)
    pmodel = parallelize(model, pm, None, **options)
    opt = pmodel.build_optimizer(torch.optim.SGD, lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    d, m = pm.dims, pmodel.microbatches
    b = global_batch // d.dp
    mine = slice(pm.dp_rank * b, (pm.dp_rank + 1) * b)
    lo, hi = pm.dp_rank * b * seqlen, (pm.dp_rank + 1) * b * seqlen
    losses = []
    for step, (idx, targets) in enumerate(batches(steps, global_batch, seqlen, cfg.vocab_size)):
        cu = packed_offsets(d.dp * m, b // m * seqlen, seed=step)
        local = torch.tensor([o - lo for o in cu.tolist() if lo <= o <= hi], dtype=torch.int32)
        ref_loss = ref(idx, targets, cu_seqlens=cu)
        ref_loss.backward()
        if step == 0:  # the check must tell packed from unpacked attention
            w = ref.blocks["0"].attn.qkv.weight
            plain = torch.autograd.grad(ref(idx, targets), w)[0]
            assert not torch.allclose(plain, w.grad, rtol=RTOL, atol=ATOL), "packing must change the gradients"
        loss = pmodel.forward_backward(idx[mine], targets[mine], cu_seqlens=local)
        check_step(pmodel, ref, opt, ref_opt, loss, ref_loss, step, max_norm)
        losses.append(float(loss))
    compare_to_reference(pmodel, ref, "final parameters", grads=False)
    idx, targets = batches(1, global_batch, seqlen, cfg.vocab_size)[0]
    cu = packed_offsets(d.dp * m, b // m * seqlen, seed=99)
    local = torch.tensor([o - lo for o in cu.tolist() if lo <= o <= hi], dtype=torch.int32)
    with torch.no_grad():
        ref_eval = ref(idx, targets, cu_seqlens=cu)
    torch.testing.assert_close(pmodel.eval_loss(idx[mine], targets[mine], cu_seqlens=local), ref_eval, rtol=RTOL,
                               atol=ATOL)
    errors = {}
    if m > 1:  # one document over the micro-batch boundary
        crossing = torch.tensor([0, b // m * seqlen + 1, b * seqlen], dtype=torch.int32)
        try:
            pmodel.forward_backward(idx[mine], targets[mine], cu_seqlens=crossing)
        except ValueError as exc:
            errors["crossing"] = str(exc)
    try:
        pmodel.forward_backward(idx[mine], targets[mine], cu_seqlens=local.long())
    except TypeError as exc:
        errors["dtype"] = str(exc)
    return losses, errors


def bad_values(layout: dict) -> dict:
    """forward_backward's errors for token ids and targets out of the vocabulary (one host read per batch), and none
    with check_values=False (the training program's data pipeline checks them)."""
    pm = ParallelDims(**layout).build("cpu", timeout=60)
    torch.manual_seed(0)
    pmodel = parallelize(GPT(tiny_config("llama")), pm, None)
    idx, targets = batches(1, 4 // pm.dims.dp, 16, 120)[0]
    targets[0, :3] = -100  # ignore_index is in range
    errors = {"ok": float(pmodel.eval_loss(idx, targets))}
    over = targets.clone()
    over[1, 5] = 120
    for name, (i, t) in {"ids": (idx + 1000, targets), "targets": (idx, over)}.items():
        try:
            pmodel.eval_loss(i, t)
        except ValueError as exc:
            errors[name] = str(exc)
    return errors


def check_local_shard_step(steps: int = 3) -> dict:
    """FSDP2 (dp over every rank), AdamW: stepping on the local shards (data_parallel.local_shards) gives the same
    parameters and state, bit for bit, as stepping on the DTensors; the state the first step creates is DTensors
    like the parameters'. Returns the host time of each kind of step (seconds, median)."""
    import statistics
    import time

    from megakern.parallel.data_parallel import local_shards

    cfg = tiny_config("llama", n_layer=2)
    n = dist.get_world_size()
    torch.manual_seed(0)
    base = GPT(cfg)
    runs, times = [], {}
    for local in (False, True):
        pm = ParallelDims(dp=n).build("cpu", timeout=60)
        pmodel = parallelize(copy.deepcopy(base), pm, None, dp_shard="fsdp")
        opt = pmodel.build_optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, foreach=True)
        spent = []
        for idx, targets in batches(steps, 2 * n, 16, cfg.vocab_size):
            r = pm.dp_rank
            pmodel.forward_backward(idx[2 * r:2 * r + 2], targets[2 * r:2 * r + 2])
            start = time.perf_counter()
            if local:
                with local_shards(opt):
                    opt.step()
            else:
                opt.step()
            spent.append(time.perf_counter() - start)
            opt.zero_grad(set_to_none=True)
            if local:  # the swap is undone: DTensor parameters and state, no gradient left on the shards
                for p in pmodel.parameters():
                    assert isinstance(p, DTensor) and p._local_tensor.grad is None
                    state = opt.state[p]
                    assert isinstance(state["exp_avg"], DTensor) and state["exp_avg"].placements == p.placements
                    assert state["exp_avg"].shape == p.shape
        times[local] = statistics.median(spent)
        runs.append(([p.detach()._local_tensor.clone() for p in pmodel.parameters()],
                     [{k: (v._local_tensor if isinstance(v, DTensor) else v).clone() for k, v in opt.state[p].items()}
                      for p in pmodel.parameters()]))
    (p0, s0), (p1, s1) = runs
    for a, b in zip(p0, p1):
        assert torch.equal(a, b)
    for a, b in zip(s0, s1):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return {"dtensor": times[False], "local": times[True]}


def check_fsdp_bf16_params(style: str = "gpt", steps: int = 3) -> bool:
    """FSDP2 with fsdp_param_dtype="bfloat16" under bf16 autocast (CPU): the blocks compute with bf16 parameters,
    the sharded parameters the optimizer updates stay fp32, the root's stay fp32, and the losses follow the one-process
    autocast run within bf16 rounding."""
    cfg = tiny_config(style, n_layer=2)
    n = dist.get_world_size()
    torch.manual_seed(0)
    ref = GPT(cfg)
    pm = ParallelDims(dp=n).build("cpu", timeout=60)
    pmodel = parallelize(copy.deepcopy(ref), pm, None, dp_shard="fsdp", fsdp_param_dtype="bfloat16")
    opt = pmodel.build_optimizer(torch.optim.AdamW, lr=1e-3, foreach=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=True)
    seen = {}
    gpt = pmodel.gpts[0]
    def spy(name):
        def hook(module, args):
            seen.setdefault(name, module.weight.dtype)
        return hook

    gpt.blocks["0"].mlp.fc.register_forward_pre_hook(spy("fc"))
    gpt.blocks["0"].attn_norm.register_forward_pre_hook(spy("norm"))
    for step, (idx, targets) in enumerate(batches(steps, 2 * n, 16, cfg.vocab_size)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_loss = ref(idx, targets)
            ref_loss.backward()
            r = pm.dp_rank
            loss = pmodel.forward_backward(idx[2 * r:2 * r + 2], targets[2 * r:2 * r + 2])
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.testing.assert_close(loss.float(), ref_loss.float(), rtol=2e-2, atol=2e-2)
    assert seen == {"fc": torch.bfloat16, "norm": torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in pmodel.parameters())  # the shards the optimizer updates
    return True


def check_all_ignored_targets() -> list[float]:
    """A batch whose targets are all ignored (an SFT batch of prompts alone) on dp ranks: the reported loss is 0 (no
    NaN), every gradient 0; a batch with targets on one rank only is that rank's mean."""
    pm = ParallelDims().build("cpu", timeout=30)
    torch.manual_seed(0)
    pmodel = parallelize(GPT(tiny_config("gpt")), pm, None)
    idx = torch.randint(0, 120, (2, 16))
    losses = [float(pmodel.forward_backward(idx, torch.full_like(idx, -100)))]
    assert all(p.grad is None or not p.grad.any() for p in pmodel.parameters())
    targets = torch.full_like(idx, -100) if dist.get_rank() == 1 else idx
    losses.append(float(pmodel.forward_backward(idx, targets)))
    return losses
