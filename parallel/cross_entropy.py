"""Cross-entropy over logits whose vocabulary is split over the tensor-parallel group, never gathering them.

Rank r holds logits z[..., r*V/tp : (r+1)*V/tp] (the output of a column-parallel head). For each token with target
t the loss is

    loss = log(sum_v exp(z_v - m)) - (z_t - m),   m = max_v z_v

computed with three reductions over the group: the max (all-reduce MAX), then the sum of exp(z - m) over the local
shard together with the target's logit (held by one rank, zero elsewhere) as one all-reduce SUM of a (2, N)
tensor. Backward: dz = softmax(z) - onehot(t), on each rank for its own columns, scaled by the incoming gradient.
Memory: one fp32 copy of the local logits (it becomes the softmax, saved for backward), as Megatron's.

Targets equal to ``ignore_index`` give loss 0 and no gradient. ``vocab_size``: the real vocabulary when the
logits carry padding columns (padded_vocab > vocab_size): columns >= vocab_size are excluded (-inf).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megakern.parallel.mappings import group_rank, group_size


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, ignore_index, vocab_size):
        n_local = logits.shape[-1]
        start = group_rank(group) * n_local
        compute = torch.promote_types(logits.dtype, torch.float32)
        z = logits.to(compute, copy=True)  # becomes the softmax in place
        if vocab_size is not None and vocab_size < start + n_local:
            z[..., max(vocab_size - start, 0):] = float("-inf")
        m = z.amax(dim=-1)
        if group_size(group) > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z -= m[..., None]
        ignored = targets == ignore_index
        local_t = targets - start
        mine = (local_t >= 0) & (local_t < n_local) & ~ignored
        index = local_t.masked_fill(~mine, 0)[..., None]
        stats = torch.stack([z.gather(-1, index)[..., 0].masked_fill(~mine, 0.0), z.exp_().sum(dim=-1)])
        if group_size(group) > 1:
            dist.all_reduce(stats, group=group)
        target_logit, sum_exp = stats[0], stats[1]
        loss = (torch.log(sum_exp) - target_logit).masked_fill(ignored, 0.0)
        z /= sum_exp[..., None]  # the softmax
        ctx.save_for_backward(z, index, mine, ignored)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if getattr(ctx, "done", False):
            raise RuntimeError("vocab_parallel_cross_entropy: backward ran twice (retain_graph=True); its saved "
                               "softmax becomes the gradient in place, so it supports one backward")
        ctx.done = True
        softmax, index, mine, ignored = ctx.saved_tensors
        grad = softmax  # reused in place
        grad.scatter_add_(-1, index, -mine.to(grad.dtype)[..., None])
        grad *= grad_loss.masked_fill(ignored, 0.0).to(grad.dtype)[..., None]
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group=None, *,
                                 ignore_index: int = -100, reduction: str = "mean",
                                 vocab_size: int | None = None) -> torch.Tensor:
    """Cross-entropy of vocabulary-sharded ``logits`` (..., V/tp) against global ``targets`` (...) int64.

    reduction: "none" (per-token fp32 losses, 0 where ignored), "sum", or "mean" over the non-ignored tokens of
    this call (nan when there are none, as torch's). ``group``: the tensor-parallel group (None: one rank).
    """
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and targets "
                         f"{tuple(targets.shape)} disagree (want logits (..., V_local), targets (...))")
    if targets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"vocab_parallel_cross_entropy: targets must be int32/int64, got {targets.dtype}")
    full = logits.shape[-1] * group_size(group)
    if vocab_size is not None and not 0 < vocab_size <= full:
        raise ValueError(f"vocab_parallel_cross_entropy: vocab_size {vocab_size} outside 1..{full} (the logits' "
                         "columns over all ranks)")
    limit = vocab_size if vocab_size is not None else full
    valid = (targets == ignore_index) | ((targets >= 0) & (targets < limit))
    torch._assert_async(valid.all(), f"vocab_parallel_cross_entropy: targets outside [0, {limit}) that are not "
                                     f"ignore_index={ignore_index}")
    losses = _VocabParallelCE.apply(logits, targets, group, ignore_index, vocab_size)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (targets != ignore_index).sum()
