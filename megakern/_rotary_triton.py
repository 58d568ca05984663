"""Triton kernel for rotary position embeddings (megakern/rotary.py has the math).

One launch rotates q and k: a 1-D grid over (sequence, block of BLOCK_T tokens); each program resolves its tokens'
positions once (position ids, a binary search of cu_seqlens, offsets), loads their (cos, sin) rows in fp32, and
walks q's heads, then k's, in (BLOCK_T, BLOCK_H, pairs) tiles: each element is read once and written once. GPT-NeoX
pairs are two contiguous half-rows; GPT-J pairs are split out of one contiguous row with reshape + split, and joined
back the same way, so loads and stores stay contiguous. Features past rotary_dim are copied (out of place) or left
alone (in place). Out of place with partial rotary (FULL_ROW), each head's whole row is loaded and stored at once
instead (16-byte aligned pieces whatever rotary_dim is), each feature's pair partner loaded a second time from the
same row (an L1 hit), with per-feature cos / sin (1 / 0 past rotary_dim). The backward is the same kernel with sin
negated (CONJ).

Launchers take 4-D (B, T, heads, hs) views with unit stride along hs and the outputs to write (megakern/rotary.py
allocates them); tensors in, tensors out, no autograd.
"""
from __future__ import annotations

import functools

import triton
import triton.language as tl

from megakern._intmath import cdiv, next_power_of_2

# Elements of q or k per (BLOCK_T, BLOCK_H, row) tile, by layout (interleaved or not); warps by tile size (4 up to
# 4096 elements, else 8). Measured with benchmarks/bench_rotary.py --tune; the figures are in docs/tuning.md (rotary).
TILE = {False: 2048, True: 4096}
# Whole-row tiles (partial rotary out of place), elements per tile by GPU, at 4 warps: the H200's and the H100's
# best (other GPUs take the H100's; profiles/h100/tune_rotary.txt, profiles/h200/tune_rotary.txt).
TILE_FULL_ROW, WARPS_FULL_ROW = {"H200": 2048, None: 8192}, 4


@functools.lru_cache(maxsize=None)
def gpu_model(index: int | None) -> str | None:
    """The key of per-GPU tables (TILE_FULL_ROW) for CUDA device ``index``: 'H200', or None for any other (and for
    the interpreter)."""
    import torch

    if index is None or not torch.cuda.is_available():
        return None
    return "H200" if "H200" in torch.cuda.get_device_name(index) else None


def _prev_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


