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

``vocab_parallel_linear_cross_entropy(x, weight, targets, group)``: the same loss of logits = x @ weight^T (+ bias)
from the head's input x (N, C) (replicated over the group) and this rank's weight shard (V/tp, C), chunked over the
tokens as ``megakern.linear_cross_entropy`` is, so that no rank ever holds its (N, V/tp) logits in fp32. Per chunk of
rows (chunk_size tokens):

    z_c       = x_c @ W_r^T (+ b_r)       in x's dtype (fp32 accumulation), then fp32, padding columns -inf
    m_r, s_r  = max_v z_c, sum_v exp(z_c - m_r);   t_r = z_t on the rank that holds column t, else 0
    one all-gather of (m_r, s_r, t_r) (3, chunk) over the group; every rank then computes the same
    lse       = M + log sum_r s_r exp(m_r - M),  M = max_r m_r;      loss = lse - sum_r t_r
    dz_c      = (exp(z_c - lse) - onehot(t)) * (1 / rows that count for "mean", else 1), in x's dtype
    dx_c      = dz_c @ W_r          this rank's partial sum of the full dx, NOT all-reduced here
    dW_r     += dz_c^T @ x_c        fp32 accumulation;   db_r += sum_rows dz_c

One collective per chunk: the all-gather of the local (max, sum, target logit) merges the softmax statistics as
flash-attention merges blocks, where Megatron's form takes two all-reduces (MAX, then SUM) with the exp of the
whole chunk waiting between them. For "mean" and "sum" the gradients are made in the forward (the backward scales
them by the incoming gradient, as ``linear_cross_entropy``); for "none" (a gradient per row) the forward keeps the
per-row lse, which is global after the gather, and the backward recomputes each chunk's logits with no collective.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from megakern import op_backends
from megakern.cross_entropy import (accumulate_mm, autocast_inputs, check_inputs, default_chunk,
                                    linear_cross_entropy, scale_gradients, take_gradients)
from megakern.parallel.mappings import all_gather, group_rank, group_size


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


# ---- the fused, chunked, vocab-parallel linear cross-entropy -------------------------------------------------------
_OP = "vocab_parallel_linear_cross_entropy"


class _Shard:
    """What every chunk needs to know about this rank's columns: the group, the first global column, the columns
    that are real vocabulary (the rest is padding), the compute dtype of the softmax."""

    def __init__(self, group, weight, vocab_size):
        self.group, self.tp = group, group_size(group)
        self.rows = weight.shape[0]
        self.start = group_rank(group) * self.rows
        self.real = self.rows if vocab_size is None else min(max(vocab_size - self.start, 0), self.rows)
        self.compute = torch.promote_types(weight.dtype, torch.float32)

    def logits(self, x_c, weight, bias_c):
        """The chunk's local logits in the compute dtype (fp32; fp64 for fp64 inputs), padding columns -inf: the
        GEMM in x's dtype, one conversion (none in fp32)."""
        z = x_c @ weight.t() if bias_c is None else torch.addmm(bias_c, x_c, weight.t())
        z = z.to(self.compute)
        if self.real < self.rows:
            z[:, self.real:] = float("-inf")
        return z

    def targets(self, t_c, ignore_index):
        """(counted, mine, local index): rows that count (not ignored), rows whose target column is on this rank,
        and the target's local column (0 where not mine)."""
        counted = t_c != ignore_index
        local = t_c - self.start
        mine = counted & (local >= 0) & (local < self.real)
        return counted, mine, local.masked_fill(~mine, 0).long()[:, None]


def _chunk_grads(dz, x_c, weight, grad_x_c, need_w: bool, grad_w, grad_b):
    """From the chunk's fp32 d(loss)/d(logits) dz: this rank's partial dx rows and db, and dW accumulated (made by
    the first chunk: ``grad_w`` None); returns dW (None without ``need_w``)."""
    if grad_b is not None:
        grad_b += dz.sum(0)
    if grad_x_c is None and not need_w:
        return grad_w
    g = dz.to(x_c.dtype)
    if grad_x_c is not None:
        torch.mm(g, weight, out=grad_x_c)
    return accumulate_mm(grad_w, g.t(), x_c) if need_w else None


