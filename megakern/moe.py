"""Mixture-of-Experts token movement and expert GEMMs: the route plan, permute, unpermute (the weighted combine) and
the grouped GEMM.

A router picks, for each of N tokens, k experts of E (``expert_idx`` (N, k), -1 where a capacity limit dropped the
assignment) with weights (N, k). Assignment a = t * k + j is token t's j-th choice. The plan sorts the assignments by
expert, stably (ties in assignment order, so which rows an expert sees and in which order is deterministic), dropped
ones last:

    order    (N k,)   sorted row r holds assignment order[r]              (int64)
    position (N k,)   the sorted row of assignment a, -1 if dropped       (int64)
    counts   (E,)     assignments per expert (kept ones)                   (int64)
    offsets  (E + 1,) offsets[e] = counts[:e].sum(): expert e owns rows offsets[e] .. offsets[e + 1]

Shapes stay static (N k rows whatever the routing; rows from offsets[E] on are zero), so nothing reads the device
on the host and a step that routes can be captured in a CUDA graph.

A padded plan (``padded_plan(plan, capacity)``, for a capacity-limited router) lays the rows out in fixed slots
instead: expert e owns rows e * capacity .. (e + 1) * capacity, its kept assignments first (in the plan's order),
then empty rows whose order is -1 (permute writes zeros there; unpermute never reads them). Then order has
E * capacity entries (one per row) and position N k (one per assignment); offsets are the slots' bounds
(offsets[e] = e * capacity) and counts the kept rows of each slot. Expert parallelism sends such slots with fixed
split sizes.

    permute(x, plan)          (N, C) -> (R, C):  out[r] = x[order[r] // k] for r < offsets[E] and order[r] >= 0,
                              else 0 (R = N k, or E * capacity for a padded plan)
    unpermute(y, w, plan)     (R, C), (N, k) -> (N, C):  out[t] = sum_j w[t, j] y[position[t k + j]] (kept j)
    grouped_mm(x, w, offsets) (M, K), (E, K, F) -> (M, F):  rows offsets[e] .. offsets[e + 1] times w[e]; rows
                              from offsets[E] on are 0
    permute_rows(x, index, inverse)  x[index] for a permutation whose inverse the caller holds: the gradient is a
                              gather by the inverse, not index_select's zero-fill and scatter-add (expert parallelism
                              reorders received rows with it)

Math in fp32 (the combine's sum over k and the GEMMs' accumulation); outputs in the input's dtype; gradients for
x, y, w and the expert weights. The references compute in fp32 under autograd; ``grouped_mm_ref`` loops over the
experts (reading the offsets on the host).

Backends (``megakern._backend``; ops "moe" for permute / unpermute and "grouped_mm"): ``torch`` (the references
under autograd; the default on a CPU and for fp64) and ``triton`` (megakern/_moe_triton.py: a gather and a combine
kernel, each gradient one launch, no atomics; megakern/_grouped_gemm_triton.py: the grouped GEMM, its dX and dW,
persistent with TMA tiles on Hopper; the default on a GPU). Inputs with any row stride are read in place; other
layouts are made contiguous first.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from megakern import _backend, _nvtx

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int64, torch.int32)


class RoutePlan(NamedTuple):
    """Where each (token, choice) assignment goes: see the module docstring."""
    order: torch.Tensor
    position: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    top_k: int


# ---- checks --------------------------------------------------------------------------------------------------------
def _check_index(name: str, idx, dims: int) -> None:
    if not isinstance(idx, torch.Tensor) or idx.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be an int64/int32 tensor, got {getattr(idx, 'dtype', type(idx).__name__)}")
    if idx.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimension(s), got shape {tuple(idx.shape)}")


def _check_float(name: str, t, dims: int) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES + (torch.float64,):
        raise TypeError(f"{name} must be a float32/float16/bfloat16 tensor, got "
                        f"{getattr(t, 'dtype', type(t).__name__)}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(t.shape)}")


def _check_same_device(op: str, *named) -> None:
    device = named[0][1].device
    for name, t in named[1:]:
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device} but {named[0][0]} is on {device}")


def _check_plan(op: str, plan: RoutePlan, rows: int) -> None:
    if not isinstance(plan, RoutePlan):
        raise TypeError(f"{op}: plan must be a RoutePlan from route_plan(), got {type(plan).__name__}")
    _check_plan_tensors(op, plan)
    if plan.order.shape != (rows,):
        raise ValueError(f"{op}: the plan lays out {plan.order.shape[0]} rows, the input has {rows} rows")


def _check_plan_tensors(op: str, plan: RoutePlan) -> None:
    """The plan's index tensors: 1-D int64 / int32 on one device (order: one entry per row, position one per
    assignment; the same length unless the plan is padded)."""
    for name in ("order", "position", "counts", "offsets"):
        _check_index(f"{op}: plan.{name}", getattr(plan, name), 1)
    if plan.offsets.shape[0] != plan.counts.shape[0] + 1:
        raise ValueError(f"{op}: plan.offsets has {plan.offsets.shape[0]} entries, expected E + 1 = "
                         f"{plan.counts.shape[0] + 1}")
    if isinstance(plan.top_k, bool) or not isinstance(plan.top_k, int) or plan.top_k < 1:
        raise ValueError(f"{op}: plan.top_k must be an int >= 1, got {plan.top_k!r}")
    _check_same_device(op, ("plan.order", plan.order), ("plan.position", plan.position),
                       ("plan.offsets", plan.offsets))


# ---- the plan ------------------------------------------------------------------------------------------------------
def route_plan(expert_idx: torch.Tensor, num_experts: int) -> RoutePlan:
    """The plan of ``expert_idx`` (N, k) (values in [0, num_experts), or -1 for a dropped assignment): a stable sort by
    expert. The values are not read on the host (a router's top-k produces them in range); out-of-range ones are
    counted as dropped."""
    _check_index("route_plan: expert_idx", expert_idx, 2)
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"route_plan: num_experts must be a positive int, got {num_experts!r}")
    n, k = expert_idx.shape
    if k < 1 or k > num_experts:
        raise ValueError(f"route_plan: top_k = {k} (expert_idx's second dim) must be in [1, num_experts = "
                         f"{num_experts}]")
    flat = expert_idx.reshape(-1).long()
    dropped = (flat < 0) | (flat >= num_experts)
    key = torch.where(dropped, torch.full_like(flat, num_experts), flat)
    sorted_key, order = torch.sort(key, stable=True)
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=order.device)
    position = torch.where(dropped, torch.full_like(position, -1), position)
    # offsets[e] = the keys below e, searched in the sorted keys (bincount reads its input's max on the host on CUDA)
    offsets = torch.searchsorted(sorted_key, torch.arange(num_experts + 1, device=key.device))
    counts = offsets[1:] - offsets[:-1]
    return RoutePlan(order, position, counts, offsets, k)


def padded_plan(plan: RoutePlan, capacity: int) -> RoutePlan:
    """``plan`` (from ``route_plan``) in fixed slots of ``capacity`` rows per expert (see the module docstring): the
    same shapes whatever the routing, computed on the device. An assignment ranked at ``capacity`` or later in its
    expert's order gets no slot (position -1, as a dropped one): a router that applies the same capacity
    (megakern.models.moe's drop_over_capacity) has dropped it already."""
    if not isinstance(plan, RoutePlan):
        raise TypeError(f"padded_plan: plan must be a RoutePlan from route_plan(), got {type(plan).__name__}")
    _check_plan_tensors("padded_plan", plan)
    if plan.position.shape != plan.order.shape:
        raise ValueError(f"padded_plan: plan is padded already ({plan.order.shape[0]} rows for "
                         f"{plan.position.shape[0]} assignments)")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"padded_plan: capacity must be an int >= 1, got {capacity!r}")
    e = plan.counts.shape[0]
    device = plan.order.device
    rows = torch.arange(plan.order.numel(), device=device)
    offsets = plan.offsets.long()
    expert = torch.searchsorted(offsets[1:], rows, right=True)  # sorted row r's expert (E past the kept rows)
    rank = rows - offsets[expert]
    keep = (expert < e) & (rank < capacity)
    slot = torch.where(keep, expert * capacity + rank, torch.full_like(rank, -1))  # each sorted row's slot
    order = torch.full((e * capacity + 1,), -1, dtype=plan.order.dtype, device=device)
    order.scatter_(0, torch.where(keep, slot, e * capacity), plan.order)  # (row E * capacity: the rest, cut off)
    position = torch.where(plan.position >= 0, slot[plan.position.clamp(min=0)], -1).to(plan.position.dtype)
    counts = plan.counts.clamp(max=capacity)
    bounds = (torch.arange(e + 1, device=device) * capacity).to(plan.offsets.dtype)
    return RoutePlan(order[:-1], position, counts, bounds, plan.top_k)


# ---- references ----------------------------------------------------------------------------------------------------
def permute_ref(x: torch.Tensor, plan: RoutePlan) -> torch.Tensor:
    """x's rows in expert order, (R, C), in x's dtype; rows past offsets[E] and rows of order -1 are zero."""
    rows = plan.order.numel()
    valid = (torch.arange(rows, device=x.device) < plan.offsets[-1]) & (plan.order >= 0)
    out = x.index_select(0, plan.order.clamp(min=0) // plan.top_k)
    return out * valid.unsqueeze(1).to(out.dtype)


def unpermute_ref(y: torch.Tensor, weights: torch.Tensor, plan: RoutePlan) -> torch.Tensor:
    """sum_j weights[t, j] y[position[t k + j]] over the kept choices, in fp32 (fp64 for fp64), cast to y's dtype."""
    compute = torch.promote_types(y.dtype, torch.float32)
    kept = plan.position >= 0
    rows = y.to(compute).index_select(0, plan.position.clamp(min=0))
    w = weights.to(compute).reshape(-1) * kept.to(compute)
    out = (rows * w.unsqueeze(1)).reshape(weights.shape[0], plan.top_k, y.shape[1]).sum(1)
    return out.to(y.dtype)


def grouped_mm_ref(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows offsets[e] .. offsets[e + 1] of x times w[e], in fp32 (fp64 for fp64), cast to x's dtype; rows from
    offsets[E] on are zero. Reads the offsets on the host."""
    compute = torch.promote_types(x.dtype, torch.float32)
    bounds = offsets.tolist()
    parts = [x[bounds[e]:bounds[e + 1]].to(compute) @ w[e].to(compute) for e in range(w.shape[0])]
    parts.append(x.new_zeros(x.shape[0] - bounds[-1], w.shape[2], dtype=compute))
    return torch.cat(parts).to(x.dtype)


# ---- the kernels' path ---------------------------------------------------------------------------------------------
def _moe_kernels():
    from megakern import _moe_triton

    return _moe_triton


def _gemm_kernels():
    from megakern import _grouped_gemm_triton

    return _grouped_gemm_triton


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t (2-D) with unit column stride (any row stride), as the kernels read it."""
    return t if t.stride(1) == 1 or t.shape[1] <= 1 else t.contiguous()


class PermuteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, order, position, offsets, top_k):
        ctx.save_for_backward(position)
        ctx.top_k = top_k
        return _moe_kernels().permute_fwd(_rows(x), order, offsets, top_k)

    @staticmethod
    def backward(ctx, dout):
        (position,) = ctx.saved_tensors
        return _moe_kernels().permute_bwd(_rows(dout), position, ctx.top_k), None, None, None, None


class UnpermuteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, weights, order, position, offsets, top_k):
        y, weights = _rows(y), weights.contiguous()
        ctx.save_for_backward(y, weights, order, offsets)
        ctx.top_k = top_k
        return _moe_kernels().unpermute_fwd(y, weights, position, top_k)

    @staticmethod
    def backward(ctx, dout):
        y, weights, order, offsets = ctx.saved_tensors
        dy, dw = _moe_kernels().unpermute_bwd(_rows(dout), y, weights, order, offsets, ctx.top_k)
        return (dy if ctx.needs_input_grad[0] else None, dw.reshape(weights.shape) if ctx.needs_input_grad[1] else None,
                None, None, None, None)


class GroupedMMFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offsets):
        ctx.save_for_backward(x, w, offsets)
        return _gemm_kernels().grouped_mm(x, w, offsets)

    @staticmethod
    def backward(ctx, dout):
        x, w, offsets = ctx.saved_tensors
        kern = _gemm_kernels()
        dout = _rows(dout)
        dx = kern.grouped_mm(dout, w.transpose(1, 2), offsets) if ctx.needs_input_grad[0] else None
        dw = kern.grouped_mm_dw(x, dout, offsets, w.shape[0], out_dtype=w.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None


class PermuteRowsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, dout):
        (inverse,) = ctx.saved_tensors
        return dout.index_select(0, inverse), None, None


