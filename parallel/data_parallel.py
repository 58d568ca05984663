"""Data parallelism from torch: FSDP2 (``fully_shard``) or DDP, over the flattened dp x cp ranks, and ZeRO-1.

Context-parallel ranks hold the same parameters but see different tokens, so gradients are reduced over dp and
cp together (the "dp_cp" mesh dim). Both wrappers average gradients over that group and overlap the reduction
with the backward (DDP's buckets, FSDP2's per-block reduce-scatter); the loss each rank backpropagates carries
the factor that turns the average into the gradient of the global mean loss (see ParallelModel).

- "fsdp": each block, then the whole stage, is ``fully_shard``-ed: parameters, gradients and optimizer state are
  sharded over dp_cp (dim 0), gathered per block for forward and backward. Under pipeline parallelism parameters
  stay gathered between forward and backward (reshard_after_forward=False), as micro-batches come back. With
  ``param_dtype`` bf16 (the training program's choice under bf16 autocast) the blocks are all-gathered and computed
  in bf16 while the fp32 shards are updated; ``local_shards`` runs the optimizer step on the shards' local tensors.
  A block may hold parameters that are sharded and reduced over another mesh (``SeparateShard``: an MoE layer's
  experts over their expert-data-parallel ranks under expert parallelism): they are left out of the block's unit and
  become a unit of their own, nested in it.
- "ddp": ``DistributedDataParallel``; with ``zero1`` the optimizer is ``ZeroRedundancyOptimizer`` (each dp_cp rank
  keeps the optimizer state of a share of the parameters, updates them and broadcasts them). Under pipeline
  parallelism, and with fp32 master weights, the stages are replicated by hand instead (``broadcast_params`` once,
  ``allreduce_tensors`` of the gradients after the schedule's last backward): torch 2.13's pipelining breaks DDP's bucket rebuild when a step has several
  micro-batches (gradients come out wrong or the reducer asserts), which torch 2.11 did not.
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel

DP_SHARDS = ("fsdp", "ddp")


@dataclass(frozen=True)
class SeparateShard:
    """A module inside a block whose own parameters (``recurse=False``; its children stay with the block) are an FSDP2
    unit over ``mesh`` instead of the block's: sharded and all-gathered there, their gradients summed there and divided
    by ``divide`` (not averaged over ``mesh``). ``placement``: parameter -> its Shard (None: dim 0)."""

    module: nn.Module
    mesh: DeviceMesh
    divide: float
    placement: Callable[[nn.Parameter], Shard] | None = None


def apply_fsdp(module: nn.Module, blocks: Iterable[nn.Module], mesh, *, reshard_after_forward: bool = True,
               param_dtype: torch.dtype | None = None, root_param_dtype: torch.dtype | None = None,
               separate: Iterable[SeparateShard] = ()):
    """fully_shard each block, then ``module`` (the root); in place, returns module. The root's own parameters
    (embeddings, final norm, head) stay gathered from forward to backward: the backward starts with them, so
    freeing them would only all-gather them again at once.

    ``param_dtype`` (e.g. bf16 under bf16 autocast): the blocks' parameters are all-gathered and computed in it (half
    the all-gather bytes, and no autocast cast of each weight at each use and back in backward), their fp32 shards
    stay what the optimizer updates, and gradients are reduced in fp32. The blocks' inputs are not cast (the
    residual stream keeps its dtype); the root (embeddings, head) stays in its own dtype, unless
    ``root_param_dtype`` is given (bf16 weights with fp32 masters: the whole model computes in bf16, the fp32 shards
    are the masters).

    ``separate``: modules inside the blocks whose own parameters are units of their own (``SeparateShard``), with the
    block's policy: each block is sharded without them, then each of them (nested in its block: its forward
    all-gathers them, its backward reduces them, after the block's own all-gather and before its reduction)."""
    # torch 2.13's FSDP2 warns when a module returns a view (an in-place op on it would skip the pre-backward
    # hook): a block's MLP output is F.linear's view of its 2-D product, and the next block's norm reads it out of
    # place, never in place, so the hazard cannot arise here
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning)
    policy = (MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
              if param_dtype is not None else MixedPrecisionPolicy())
    blocks, separate = list(blocks), list(separate)
    nested = [[s for s in separate if any(s.module is m for m in block.modules())] for block in blocks]
    placed = {id(s.module) for inner in nested for s in inner}
    missing = [type(s.module).__name__ for s in separate if id(s.module) not in placed]
    if missing:
        raise ValueError(f"apply_fsdp: separate units {missing} are in none of the blocks")
    for block, inner in zip(blocks, nested):
        own = {p for s in inner for p in s.module.parameters(recurse=False)}
        # the block first, without the separate parameters: a unit nested before it would hide its children (the
        # MoE router) from the block's
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                    ignored_params=own or None)
        for s in inner:
            mine = set(s.module.parameters(recurse=False))
            children = {p for p in s.module.parameters() if p not in mine}  # the block's (sharded already)
            fully_shard(s.module, mesh=s.mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                        ignored_params=children or None, shard_placement_fn=s.placement)
            s.module.set_gradient_divide_factor(s.divide)
            # a sum, then the division of the shard: every backend has SUM (gloo has no PREMUL_SUM, which a factor
            # other than the group's size would use). Not on one rank: there torch 2.13 would divide twice
            s.module.set_force_sum_reduction_for_comms(s.mesh.size() > 1)
    root_policy = (MixedPrecisionPolicy(param_dtype=root_param_dtype, reduce_dtype=torch.float32,
                                        cast_forward_inputs=False) if root_param_dtype is not None
                   else MixedPrecisionPolicy())
    fully_shard(module, mesh=mesh, reshard_after_forward=False, mp_policy=root_policy)
    return module


