"""Triton kernel of megakern.linear's backward: the bias gradient, the column sums of dy (M, N).

A program per (BLOCK_M x BLOCK_N) tile sums its rows in fp32 and writes them to its row of an (M / BLOCK_M, N) fp32
buffer, which megakern._reduce_triton.sum_rows sums (and casts) in one more launch: dy is read once at full bandwidth (torch's reduction over rows moved about 0.4 of
the copy bandwidth on an H100 for the (16384, 1024..3072) bf16 gradients of a GPT-350M layer).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megakern._intmath import cdiv
from megakern._reduce_triton import sum_rows


@triton.jit
def _colsum_kernel(X, PART, M, N, stride_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    x = tl.load(X + rows.to(tl.int64)[:, None] * stride_m + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(PART + pid_m.to(tl.int64) * N + cols, tl.sum(x, axis=0), mask=cols < N)


def colsum(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Column sums of a 2-D tensor with unit column stride, summed in fp32, in ``dtype``: (N,)."""
    m, n = x.shape
    if m == 0:
        return torch.zeros(n, dtype=dtype, device=x.device)
    block_m, block_n, warps = (128, 128, 8) if x.is_cuda else (8, 32, 4)
    grid = (cdiv(m, block_m), cdiv(n, block_n))
    part = torch.empty((grid[0], n), dtype=torch.float32, device=x.device)
    _colsum_kernel[grid](x, part, m, n, x.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    return sum_rows(part, dtype)