def permute_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """x[index] for a permutation ``index`` of x's rows, whose inverse (``inverse[index] = arange``) the caller has:
    the gradient is a gather by ``inverse``, where index_select's backward would zero a buffer and scatter-add into
    it (atomics; slow for bf16 rows). Not checked to be a permutation (the callers build both on the device)."""
    if index.shape != (x.shape[0],) or inverse.shape != index.shape:
        raise ValueError(f"permute_rows: index {tuple(index.shape)} and inverse {tuple(inverse.shape)} must both be "
                         f"({x.shape[0]},), a permutation of x's rows")
    return PermuteRowsFunction.apply(x, index, inverse)


def _resolve(op: str, name: str, t: torch.Tensor, backend, size: int) -> str:
    """The backend of one call: as ``_backend.resolve``, the reference for fp64 unless asked otherwise."""
    explicit = backend.get(op) if isinstance(backend, Mapping) else backend
    if explicit is None and t.dtype == torch.float64:
        return "torch"
    chosen = _backend.resolve(op, t.device, backend, size=size)
    if chosen != "torch" and t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: the {chosen} backend takes float32 / float16 / bfloat16, got {t.dtype}")
    return chosen


def moe_backend(x: torch.Tensor, backend: str | Mapping[str, str] | None = None) -> str:
    """The backend ``permute`` / ``unpermute`` take for rows like ``x``: 'torch' | 'triton'."""
    return _resolve("moe", "moe", x, backend, x.shape[-1])


