"""Triton kernel of megakern.optim.SumOfSquares: the sum of squares of many tensors in one launch, in fp32.

Each tensor is a row of an int64 table, (numel, address); a work list of (row, first element) pairs gives each
program BLOCK elements of one tensor (megakern._tables). A program squares its block in fp32 and writes the sum to
its own slot of PARTIALS; the caller sums the partials (a fixed order: the same bits every run, no atomics). Where
every tensor of a launch starts 16-byte aligned (ALIGNED, the host checks) a whole block is read unmasked through a
pointer declared aligned, in 16-byte vectors.

torch._foreach_norm splits the same work into launches of 320 blocks of 65536 elements: 72 launches for a
Llama-1B's gradients, each a partial wave with its own tail, about 0.56 of the read bandwidth on an H200.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ROW = 2  # int64 entries per tensor in the table


@triton.jit
def _sumsq_kernel(WORK, TABLE, PARTIALS, DTYPE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    item = WORK + pid * 2
    row = TABLE + tl.load(item) * 2
    start = tl.multiple_of(tl.load(item + 1), BLOCK)
    numel = tl.load(row)
    x = tl.load(row + 1).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        x = tl.multiple_of(x, 16)
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= numel:  # a whole block: unmasked, so that ALIGNED loads are vectorized
        v = tl.load(x + offs).to(tl.float32)
    else:
        v = tl.load(x + offs, mask=offs < numel, other=0.0).to(tl.float32)
    tl.store(PARTIALS + pid, tl.sum(v * v, axis=0))


TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def launch(work: torch.Tensor, table: torch.Tensor, partials: torch.Tensor, *, programs: int, dtype: torch.dtype,
           block: int, warps: int, aligned: bool) -> None:
    """``programs`` work items, each writing its block's sum of squares to ``partials[program]`` (fp32, at least
    ``programs`` long). ``dtype``: the tensors' (float32, bfloat16 or float16); ``aligned``: every tensor of the
    table starts at a 16-byte aligned address."""
    _sumsq_kernel[(programs,)](work, table, partials, DTYPE=TL_DTYPES[dtype], ALIGNED=aligned, BLOCK=block,
                               num_warps=warps)
