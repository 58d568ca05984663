"""Triton kernels of megakern.moe's token movement: permute, unpermute (the weighted combine) and their gradients.

Two kernels, each used twice. With the plan's order, position and offsets (see megakern/moe.py), top_k = k:

gather (a program per BLOCK_R sorted rows, walking the columns in BLOCK_C steps):
    out[r] = s_r * src[order[r] // k]      for r < offsets[E] and order[r] >= 0, else 0;   s_r = w[order[r]] or 1
    dw[order[r]] = dot(src[order[r] // k], y[r])   (fp32; 0 for the dropped assignments past offsets[E], and for
                                                    those a padded plan gives no row)
  permute forward:    src = x, no weights
  unpermute backward: src = dout, s = w, and dw against y: dy and dweights in one pass

combine (a program per BLOCK_T tokens x BLOCK_C columns):
    out[t] = sum over kept j of s_tj * src[position[t k + j]]   (fp32 sum);   s_tj = w[t, j] or 1
  unpermute forward:  src = y, s = w
  permute backward:   src = dout, no weights (a gather-sum by token: no atomics, deterministic)

Every row of an output is written by exactly one program. Rows move in the source's dtype when no weight scales them
(the permute forward copies bits); weighted rows are computed in fp32. Launchers take rows with unit column stride;
tensors in, tensors out, no autograd.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megakern._intmath import cdiv, next_power_of_2


@triton.jit
def _gather_kernel(SRC, ORDER, OFFSETS, W, Y, OUT, DW, R, C, E, stride_s, stride_y, stride_o,
                   TOP_K: tl.constexpr, HAS_W: tl.constexpr, HAS_DW: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < R
    total = tl.load(OFFSETS + E)
    assignment = tl.load(ORDER + rows, mask=in_range, other=-1)
    kept = in_range & (rows < total) & (assignment >= 0)  # order -1: a padded plan's empty row
    token = (tl.maximum(assignment, 0) // TOP_K).to(tl.int64)
    rows64 = rows.to(tl.int64)
    if HAS_W:
        scale = tl.load(W + assignment, mask=kept, other=0.0).to(tl.float32)
    dot = tl.zeros([BLOCK_R], tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        col_ok = cols < C
        v = tl.load(SRC + token[:, None] * stride_s + cols[None, :], mask=kept[:, None] & col_ok[None, :], other=0.0)
        if HAS_W:
            out = (v.to(tl.float32) * scale[:, None]).to(OUT.dtype.element_ty)
        else:
            out = v.to(OUT.dtype.element_ty)
        tl.store(OUT + rows64[:, None] * stride_o + cols[None, :], out, mask=in_range[:, None] & col_ok[None, :])
        if HAS_DW:
            y = tl.load(Y + rows64[:, None] * stride_y + cols[None, :], mask=kept[:, None] & col_ok[None, :],
                        other=0.0)
            dot += tl.sum(v.to(tl.float32) * y.to(tl.float32), axis=1)
    if HAS_DW:
        tl.store(DW + assignment, dot.to(DW.dtype.element_ty), mask=in_range & (assignment >= 0))


@triton.jit
def _combine_kernel(SRC, POSITION, W, OUT, T, C, stride_s, stride_o,
                    TOP_K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_range = tokens < T
    col_ok = cols < C
    tokens64 = tokens.to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for j in tl.static_range(TOP_K):
        # choice j of each token: its sorted row, or -1 if dropped
        pos = tl.load(POSITION + tokens64 * TOP_K + j, mask=in_range, other=-1)
        kept = pos >= 0
        v = tl.load(SRC + pos.to(tl.int64)[:, None] * stride_s + cols[None, :], mask=kept[:, None] & col_ok[None, :],
                    other=0.0).to(tl.float32)
        if HAS_W:
            w = tl.load(W + tokens64 * TOP_K + j, mask=kept, other=0.0).to(tl.float32)
            acc += v * w[:, None]
        else:
            acc += v
    tl.store(OUT + tokens64[:, None] * stride_o + cols[None, :], acc.to(OUT.dtype.element_ty),
             mask=in_range[:, None] & col_ok[None, :])


# ---- launchers -------------------------------------------------------------------------------------------------
def _gather_blocks(cols: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, warps): up to 1024 columns a step, about 4096 elements a program on a GPU."""
    if device.type != "cuda":
        return 4, min(max(16, next_power_of_2(cols)), 32), 4
    block_c = min(max(16, next_power_of_2(cols)), 1024)
    return max(1, 4096 // block_c), block_c, 4


def _combine_blocks(cols: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_C, warps) of the combine's (tokens, columns) tiles."""
    if device.type != "cuda":
        return 4, min(max(16, next_power_of_2(cols)), 32), 4
    block_c = min(max(16, next_power_of_2(cols)), 1024)
    return max(1, 2048 // block_c), block_c, 4


def _gather(src, order, offsets, top_k, weights=None, y=None, blocks=None):
    rows, cols = order.shape[0], src.shape[1]
    out = torch.empty((rows, cols), dtype=src.dtype, device=src.device)
    # by assignment: zeros, as a padded plan has rows for the kept assignments only
    dw = torch.zeros(weights.numel(), dtype=weights.dtype, device=src.device) if y is not None else None
    if rows == 0:
        return out, dw
    block_r, block_c, warps = blocks or _gather_blocks(cols, src.device)
    _gather_kernel[(cdiv(rows, block_r),)](
        src, order, offsets, out if weights is None else weights, out if y is None else y, out,
        out if dw is None else dw, rows, cols, offsets.shape[0] - 1,
        src.stride(0), 0 if y is None else y.stride(0), out.stride(0),
        TOP_K=top_k, HAS_W=weights is not None, HAS_DW=y is not None, BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=warps,
    )
    return out, dw


def _combine(src, position, top_k, weights=None, blocks=None):
    tokens, cols = position.shape[0] // top_k, src.shape[1]
    out = torch.empty((tokens, cols), dtype=src.dtype, device=src.device)
    if tokens == 0 or cols == 0:
        return out
    block_t, block_c, warps = blocks or _combine_blocks(cols, src.device)
    _combine_kernel[(cdiv(tokens, block_t), cdiv(cols, block_c))](
        src, position, out if weights is None else weights, out, tokens, cols, src.stride(0), out.stride(0),
        TOP_K=top_k, HAS_W=weights is not None, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=warps,
    )
    return out


def permute_fwd(x: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, top_k: int, blocks=None) -> torch.Tensor:
    """(R, C) in x's dtype, R = order's length: out[r] = x[order[r] // top_k] for r < offsets[E] and order[r] >= 0,
    else 0."""
    return _gather(x, order, offsets, top_k, blocks=blocks)[0]


def permute_bwd(dout: torch.Tensor, position: torch.Tensor, top_k: int, blocks=None) -> torch.Tensor:
    """dx (N, C) in dout's dtype: dx[t] = sum over kept j of dout[position[t k + j]] (fp32 sum)."""
    return _combine(dout, position, top_k, blocks=blocks)


def unpermute_fwd(y: torch.Tensor, weights: torch.Tensor, position: torch.Tensor, top_k: int,
                  blocks=None) -> torch.Tensor:
    """(N, C) in y's dtype: out[t] = sum over kept j of weights[t, j] y[position[t k + j]] (fp32 sum). ``weights``
    contiguous (N, k)."""
    return _combine(y, position, top_k, weights, blocks=blocks)


def unpermute_bwd(dout: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, order: torch.Tensor,
                  offsets: torch.Tensor, top_k: int, blocks=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy (R, C) in dout's dtype, dweights (N k,) in weights' dtype): dy[r] = w[a] dout[a // k] and
    dweights[a] = dot(dout[a // k], y[r]) in fp32 for a = order[r] >= 0, r < offsets[E]; 0 elsewhere."""
    return _gather(dout, order, offsets, top_k, weights.reshape(-1), y, blocks=blocks)
