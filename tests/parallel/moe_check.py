"""Rank-side check of MoE layers under the layouts that keep experts whole (data, tensor (+ sequence), context and
pipeline parallel): a 2-layer moe-tiny (block 0 dense, block 1 MoE; sigmoid router with its balancing bias, aux and
z losses on) trained a few SGD steps with the training step's MoE statistics (megakern.train.experts), against one
process (the local mesh of ones) under the same seed and the same micro-batches. Losses, every trained weight, the
routers' biases and the step's MoE figures must match to fp32 rounding."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from gpt_check import batches, expected_slice, full_param

from megakern.models.gpt import GPT, GPTConfig
from megakern.parallel import ParallelDims, parallelize
from megakern.parallel.dims import ParallelMesh
from megakern.train.experts import MoEStats

RTOL, ATOL = 2e-4, 2e-6


def moe_config(**overrides) -> GPTConfig:
    base = dict(n_layer=2, n_embd=64, n_head=4, n_kv_head=2, max_seqlen=32, moe_ffn_hidden=32, moe_router="sigmoid",
                moe_renormalize=True, moe_bias_update_rate=0.01, moe_aux_loss_coef=0.05, moe_z_loss_coef=0.01)
    return GPTConfig.preset("moe-tiny", **{**base, **overrides})


def _local_mesh() -> ParallelMesh:
    return ParallelMesh(ParallelDims(world_size=1).resolve(1), "cpu", datetime.timedelta(seconds=60), local=True)


def _train(mesh, options: dict, steps: int, global_batch: int, seqlen: int, config: dict):
    cfg = moe_config(**config)
    with torch.device("meta"):
        model = GPT(cfg)
    pmodel = parallelize(model, mesh, None, generator=torch.Generator().manual_seed(7), **options)
    moe = MoEStats(pmodel, torch.device("cpu"))
    opt = pmodel.build_optimizer(torch.optim.SGD, lr=0.2, momentum=0.9)
    d = mesh.dims
    b = global_batch // d.dp
    mine = slice(mesh.dp_rank * b, (mesh.dp_rank + 1) * b)
    losses, figures = [], []
    for idx, targets in batches(steps, global_batch, seqlen, cfg.vocab_size):
        moe.begin()
        loss = pmodel.forward_backward(idx[mine], targets[mine])
        moe.reduce()
        opt.step()
        opt.zero_grad(set_to_none=True)
        moe.update_bias(torch.tensor(False))
        losses.append(float(loss))
        figures.append(moe.figures())
    weights = {name: (full_param(p).float().clone(), tp_dim)
               for name, p, tp_dim, _, tied in pmodel._param_table() if not tied}
    biases = {layer.row: layer.router.expert_bias.clone() for g in pmodel.gpts for layer in g.moe_layers()}
    return losses, weights, biases, torch.stack(figures)


def check_moe(layout: dict, options: dict, steps: int = 3, global_batch: int = 4, seqlen: int = 32,
              config: dict | None = None) -> list[float]:
    """MoE training under ``layout`` against one process (see the module docstring); returns the losses."""
    config = config or {}
    pm = ParallelDims(**layout).build("cpu", timeout=60)
    mine, weights, biases, figures = _train(pm, options, steps, global_batch, seqlen, config)
    m = options.get("microbatches") or (pm.dims.pp if pm.dims.pp > 1 else 1)
    one, one_weights, one_biases, one_figures = _train(_local_mesh(), {"microbatches": m * pm.dims.dp}, steps,
                                                       global_batch, seqlen, config)
    rank = dist.get_rank()
    torch.testing.assert_close(torch.tensor(mine), torch.tensor(one), rtol=RTOL, atol=ATOL,
                               msg=lambda msg: f"losses (rank {rank}): {msg}")
    torch.testing.assert_close(figures, one_figures, rtol=RTOL, atol=1e-5,
                               msg=lambda msg: f"MoE figures (rank {rank}): {msg}")
    for name, (w, tp_dim) in weights.items():
        want = expected_slice(one_weights[name][0], tp_dim, pm.dims.tp, pm.tp_rank)
        torch.testing.assert_close(w, want, rtol=RTOL, atol=ATOL, msg=lambda msg: f"{name} (rank {rank}): {msg}")
    assert all(b.abs().sum() > 0 for b in biases.values()), biases  # (a pipeline's first stage has none)
    for row, b in biases.items():
        torch.testing.assert_close(b, one_biases[row], rtol=0, atol=1e-7,
                                   msg=lambda msg: f"expert bias of MoE layer {row} (rank {rank}): {msg}")
    return mine