def _weight_grad(grad_w, need_w: bool, weight):
    """dW in the weight's dtype; zeros where no chunk made one (no rows)."""
    if not need_w:
        return None
    return torch.zeros_like(weight) if grad_w is None else grad_w.to(weight.dtype)


class _VocabParallelLinearCE(torch.autograd.Function):
    """The loss of x @ W_r^T (+ b_r) over the group's vocabulary shards, chunked over the rows of x. "mean" / "sum":
    the gradients are made in the forward (times ``scale``, 1 element in fp32 or fp64: 1 / rows that count, or 1) and
    the backward scales them by its scalar; "none": per-row losses, the backward recomputes each chunk with its
    per-row incoming gradient and the saved lse."""

    @staticmethod
    def forward(ctx, x, weight, bias, targets, group, ignore_index, vocab_size, chunk, scale, reduction):
        shard = _Shard(group, weight, vocab_size)
        n = x.shape[0]
        need = ctx.needs_input_grad[:3]
        now = reduction != "none" and any(need)
        losses = torch.empty(n, dtype=shard.compute, device=x.device)
        lse_all = None if now or not any(need) else torch.empty(n, dtype=shard.compute, device=x.device)
        grad_x = torch.empty_like(x, memory_format=torch.contiguous_format) if now and need[0] else None
        grad_w = None  # the chunks' sum, made by the first
        grad_b = torch.zeros(shard.rows, dtype=shard.compute, device=x.device) if now and need[2] else None
        bias_c = None if bias is None else bias.to(x.dtype)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            x_c, t_c = x[start:end], targets[start:end]
            z = shard.logits(x_c, weight, bias_c)
            counted, mine, index = shard.targets(t_c, ignore_index)
            m = z.amax(1)
            shift = m.masked_fill(torch.isinf(m), 0.0)  # a shard of padding only: s = 0, not exp(-inf + inf)
            t_logit = z.gather(1, index)[:, 0].masked_fill(~mine, 0.0)
            z.sub_(shift[:, None]).exp_()
            stats = torch.stack([m, z.sum(1), t_logit])  # (3, chunk)
            every = all_gather(stats, group, dim=0).view(shard.tp, 3, end - start)
            top = every[:, 0].amax(0)
            lse = top + torch.log((every[:, 1] * torch.exp(every[:, 0] - top)).sum(0))
            loss = lse - every[:, 2].sum(0)
            # a target that is neither ignore_index nor a real column (range unchecked): NaN, as linear_cross_entropy
            held = (t_c >= 0) & (t_c < shard.rows * shard.tp if vocab_size is None else t_c < vocab_size)
            losses[start:end] = loss.masked_fill(~counted, 0.0).masked_fill(counted & ~held, float("nan"))
            if lse_all is not None:
                lse_all[start:end] = lse
            if now:  # z = exp(logits - shift) becomes (softmax - onehot(t)) x (scale on counted rows, else 0)
                row = torch.where(counted, scale.to(z.dtype), 0.0)
                z.mul_((torch.exp(shift - lse) * row)[:, None])
                z.scatter_add_(1, index, (-row * mine)[:, None])
                grad_w = _chunk_grads(z, x_c, weight, None if grad_x is None else grad_x[start:end], need[1],
                                      grad_w, grad_b)
            del z  # before the next chunk's logits are allocated
        ctx.now = now
        ctx.grads = None
        if now:  # on ctx, not saved: the backward scales them in place and hands them on (take_gradients)
            ctx.grads = (grad_x, _weight_grad(grad_w, need[1], weight),
                         None if grad_b is None else grad_b.to(bias.dtype))
        elif any(need):
            ctx.save_for_backward(x, weight, bias, targets, lse_all)
            ctx.shard, ctx.ignore_index, ctx.chunk = shard, ignore_index, chunk
        losses = losses.to(torch.promote_types(x.dtype, torch.float32))
        if reduction == "none":
            return losses
        return losses.sum() * scale[0] if reduction == "mean" else losses.sum()

    @staticmethod
    def backward(ctx, grad_losses):
        if ctx.now:  # the gradients of the loss were made in the forward: scaled by the incoming scalar
            grads = take_gradients(ctx, "vocab_parallel_linear_cross_entropy")
            return (*scale_gradients(grads, grad_losses, inplace=True), None, None, None, None, None, None, None)
        x, weight, bias, targets, lse_all = ctx.saved_tensors
        shard, need = ctx.shard, ctx.needs_input_grad[:3]
        grad_x = torch.empty_like(x, memory_format=torch.contiguous_format) if need[0] else None
        grad_w = None  # the chunks' sum, made by the first
        grad_b = torch.zeros(shard.rows, dtype=shard.compute, device=x.device) if need[2] else None
        bias_c = None if bias is None else bias.to(x.dtype)
        for start in range(0, x.shape[0], ctx.chunk):  # recomputed from the global lse: no collective
            end = min(start + ctx.chunk, x.shape[0])
            x_c = x[start:end]
            z = shard.logits(x_c, weight, bias_c)
            counted, mine, index = shard.targets(targets[start:end], ctx.ignore_index)
            row = grad_losses[start:end].to(z.dtype).masked_fill(~counted, 0.0)
            z.sub_(lse_all[start:end, None]).exp_().mul_(row[:, None])
            z.scatter_add_(1, index, (-row * mine)[:, None])
            grad_w = _chunk_grads(z, x_c, weight, None if grad_x is None else grad_x[start:end], need[1], grad_w,
                                  grad_b)
            del z
        return (grad_x, _weight_grad(grad_w, need[1], weight),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None, None, None, None)