@triton.jit
def _rotate_heads(X, O, t, t_mask, c, s, nheads, stride_xt, stride_xh, stride_ot, stride_oh,
                  ROT_HALF: tl.constexpr, HEAD_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
                  COPY_REST: tl.constexpr, FULL_ROW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_P: tl.constexpr, BLOCK_REST: tl.constexpr):
    # X, O: this sequence's first token of one tensor (q or k); t (BLOCK_T,) int64 token indices; c, s
    # (BLOCK_T, BLOCK_P) fp32 rows of the table, or with FULL_ROW (BLOCK_T, BLOCK_P) per feature of the whole row
    # (BLOCK_P = next_power_of_2(HEAD_DIM)): 1 and 0 past rotary_dim, s signed for the feature's side of its pair
    p = tl.arange(0, BLOCK_P)
    c3 = c[:, None, :]
    s3 = s[:, None, :]
    for h0 in range(0, nheads, BLOCK_H):
        h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
        row_mask = t_mask[:, None] & (h < nheads)[None, :]
        x_rows = X + (t[:, None] * stride_xt + h[None, :] * stride_xh)[:, :, None]  # (BLOCK_T, BLOCK_H, 1)
        o_rows = O + (t[:, None] * stride_ot + h[None, :] * stride_oh)[:, :, None]
        if FULL_ROW:
            # the whole row in one contiguous load and store (out of place only: a feature's partner, loaded
            # again from the same row (L1), may belong to another thread); y = x c + x_partner s
            mask = row_mask[:, :, None] & (p < HEAD_DIM)[None, None, :]
            if INTERLEAVED:
                partner = p ^ 1
            else:
                partner = tl.where(p < ROT_HALF, p + ROT_HALF, p - ROT_HALF)
            x = tl.load(x_rows + p[None, None, :], mask=mask, other=0.0).to(tl.float32)
            xp = tl.load(x_rows + partner[None, None, :], mask=mask & (p < 2 * ROT_HALF)[None, None, :],
                         other=0.0).to(tl.float32)
            tl.store(o_rows + p[None, None, :], (x * c3 + xp * s3).to(O.dtype.element_ty), mask=mask)
        elif INTERLEAVED:
            # one contiguous row of 2 * BLOCK_P features, split into its (even, odd) pairs and joined back
            d = tl.arange(0, 2 * BLOCK_P)
            mask = row_mask[:, :, None] & (d < 2 * ROT_HALF)[None, None, :]
            x = tl.load(x_rows + d[None, None, :], mask=mask, other=0.0).to(tl.float32)
            x1, x2 = tl.split(tl.reshape(x, (BLOCK_T, BLOCK_H, BLOCK_P, 2)))
            y = tl.reshape(tl.join(x1 * c3 - x2 * s3, x2 * c3 + x1 * s3), (BLOCK_T, BLOCK_H, 2 * BLOCK_P))
            tl.store(o_rows + d[None, None, :], y.to(O.dtype.element_ty), mask=mask)
        else:
            # the two halves of the rotary features, each contiguous
            mask = row_mask[:, :, None] & (p < ROT_HALF)[None, None, :]
            x1 = tl.load(x_rows + p[None, None, :], mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(x_rows + ROT_HALF + p[None, None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(o_rows + p[None, None, :], (x1 * c3 - x2 * s3).to(O.dtype.element_ty), mask=mask)
            tl.store(o_rows + ROT_HALF + p[None, None, :], (x2 * c3 + x1 * s3).to(O.dtype.element_ty), mask=mask)
        if COPY_REST and not FULL_ROW:
            # features past rotary_dim, unchanged
            r = tl.arange(0, BLOCK_REST)
            mask = row_mask[:, :, None] & (r < HEAD_DIM - 2 * ROT_HALF)[None, None, :]
            v = tl.load(x_rows + 2 * ROT_HALF + r[None, None, :], mask=mask, other=0.0)
            tl.store(o_rows + 2 * ROT_HALF + r[None, None, :], v, mask=mask)


@triton.jit
def _rotary_kernel(
    Q, K, QO, KO, COS, SIN, POS, CU, OFFS,
    T, NH, NKV, ndocs, search_steps, offset,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_cos, stride_sin, stride_pb, stride_pt,
    ROT_HALF: tl.constexpr, HEAD_DIM: tl.constexpr, POS_MODE: tl.constexpr, HAS_OFFSETS: tl.constexpr,
    HAS_K: tl.constexpr, INTERLEAVED: tl.constexpr, CONJ: tl.constexpr, INPLACE: tl.constexpr,
    COPY_REST: tl.constexpr, FULL_ROW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_REST: tl.constexpr,
):
    # outputs: q and k themselves (INPLACE), else fresh contiguous (B, T, heads, HEAD_DIM) tensors, whose strides
    # follow from the shape (fewer launch arguments: each costs host time at every launch)
    t_blocks = tl.cdiv(T, BLOCK_T)
    pid = tl.program_id(0)
    b = (pid // t_blocks).to(tl.int64)
    if INPLACE:
        stride_qot, stride_qoh, qo_start = stride_qt, stride_qh, b * stride_qb
        stride_kot, stride_koh, ko_start = stride_kt, stride_kh, b * stride_kb
    else:
        stride_qot, stride_qoh, qo_start = NH * HEAD_DIM, HEAD_DIM, b * T * NH * HEAD_DIM
        stride_kot, stride_koh, ko_start = NKV * HEAD_DIM, HEAD_DIM, b * T * NKV * HEAD_DIM
    t = ((pid % t_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_mask = t < T
    # positions: POS_MODE 0 = t, 1 = position ids, 2 = t - start of its document (cu_seqlens, B == 1)
    seq = tl.zeros([BLOCK_T], dtype=tl.int64) + b  # which entry of OFFS: the sequence, or the document
    if POS_MODE == 1:
        pos = tl.load(POS + b * stride_pb + t * stride_pt, mask=t_mask, other=0).to(tl.int64)
    elif POS_MODE == 2:
        # the last document starting at or before t: binary search over cu_seqlens[0 .. ndocs - 1]
        lo = tl.zeros([BLOCK_T], dtype=tl.int32)
        hi = tl.zeros([BLOCK_T], dtype=tl.int32) + (ndocs - 1)
        for _ in range(search_steps):
            mid = (lo + hi + 1) // 2
            go_right = tl.load(CU + mid) <= t
            lo = tl.where(go_right, mid, lo)
            hi = tl.where(go_right, hi, mid - 1)
        seq = lo.to(tl.int64)
        pos = t - tl.load(CU + lo).to(tl.int64)
    else:
        pos = t
    if HAS_OFFSETS:
        pos += tl.load(OFFS + seq, mask=t_mask, other=0).to(tl.int64)
    pos += offset
    # the (cos, sin) rows of these tokens, in fp32; the backward rotates by -theta
    p = tl.arange(0, BLOCK_P)
    if FULL_ROW:
        # per feature of the row: its pair's entry, cos 1 and sin 0 past rotary_dim; sin negated on the side of
        # the pair that subtracts (y_a = x_a c - x_b s, y_b = x_b c + x_a s)
        if INTERLEAVED:
            pair = p // 2
            first = p % 2 == 0
        else:
            pair = tl.where(p < ROT_HALF, p, p - ROT_HALF)
            first = p < ROT_HALF
        cs_mask = t_mask[:, None] & (p < 2 * ROT_HALF)[None, :]
        c = tl.load(COS + pos[:, None] * stride_cos + pair[None, :], mask=cs_mask, other=1.0).to(tl.float32)
        s = tl.load(SIN + pos[:, None] * stride_sin + pair[None, :], mask=cs_mask, other=0.0).to(tl.float32)
        s = tl.where(first[None, :], -s, s)
    else:
        cs_mask = t_mask[:, None] & (p < ROT_HALF)[None, :]
        c = tl.load(COS + pos[:, None] * stride_cos + p[None, :], mask=cs_mask, other=0.0).to(tl.float32)
        s = tl.load(SIN + pos[:, None] * stride_sin + p[None, :], mask=cs_mask, other=0.0).to(tl.float32)
    if CONJ:
        s = -s
    # q's heads, then k's
    _rotate_heads(Q + b * stride_qb, QO + qo_start, t, t_mask, c, s, NH, stride_qt, stride_qh, stride_qot,
                  stride_qoh, ROT_HALF, HEAD_DIM, INTERLEAVED, COPY_REST, FULL_ROW, BLOCK_T, BLOCK_HQ, BLOCK_P,
                  BLOCK_REST)
    if HAS_K:
        _rotate_heads(K + b * stride_kb, KO + ko_start, t, t_mask, c, s, NKV, stride_kt, stride_kh,
                      stride_kot, stride_koh, ROT_HALF, HEAD_DIM, INTERLEAVED, COPY_REST, FULL_ROW, BLOCK_T, BLOCK_HK,
                      BLOCK_P, BLOCK_REST)


def config(nh: int, nkv: int, rot_half: int, rest: int = 0, block_t: int | None = None,
           num_warps: int | None = None, tile: int = TILE[False], full_row: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_HQ, BLOCK_HK, warps) for rows of ``rot_half`` pairs and ``rest`` copied features (or whole
    rows of 2 * rot_half + rest features, ``full_row``): as many heads per step as fit ``tile`` elements, then as
    many tokens."""
    if full_row:
        row = next_power_of_2(2 * rot_half + rest)
    else:
        row = 2 * next_power_of_2(rot_half) + (next_power_of_2(rest) if rest else 0)
    heads_fit = _prev_pow2(tile // row)
    block_hq = min(next_power_of_2(nh), heads_fit)
    block_hk = min(next_power_of_2(max(nkv, 1)), heads_fit)
    block_t = block_t or _prev_pow2(tile // (block_hq * row))
    if block_t & (block_t - 1):
        raise ValueError(f"rotary: block_t must be a power of 2, got {block_t}")
    warps = num_warps or (4 if block_t * block_hq * row <= 4096 else 8)
    return block_t, block_hq, block_hk, warps


def launch_config(nh: int, nkv: int, hs: int, rotary_dim: int, interleaved: bool, inplace: bool, gpu: str | None = None,
                  *,
                  block_t: int | None = None, num_warps: int | None = None, tile: int | None = None,
                  full_row: bool | None = None) -> tuple[dict, int]:
    """(the kernel's tile constexprs, warps) for one launch: whole-row tiles by default for partial rotary out of
    place (TILE_FULL_ROW, WARPS_FULL_ROW), else half-row tiles (TILE by layout); the keywords override (tuning)."""
    rot_half = rotary_dim // 2
    copy_rest = not inplace and rotary_dim < hs
    if full_row is None:
        full_row = copy_rest
    elif full_row and inplace:
        raise ValueError("rotary: full_row rotates out of place only (a feature's partner may be another thread's)")
    if full_row:
        tile, num_warps = tile or TILE_FULL_ROW.get(gpu, TILE_FULL_ROW[None]), num_warps or WARPS_FULL_ROW
    block_t, block_hq, block_hk, warps = config(nh, nkv, rot_half, hs - rotary_dim if copy_rest or full_row else 0,
                                                block_t, num_warps, tile or TILE[interleaved], full_row)
    return dict(COPY_REST=copy_rest, FULL_ROW=full_row, BLOCK_T=block_t, BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
                BLOCK_P=next_power_of_2(hs if full_row else rot_half),
                BLOCK_REST=next_power_of_2(hs - rotary_dim) if copy_rest and not full_row else 1), warps


_default_launch_config = functools.lru_cache(maxsize=256)(launch_config)  # per launch, without overrides


def fwd(q, k, q_out, k_out, cos, sin, position_ids, cu_seqlens, offsets, offset: int, rotary_dim: int,
        interleaved: bool, conj: bool, inplace: bool, **overrides):
    """(q_out, k_out | None), written, for 4-D q (B, T, nh, hs), k (B, T, nkv, hs) or None; the rest as
    megakern.rotary.Rotation holds it. ``q_out``, ``k_out``: fresh contiguous tensors of q's and k's shapes, or with
    ``inplace`` q and k themselves. ``conj``: rotate by -theta (the backward). ``overrides``: launch_config's keywords
    (block_t, num_warps, tile, full_row), for tuning."""
    batch, seqlen, nh, hs = q.shape
    nkv = k.shape[2] if k is not None else 0
    if batch * seqlen == 0 or nh + nkv == 0:
        return q_out, k_out
    gpu = gpu_model(q.device.index) if q.is_cuda else None
    if overrides:
        tiles, warps = launch_config(nh, nkv, hs, rotary_dim, interleaved, inplace, gpu, **overrides)
    else:
        tiles, warps = _default_launch_config(nh, nkv, hs, rotary_dim, interleaved, inplace, gpu)
    t_blocks = cdiv(seqlen, tiles["BLOCK_T"])
    pos_mode = 1 if position_ids is not None else 2 if cu_seqlens is not None else 0
    ndocs = cu_seqlens.numel() - 1 if cu_seqlens is not None else 1
    kk, kko = (k, k_out) if k is not None else (q, q_out)  # unused (HAS_K=False), any valid pointer
    _rotary_kernel[(batch * t_blocks,)](
        q, kk, q_out, kko, cos, sin, position_ids, cu_seqlens, offsets,
        seqlen, nh, nkv, ndocs, (ndocs - 1).bit_length(), offset,
        *q.stride()[:3], *kk.stride()[:3],
        cos.stride(0), sin.stride(0),
        (position_ids.stride(0) if position_ids.shape[0] > 1 else 0) if position_ids is not None else 0,
        position_ids.stride(1) if position_ids is not None else 0,
        ROT_HALF=rotary_dim // 2, HEAD_DIM=hs, POS_MODE=pos_mode, HAS_OFFSETS=offsets is not None,
        HAS_K=k is not None, INTERLEAVED=interleaved, CONJ=conj, INPLACE=inplace, **tiles, num_warps=warps,
    )
    return q_out, k_out