def grouped_mm_backend(x: torch.Tensor, backend: str | Mapping[str, str] | None = None) -> str:
    """The backend ``grouped_mm`` takes for ``x``: 'torch' | 'triton'."""
    return _resolve("grouped_mm", "grouped_mm", x, backend, x.shape[-1])


# ---- public ops ----------------------------------------------------------------------------------------------------
def permute(x: torch.Tensor, plan: RoutePlan, *, backend: str | Mapping[str, str] | None = None) -> torch.Tensor:
    """x (N, C) -> (R, C) in the plan's expert order (zeros for the dropped tail, or a padded plan's empty rows).
    ``backend``: 'torch' | 'triton', or a config's kernel table {op: backend} (op "moe"); None picks the default for
    the device."""
    _check_float("permute: x", x, 2)
    if not isinstance(plan, RoutePlan):
        raise TypeError(f"permute: plan must be a RoutePlan from route_plan(), got {type(plan).__name__}")
    _check_plan_tensors("permute", plan)
    if plan.position.numel() != x.shape[0] * plan.top_k:
        raise ValueError(f"permute: the plan routes {plan.position.numel()} assignments, x has {x.shape[0]} tokens x "
                         f"top_k {plan.top_k}")
    _check_same_device("permute", ("x", x), ("plan.order", plan.order))
    name = _resolve("moe", "permute", x, backend, x.shape[1])
    with _nvtx.annotate(f"megakern.permute[{name}]"):
        if name == "torch":
            return permute_ref(x, plan)
        return PermuteFunction.apply(x, plan.order, plan.position, plan.offsets, plan.top_k)


