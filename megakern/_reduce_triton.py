"""The last step of the column sums that several backward kernels leave as per-program partial rows: ``sum_rows``.

The bias gradients of megakern.linear and megakern.bias_gelu and the weight/bias gradients of the norms are written
by their backward kernels as (G, N) fp32 partial sums, one row per program (or tile row). Summing them with
``part.sum(-2)`` and casting with ``.to(dtype)`` costs two launches of torch kernels that take about 10 us each on an
H100 for GPT-350M's shapes, 145 times a step. This kernel does both in one launch of a few microseconds: a program
per BLOCK_N columns (and per leading index) adds the rows in a fixed order in fp32 and stores in the output dtype.
Deterministic: the same partial rows give the same bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megakern._intmath import cdiv


@triton.jit
def _sum_rows_kernel(PART, OUT, G, N, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n, lead = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    base = PART + lead.to(tl.int64) * G * N
    acc = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    for start in range(0, G, BLOCK_G):
        rows = start + tl.arange(0, BLOCK_G)
        acc += tl.load(base + rows.to(tl.int64)[:, None] * N + cols[None, :],
                       mask=(rows < G)[:, None] & col_ok[None, :], other=0.0)
    total = tl.sum(acc, axis=0)
    tl.store(OUT + lead.to(tl.int64) * N + cols, total.to(OUT.dtype.element_ty), mask=col_ok)


def sum_rows(part: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``part.sum(-2).to(dtype)`` for a contiguous fp32 (G, N) or (L, G, N) tensor, in one launch: (N,) or (L, N)."""
    if part.dtype != torch.float32 or part.dim() not in (2, 3) or not part.is_contiguous():
        raise ValueError(f"sum_rows: expected a contiguous float32 (G, N) or (L, G, N) tensor, got {part.dtype} of "
                         f"shape {tuple(part.shape)}{'' if part.is_contiguous() else ' (not contiguous)'}")
    lead, (g, n) = (part.shape[0] if part.dim() == 3 else 1), part.shape[-2:]
    out = torch.empty((*part.shape[:-2], n), dtype=dtype, device=part.device)
    if n == 0 or lead == 0:
        return out
    if g == 0:
        return out.zero_()
    # H100: 32 columns a program keeps enough programs in flight for N = 1024 (64 with dweight and dbias)
    block_g, block_n = (64, 32) if part.is_cuda else (16, 32)
    _sum_rows_kernel[(cdiv(n, block_n), lead)](part, out, g, n, BLOCK_G=block_g, BLOCK_N=block_n, num_warps=4)
    return out