def _check(x, weight, targets, bias, group, ignore_index, reduction, vocab_size, chunk_size, backend,
           check_targets) -> int:
    """TypeError / ValueError naming the argument; returns the group size."""
    try:  # megakern.cross_entropy's checks of the tensors' shapes, dtypes and devices, under this op's name
        check_inputs(x, weight, targets, bias, ignore_index, reduction, 0.0, None, chunk_size, check_targets=False)
    except (TypeError, ValueError) as exc:
        raise type(exc)(str(exc).replace("linear_cross_entropy", _OP, 1)) from None
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError(f"{_OP}: this rank (global {dist.get_rank()}) is not in group")
    tp = group_size(group)
    full = weight.shape[0] * tp
    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
                                   or not 0 < vocab_size <= full):
        raise ValueError(f"{_OP}: vocab_size must be None or an int in 1..{full} (weight's {weight.shape[0]} rows x "
                         f"{tp} ranks), got {vocab_size!r}")
    if isinstance(backend, str) and tp > 1 and backend != "torch":
        raise ValueError(f"{_OP}: backend {backend!r} is not offered with {tp} ranks: the vocab-parallel path is torch "
                         "GEMMs and elementwise ops per chunk ('torch'; a kernel table {op: backend} is taken and "
                         "applies with one rank)")
    if isinstance(backend, str) and backend not in op_backends("cross_entropy"):
        raise ValueError(f"{_OP}: unknown backend {backend!r}; choose one of "
                         f"{', '.join(sorted(op_backends('cross_entropy')))}")
    if backend is not None and not isinstance(backend, (str, Mapping)):
        raise TypeError(f"{_OP}: backend must be None, a str or a kernel table {{op: backend}}, got "
                        f"{type(backend).__name__}")
    limit = full if vocab_size is None else vocab_size
    if check_targets and targets.numel() and not torch.compiler.is_compiling():
        bad = ((targets < 0) | (targets >= limit)) & (targets != ignore_index)
        if bool(bad.any()):  # one host sync
            first = int(bad.flatten().nonzero()[0])
            raise ValueError(f"{_OP}: target {int(targets.flatten()[first])} (row {first}) is outside the "
                             f"vocabulary [0, {limit}) and is not ignore_index ({ignore_index})")
    return tp


