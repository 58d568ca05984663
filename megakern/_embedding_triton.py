"""Triton kernel of the embedding's weight gradient (megakern/embedding.py): every row of the (V, C) gradient written
once, the sum of the output gradients of the tokens with that id (fp32 accumulation, in the order the tokens come),
zeros for ids no token has. The tokens arrive sorted by id (stable) with the offsets of each id's run, so the sums
need no atomics and every call gives the same bits. Tensors in, tensors out, no autograd."""
from __future__ import annotations

import triton
import triton.language as tl

from megakern._intmath import cdiv, next_power_of_2

ROWS, BLOCK_C, WARPS = 4, 1024, 4  # vocabulary rows a program, columns a program, warps a program


@triton.jit
def _embedding_bwd_kernel(GRAD, ORDER, OFFSETS, OUT, rows, cols, stride_g, stride_o, ROWS: tl.constexpr,
                          BLOCK_C: tl.constexpr):
    """Rows program_id(0) * ROWS .. of OUT, columns program_id(1) * BLOCK_C ..: row r is the sum over p in
    OFFSETS[r] .. OFFSETS[r + 1] - 1 of GRAD's row ORDER[p]."""
    offs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = offs < cols
    for i in tl.static_range(ROWS):
        r = tl.program_id(0) * ROWS + i
        if r < rows:
            start = tl.load(OFFSETS + r)
            end = tl.load(OFFSETS + r + 1)
            acc = tl.zeros([BLOCK_C], dtype=tl.float32)
            for p in range(start, end):
                src = tl.load(ORDER + p)
                acc += tl.load(GRAD + src * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(OUT + r.to(tl.int64) * stride_o + offs, acc.to(OUT.dtype.element_ty), mask=mask)


def weight_grad(grad, order, offsets, out) -> None:
    """``out`` (V, C) from ``grad`` (N, C) (unit column stride both), ``order`` (N,) int64 the token positions sorted by
    id, ``offsets`` (V + 1,) int64 where each id's run starts in ``order``."""
    rows, cols = out.shape
    if rows == 0 or cols == 0:
        return
    block = min(BLOCK_C, max(16, next_power_of_2(cols)))
    _embedding_bwd_kernel[(cdiv(rows, ROWS), cdiv(cols, block))](
        grad, order, offsets, out, rows, cols, grad.stride(0), out.stride(0), ROWS=ROWS, BLOCK_C=block,
        num_warps=WARPS)