def apply_ddp(module: nn.Module, group, device) -> DistributedDataParallel:
    device_ids = [device.index] if device.type == "cuda" else None
    # gradients are views into the reducer's buckets: no copy of every gradient into them (and back) per step
    return DistributedDataParallel(module, device_ids=device_ids, process_group=group, gradient_as_bucket_view=True)


def set_grad_sync(modules: Iterable[nn.Module], enabled: bool) -> None:
    """Turn gradient reduction off (accumulating micro-batches) or on (the last one), for FSDP2 roots. (DDP uses
    its ``no_sync`` context instead; see ParallelModel.)"""
    for m in modules:
        if isinstance(m, FSDPModule):
            m.set_requires_gradient_sync(enabled)


@contextlib.contextmanager
def local_shards(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside, the optimizer's DTensor parameters (FSDP2's shards), their gradients and their state are the local
    shards, plain tensors: ``optimizer.step()`` then runs the same elementwise update on the same memory without
    DTensor's per-call sharding propagation, which for a foreach or fused step over every parameter is not cached
    and costs the host more than the update costs the GPU. State the step creates is stored back as DTensors of the
    parameters' placements, as the optimizer would have made it (checkpoints read it so). Parameters that are not
    DTensors (DDP, ZeRO-1, tensor parallel alone) are left as they are."""
    swaps = []
    state = optimizer.state
    try:
        for group in optimizer.param_groups:
            originals = group["params"]
            if not any(isinstance(p, DTensor) for p in originals):
                continue
            shards = []
            for p in originals:
                if not isinstance(p, DTensor):
                    shards.append(p)
                    continue
                local = p._local_tensor
                local.grad = None if p.grad is None else p.grad._local_tensor
                if state.get(p):
                    state[local] = {k: v._local_tensor if isinstance(v, DTensor) else v for k, v in state[p].items()}
                shards.append(local)
            group["params"] = shards
            swaps.append((group, originals, shards))
        yield
    finally:
        for group, originals, shards in swaps:
            group["params"] = originals
            for p, local in zip(originals, shards):
                if local is p:
                    continue
                made = state.pop(local, None)
                if made is not None and not state.get(p):  # created by this step: in the parameter's form
                    state[p] = {k: DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                                      stride=p.stride())
                                if isinstance(v, torch.Tensor) and v.dim() and v.shape == local.shape else v
                                for k, v in made.items()}
                local.grad = None


def zero1_optimizer(params, optimizer_class, group, **kwargs) -> ZeroRedundancyOptimizer:
    """ZeRO-1: ``optimizer_class`` over this rank's share of ``params`` (whole parameters, balanced by size)."""
    return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, process_group=group, **kwargs)


BUCKET_BYTES = 25 << 20  # DDP's default bucket size


def _buckets(tensors: list[torch.Tensor]):
    """Consecutive runs of same-dtype tensors of at most BUCKET_BYTES (one tensor may exceed it alone)."""
    bucket, size = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (t.dtype != bucket[0].dtype or size + nbytes > BUCKET_BYTES):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


def allreduce_tensors(tensors: list[torch.Tensor], group, average: bool = False) -> None:
    """Sum (or average) each tensor over ``group`` in place, a flat bucket per collective."""
    n = dist.get_world_size(group)
    for bucket in _buckets(tensors):
        flat = torch.cat([t.reshape(-1) for t in bucket])
        if average:
            flat /= n
        dist.all_reduce(flat, group=group)
        offset = 0
        for t in bucket:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


@torch.no_grad()
def broadcast_params(params: list[torch.Tensor], group) -> None:
    """Every replica starts from the group's first rank's parameters (as DDP does at construction)."""
    src = dist.get_global_rank(group, 0)
    for bucket in _buckets(params):
        flat = torch.cat([p.reshape(-1) for p in bucket])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for p in bucket:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