def vocab_parallel_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, group=None, *,
                                        bias: torch.Tensor | None = None, ignore_index: int = -100,
                                        reduction: str = "mean", vocab_size: int | None = None,
                                        chunk_size: int | None = None,
                                        backend: str | Mapping[str, str] | None = None,
                                        check_targets: bool = True) -> torch.Tensor:
    """Cross-entropy of logits = x @ W^T (+ b) whose vocabulary rows W are split over the tensor-parallel ``group``,
    chunked over the tokens: neither the (N, V) logits nor this rank's (N, V/tp) logits are ever held in fp32.

    x (N, C) (or (..., C)): the head's input, the same on every rank of the group (under sequence parallel, already
    all-gathered). weight (V/tp, C): this rank's shard, rows [r V/tp, (r+1) V/tp) of the (padded) vocabulary (a
    column-parallel head's weight); bias (V/tp,) its shard or None. targets (N,) (or (...)) int64 / int32: global
    vocabulary ids, the same on every rank, or ``ignore_index`` (loss 0, no gradient). ``vocab_size``: the real
    vocabulary when the shards carry padding rows (V > vocab_size): columns >= vocab_size are excluded (-inf).
    ``reduction`` "mean" (over the rows that count; NaN when none does, as torch) | "sum" | "none" (per-row fp32
    losses, 0 where ignored; differentiable: the backward recomputes the logits chunk by chunk).
    ``chunk_size`` tokens per chunk (default: ``megakern.cross_entropy.default_chunk`` of the local fp32 logits, a
    chunk's fp32 logits under 256 MiB). ``check_targets``: one host sync to check every target is in
    [0, vocab_size) or ignore_index (ValueError naming the first bad one); False where the data pipeline checked them
    (a bad target then gives a NaN loss).

    Gradients: x's is this rank's PARTIAL sum dlogits_r @ W_r (its vocabulary columns' share), not all-reduced
    here: the caller's mapping into the tensor-parallel region (``copy_to_tp``, or ``gather_from_sp`` under sequence
    parallel) sums it over the group in its backward. W's and b's are this rank's shards (fp32 accumulated over the
    chunks, returned in their dtypes).

    Memory beyond the inputs and outputs: per chunk the logits in x's dtype, their fp32 copy (it becomes the
    gradient; the same tensor for fp32 inputs) and the gradient in x's dtype, (chunk, V/tp) each; for "mean"/"sum"
    with gradients, dx (N, C) and dW (V/tp, C) in fp32 (fp64 for fp64 inputs) made during the forward (the backward
    only scales them); for "none" with gradients, the per-row lse (N,) kept for the backward.
    Communication: one all-gather of 3 x chunk values per chunk in the forward, none in the backward.

    Dtypes: x and weight the same (float32 / float16 / bfloat16 / float64; under autocast both cast to the autocast
    dtype); the GEMMs run in that dtype with fp32 accumulation, the softmax in fp32. Returns the fp32 loss.

    ``group`` None or of one rank: the same loss as ``megakern.linear_cross_entropy`` (which runs it, with
    ``backend``, for "mean"/"sum" when no padding column is excluded). With several ranks the per-chunk math is
    torch ops: ``backend`` may be None, "torch" or a kernel table (which then applies to the one-rank case only).
    """
    x, weight, bias = autocast_inputs(x, weight, bias)
    tp = _check(x, weight, targets, bias, group, ignore_index, reduction, vocab_size, chunk_size, backend,
                check_targets)
    if tp == 1 and reduction != "none" and (vocab_size is None or vocab_size >= weight.shape[0]):
        return linear_cross_entropy(x, weight, targets, bias=bias, ignore_index=ignore_index, reduction=reduction,
                                    chunk_size=chunk_size, backend=backend, check_targets=False)
    with torch.autocast(x.device.type, enabled=False):
        x2, t2 = x.reshape(-1, x.shape[-1]), targets.reshape(-1)
        if not torch.is_grad_enabled():  # no gradient work for inputs that require one outside autograd
            x2, weight, bias = (None if t is None else t.detach() for t in (x2, weight, bias))
        chunk = chunk_size or default_chunk(max(1, x2.shape[0]), weight.shape[0], 4)
        acc = torch.promote_types(x.dtype, torch.float32)  # fp32 (fp64 for fp64 inputs)
        scale = ((t2 != ignore_index).sum().to(acc).reciprocal() if reduction == "mean"
                 else torch.ones((), dtype=acc, device=x.device)).reshape(1)
        loss = _VocabParallelLinearCE.apply(x2, weight, bias, t2, group, ignore_index, vocab_size, chunk, scale,
                                            reduction)
        return loss.reshape(targets.shape) if reduction == "none" else loss
