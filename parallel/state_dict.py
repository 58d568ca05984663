"""Checkpoint state that reshards: every tensor as a DTensor over the single model's FQNs and full shapes.

A parameter of the parallel model is a piece of the single model's tensor of the same name: tensor parallel
splits one dim (``shard_dims``), FSDP2 splits dim 0 of that (torch.chunk sizes), pipeline stages hold different
names. Here each piece is described to torch.distributed.checkpoint as a DTensor on a mesh ("tp", "dp_cp") of the
ranks of this pipeline stage, placements (Shard(tp dim) or Replicate, Shard(0) under FSDP or Replicate): the
mesh dims are in that order because FSDP shards the tensor-parallel shard (mesh order = order of sharding). DCP
then writes each region once (replicas deduplicated) and reads whatever region a rank holds under another
layout. The mesh needs no process groups (``_init_backend=False``): DCP only asks it for coordinates. Expert weights
under expert parallelism (dim-0 shards over ep, and over their edp ranks under FSDP2) are described on a mesh of their
own (megakern.parallel.expert.expert_checkpoint_mesh).

Optimizer state (torch optimizers: tensors shaped like the parameter, plus scalars such as ``step``) is stored
the same way under "optim.state.<fqn>.<key>", with the hyper-parameters of each param group.
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard


def checkpoint_mesh(pm) -> DeviceMesh:
    """("tp", "dp_cp") mesh of this rank's pipeline stage, without process groups."""
    d = pm.dims
    ranks = torch.arange(d.world_size).reshape(d.shape)[pm.pp_rank]  # (dp, cp, tp)
    grid = ranks.permute(2, 0, 1).reshape(d.tp, d.dp * d.cp).contiguous()
    return DeviceMesh(pm.device_type, grid, mesh_dim_names=("tp", "dp_cp"), _init_backend=False)


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def as_global(t: torch.Tensor, tp_dim: int | None, tp: int, mesh: DeviceMesh) -> DTensor:
    """``t`` (this rank's tensor, or an FSDP2 DTensor over dp_cp) as a piece of the single model's tensor."""
    fsdp = isinstance(t, DTensor)
    local = t.to_local() if fsdp else t
    shape = list(t.shape)  # an FSDP DTensor's shape is the tensor-parallel shard's
    if tp_dim is not None:
        shape[tp_dim] *= tp
    placements = [Shard(tp_dim) if tp_dim is not None else Replicate(), Shard(0) if fsdp else Replicate()]
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=_contiguous_stride(shape))


@torch.no_grad()
def init_optimizer_state(optimizer, params) -> None:
    """Give every parameter its optimizer state (so a checkpoint can be loaded into it): one step with zero
    gradients and learning rate 0, which leaves the parameters as they are."""
    saved = [(p, p.grad) for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    groups = optimizer.param_groups
    lrs = [g["lr"] for g in groups]
    for g in groups:
        g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else g["lr"].clone().zero_()
    try:
        optimizer.step()
    finally:
        for g, lr in zip(groups, lrs):
            g["lr"] = lr
        for p, grad in saved:
            p.grad = grad


def group_hparams(optimizer) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
