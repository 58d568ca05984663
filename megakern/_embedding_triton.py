"""Triton kernel of the embedding table's gradient (megakern/embedding.py): one program per block of table rows and
block of columns; each row's incoming gradient rows (found through the token order sorted by id and each id's range
in it) summed in fp32, TOK of them at a time in token order, and the row written once, zeros where no token took it.
Tensors in, tensors out, no autograd."""
from __future__ import annotations

import triton
import triton.language as tl

from megakern._intmath import cdiv

# rows a program, gathered gradient rows a step, columns a program (at most), warps: the defaults of ``table_grad``
ROWS, TOK, BLOCK_C, WARPS = 4, 8, 1024, 4


@triton.jit
def _embedding_grad_kernel(G, ORDER, STARTS, DW, V, C, stride_g, stride_w, ROWS: tl.constexpr, TOK: tl.constexpr,
                           BLOCK_C: tl.constexpr):
    """DW[v, cols] = sum over i in [STARTS[v], STARTS[v + 1]) of G[ORDER[i], cols], for ROWS rows v of this program;
    ORDER holds the token positions sorted by id (stably), STARTS (V + 1 entries) each id's first position in it."""
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    toks = tl.arange(0, TOK)
    for r in range(ROWS):
        v = tl.program_id(0) * ROWS + r
        start = tl.load(STARTS + tl.minimum(v, V))  # past the table: STARTS[V] twice, no gradient rows
        end = tl.load(STARTS + tl.minimum(v + 1, V))
        acc = tl.zeros((BLOCK_C,), tl.float32)
        for i in range(start, end, TOK):
            idx = i + toks
            take = idx < end
            t = tl.load(ORDER + idx, mask=take, other=0).to(tl.int64)
            g = tl.load(G + t[:, None] * stride_g + cols[None, :], mask=take[:, None] & cmask[None, :], other=0.0)
            acc += tl.sum(g.to(tl.float32), axis=0)
        inside = tl.zeros((BLOCK_C,), tl.int32) + v < V  # a vector mask (the interpreter takes no scalar one)
        tl.store(DW + v.to(tl.int64) * stride_w + cols, acc.to(DW.dtype.element_ty), mask=cmask & inside)


def table_grad(grad, order, starts, out, *, rows: int = ROWS, tok: int = TOK, block_c: int = BLOCK_C,
               warps: int = WARPS) -> None:
    """out (V, C) from grad (N, C) (unit column stride), order (N,) and starts (V + 1,) int32 as the kernel's doc
    says; ``rows``, ``tok``, ``block_c`` (powers of two; block_c is capped at C's next power of two) and ``warps``
    override the launch geometry."""
    num_rows, cols = out.shape
    block = min(block_c, max(16, triton.next_power_of_2(cols)))
    _embedding_grad_kernel[(cdiv(num_rows, rows), cdiv(cols, block))](
        grad, order, starts, out, num_rows, cols, grad.stride(0), out.stride(0), ROWS=rows, TOK=tok, BLOCK_C=block,
        num_warps=warps)
