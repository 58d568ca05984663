"""Integer helpers for the kernel launchers, in plain Python: ceil division, powers of 2, TMA alignment.

``triton.cdiv`` and ``triton.next_power_of_2`` are Triton constexpr functions in recent releases; called from host
code they cost microseconds each (argument unwrapping on every call), which adds up on the per-call launch path.
Kernel-free, so that launchers of different kernel modules share these without importing each other.
"""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n for n >= 1 (0 for 0), as triton.next_power_of_2."""
    return n if n <= 1 else 1 << (n - 1).bit_length()


def tma_aligned(tensors) -> bool:
    """Every (B, T, heads, hs) tensor has a 16-byte aligned base and 16-byte aligned batch / row / head strides, as
    a TMA descriptor needs."""
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % 16 or any((s * size) % 16 for s in t.stride()[:3]):
            return False
    return True
