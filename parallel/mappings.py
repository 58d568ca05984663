"""Tensor- and sequence-parallel communication as small paired autograd functions (Megatron core's mappings).

Each function takes the process group it talks over (a group of size 1 makes it the identity) and is the
transpose of its pair in backward:

| function | forward | backward |
|---|---|---|
| ``copy_to_tp(x, g)`` | identity | all-reduce |
| ``reduce_from_tp(x, g)`` | all-reduce | identity |
| ``scatter_to_tp(x, g, dim)`` | keep this rank's chunk of dim | all-gather along dim |
| ``gather_from_tp(x, g, dim)`` | all-gather along dim | keep this rank's chunk |
| ``gather_from_sp(x, g, dim)`` | all-gather of the token shards (dim: the sequence) | reduce-scatter to them |
| ``reduce_scatter_to_sp(x, g, dim)`` | reduce-scatter to the token shards | all-gather of them |
| ``scatter_to_sp(x, g, dim)`` | keep this rank's token shard | all-gather of them |

Sequence parallel (SP) keeps activations between blocks sharded over the tokens: a column-parallel layer
all-gathers its input (``gather_from_sp``) instead of ``copy_to_tp``, a row-parallel layer reduce-scatters its
output (``reduce_scatter_to_sp``) instead of all-reducing. An all-reduce is a reduce-scatter plus an all-gather, so
SP moves the same bytes and divides the norm/dropout activations by tp.

The token shards: a tensor (*lead, T, *rest) whose sequence is dim ``d`` (``lead`` the dims before it, e.g. the
batch of (B, T, C)) has L x T tokens in memory order; rank r keeps the r-th of tp equal runs of them, viewed as
(*lead, T / tp, *rest). With the sequence first (d = 0) or a batch of one this is the r-th chunk of the sequence;
for (B, T, C) with B > 1 the runs cross batch rows (rank 0 of 2 holds rows 0 .. B/2 - 1 whole when B is even). The
ops between the layers (norms, dropout, residual adds, a MoE router) act token by token, so any equal split serves;
this one makes every shard a contiguous run of the whole tensor: the collectives move it with no permuting copy,
and a fused GEMM + collective reads and writes plain row blocks. Where a whole-sequence tensor must be split like
the activations (a learned position table), it must have every token's row: (*lead, T, *rest), not broadcast.

Collectives run on contiguous buffers, one rank's chunk after another: ``all_gather`` / ``reduce_scatter`` along dim
d (the tensor-parallel mappings' features, dim -1) make one permuting copy when the dims before d hold more than one
element (none along dim 0); the sequence-parallel mappings never do (token shards, above). Chunks are equal:
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


def token_rows(x: torch.Tensor, n: int, dim: int, what: str) -> torch.Tensor:
    """A whole-sequence tensor (*lead, T, *rest) (sequence: dim ``dim``) as (n * L, T / n, *rest), L = prod(lead):
    dim 0's runs of L hold the n token shards in rank order (a view of a contiguous x). T must be divisible by n."""
    dim = dim % x.dim()
    m = _check_split(x, dim, n, what)
    return x.reshape(n * math.prod(x.shape[:dim]), m, *x.shape[dim + 1:])


def token_shard_shape(whole: torch.Size | tuple, n: int, dim: int) -> tuple[int, ...]:
    """The shape of a token shard of a whole-sequence tensor of shape ``whole`` over n ranks."""
    dim = dim % len(whole)
    return (*whole[:dim], whole[dim] // n, *whole[dim + 1:])


def token_whole_shape(shard: torch.Size | tuple, n: int, dim: int) -> tuple[int, ...]:
    """The shape of the whole-sequence tensor of which ``shard`` is one of n token shards."""
    dim = dim % len(shard)
    return (*shard[:dim], shard[dim] * n, *shard[dim + 1:])


def token_shard(x: torch.Tensor, n: int, r: int, dim: int = 1) -> torch.Tensor:
    """Rank r's token shard (of n) of the whole-sequence tensor ``x`` (sequence along ``dim``), as
    ``scatter_to_sp`` keeps it: for preparing a shard or checking one against a whole reference."""
    if not 0 <= r < n:
        raise ValueError(f"token_shard: rank {r} is not in [0, {n})")
    rows = token_rows(x, n, dim, "token_shard")
    lead = rows.shape[0] // n
    return rows[r * lead:(r + 1) * lead].reshape(token_shard_shape(x.shape, n, dim))


def gather_from_sp(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """This rank's token shard (sequence along ``dim``) -> the whole sequence (before a column-parallel layer):
    the shards concatenated in rank order, one all-gather with no permuting copy; the gradient, a partial sum on
    each rank, is reduce-scattered back to the shards."""
    n = group_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    rows = x.reshape(math.prod(x.shape[:dim]), *x.shape[dim:])  # the shard's tokens along dim 0
    return _GatherFromSP.apply(rows, group, 0).view(token_whole_shape(x.shape, n, dim))


def reduce_scatter_to_sp(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Partial sums over the whole sequence (after a row-parallel layer) -> this rank's token shard of their sum
    (one reduce-scatter, no permuting copy); the gradient is all-gathered."""
    n = group_size(group)
    if n == 1:
        return x
    rows = token_rows(x, n, dim, "reduce_scatter_to_sp")
    return _ReduceScatterToSP.apply(rows, group, 0).view(token_shard_shape(x.shape, n, dim))


def scatter_to_sp(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """The whole sequence (equal on every rank) -> this rank's token shard; the gradient is all-gathered."""
    n = group_size(group)
    if n == 1:
        return x
    rows = token_rows(x, n, dim, "scatter_to_sp")
    return _ScatterToTP.apply(rows, group, 0).view(token_shard_shape(x.shape, n, dim))