def unpermute(y: torch.Tensor, weights: torch.Tensor, plan: RoutePlan, *,
              backend: str | Mapping[str, str] | None = None) -> torch.Tensor:
    """y (R, C) in the plan's expert order, weights (N, k) -> (N, C): each token's weighted sum over its kept
    choices. ``backend`` as ``permute``."""
    _check_float("unpermute: y", y, 2)
    _check_float("unpermute: weights", weights, 2)
    _check_plan("unpermute", plan, y.shape[0])
    if weights.shape[1] != plan.top_k or weights.numel() != plan.position.numel():
        raise ValueError(f"unpermute: weights has shape {tuple(weights.shape)}, expected "
                         f"({plan.position.numel() // plan.top_k}, {plan.top_k})")
    _check_same_device("unpermute", ("y", y), ("weights", weights), ("plan.position", plan.position))
    name = _resolve("moe", "unpermute", y, backend, y.shape[1])
    if name != "torch" and weights.dtype not in FLOAT_DTYPES:
        raise TypeError(f"unpermute: the {name} backend takes float32 / float16 / bfloat16 weights, got "
                        f"{weights.dtype}")
    with _nvtx.annotate(f"megakern.unpermute[{name}]"):
        if name == "torch":
            return unpermute_ref(y, weights, plan)
        return UnpermuteFunction.apply(y, weights, plan.order, plan.position, plan.offsets, plan.top_k)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, *,
               backend: str | Mapping[str, str] | None = None) -> torch.Tensor:
    """x (M, K) and the experts' weights w (E, K, F) -> (M, F); offsets (E + 1,) the experts' row ranges (on x's
    device; never read on the host by the triton backend). ``backend`` as ``permute`` (op "grouped_mm")."""
    _check_float("grouped_mm: x", x, 2)
    _check_float("grouped_mm: w", w, 3)
    _check_index("grouped_mm: offsets", offsets, 1)
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"grouped_mm: x has {x.shape[1]} columns but w is (E, K, F) = {tuple(w.shape)}")
    if offsets.shape[0] != w.shape[0] + 1:
        raise ValueError(f"grouped_mm: offsets must have E + 1 = {w.shape[0] + 1} entries, got {offsets.shape[0]}")
    if w.dtype != x.dtype:
        raise TypeError(f"grouped_mm: w is {w.dtype} but x is {x.dtype}")
    _check_same_device("grouped_mm", ("x", x), ("w", w), ("offsets", offsets))
    name = _resolve("grouped_mm", "grouped_mm", x, backend, x.shape[1])
    with _nvtx.annotate(f"megakern.grouped_mm[{name}]"):
        if name == "torch":
            return grouped_mm_ref(x, w, offsets)
        return GroupedMMFunction.apply(x, w, offsets)
