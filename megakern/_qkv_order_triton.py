"""Triton kernel that reorders the rows of a fused qkv projection's weight, bias or gradient (megakern/qkv_order.py
has the layouts): one program per output row and block of columns, its source row computed from the layout (no index
tensor), each element read once and written once in 16-byte pieces. Tensors in, tensors out, no autograd."""
from __future__ import annotations

import triton
import triton.language as tl

from megakern._intmath import cdiv

BLOCK, WARPS = 4096, 4  # columns a program, warps a program


@triton.jit
def _qkv_order_kernel(SRC, DST, cols, stride_s, stride_d, NKV: tl.constexpr, G: tl.constexpr, HS: tl.constexpr,
                      TO_HEADS_MAJOR: tl.constexpr, BLOCK_C: tl.constexpr):
    """Row r of the heads-major order [every query head, every k head, every v head] (hs rows a head) is row
    ((kv * (G + 2) + slot) * HS + i) of the grouped order [G query heads, k, v] per kv head; DST row r takes that row
    of SRC (TO_HEADS_MAJOR), or the other way round."""
    r = tl.program_id(0)
    head = r // HS
    i = r - head * HS
    nq = NKV * G
    is_q = head < nq
    kv = tl.where(is_q, head // G, (head - nq) % NKV)
    slot = tl.where(is_q, head % G, G + (head - nq) // NKV)
    g_row = (kv * (G + 2) + slot) * HS + i
    src_row = g_row if TO_HEADS_MAJOR else r
    dst_row = r if TO_HEADS_MAJOR else g_row
    offs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = offs < cols
    x = tl.load(SRC + src_row.to(tl.int64) * stride_s + offs, mask=mask)
    tl.store(DST + dst_row.to(tl.int64) * stride_d + offs, x, mask=mask)


def reorder(src, dst, nkv: int, g: int, hs: int, to_heads_major: bool) -> None:
    """dst (rows, cols) from src, both with unit column stride, rows = nkv * (g + 2) * hs."""
    rows, cols = src.shape
    block = min(BLOCK, max(16, triton.next_power_of_2(cols)))
    _qkv_order_kernel[(rows, cdiv(cols, block))](
        src, dst, cols, src.stride(0), dst.stride(0), NKV=nkv, G=g, HS=hs, TO_HEADS_MAJOR=to_heads_major,
        BLOCK_C=block, num_warps=WARPS)
