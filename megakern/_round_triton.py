"""A Triton helper the kernel modules share: an fp32 value stored in a lower-precision dtype, rounded to nearest even.

Under the Triton interpreter (CPU tensors, tests) an fp32 -> bf16 cast truncates; ``ROUND_BY_BITS`` rounds by
integer arithmetic instead, so CPU runs match torch's ``.to(torch.bfloat16)``. On a GPU the cast itself rounds.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rounded(y, DTYPE: tl.constexpr, ROUND_BY_BITS: tl.constexpr):
    """fp32 ``y`` in ``DTYPE``; ``ROUND_BY_BITS`` (bf16 under the interpreter): to nearest even by its bits."""
    if ROUND_BY_BITS:
        bits = y.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        out = (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        out = y.to(DTYPE)
    return out
