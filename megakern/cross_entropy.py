"""Cross-entropy of next-token logits, and the fused linear cross-entropy that never holds all the logits.

The math, per row n with logits z (V,) and target t:

    lse_n  = log sum_j exp(z_j)
    loss_n = (1 - eps) (lse_n - z_t) + eps (lse_n - mean_j z_j)                (label smoothing eps, default 0)
    dloss_n / dz_j = softmax(z)_j - (1 - eps) [j == t] - eps / V

Rows whose target is ``ignore_index`` (default -100) count for nothing; "mean" divides the sum by the number of
rows that count (NaN when none does, as torch). With ``softcap`` s the logits are s * tanh(z / s) first (Gemma 2).

``linear_cross_entropy(x, weight, targets)``: the loss of logits = x @ weight^T (+ bias), x (N, C) (or (..., C)
with targets (...)), weight (V, C), without the (N, V) fp32 logits (Liger's fused linear cross-entropy). Tokens go
in chunks of ``chunk_size`` (default ``default_chunk``: the fewest chunks whose memory stays within twice the fp32
weight gradient that chunking accumulates, 8 V C bytes, and a sixteenth of the device's memory; larger chunks are
faster); per chunk:

    logits_c  = x_c @ W^T                  in x's dtype (tensor cores), (chunk, V)
    kernel:     loss_c, and d(loss)/d(logits_c) written over logits_c      fp32 math, online over V in blocks
    grad_x_c  = dlogits_c @ W              (chunk, C)
    grad_W   += dlogits_c^T @ x_c          (V, C), accumulated in fp32

so the gradients are done when the forward returns; the backward only scales them by the incoming gradient. A caller
that knows that gradient in advance (a training step's 1 / tokens) passes it as ``grad_scale``: the forward's
gradients then carry it, and the backward's factor, the incoming gradient over it, is exactly 1, where the weight-sized
gradients are neither read nor written again.
Memory beyond the inputs: one chunk of logits, grad_x (N, C) and grad_W (V, C). When no input requires a gradient
the kernel writes none and no gradient GEMM runs.

Targets must lie in [0, V) or equal ignore_index: checked on the host (one sync), except while torch.compile
traces, when the kernel instead makes the loss of such a row NaN (never reading outside the row).

Dtypes: x and weight fp32 / fp16 / bf16 (the same; under autocast both are cast to the autocast dtype), bias x's
dtype or fp32; targets int64 / int32. The loss is fp32. Gradients in their inputs' dtypes.

Backends (``megakern._backend``, op "cross_entropy"): ``torch`` (``linear_cross_entropy_ref`` /
``cross_entropy_ref`` under autograd: fp32 logits for every row at once) and ``triton``.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import torch

from megakern import _backend, _nvtx

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int64, torch.int32)
REDUCTIONS = ("mean", "sum", "none")
CHUNK_BYTES = 256 << 20  # the default chunk's logits stay under this


# ---- references ----------------------------------------------------------------------------------------------------
def cross_entropy_ref(logits, targets, *, ignore_index: int = -100, reduction: str = "mean",
                      label_smoothing: float = 0.0, softcap: float | None = None, upcast: bool = True):
    """The torch reference: F.cross_entropy semantics, computed in fp32 (fp64 for fp64 inputs; without ``upcast``
    in logits' dtype). Returns the fp32 (or fp64) loss; (rows,) for reduction "none"."""
    compute = torch.promote_types(logits.dtype, torch.float32) if upcast else logits.dtype
    z = logits.to(compute)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return torch.nn.functional.cross_entropy(z.reshape(-1, z.shape[-1]), targets.reshape(-1).long(),
                                             ignore_index=ignore_index, reduction=reduction,
                                             label_smoothing=label_smoothing)


def linear_cross_entropy_ref(x, weight, targets, *, bias=None, ignore_index: int = -100, reduction: str = "mean",
                             label_smoothing: float = 0.0, softcap: float | None = None, upcast: bool = True):
    """The torch reference of ``linear_cross_entropy``: the full logits x @ weight^T (+ bias) in fp32 (fp64 for fp64
    inputs; without ``upcast`` in x's dtype), then ``cross_entropy_ref``."""
    compute = torch.promote_types(x.dtype, torch.float32) if upcast else x.dtype
    logits = x.to(compute) @ weight.to(compute).t()
    if bias is not None:
        logits = logits + bias.to(compute)
    return cross_entropy_ref(logits, targets, ignore_index=ignore_index, reduction=reduction,
                             label_smoothing=label_smoothing, softcap=softcap)


# ---- checks --------------------------------------------------------------------------------------------------------
def _check_common(op, targets, rows_shape, vocab, device, ignore_index, reduction, label_smoothing, softcap,
                  check_targets=True):
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"{op}: targets must be a torch.Tensor, got {type(targets).__name__}")
    if targets.dtype not in INDEX_DTYPES:
        raise TypeError(f"{op}: targets have dtype {targets.dtype}; expected torch.int64 or torch.int32")
    if tuple(targets.shape) != tuple(rows_shape):
        raise ValueError(f"{op}: targets have shape {tuple(targets.shape)}, expected {tuple(rows_shape)} (one per row)")
    if targets.device != device:
        raise ValueError(f"{op}: targets are on {targets.device} but the inputs are on {device}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{op}: ignore_index must be an int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if (isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float))
            or not 0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"{op}: label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not math.isfinite(softcap) or softcap <= 0):
        raise ValueError(f"{op}: softcap must be None or a finite number > 0, got {softcap!r}")
    if vocab == 0:
        raise ValueError(f"{op}: the vocabulary is empty (V = 0)")
    if check_targets and targets.numel() and not torch.compiler.is_compiling():  # traced: no sync (the loss goes NaN)
        bad = ((targets < 0) | (targets >= vocab)) & (targets != ignore_index)
        if bool(bad.any()):  # one host sync
            first = int(bad.flatten().nonzero()[0])
            value = int(targets.flatten()[first])
            raise ValueError(f"{op}: target {value} (row {first}) is outside the vocabulary [0, {vocab}) and is not "
                             f"ignore_index ({ignore_index})")


def check_inputs(x, weight, targets, bias, ignore_index, reduction, label_smoothing, softcap, chunk_size,
                 check_targets=True) -> None:
    """Raise TypeError / ValueError naming the problem with any argument of ``linear_cross_entropy``;
    ``check_targets`` False skips the one check that reads device memory (the targets' range)."""
    op = "linear_cross_entropy"
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES + (torch.float64,):
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; supported: float32, float16, bfloat16")
    if x.dim() < 1:
        raise ValueError(f"{op}: x must be (N, C) or (..., C), got a scalar")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{op}: weight must be (V, C) with C = x's last dim ({x.shape[-1]}), got "
                         f"{tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise TypeError(f"{op}: x has dtype {x.dtype} but weight has {weight.dtype}; they must match (or run under "
                        "autocast)")
    if weight.device != x.device:
        raise ValueError(f"{op}: weight is on {weight.device} but x is on {x.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"{op}: bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"{op}: bias has shape {tuple(bias.shape)}, expected ({weight.shape[0]},)")
        if bias.dtype not in (x.dtype, torch.float32):
            raise TypeError(f"{op}: bias has dtype {bias.dtype}; expected x's dtype ({x.dtype}) or float32")
        if bias.device != x.device:
            raise ValueError(f"{op}: bias is on {bias.device} but x is on {x.device}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"{op}: chunk_size must be None or an int >= 1, got {chunk_size!r}")
    _check_common(op, targets, x.shape[:-1], weight.shape[0], x.device, ignore_index, reduction, label_smoothing,
                  softcap, check_targets)


def default_chunk(rows: int, vocab: int, itemsize: int, hidden: int | None = None,
                  device_memory: int | None = None) -> int:
    """Tokens per chunk of logits in ``itemsize``-byte elements.

    ``hidden`` (C, given when the weight takes a gradient): the fewest chunks within a budget of 8 * V * C bytes,
    twice the fp32 weight gradient that chunks accumulate, and within a sixteenth of ``device_memory`` (the device's
    bytes, when known): all ``rows`` in one chunk where their logits fit the budget (the weight gradient is then one
    GEMM written in the weight's dtype, with no accumulator), else chunks (a power of two of rows) whose logits take
    what the budget leaves beside the 4 * V * C bytes of the accumulator (4 * C / itemsize rows without the device
    cap), at least CHUNK_BYTES' worth. Fewer, larger chunks are faster: each chunk reads and writes the whole
    accumulator, and larger GEMMs run closer to the roofline (docs/tuning.md). Without ``hidden`` (no accumulator):
    the largest power of two whose logits fit CHUNK_BYTES, between 256 and 8192. Every chunk is at most ``rows``."""
    row_bytes = max(1, vocab * itemsize)
    fit = max(1, CHUNK_BYTES // row_bytes)
    chunk = max(256, min(8192, 1 << (fit.bit_length() - 1)))
    if hidden is not None:
        budget = 8 * vocab * hidden
        if device_memory:
            budget = min(budget, device_memory // 16)
        if rows * row_bytes <= budget:
            return max(1, rows)
        rows_of_budget = max(1, (budget - 4 * vocab * hidden) // row_bytes)
        chunk = max(chunk, 1 << (rows_of_budget.bit_length() - 1))
    return max(1, min(rows, chunk))


@functools.lru_cache(maxsize=None)
def _device_memory(device: torch.device) -> int | None:
    """The bytes of a CUDA device's memory (None elsewhere): default_chunk's cap."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


# ---- the kernels' path ---------------------------------------------------------------------------------------------
def _kernels():
    from megakern import _cross_entropy_triton

    return _cross_entropy_triton


@functools.lru_cache(maxsize=None)
def _fp32_accumulating_mm(device: torch.device) -> bool:
    """Whether addmm can accumulate a low-precision product into an fp32 output here (``out_dtype``, CUDA)."""
    if device.type != "cuda":
        return False
    try:
        a = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
        c = torch.ones(16, 16, dtype=torch.float32, device=device)
        torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
        first = torch.mm(a, a, out_dtype=torch.float32)
        return bool((c == 17).all()) and first.dtype == torch.float32 and bool((first == 16).all())
    except Exception:  # an older torch without out_dtype, or no such kernel for this device
        return False


def accumulate_mm(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc (fp32, or fp64) + a @ b, a and b possibly in a lower precision (accumulated in fp32 where the GEMM can),
    in place; ``acc`` None: a @ b as a new tensor of at least fp32 (the first term of a sum over chunks: no
    zero-filled accumulator to write and read back first). Returns the accumulator."""
    if acc is None:
        if a.dtype in (torch.float32, torch.float64):
            return a @ b
        if _fp32_accumulating_mm(a.device):
            return torch.mm(a, b, out_dtype=torch.float32)
        return (a @ b).float()
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif _fp32_accumulating_mm(acc.device):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.add_(a @ b)
    return acc


def scale_gradients(grads, factor: torch.Tensor, *, inplace: bool = False) -> list:
    """Each of ``grads`` (None stays None) times the one-element ``factor`` (a loss's incoming gradient), computed in
    at least fp32 and returned in the gradient's dtype: the backward of a loss whose gradients were made in its forward.
    ``inplace``: into the given tensors, which are returned (no second copy of a weight-sized gradient while the first
    is alive). Contiguous fp32 / fp16 / bf16 tensors where Triton runs take megakern's kernel (the factor read on the
    device, vectorized); torch's ``t * factor`` with a 0-d CUDA factor takes its broadcasting kernel, at about a quarter
    of copy bandwidth on a 128k-vocabulary weight gradient."""
    g = factor.to(torch.promote_types(factor.dtype, torch.float32))
    out = []
    for t in grads:
        if t is None:
            out.append(None)
        elif t.is_contiguous() and t.dtype in FLOAT_DTYPES and not _backend.triton_problem(t.device):
            out.append(_kernels().scale(t, g, inplace))
        else:  # upcast first: torch's CUDA bf16 * 0-d fp32 tensor would round the factor to bf16
            product = t.to(torch.promote_types(t.dtype, g.dtype)) * g
            out.append(t.copy_(product) if inplace else product.to(t.dtype))
    return out


def take_gradients(ctx, name: str) -> tuple:
    """The gradients a loss's forward left on ``ctx`` for its one backward (``ctx.grads``), taken off it, so that the
    backward can scale them in place and hand them on as the only reference (autograd then keeps them as the
    parameters' ``.grad`` without a copy). A second backward through the same graph (retain_graph=True) finds none
    and raises."""
    grads = ctx.grads
    if grads is None:
        raise RuntimeError(f"{name}: backward ran twice through the same graph (retain_graph=True); its gradients are "
                           "made in the forward and handed on, scaled in place, by the first backward: run the "
                           "forward again for another backward")
    ctx.grads = None
    return grads


def check_grad_scale(op: str, grad_scale, device) -> None:
    """``grad_scale`` None or a one-element floating tensor on ``device`` (TypeError / ValueError naming it)."""
    if grad_scale is None:
        return
    if not isinstance(grad_scale, torch.Tensor):
        raise TypeError(f"{op}: grad_scale must be a one-element tensor or None, got {type(grad_scale).__name__}")
    if grad_scale.numel() != 1:
        raise ValueError(f"{op}: grad_scale must hold one element, got shape {tuple(grad_scale.shape)}")
    if not grad_scale.is_floating_point():
        raise TypeError(f"{op}: grad_scale must be a floating tensor, got {grad_scale.dtype}")
    if grad_scale.device != device:
        raise ValueError(f"{op}: grad_scale is on {grad_scale.device} but x is on {device}")


def _announced(grad_scale: torch.Tensor | None) -> torch.Tensor | None:
    """The fp32 one-element factor the forward's gradients carry for ``grad_scale``: itself where finite and
    nonzero, else 1 (a factor that could not be divided out again), read on the device (no sync)."""
    if grad_scale is None:
        return None
    g = grad_scale.detach().reshape(1).to(torch.float32)
    return torch.where(torch.isfinite(g) & (g != 0), g, torch.ones_like(g))


def _scale(targets, ignore_index, reduction, device) -> torch.Tensor:
    """The 1-element fp32 factor of every row's gradient: 1 / (rows that count) for "mean", else 1 (no sync)."""
    if reduction == "mean":
        return (targets != ignore_index).sum().to(torch.float32).reciprocal().reshape(1)
    return torch.ones(1, dtype=torch.float32, device=device)


def _reduce(losses: torch.Tensor, scale: torch.Tensor, reduction: str) -> torch.Tensor:
    """The per-row losses as asked: "none" as they are, "sum", or "mean" (``scale`` = 1 / rows that count)."""
    if reduction == "none":
        return losses
    loss = losses.sum()
    return loss * scale[0] if reduction == "mean" else loss


class LinearCrossEntropyFunction(torch.autograd.Function):
    """loss(x @ W^T + b, targets), chunked over the rows of x (N, C); every gradient computed in the forward."""

    @staticmethod
    def forward(ctx, x, weight, bias, targets, ignore_index, reduction, label_smoothing, softcap, chunk,
                announced=None):
        kern = _kernels()
        n, _ = x.shape
        vocab = weight.shape[0]
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        need_grad = need_dx or need_dw or need_db
        scale = _scale(targets, ignore_index, reduction, x.device)
        # the gradients carry the announced incoming gradient (``_announced``); the backward divides it out again
        ctx.announced = announced
        grad_factor = scale if announced is None else scale * announced
        losses = torch.empty(n, dtype=torch.float32, device=x.device)
        grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_dx else None
        one_chunk = chunk >= n
        # the weight's gradient: one chunk's GEMM written in the weight's dtype, or chunks' products summed in fp32
        # (no rows: a zero gradient, which no GEMM writes)
        grad_w = (torch.zeros_like(weight) if n == 0 else torch.empty_like(weight)) if need_dw and one_chunk else None
        grad_b = torch.zeros(vocab, dtype=torch.float32, device=x.device) if need_db else None
        bias_c = None if bias is None else bias.to(x.dtype)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            x_c = x[start:end]
            # logits in x's dtype, then overwritten with their gradient
            logits = x_c @ weight.t() if bias_c is None else torch.addmm(bias_c, x_c, weight.t())
            loss_c, _ = kern.fwd(logits, targets[start:end], logits if need_grad else None, grad_factor,
                                 ignore_index, label_smoothing, softcap)
            losses[start:end] = loss_c
            if need_dx:
                torch.mm(logits, weight, out=grad_x[start:end])
            if need_dw:
                if one_chunk:
                    torch.mm(logits.t(), x_c, out=grad_w)
                else:
                    grad_w = accumulate_mm(grad_w, logits.t(), x_c)
            if need_db:
                grad_b += logits.sum(0, dtype=torch.float32)
            del logits  # before the next chunk's logits are allocated
        # on ctx, not saved: the backward scales them in place and hands them on (take_gradients)
        ctx.grads = (grad_x, None if grad_w is None else grad_w.to(weight.dtype),
                     None if grad_b is None else grad_b.to(bias.dtype))
        return _reduce(losses, scale, reduction)

    @staticmethod
    def backward(ctx, grad_loss):
        grads = take_gradients(ctx, "linear_cross_entropy")
        # exactly 1 (nothing read or written) when the gradient arrives as announced
        factor = grad_loss if ctx.announced is None else grad_loss.to(torch.float32) / ctx.announced
        return (*scale_gradients(grads, factor, inplace=True), None, None, None, None, None, None, None)


class CrossEntropyFunction(torch.autograd.Function):
    """loss(logits, targets) on given logits (N, V): the gradient computed in the forward into a new tensor."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index, reduction, label_smoothing, softcap):
        need_grad = ctx.needs_input_grad[0]
        scale = _scale(targets, ignore_index, "sum" if reduction == "none" else reduction, logits.device)
        rows = logits if logits.stride(-1) == 1 else logits.contiguous()
        grad = torch.empty(rows.shape, dtype=logits.dtype, device=logits.device) if need_grad else None
        losses, _ = _kernels().fwd(rows, targets, grad, scale, ignore_index, label_smoothing, softcap)
        ctx.save_for_backward(grad)
        ctx.reduction = reduction
        return _reduce(losses, scale, reduction)

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        g = grad_loss.to(torch.float32)
        g = g[:, None] if ctx.reduction == "none" else g
        return (grad * g).to(grad.dtype), None, None, None, None, None


# ---- public functions ----------------------------------------------------------------------------------------------
def autocast_inputs(x, weight, bias):
    """Under autocast, x and weight (and a low-precision bias) in the autocast dtype, cast under autograd (what the
    fused linear cross-entropy computes in; a caller with the same inputs takes them so too)."""
    device_type = x.device.type
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
        if bias is not None and bias.dtype != torch.float32:
            bias = bias.to(dtype)
    return x, weight, bias


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         bias: torch.Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                         label_smoothing: float = 0.0, softcap: float | None = None, chunk_size: int | None = None,
                         backend: str | Mapping[str, str] | None = None, check_targets: bool = True,
                         grad_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of logits = x @ weight^T (+ bias) against ``targets``, without the (N, V) logits.

    x (N, C) or (..., C), weight (V, C), targets (N,) or (...) int; ``reduction`` "mean" | "sum" ("none", per-row
    losses, only without gradients); ``chunk_size`` tokens per chunk (default: logits of a chunk under 256 MiB).
    ``backend``: 'torch' | 'triton', or a config's kernel table {op: backend}; None picks the fastest available.
    ``check_targets``: check that every target is in [0, V) or ignore_index (ValueError naming the first bad one),
    which costs one host-device sync per call; pass False where the data pipeline already checked every id (a
    target out of range then gives a NaN loss on the kernels' path, never an out-of-bounds read).
    ``grad_scale``: the gradient the loss's backward will receive, where the caller knows it in advance (one element
    on x's device, e.g. a training step's 1 / tokens, as ``(loss * grad_scale).backward()`` sends it): the kernels'
    gradients are made with it, so that the backward, when that gradient arrives, reads and writes nothing. Any
    other incoming gradient still gives the right gradients (one more pass over them); the torch backend ignores it.
    Returns the fp32 loss.
    """
    x, weight, bias = autocast_inputs(x, weight, bias)
    check_inputs(x, weight, targets, bias, ignore_index, reduction, label_smoothing, softcap, chunk_size,
                 check_targets)
    check_grad_scale("linear_cross_entropy", grad_scale, x.device)
    name = _backend.resolve("cross_entropy", x.device, backend, size=weight.shape[0])
    if name == "triton" and x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"linear_cross_entropy: the triton backend takes float32 / float16 / bfloat16, got {x.dtype}")
    with _nvtx.annotate(f"megakern.linear_cross_entropy[{name}]"), torch.autocast(x.device.type, enabled=False):
        if name == "torch":
            loss = linear_cross_entropy_ref(x, weight, targets, bias=bias, ignore_index=ignore_index,
                                            reduction=reduction, label_smoothing=label_smoothing, softcap=softcap)
            return loss.reshape(targets.shape) if reduction == "none" else loss
        x2, t2 = x.reshape(-1, x.shape[-1]), targets.reshape(-1)
        if not torch.is_grad_enabled():  # no gradient is computed for inputs that require one outside autograd
            x2, weight, bias = (None if t is None else t.detach() for t in (x2, weight, bias))
        elif reduction == "none" and any(t is not None and t.requires_grad for t in (x2, weight, bias)):
            raise ValueError("linear_cross_entropy: reduction 'none' is for evaluation (no gradient); training takes "
                             "'mean' or 'sum'")
        weight_grad = torch.is_grad_enabled() and weight.requires_grad
        chunk = chunk_size or default_chunk(x2.shape[0], weight.shape[0], x.element_size(),
                                            hidden=weight.shape[1] if weight_grad else None,
                                            device_memory=_device_memory(x.device))
        loss = LinearCrossEntropyFunction.apply(x2, weight, bias, t2, ignore_index, reduction,
                                                float(label_smoothing), softcap, chunk, _announced(grad_scale))
        return loss.reshape(targets.shape) if reduction == "none" else loss


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0, softcap: float | None = None,
                  backend: str | Mapping[str, str] | None = None, check_targets: bool = True) -> torch.Tensor:
    """Cross-entropy of ``logits`` (N, V) (or (..., V)) against ``targets`` (N,) (or (...)): F.cross_entropy's
    semantics, fp32 math, the fp32 loss; reduction "mean" | "sum" | "none". The gradient is computed in the forward
    (one (N, V) tensor in logits' dtype, no fp32 copy). ``backend``, ``check_targets`` as ``linear_cross_entropy``."""
    op = "cross_entropy"
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{op}: logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dtype not in FLOAT_DTYPES + (torch.float64,):
        raise TypeError(f"{op}: logits have dtype {logits.dtype}; supported: float32, float16, bfloat16")
    if logits.dim() < 1:
        raise ValueError(f"{op}: logits must be (N, V) or (..., V), got a scalar")
    _check_common(op, targets, logits.shape[:-1], logits.shape[-1], logits.device, ignore_index, reduction,
                  label_smoothing, softcap, check_targets)
    name = _backend.resolve("cross_entropy", logits.device, backend, size=logits.shape[-1])
    if name == "triton" and logits.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: the triton backend takes float32 / float16 / bfloat16, got {logits.dtype}")
    with _nvtx.annotate(f"megakern.cross_entropy[{name}]"):
        if name == "torch":
            loss = cross_entropy_ref(logits, targets, ignore_index=ignore_index, reduction=reduction,
                                     label_smoothing=label_smoothing, softcap=softcap)
        else:
            rows = logits.reshape(-1, logits.shape[-1])
            loss = CrossEntropyFunction.apply(rows if torch.is_grad_enabled() else rows.detach(), targets.reshape(-1),
                                              ignore_index, reduction, float(label_smoothing), softcap)
        return loss.reshape(targets.shape) if reduction == "none" else loss
