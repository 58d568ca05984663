"""Integer helpers for the kernel launchers, in plain Python.

``triton.cdiv`` and ``triton.next_power_of_2`` are Triton constexpr functions in recent releases; called from host
code they cost microseconds each (argument unwrapping on every call), which adds up on the per-call launch path.
"""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n for n >= 1 (0 for 0), as triton.next_power_of_2."""
    return n if n <= 1 else 1 << (n - 1).bit_length()
