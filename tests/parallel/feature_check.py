"""Rank-side checks of the training features under each layout: a tiny GPT trained a few steps with one feature
(bf16 weights with fp32 masters, FP8, torch.compile of the blocks, activation recomputation) under a layout, against
the same GPT with the same feature in one process (megakern.parallel's local mesh of ones: the training program's
single-process path) under the same seed.

Exact features must match the single process to fp32 rounding: compile, recomputation, and FP8 under tensor
parallelism (its amaxes reduced over the ranks: each rank casts with the single model's scales, checked too). bf16
weights cannot (the ranks sum bf16 partial products in another order), nor FP8 over data-parallel ranks (a rank's
gradients carry the factor dp that DDP's average takes back, so they round differently in E5M2): there the 2x rule
holds, against an fp32 run in one process: |layout - fp32| <= 2 |one process - fp32| + atol, for every loss and
every trained weight.
"""
from __future__ import annotations

import dataclasses
import datetime

import torch
import torch.distributed as dist
from gpt_check import STYLES, batches, expected_slice, full_param

from megakern import fp8
from megakern.models.gpt import GPT, GPTConfig
from megakern.parallel import ParallelDims, parallelize
from megakern.parallel.dims import ParallelMesh

RTOL, ATOL = 2e-4, 2e-6  # exact features: fp32, sums over ranks reordered
FEATURES = ("bf16", "fp8", "compile", "recompute-full", "recompute-selective")


def _config(style: str, n_layer: int, feature: str) -> GPTConfig:
    cfg = GPTConfig(n_layer=n_layer, n_embd=64, n_head=4, n_kv_head=2, vocab_size=120, max_seqlen=32,
                    ffn_hidden=96, dropout=0.0, **STYLES[style])
    if feature.startswith("recompute-"):
        cfg = dataclasses.replace(cfg, recompute=feature.split("-", 1)[1])
    return cfg


def _local_mesh() -> ParallelMesh:
    """The mesh of a single process (what ParallelDims().build() gives outside torchrun), inside a rank."""
    return ParallelMesh(ParallelDims(world_size=1).resolve(1), "cpu", datetime.timedelta(seconds=60), local=True)


def _train(mesh, options: dict, feature: str | None, style: str, n_layer: int, steps: int, global_batch: int,
           seqlen: int):
    """Train under ``mesh``; returns (losses, {name: trained weight of this rank}, {name: FP8 scaling buffer})."""
    cfg = _config(style, n_layer, feature or "")
    with torch.device("meta"):
        model = GPT(cfg)
    kwargs = {}
    if feature == "bf16":
        kwargs["master_weights"] = True
    elif feature == "fp8":
        kwargs["fp8"] = fp8.DelayedScaling()
    elif feature == "compile":
        kwargs["compile"] = "aot_eager"  # dynamo's capture and AOT autograd, without a C++ compiler
        # each run starts with dynamo's caches empty, as a training run does: the pool's ranks live across checks,
        # and the graphs of earlier checks' models (other layouts, other block classes) would otherwise pile up
        torch.compiler.reset()
    pmodel = parallelize(model, mesh, None, generator=torch.Generator().manual_seed(7), **options, **kwargs)
    layers = [m for g in pmodel.gpts for m in g.modules() if isinstance(m, fp8.Linear)]
    assert (feature == "fp8") == bool(layers), f"FP8 layers: {len(layers)}"
    for m in layers:
        m.emulate = True  # FP8 casts and GEMMs emulated on the CPU
    opt = pmodel.build_optimizer(torch.optim.SGD, lr=0.5, momentum=0.9)
    d = mesh.dims
    b = global_batch // d.dp
    mine = slice(mesh.dp_rank * b, (mesh.dp_rank + 1) * b)
    losses = []
    for idx, targets in batches(steps, global_batch, seqlen, cfg.vocab_size):
        loss = pmodel.forward_backward(idx[mine], targets[mine])
        pmodel.clip_grad_norm_(0.05)
        if layers:
            assert not bool(pmodel.update_fp8_scales())
        opt.step()
        if pmodel.masters is not None:
            pmodel.masters.copy_to_model()
        else:
            opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    weights = {}
    for name, p, tp_dim, _, tied_copy in pmodel._param_table():
        w = pmodel.masters.masters[p] if pmodel.masters is not None else p
        weights["wte.weight" if tied_copy else name] = (full_param(w).float(), tp_dim)
    buffers = {}
    for g in pmodel.gpts:
        for key, t in g.state_dict().items():
            if "scaling" in key:
                buffers[key.replace(".fp8_gemm.", ".")] = t.clone()
    return losses, weights, buffers


def check_feature(layout: dict, options: dict, feature: str, style: str = "gpt", n_layer: int = 2,
                  steps: int = 3, global_batch: int = 4, seqlen: int = 16) -> list[float]:
    """``feature`` under ``layout`` against one process (see the module docstring); returns the losses."""
    assert feature in FEATURES, feature
    args = (style, n_layer, steps, global_batch, seqlen)
    pm = ParallelDims(**layout).build("cpu", timeout=60)
    mine, weights, buffers = _train(pm, options, feature, *args)
    single_opts = {k: v for k, v in options.items() if k in ("microbatches",)}
    if pm.dims.pp > 1 and "microbatches" not in options:
        single_opts["microbatches"] = pm.dims.pp
    one, one_weights, one_buffers = _train(_local_mesh(), single_opts, feature, *args)
    rank = dist.get_rank()
    tp, tp_rank = pm.dims.tp, pm.tp_rank
    exact = feature != "bf16" and not (feature == "fp8" and pm.dims.dp * pm.dims.cp > 1)
    if exact:
        torch.testing.assert_close(torch.tensor(mine), torch.tensor(one), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{feature}: losses (rank {rank}): {m}")
        for name, (w, tp_dim) in weights.items():
            want = expected_slice(one_weights[name][0], tp_dim, tp, tp_rank)
            torch.testing.assert_close(w, want, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{feature}: {name} (rank {rank}): {m}")
        for key, t in buffers.items():  # the amaxes reduced over the ranks: each rank scales as one process does
            torch.testing.assert_close(t, one_buffers[key], rtol=RTOL, atol=0,
                                       msg=lambda m: f"{feature}: FP8 state {key} (rank {rank}): {m}")
        assert set(buffers) <= set(one_buffers) and (feature != "fp8" or buffers)
        return mine
    ref, ref_weights, _ = _train(_local_mesh(), single_opts, None, *args)  # fp32
    for step, (a, b, r) in enumerate(zip(mine, one, ref)):
        assert abs(a - r) <= 2 * abs(b - r) + 2e-3, (
            f"{feature} step {step + 1} loss (rank {rank}): {a} under the layout, {b} in one process, fp32 {r}")
    for name, (w, tp_dim) in weights.items():
        r = expected_slice(ref_weights[name][0], tp_dim, tp, tp_rank)
        b = expected_slice(one_weights[name][0], tp_dim, tp, tp_rank)
        err, err_one = (w - r).abs().max().item(), (b - r).abs().max().item()
        assert err <= 2 * err_one + 1e-3 * r.abs().max().item(), (
            f"{feature} {name} (rank {rank}): max error {err:.3e} under the layout, {err_one:.3e} in one process")
    return mine
