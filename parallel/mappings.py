"""Tensor- and sequence-parallel communication as small paired autograd functions (Megatron core's mappings).

Each function takes the process group it talks over (a group of size 1 makes it the identity) and is the
transpose of its pair in backward:

| function | forward | backward |
|---|---|---|
| ``copy_to_tp(x, g)`` | identity | all-reduce |
| ``reduce_from_tp(x, g)`` | all-reduce | identity |
| ``scatter_to_tp(x, g, dim)`` | keep this rank's chunk of dim | all-gather along dim |
| ``gather_from_tp(x, g, dim)`` | all-gather along dim | keep this rank's chunk |
| ``gather_from_sp(x, g, dim)`` | all-gather along dim (the sequence) | reduce-scatter along dim |
| ``reduce_scatter_to_sp(x, g, dim)`` | reduce-scatter along dim | all-gather along dim |

Sequence parallel (SP) keeps activations between blocks sharded along the sequence (dim 1 of (B, T, C)): a
column-parallel layer all-gathers its input (``gather_from_sp``) instead of ``copy_to_tp``, a row-parallel layer
reduce-scatters its output (``reduce_scatter_to_sp``) instead of all-reducing. An all-reduce is a reduce-scatter
plus an all-gather, so SP moves the same bytes and divides the norm/dropout activations by tp.

Collectives run on contiguous buffers, one rank's chunk after another: an all-gather or reduce-scatter along dim d
makes one permuting copy when the dims before d hold more than one element (none along dim 0). Chunks are equal:
the split dim must be divisible by the group size (checked, with the numbers in the error). On gloo builds that
lack the single-tensor collectives (gloo in torch 2.11 and 2.13 has both, for fp32 and bf16), all-gather falls
back to the list form and reduce-scatter to an all-reduce of the whole tensor keeping this rank's chunk (twice the
bytes, CPU only).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

# torch 2.13 renamed the tensor collectives (*_single); 2.11 has only the older names
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


# ---- the collectives (no autograd) -----------------------------------------------------------------------------
def all_reduce(x: torch.Tensor, group, inplace: bool = False) -> torch.Tensor:
    """Sum over the group; in place on x when ``inplace`` and x is contiguous, else on a copy."""
    if group_size(group) == 1:
        return x
    out = x if inplace and x.is_contiguous() else x.contiguous().clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def _check_split(x: torch.Tensor, dim: int, n: int, what: str) -> int:
    if x.shape[dim] % n:
        raise ValueError(f"{what}: dim {dim} of shape {tuple(x.shape)} ({x.shape[dim]}) is not divisible by the "
                         f"group size {n}")
    return x.shape[dim] // n


def split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's chunk of ``dim`` (a view)."""
    n = group_size(group)
    if n == 1:
        return x
    size = _check_split(x, dim, n, "split")
    return x.narrow(dim, group_rank(group) * size, size)


def _gloo_lacks(exc: Exception, group) -> bool:
    return dist.get_backend(group) == "gloo" and isinstance(exc, (RuntimeError, NotImplementedError))


def all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Concatenation of every rank's x along ``dim`` (rank order). NCCL gathers the ranks' contiguous tensors one
    after another; when dims before ``dim`` hold more than one element the result is one permuting copy of that
    (for dim 0, or a batch of one, no copy at all)."""
    n = group_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    x = x.contiguous()
    lead, rest = math.prod(x.shape[:dim]), math.prod(x.shape[dim + 1:])
    out = x.new_empty((n, *x.shape))
    try:  # flat: backends that check dim 0 (gloo: input dim 0 x ranks == output dim 0) and those that count elements
        _ALL_GATHER(out.view(-1), x.view(-1), group=group)
    except (RuntimeError, NotImplementedError) as exc:
        if not _gloo_lacks(exc, group):
            raise
        dist.all_gather(list(out.unbind(0)), x, group=group)
    shape = (*x.shape[:dim], n * x.shape[dim], *x.shape[dim + 1:])
    if lead == 1:
        return out.view(shape)
    return out.view(n, lead, x.shape[dim], rest).transpose(0, 1).reshape(shape)


def reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's chunk of ``dim`` of the sum over the group. The ranks' chunks go to NCCL one after another: one
    permuting copy of x when dims before ``dim`` hold more than one element (none for dim 0 or a batch of one)."""
    n = group_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    m = _check_split(x, dim, n, "reduce_scatter")
    lead, rest = math.prod(x.shape[:dim]), math.prod(x.shape[dim + 1:])
    shape = (*x.shape[:dim], m, *x.shape[dim + 1:])
    if lead == 1:
        chunks = x.contiguous().view(n, *shape)
    else:
        chunks = x.reshape(lead, n, m, rest).transpose(0, 1).contiguous().view(n, *shape)
    out = x.new_empty(shape)
    try:  # flat, as in all_gather
        _REDUCE_SCATTER(out.view(-1), chunks.view(-1), group=group)
    except (RuntimeError, NotImplementedError) as exc:
        if not _gloo_lacks(exc, group):
            raise
        whole = chunks.clone()
        dist.all_reduce(whole, group=group)
        out.copy_(whole[group_rank(group)])
    return out


# ---- the autograd pairs ----------------------------------------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, inplace):
        if inplace and x.is_contiguous():
            ctx.mark_dirty(x)  # autograd then refuses any earlier use of x that saved it for backward
            return all_reduce(x, group, inplace=True)
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def _along_dim(name: str, forward, backward) -> type:
    """An autograd Function applying ``forward(x, group, dim)`` whose backward is ``backward(grad, group, dim)``:
    the mappings that move a tensor's pieces along one dimension, each paired with its adjoint."""

    def fwd(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return forward(x, group, dim)

    def bwd(ctx, grad):
        return backward(grad, ctx.group, ctx.dim), None, None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


def _split(x, group, dim):
    return split(x, group, dim).contiguous()


_ScatterToTP = _along_dim("_ScatterToTP", _split, all_gather)
_GatherFromTP = _along_dim("_GatherFromTP", all_gather, _split)
_GatherFromSP = _along_dim("_GatherFromSP", all_gather, reduce_scatter)
_ReduceScatterToSP = _along_dim("_ReduceScatterToSP", reduce_scatter, all_gather)


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a tensor-parallel region: identity forward, all-reduce of the gradient backward."""
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group, inplace: bool = False) -> torch.Tensor:
    """Leave a tensor-parallel region: all-reduce forward (partial sums -> the sum), identity backward.
    ``inplace``: reduce in x's own memory (for a fresh temporary such as a matmul's output)."""
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group, inplace)


def scatter_to_tp(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Keep this rank's chunk of ``dim``; the gradient is all-gathered back."""
    return x if group_size(group) == 1 else _ScatterToTP.apply(x, group, dim)


def gather_from_tp(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """All-gather along ``dim``; the gradient is split back to this rank's chunk."""
    return x if group_size(group) == 1 else _GatherFromTP.apply(x, group, dim)


def gather_from_sp(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Sequence-parallel shard -> the whole sequence (before a column-parallel layer); the gradient, a partial sum
    on each rank, is reduce-scattered back to the shards."""
    return x if group_size(group) == 1 else _GatherFromSP.apply(x, group, dim)


def reduce_scatter_to_sp(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Partial sums over the whole sequence (after a row-parallel layer) -> this rank's shard of their sum; the
    gradient is all-gathered."""
    return x if group_size(group) == 1 else _ReduceScatterToSP.apply(x, group, dim)


def scatter_to_sp(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """The whole sequence (equal on every rank) -> this rank's shard; the gradient is all-gathered."""
    return scatter_to_tp(x, group, dim)
