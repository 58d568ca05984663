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

from megakern._cuda import sm_count
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


def sum_rows_geometry(g: int, n: int, lead: int, sms: int) -> tuple[int, int, int]:
    """(BLOCK_G, BLOCK_N, warps) of the sum of ``lead`` (g, n) fp32 partial tensors on a GPU of ``sms`` SMs.

    The sum is small (a few MB at most) and bound by latency, not bandwidth: each program's rows are read in
    dependent steps of BLOCK_G rows. 16 columns a program, the rows in steps of up to 512; where that leaves fewer
    than half a program an SM, 8 columns (one 32-byte sector a row) in steps of up to 1024 rows; where 32 columns
    still give three programs an SM, 32 columns in steps of 32 rows (the fastest on the H200,
    profiles/tune_sum_rows.py; docs/tuning.md)."""
    if cdiv(n, 16) * lead < sms // 2:
        block_n, most = 8, 1024
    elif cdiv(n, 32) * lead >= 3 * sms:
        block_n, most = 32, 32
    else:
        block_n, most = 16, 512
    block_g = min(most, max(16, 1 << (g - 1).bit_length()))
    warps = 8 if block_g * block_n >= 2048 and block_n < 32 else 4
    return block_g, block_n, warps


def sum_rows(part: torch.Tensor, dtype: torch.dtype = torch.float32, *, block_g: int | None = None,
             block_n: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """``part.sum(-2).to(dtype)`` for a contiguous fp32 (G, N) or (L, G, N) tensor, in one launch: (N,) or (L, N).
    ``block_g``, ``block_n``, ``num_warps`` override the launch geometry (tuning; powers of two)."""
    if part.dtype != torch.float32 or part.dim() not in (2, 3) or not part.is_contiguous():
        raise ValueError(f"sum_rows: expected a contiguous float32 (G, N) or (L, G, N) tensor, got {part.dtype} of "
                         f"shape {tuple(part.shape)}{'' if part.is_contiguous() else ' (not contiguous)'}")
    lead, (g, n) = (part.shape[0] if part.dim() == 3 else 1), part.shape[-2:]
    out = torch.empty((*part.shape[:-2], n), dtype=dtype, device=part.device)
    if n == 0 or lead == 0:
        return out
    if g == 0:
        return out.zero_()
    if part.is_cuda:
        auto = sum_rows_geometry(g, n, lead, sm_count(part.device.index))
    else:  # the CPU interpreter: small blocks
        auto = (16, 32, 4)
    block_g, block_n, warps = (given or default for given, default in zip((block_g, block_n, num_warps), auto))
    for name, value in (("block_g", block_g), ("block_n", block_n), ("num_warps", warps)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"sum_rows: {name} must be a power of two, got {value}")
    _sum_rows_kernel[(cdiv(n, block_n), lead)](part, out, g, n, BLOCK_G=block_g, BLOCK_N=block_n, num_warps=warps)
    return out
