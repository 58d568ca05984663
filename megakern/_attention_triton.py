"""Triton kernels of megakern.attention (FlashAttention-2 algorithm, laid out for Hopper).

Forward: a program per (batch x head, block of BLOCK_M queries); it walks the key blocks its masks allow, keeping
the running max, the running sum and the output in fp32 registers (online softmax, base 2, scale folded into one
multiply-add), and writes out and the row's log-sum-exp. The key range is cut in three: blocks that the masks cut
(causal diagonal, window edges, the ragged end) get the mask, the blocks between them run without one. On sm_90,
``fwd`` hands fixed-length batches with head dim 64 / 128 and no window to the Gluon forward
(megakern/_attention_gluon.py) where GLUON_FWD says it is the faster one; same outputs.

Backward, deterministic (the default): first a program per (batch x head, block of BLOCK_M queries) computes its
rows' delta = rowsum(dO * O) (kept for the next kernel) and walks the key blocks its rows see, accumulating dq;
then a program per (batch x kv head, block of BLOCK_N keys) walks every query head of its group and every query
block that sees its keys, accumulating dk and dv in registers (GQA groups reduced in the kernel). No atomics: the
same inputs give the same bits. With atomics: delta by its own small kernel, then the dk/dv pass also adds each
block's dq in fp32 (a TMA reduce where tensor descriptors are used; element atomics under the interpreter, which
has no TMA reduce): two fewer matmuls per block pair, results that vary in the last bits.

Tiles move by TMA on Hopper and newer when the strides allow (16-byte aligned): through the launcher's 4-D
(B, T, heads, hs) tensor descriptors where the batch has one length (the forward's tiles, the backward's loop
tiles), or through device-side descriptors made per (sequence, head), each shaped to its sequence's own length
(packed documents, the backward's loaded-once tiles); either way ragged ends read zeros and stores stop at the end. Elsewhere tiles move by masked pointer loads. All three paths
compute the same thing and all are tested; CONFIGS says which each kernel takes, and why.

Packed sequences (cu_seqlens): the batch index is the document; its rows start at cu_seqlens[b]. Tensors come in
as (B, T, heads, hs) views with unit stride along hs (packed ones as (1, total, heads, hs), batch stride unused).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from megakern._intmath import cdiv, next_power_of_2

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # Triton < 3.4: device-side descriptors or pointers only
    TensorDescriptor = None

LN2 = 0.6931471805599453
LOG2E = 1.4426950408889634


# ---- tile access: a TMA tensor descriptor or a plain pointer ----------------------------------------------------
# TMA modes: 0 masked pointer loads; 1 a device-side descriptor per (sequence, head), made by the program; 2 the
# launcher's 4-D (B, T, heads, hs) descriptor, addressed at (batch, row, head, 0) (fixed-length batches only).
@triton.jit
def _tile_src(BASE, offset, rows, stride_t, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
              TMA: tl.constexpr):
    """What _load / _store take for the (rows, HEAD_DIM) matrix at BASE + offset (row stride stride_t, unit column
    stride); BASE itself in mode 2."""
    if TMA == 2:
        return BASE
    elif TMA == 1:
        return tl.make_tensor_descriptor(BASE + offset, shape=[rows, HEAD_DIM], strides=[stride_t, 1],
                                         block_shape=[BLOCK, BLOCK_D])
    else:
        return BASE + offset


@triton.jit
def _load(src, b, h, row, rows, stride_t, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
          TMA: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """Rows row .. row + BLOCK - 1 of the matrix of batch entry b, head h, zeros past ``rows`` (pointer path: only if
    CHECK_ROWS) and past HEAD_DIM."""
    if TMA == 2:
        return src.load([b, row, h, 0]).reshape(BLOCK, BLOCK_D)
    elif TMA == 1:
        return src.load([row, 0])
    else:
        offs = row + tl.arange(0, BLOCK)
        offs_d = tl.arange(0, BLOCK_D)
        ptrs = src + offs.to(tl.int64)[:, None] * stride_t + offs_d[None, :]
        if CHECK_ROWS:
            return tl.load(ptrs, mask=(offs[:, None] < rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        elif BLOCK_D != HEAD_DIM:
            return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            return tl.load(ptrs)


@triton.jit
def _store(dst, b, h, row, rows, stride_t, value, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
           HEAD_DIM: tl.constexpr, TMA: tl.constexpr):
    """Store rows row .. row + BLOCK - 1 (those before ``rows``, columns before HEAD_DIM)."""
    if TMA == 2:
        dst.store([b, row, h, 0], value.reshape(1, BLOCK, 1, BLOCK_D))
    elif TMA == 1:
        dst.store([row, 0], value)
    else:
        offs = row + tl.arange(0, BLOCK)
        offs_d = tl.arange(0, BLOCK_D)
        tl.store(dst + offs.to(tl.int64)[:, None] * stride_t + offs_d[None, :], value,
                 mask=(offs[:, None] < rows) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _atomic_add(dst, row, rows, stride_t, value, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
                HEAD_DIM: tl.constexpr, TMA: tl.constexpr):
    """fp32 add of ``value`` into rows row .. row + BLOCK - 1 (a TMA reduce with descriptors)."""
    if TMA:
        dst.atomic_add([row, 0], value)
    else:
        offs = row + tl.arange(0, BLOCK)
        offs_d = tl.arange(0, BLOCK_D)
        tl.atomic_add(dst + offs.to(tl.int64)[:, None] * stride_t + offs_d[None, :], value,
                      mask=(offs[:, None] < rows) & (offs_d[None, :] < HEAD_DIM), sem="relaxed")


# ---- masks and ranges ------------------------------------------------------------------------------------------
@triton.jit
def _bounds(CU, b, TQ, TK, VARLEN: tl.constexpr):
    """(first row of q, first row of k, length of q, length of k) of batch entry / document b; rows in int64."""
    if VARLEN:
        start = tl.load(CU + b)
        length = tl.load(CU + b + 1) - start
        return start.to(tl.int64), start.to(tl.int64), length, length
    else:
        return 0, 0, TQ, TK


@triton.jit
def _visible(i, j, len_q, len_k, win_left, win_right,
             CAUSAL: tl.constexpr, WINDOW_L: tl.constexpr, WINDOW_R: tl.constexpr):
    """Key j visible to query i (broadcast index tiles); the causal diagonal is aligned bottom-right."""
    diag = len_k - len_q
    ok = (i < len_q) & (j < len_k)
    if CAUSAL:
        ok = ok & (j <= i + diag)
    if WINDOW_L:
        ok = ok & (j >= i + diag - win_left)
    if WINDOW_R:
        ok = ok & (j <= i + diag + win_right)
    return ok


@triton.jit
def _key_blocks(start_m, len_q, len_k, win_left, win_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, WINDOW_L: tl.constexpr, WINDOW_R: tl.constexpr):
    """Key range of the queries start_m .. start_m + BLOCK_M - 1: lo <= full_lo <= full_hi <= hi, with blocks of
    BLOCK_N from lo; [lo, full_lo) and [full_hi, hi) need the mask, [full_lo, full_hi) is visible to every query."""
    diag = len_k - len_q
    lo = 0
    hi = len_k
    full_hi = len_k  # keys every query of the block sees: below full_hi ...
    full_lo = 0  # ... and from full_lo
    if CAUSAL:
        hi = tl.minimum(hi, start_m + BLOCK_M + diag)
        full_hi = tl.minimum(full_hi, start_m + diag + 1)
    if WINDOW_R:
        hi = tl.minimum(hi, start_m + BLOCK_M + diag + win_right)
        full_hi = tl.minimum(full_hi, start_m + diag + win_right + 1)
    if WINDOW_L:
        lo = tl.maximum(0, start_m + diag - win_left)
        full_lo = tl.maximum(0, start_m + BLOCK_M - 1 + diag - win_left)
    lo = (lo // BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, lo), tl.maximum(hi, lo))
    full_hi = (tl.maximum(full_hi, 0) // BLOCK_N) * BLOCK_N
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), tl.maximum(hi, lo))
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_blocks(start_n, len_q, len_k, win_left, win_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAUSAL: tl.constexpr, WINDOW_L: tl.constexpr, WINDOW_R: tl.constexpr):
    """Query range that sees keys start_n .. start_n + BLOCK_N - 1, cut as _key_blocks: lo <= full_lo <= full_hi
    <= hi, blocks of BLOCK_M from lo; every pair in [full_lo, full_hi) is visible (query rows past len_q are
    harmless there: their lse reads +inf, so their p is 0)."""
    diag = len_k - len_q
    lo = 0
    hi = len_q
    full_lo = 0
    full_hi = len_q
    if CAUSAL:
        lo = tl.maximum(0, start_n - diag)
        full_lo = tl.maximum(full_lo, start_n + BLOCK_N - 1 - diag)
    if WINDOW_R:
        lo = tl.maximum(lo, start_n - diag - win_right)
        full_lo = tl.maximum(full_lo, start_n + BLOCK_N - 1 - diag - win_right)
    if WINDOW_L:
        hi = tl.minimum(hi, start_n + BLOCK_N - diag + win_left)
        full_hi = (tl.maximum(start_n - diag + win_left + 1, 0) // BLOCK_M) * BLOCK_M
    else:
        full_hi = hi
    lo = (lo // BLOCK_M) * BLOCK_M
    full_lo = tl.cdiv(full_lo, BLOCK_M) * BLOCK_M
    full_lo = tl.where(start_n + BLOCK_N > len_k, hi, full_lo)  # a ragged key block: masked throughout
    full_lo = tl.minimum(tl.maximum(full_lo, lo), tl.maximum(hi, lo))
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), tl.maximum(hi, lo))
    return lo, full_lo, full_hi, hi


# ---- forward ---------------------------------------------------------------------------------------------------
@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_src, v_src, b, hk, lo, hi, offs_m, len_q, len_k, win_left, win_right,
               stride_kt, stride_vt, scale_log2,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, WINDOW_L: tl.constexpr, WINDOW_R: tl.constexpr, TMA: tl.constexpr,
               MASKED: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        k = _load(k_src, b, hk, start_n, len_k, stride_kt, BLOCK_N, BLOCK_D, HEAD_DIM, TMA, MASKED)
        qk = tl.dot(q, tl.trans(k))
        if MASKED:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            ok = _visible(offs_m[:, None], offs_n[None, :], len_q, len_k, win_left, win_right,
                          CAUSAL, WINDOW_L, WINDOW_R)
            qk = tl.where(ok, qk * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
            p = tl.math.exp2(qk - m_use[:, None])
        else:  # scale > 0, so max(qk) * scale = max(qk * scale): one multiply-add per score
            m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
            m_use = m_new
            p = tl.math.exp2(qk * scale_log2 - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = _load(v_src, b, hk, start_n, len_k, stride_vt, BLOCK_N, BLOCK_D, HEAD_DIM, TMA, MASKED)
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, O, LSE, CU,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lh,
    NH, GROUP, TQ, TK, scale_log2, win_left, win_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW_L: tl.constexpr, WINDOW_R: tl.constexpr, VARLEN: tl.constexpr,
    TMA: tl.constexpr, TMA_LOOP: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    if CAUSAL:  # the longest rows first: the tail of the grid is short work
        pid_m = tl.num_programs(1) - 1 - pid_m
    b = pid_bh // NH
    h = pid_bh % NH
    hk = h // GROUP
    q_start, k_start, len_q, len_k = _bounds(CU, b, TQ, TK, VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m < len_q:  # packed documents: blocks past this document's end have nothing to do
        bb = b.to(tl.int64)
        q_src = _tile_src(Q, bb * stride_qb + q_start * stride_qt + h * stride_qh, len_q, stride_qt,
                          BLOCK_M, BLOCK_D, HEAD_DIM, TMA)
        k_src = _tile_src(K, bb * stride_kb + k_start * stride_kt + hk * stride_kh, len_k, stride_kt,
                          BLOCK_N, BLOCK_D, HEAD_DIM, TMA_LOOP)
        v_src = _tile_src(V, bb * stride_vb + k_start * stride_vt + hk * stride_vh, len_k, stride_vt,
                          BLOCK_N, BLOCK_D, HEAD_DIM, TMA_LOOP)
        o_dst = _tile_src(O, bb * stride_ob + q_start * stride_ot + h * stride_oh, len_q, stride_ot,
                          BLOCK_M, BLOCK_D, HEAD_DIM, TMA)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load(q_src, b, h, start_m, len_q, stride_qt, BLOCK_M, BLOCK_D, HEAD_DIM, TMA, True)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        lo, full_lo, full_hi, hi = _key_blocks(start_m, len_q, len_k, win_left, win_right, BLOCK_M, BLOCK_N,
                                               CAUSAL, WINDOW_L, WINDOW_R)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, b, hk, full_lo, full_hi, offs_m, len_q, len_k, win_left, win_right,
                                   stride_kt, stride_vt, scale_log2, HEAD_DIM, BLOCK_D, BLOCK_N, CAUSAL, WINDOW_L,
                                   WINDOW_R, TMA_LOOP, False)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, b, hk, full_hi, hi, offs_m, len_q, len_k, win_left, win_right,
                                   stride_kt, stride_vt, scale_log2, HEAD_DIM, BLOCK_D, BLOCK_N, CAUSAL, WINDOW_L,
                                   WINDOW_R, TMA_LOOP, True)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, b, hk, lo, full_lo, offs_m, len_q, len_k, win_left, win_right,
                                   stride_kt, stride_vt, scale_log2, HEAD_DIM, BLOCK_D, BLOCK_N, CAUSAL, WINDOW_L,
                                   WINDOW_R, TMA_LOOP, True)
        # normalize; a row that saw no key gets 0 and lse -inf
        seen = l_i > 0.0
        l_use = tl.where(seen, l_i, 1.0)
        out = acc / l_use[:, None]
        lse = tl.where(seen, (m_i + tl.math.log2(l_use)) * 0.6931471805599453, float("-inf"))
        _store(o_dst, b, h, start_m, len_q, stride_ot, out.to(q.dtype), BLOCK_M, BLOCK_D, HEAD_DIM, TMA)
        tl.store(LSE + bb * stride_lb + h * stride_lh + q_start + offs_m, lse, mask=offs_m < len_q)


# ---- backward --------------------------------------------------------------------------------------------------
@triton.jit
def _attn_bwd_delta_kernel(
    O, DO, DELTA, CU,
    stride_ob, stride_ot, stride_oh, stride_db, stride_dt, stride_dh, stride_lb, stride_lh,
    NH, TQ,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, VARLEN: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // NH
    h = pid_bh % NH
    q_start, _k_start, len_q, _len_k = _bounds(CU, b, TQ, TQ, VARLEN)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < len_q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = (q_start + offs_m)[:, None]
    bb = b.to(tl.int64)
    o = tl.load(O + bb * stride_ob + rows * stride_ot + h * stride_oh + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + bb * stride_db + rows * stride_dt + h * stride_dh + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bb * stride_lb + h * stride_lh + q_start + offs_m, delta, mask=offs_m < len_q)


@triton.jit
def _row_stats(LSE_H, DELTA_H, offs_m, len_q):
    """Base-2 lse (+inf where a row saw no key, or past the end: p = 0 there) and delta of the query rows."""
    m_ok = offs_m < len_q
    lse = tl.load(LSE_H + offs_m, mask=m_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(DELTA_H + offs_m, mask=m_ok, other=0.0)
    return lse2, delta


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, dq_dst, LSE_H, DELTA_H, b, h, lo, hi, offs_n, len_q, len_k,
                    win_left, win_right, stride_qt, stride_dot, stride_dqt, scale_log2, scale,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    CAUSAL: tl.constexpr, WINDOW_L: tl.constexpr, WINDOW_R: tl.constexpr, TMA: tl.constexpr,
                    ATOMIC_DQ: tl.constexpr, DQ_TMA: tl.constexpr, MASKED: tl.constexpr):
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load(q_src, b, h, start_m, len_q, stride_qt, BLOCK_M, BLOCK_D, HEAD_DIM, TMA, True)
        lse2, delta = _row_stats(LSE_H, DELTA_H, offs_m, len_q)
        # P^T recomputed from the saved lse, then dV += P^T dO, dS^T = P^T * (dP^T - delta), dK += dS^T Q
        s_t = tl.dot(k, tl.trans(q))
        p_t = tl.math.exp2(s_t * scale_log2 - lse2[None, :])
        if MASKED:
            ok_t = _visible(offs_m[None, :], offs_n[:, None], len_q, len_k, win_left, win_right,
                            CAUSAL, WINDOW_L, WINDOW_R)
            p_t = tl.where(ok_t, p_t, 0.0)
        do = _load(do_src, b, h, start_m, len_q, stride_dot, BLOCK_M, BLOCK_D, HEAD_DIM, TMA, True)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk = tl.dot(ds_t, q, dk)
        if ATOMIC_DQ:
            dq = tl.dot(tl.trans(ds_t), k) * scale
            _atomic_add(dq_dst, start_m, len_q, stride_dqt, dq, BLOCK_M, BLOCK_D, HEAD_DIM, DQ_TMA)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ_ACC, CU,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh, stride_lb, stride_lh,
    stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt, stride_dvh, stride_dqb, stride_dqt, stride_dqh,
    NKV, GROUP, TQ, TK, scale_log2, scale, win_left, win_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW_L: tl.constexpr, WINDOW_R: tl.constexpr, VARLEN: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, TMA: tl.constexpr, TMA_LOOP: tl.constexpr, DQ_TMA: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_n = tl.program_id(1)  # causal: the first key blocks see the most queries and go first
    b = pid_bh // NKV
    hk = pid_bh % NKV
    q_start, k_start, len_q, len_k = _bounds(CU, b, TQ, TK, VARLEN)
    start_n = pid_n * BLOCK_N
    if start_n < len_k:
        bb = b.to(tl.int64)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_src = _tile_src(K, bb * stride_kb + k_start * stride_kt + hk * stride_kh, len_k, stride_kt,
                          BLOCK_N, BLOCK_D, HEAD_DIM, TMA)
        v_src = _tile_src(V, bb * stride_vb + k_start * stride_vt + hk * stride_vh, len_k, stride_vt,
                          BLOCK_N, BLOCK_D, HEAD_DIM, TMA)
        k = _load(k_src, b, hk, start_n, len_k, stride_kt, BLOCK_N, BLOCK_D, HEAD_DIM, TMA, True)
        v = _load(v_src, b, hk, start_n, len_k, stride_vt, BLOCK_N, BLOCK_D, HEAD_DIM, TMA, True)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        lo, full_lo, full_hi, hi = _query_blocks(start_n, len_q, len_k, win_left, win_right, BLOCK_M, BLOCK_N,
                                                 CAUSAL, WINDOW_L, WINDOW_R)
        for g in range(GROUP):  # every query head of this kv head's group: dk, dv summed in registers
            h = hk * GROUP + g
            q_src = _tile_src(Q, bb * stride_qb + q_start * stride_qt + h * stride_qh, len_q, stride_qt,
                              BLOCK_M, BLOCK_D, HEAD_DIM, TMA_LOOP)
            do_src = _tile_src(DO, bb * stride_dob + q_start * stride_dot + h * stride_doh, len_q, stride_dot,
                               BLOCK_M, BLOCK_D, HEAD_DIM, TMA_LOOP)
            if ATOMIC_DQ:
                dq_dst = _tile_src(DQ_ACC, bb * stride_dqb + q_start * stride_dqt + h * stride_dqh, len_q,
                                   stride_dqt, BLOCK_M, BLOCK_D, HEAD_DIM, DQ_TMA)
            else:
                dq_dst = DQ_ACC
            stats = bb * stride_lb + h * stride_lh + q_start
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, dq_dst, LSE + stats, DELTA + stats, b, h,
                                     full_lo, full_hi, offs_n, len_q, len_k, win_left, win_right, stride_qt, stride_dot,
                                     stride_dqt, scale_log2, scale, HEAD_DIM, BLOCK_D, BLOCK_M, CAUSAL, WINDOW_L,
                                     WINDOW_R, TMA_LOOP, ATOMIC_DQ, DQ_TMA, False)
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, dq_dst, LSE + stats, DELTA + stats, b, h,
                                     lo, full_lo, offs_n, len_q, len_k, win_left, win_right, stride_qt, stride_dot,
                                     stride_dqt, scale_log2, scale, HEAD_DIM, BLOCK_D, BLOCK_M, CAUSAL, WINDOW_L,
                                     WINDOW_R, TMA_LOOP, ATOMIC_DQ, DQ_TMA, True)
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, dq_dst, LSE + stats, DELTA + stats, b, h,
                                     full_hi, hi, offs_n, len_q, len_k, win_left, win_right, stride_qt, stride_dot,
                                     stride_dqt, scale_log2, scale, HEAD_DIM, BLOCK_D, BLOCK_M, CAUSAL, WINDOW_L,
                                     WINDOW_R, TMA_LOOP, ATOMIC_DQ, DQ_TMA, True)
        dk_dst = _tile_src(DK, bb * stride_dkb + k_start * stride_dkt + hk * stride_dkh, len_k, stride_dkt,
                           BLOCK_N, BLOCK_D, HEAD_DIM, TMA)
        dv_dst = _tile_src(DV, bb * stride_dvb + k_start * stride_dvt + hk * stride_dvh, len_k, stride_dvt,
                           BLOCK_N, BLOCK_D, HEAD_DIM, TMA)
        _store(dk_dst, b, hk, start_n, len_k, stride_dkt, (dk * scale).to(k.dtype), BLOCK_N, BLOCK_D, HEAD_DIM, TMA)
        _store(dv_dst, b, hk, start_n, len_k, stride_dvt, dv.to(v.dtype), BLOCK_N, BLOCK_D, HEAD_DIM, TMA)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse2, delta, k_src, v_src, b, hk, lo, hi, offs_m, len_q, len_k, win_left, win_right,
                  stride_kt, stride_vt, scale_log2,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAUSAL: tl.constexpr, WINDOW_L: tl.constexpr, WINDOW_R: tl.constexpr, TMA: tl.constexpr,
                  MASKED: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        k = _load(k_src, b, hk, start_n, len_k, stride_kt, BLOCK_N, BLOCK_D, HEAD_DIM, TMA, MASKED)
        v = _load(v_src, b, hk, start_n, len_k, stride_vt, BLOCK_N, BLOCK_D, HEAD_DIM, TMA, MASKED)
        s = tl.dot(q, tl.trans(k))
        p = tl.math.exp2(s * scale_log2 - lse2[:, None])
        if MASKED:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            ok = _visible(offs_m[:, None], offs_n[None, :], len_q, len_k, win_left, win_right,
                          CAUSAL, WINDOW_L, WINDOW_R)
            p = tl.where(ok, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, O, DO, LSE, DELTA, DQ, CU,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh, stride_dob, stride_dot, stride_doh, stride_lb, stride_lh,
    stride_dqb, stride_dqt, stride_dqh,
    NH, GROUP, TQ, TK, scale_log2, scale, win_left, win_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW_L: tl.constexpr, WINDOW_R: tl.constexpr, VARLEN: tl.constexpr,
    TMA: tl.constexpr, TMA_LOOP: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    if CAUSAL:
        pid_m = tl.num_programs(1) - 1 - pid_m
    b = pid_bh // NH
    h = pid_bh % NH
    hk = h // GROUP
    q_start, k_start, len_q, len_k = _bounds(CU, b, TQ, TK, VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m < len_q:
        bb = b.to(tl.int64)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_src = _tile_src(Q, bb * stride_qb + q_start * stride_qt + h * stride_qh, len_q, stride_qt,
                          BLOCK_M, BLOCK_D, HEAD_DIM, TMA)
        do_src = _tile_src(DO, bb * stride_dob + q_start * stride_dot + h * stride_doh, len_q, stride_dot,
                           BLOCK_M, BLOCK_D, HEAD_DIM, TMA)
        k_src = _tile_src(K, bb * stride_kb + k_start * stride_kt + hk * stride_kh, len_k, stride_kt,
                          BLOCK_N, BLOCK_D, HEAD_DIM, TMA_LOOP)
        v_src = _tile_src(V, bb * stride_vb + k_start * stride_vt + hk * stride_vh, len_k, stride_vt,
                          BLOCK_N, BLOCK_D, HEAD_DIM, TMA_LOOP)
        dq_dst = _tile_src(DQ, bb * stride_dqb + q_start * stride_dqt + h * stride_dqh, len_q, stride_dqt,
                           BLOCK_M, BLOCK_D, HEAD_DIM, TMA)
        q = _load(q_src, b, h, start_m, len_q, stride_qt, BLOCK_M, BLOCK_D, HEAD_DIM, TMA, True)
        do = _load(do_src, b, h, start_m, len_q, stride_dot, BLOCK_M, BLOCK_D, HEAD_DIM, TMA, True)
        # delta = rowsum(dO * O) of these rows, here (no separate pass over O and dO), kept for the dk/dv kernel
        o_src = _tile_src(O, bb * stride_ob + q_start * stride_ot + h * stride_oh, len_q, stride_ot,
                          BLOCK_M, BLOCK_D, HEAD_DIM, TMA)
        o = _load(o_src, b, h, start_m, len_q, stride_ot, BLOCK_M, BLOCK_D, HEAD_DIM, TMA, True)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        stats = bb * stride_lb + h * stride_lh + q_start
        tl.store(DELTA + stats + offs_m, delta, mask=offs_m < len_q)
        lse = tl.load(LSE + stats + offs_m, mask=offs_m < len_q, other=float("-inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        lo, full_lo, full_hi, hi = _key_blocks(start_m, len_q, len_k, win_left, win_right, BLOCK_M, BLOCK_N,
                                               CAUSAL, WINDOW_L, WINDOW_R)
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_src, v_src, b, hk, full_lo, full_hi, offs_m, len_q, len_k, win_left,
                           win_right, stride_kt, stride_vt, scale_log2, HEAD_DIM, BLOCK_D, BLOCK_N, CAUSAL,
                           WINDOW_L, WINDOW_R, TMA_LOOP, False)
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_src, v_src, b, hk, full_hi, hi, offs_m, len_q, len_k, win_left,
                           win_right, stride_kt, stride_vt, scale_log2, HEAD_DIM, BLOCK_D, BLOCK_N, CAUSAL,
                           WINDOW_L, WINDOW_R, TMA_LOOP, True)
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_src, v_src, b, hk, lo, full_lo, offs_m, len_q, len_k, win_left,
                           win_right, stride_kt, stride_vt, scale_log2, HEAD_DIM, BLOCK_D, BLOCK_N, CAUSAL,
                           WINDOW_L, WINDOW_R, TMA_LOOP, True)
        _store(dq_dst, b, h, start_m, len_q, stride_dqt, (dq * scale).to(q.dtype), BLOCK_M, BLOCK_D, HEAD_DIM, TMA)


# ---- launchers -------------------------------------------------------------------------------------------------
# (BLOCK_M, BLOCK_N, num_warps, num_stages, tile moves) per kernel, head dim and sequence length: a head dim uses
# the entry of the smallest tuned one >= it, a sequence (the longer of Tq and Tk, or max_seqlen) the first row whose
# limit it does not pass. Tile moves: "host" the launcher's 4-D descriptors, "hybrid" device-side descriptors for the
# tiles a program loads or stores once and the launcher's for the tiles of its loop, "device" device-side descriptors
# (packed documents always take these), False masked pointer loads. Measured on the H200 with profiles/tune_attention.py
# (bf16, B * T = 16384, nh * hs = 2048, causal unless said; TFLOP/s, the same-run bf16 matmul at 679-701):
# - fwd, the launcher's descriptors against device-side ones (same tiles): hs128 T 4096 128x128 8 warps 3 stages
#   423 against 392, 128x64 8w3s 404 / 374; T 1024 128x32 4w4s 274 / 264, 128x128 8w3s 264 / 214; hs64 T 4096
#   128x64 4w3s 368 / 339. Beside dropping the per-program descriptor setup, the loaded-once q tile goes to registers
#   (wgmma's A operand) rather than shared memory.
# - fwd tiles, T 4096: hs128 128x128 8w3s as above (full 431 with device-side descriptors); 128x128 8w2s 373;
#   Triton's warp specialization of the loop (128x128 8w3s, device-side) 385, so it is not used. T 2048: hs128
#   128x128 8w3s 350, 64x64 4w3s 343, 128x64 8w3s 339, 128x32 4w4s 332; hs64 128x64 4w3s 305, 64x64 4w3s 295,
#   128x32 4w4s 284, 128x128 8w3s 247. T 1024: hs128 128x32 4w4s 274, 64x64 4w3s 224, 128x64 4w3s 218.
# - backward, two passes (dq kernel, making delta as it goes, then the dk/dv kernel), T 4096: hs128 dk/dv 64x64
#   4w2s + dq 128x64 8w3s 329-331 with the loop's tiles through the launcher's descriptors ("hybrid"), 322-328
#   all device-side (full 349); hs64 dk/dv 32x64 4w3s + dq 64x64 4w3s 272-274 hybrid, 267-270 device-side. With
#   the launcher's descriptors everywhere the backward is slower (hs128 265-271): the loaded-once k and v (dk/dv)
#   or q and dO (dq) tiles go to registers, which these kernels lack (255 registers and spills). The single pass
#   with atomic dq is slower at its best tile: hs128 291 (full 304, 32x128 8w3s), hs64 224 (64x64 4w2s); so dq
#   comes from its own pass by default.
# - backward, T 1024: hs128 dk/dv 64x64 4w2s + dq 128x32 4w3s 203-216 hybrid, 195-206 device-side (the earlier
#   dk/dv 64x128 8w2s with pointer loads 204); hs64 dk/dv 32x64 4w3s 163, dq 128x64 8w2s with pointer loads 170.
# - the launcher's descriptors cost host time: on the H200 machine's host, kern.fwd takes 137 us with them against
#   77 us device-side (profiles/profile_attention_launch.py), and a forward + backward through autograd at B 16
#   T 1024 hs128 took 1324 us of host time against 926 device-side, above its 1059 us of GPU time: the GPU waited.
#   So up to T 1024 every kernel takes device-side descriptors (GPU-side a few percent slower, see above).
# - backward, hs64 T 1024 on an H100 (B 16, 32 heads; the tile moves forced on both kernels): pointer loads win
#   at this length: dk/dv 32x64 4w3s + dq 128x32 4w3s 186 TFLOP/s with pointers, 173 with the launcher's
#   descriptors, 161 hybrid, 154 device-side (the previous entry's dk/dv moves); dq 128x64 8w2s 157 with pointers.
#   Then with pointers, one kernel's tile at a time: dk/dv 32x128 4w3s 207 (32x64 4w3s 190, 16x64 187, 64x64 182,
#   32x64 4w2s 174, 32x32 134), dq 128x32 4w4s 193 (4w3s 187, 8w3s 191, 128x64 180, 64x32 171).
# - tried and left out: FlashAttention-4's lazy rescale in the forward's unmasked loop (the running max moves only
#   when a row's max grows by more than 8, base 2, so most blocks skip rescaling acc and l; a block-wide max decides,
#   which costs a cross-warp reduction and two more barriers per block). H100, causal, tiles as CONFIGS, TFLOP/s
#   without / with: hs128 T 1024 234 / 232, T 2048 297 / 296, T 4096 401 / 380; hs64 T 4096 366 / 351.
#   Nor can the next block's QK^T be issued before the softmax of this one (FlashAttention-3's overlap): Triton's
#   wgmma pipeliner waits on a dot whose result the loop uses outside an `if` right after issuing it.
# - 256-row forward tiles spill (H200, hs128 causal, the launcher's descriptors): T 4096 256x64 16w2s 231, 256x32 8w3s
#   325, 256x128 16w2s 46, against 128x128 8w3s 409; T 16384 258 against 479. The long-sequence backward tiles hold at
#   T 16384 too: dk/dv 64x64 4w2s 384 (64x128 8w2s 372, 128x128 8w1s 262), dq 128x64 8w3s 380 (128x128 8w2s 368)
#   (profiles/h200/tune_attention.txt).
# - hs256: not tuned; tiles that fit the shared memory, device-side descriptors (a 64x256 q tile in registers would
#   spill). Head dims up to 32 keep the long-sequence tiles at every length: with the short-sequence ones, ptxas 13.0
#   (on the H200 machine) crashed compiling hs16 at T 1.
_LONG = 1 << 62
# The Gluon forward (megakern._attention_gluon: warp-specialized, persistent, two consumer warpgroups in ping-pong)
# takes fixed-length batches on sm_90 up to these sequence lengths, per head dim and causal; H200, bf16, B * T = 16384,
# nh * hs = 2048, TFLOP/s Gluon / the Triton forward (profiles/probe_attention_gluon.py), with the tile schedules that
# keep a head's k / v in L2 (_attention_gluon.L2_GROUP_BYTES):
# - hs128 causal: T 1024 375 / 262, 2048 467 / 345, 4096 536 / 405, 16384 607 / 479; full: 522 / 333, 574 / 405,
#   595 / 425, 622 / 485.
# - hs64 causal: T 2048 354 / 310, 4096 407 / 351; full: 423 / 340, 443 / 384. (Before those schedules hs64 full
#   attention was 383 / 385 at T 4096 and kept the Triton kernel past T 2048.)
# One consumer of 8 warps instead of the ping-pong pair is slower everywhere (hs128 T 4096 causal 389, hs64 299).
GLUON_FWD = {128: {True: _LONG, False: _LONG}, 64: {True: _LONG, False: _LONG}}
# The deterministic backward's passes by the Gluon kernels (two consumer warpgroups of 64 rows each, a TMA producer
# warp, persistent): head dims and masks where each is the faster one; dq (GLUON_DQ, which also makes delta) runs
# first, then dk/dv (GLUON_BWD). H200, TFLOP/s of the whole deterministic backward with both passes in Triton / the
# Gluon dk/dv pass / both in Gluon (profiles/probe_attention_gluon.py --bwd), with the L2 tile schedules: hs128
# causal T 1024 206 / 241 / 269, 2048 271 / 300 / 342, 4096 321 / 350 / 383, 16384 388 / 411 / 445; full T 4096
# 356 / 404 / 448; hs64 causal T 2048 227 / 259 / 292, 4096 258 / 304 / 324; full T 4096 272 / 316 / 348. The dq
# pass with 2 k / v slots instead of 3 (hs128) or 4 (hs64) is slower than Triton's (hs128 T 2048 264, hs64 205): a
# block's k stays in use until its dS K is done, an iteration later. Turns between the dq pass's two warpgroups
# (ping-pong, as in the forward): no better (hs128 causal T 2048 302 against 301, T 4096 345 against 359). 3 q / dO
# slots instead of 2 in the dk/dv pass (hs128), or P^T computed while dP^T runs there: no better.
GLUON_BWD = {128: (True, False), 64: (True, False)}
GLUON_DQ = {128: (True, False), 64: (True, False)}
CONFIGS = {
    "fwd": {32: ((_LONG, (128, 64, 4, 3, "host")),),
            64: ((1024, (128, 32, 4, 4, "device")), (_LONG, (128, 64, 4, 3, "host"))),
            128: ((1024, (128, 32, 4, 4, "device")), (_LONG, (128, 128, 8, 3, "host"))),
            256: ((_LONG, (64, 32, 4, 2, "device")),)},
    # the forward while a CUDA graph is captured, where launch cost is paid once: the launcher's descriptors at every
    # length (H100, hs64 T 1024 causal: 128x64 4w3s 236 TFLOP/s with them, against 128x32 4w4s device-side 209)
    "fwd_graph": {32: ((_LONG, (128, 64, 4, 3, "host")),),
                  64: ((_LONG, (128, 64, 4, 3, "host")),),
                  128: ((1024, (128, 32, 4, 4, "host")), (_LONG, (128, 128, 8, 3, "host"))),
                  256: ((_LONG, (64, 32, 4, 2, "device")),)},
    "dkdv": {32: ((_LONG, (32, 64, 4, 3, "device")),),
             64: ((1024, (32, 128, 4, 3, False)), (_LONG, (32, 64, 4, 3, "hybrid"))),
             128: ((1024, (64, 64, 4, 2, "device")), (_LONG, (64, 64, 4, 2, "hybrid"))),
             256: ((_LONG, (32, 64, 4, 2, "device")),)},
    "dkdv_atomic": {32: ((_LONG, (64, 64, 4, 2, "device")),), 64: ((_LONG, (64, 64, 4, 2, "device")),), 128: ((_LONG, (32, 128, 8, 3, "device")),),
                    256: ((_LONG, (32, 64, 4, 2, "device")),)},
    "dq": {32: ((_LONG, (64, 64, 4, 3, "device")),),
           64: ((1024, (128, 32, 4, 4, False)), (_LONG, (64, 64, 4, 3, "hybrid"))),
           128: ((1024, (128, 32, 4, 3, "device")), (_LONG, (128, 64, 8, 3, "hybrid"))),
           256: ((_LONG, (64, 32, 4, 2, "device")),)},
}


def _config(hs: int, device: torch.device, kind: str, seqlen: int) -> tuple[int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, tma) of ``kind`` (a key of CONFIGS) for head dim hs and sequence
    length seqlen."""
    if device.type != "cuda":  # the interpreter: small tiles, each kind's choice of descriptors
        return 16, 16, 4, 1, CONFIGS[kind][128][-1][1][4]
    table = CONFIGS[kind]
    rows = table[min(d for d in table if d >= hs)]
    return next(cfg for limit, cfg in rows if seqlen <= limit)


def _tiles(config, tma, hs, device, kind, seqlen):
    """(BLOCK_M, BLOCK_N, warps, stages, prefer descriptors): an explicit 4-tuple ``config`` with ``tma`` (None: yes),
    else the table's entry; an explicit ``tma`` wins over the table's preference."""
    if config is not None:
        return (*config[:4], True if tma is None else tma)
    *tiles, prefer = _config(hs, device, kind, seqlen)
    return (*tiles, prefer if tma is None else tma)


def _as4d(t: torch.Tensor, varlen: bool) -> torch.Tensor:
    """(B, T, heads, hs) view with unit stride along hs; packed (total, heads, hs) as (1, total, heads, hs)."""
    t = t[None] if varlen else t
    return t if t.stride(-1) == 1 else t.contiguous()


def _strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    return (0 if varlen else t.stride(0)), t.stride(1), t.stride(2)


def _geometry(q, k, cu_seqlens, max_seqlen):
    varlen = cu_seqlens is not None
    if varlen:
        return True, cu_seqlens.numel() - 1, max_seqlen, max_seqlen
    return False, q.shape[0], q.shape[1], k.shape[1]


def _masks(causal, window):
    left, right = window
    return dict(CAUSAL=causal, WINDOW_L=left >= 0, WINDOW_R=right >= 0 and not causal), max(left, 0), max(right, 0)


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _hopper_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def _tma_ok(tensors) -> bool:
    """Tensor descriptors (TMA) can carry these 4-D tensors: Hopper or newer (or the interpreter), 16-byte aligned
    base and row / head / batch strides. (The launchers pass the caller's tensors, the gradients the caller hands the
    backward included: their own outputs are fresh contiguous allocations with head dims that are multiples of 16,
    aligned by construction.)"""
    first = tensors[0]
    if first.device.type == "cuda":
        if not _hopper_or_newer(first.device.index):
            return False
    elif not _interpreting():
        return False
    return tma_aligned(tensors)


def tma_aligned(tensors) -> bool:
    """Every (B, T, heads, hs) tensor has a 16-byte aligned base and 16-byte aligned batch / row / head strides, as
    a TMA descriptor needs."""
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % 16 or any((s * size) % 16 for s in t.stride()[:3]):
            return False
    return True


def _scratch(size: int, alignment: int, stream):
    """Global scratch for device-side tensor descriptors (Triton asks for it at launch)."""
    device = "cpu" if _interpreting() or not torch.cuda.is_available() else torch.cuda.current_device()
    return torch.empty(size, dtype=torch.int8, device=device)


def _ensure_allocator() -> None:
    """Device-side descriptors need a Triton allocator; set one unless the application has its own."""
    try:
        from triton.runtime import _allocation

        current = _allocation._allocator.get()
        if not isinstance(current, _allocation.NullAllocator):
            return
    except (ImportError, AttributeError):
        pass
    triton.set_allocator(_scratch)


def _pick_tma(prefer, forced, tensors, varlen: bool) -> tuple[int, int]:
    """TMA modes (see _tile_src) of a launch, (tiles loaded or stored once per program, tiles of the loop): tensor
    descriptors if forced on (tests, tuning: True, or one of the kinds below) or else if preferred and the tensors
    allow them. Kinds: 'host' the launcher's 4-D descriptors for all tiles, 'hybrid' device-side descriptors for the
    once-per-program tiles and the launcher's for the loop's, 'device' device-side ones for all. Packed documents
    always take device-side descriptors."""
    use = forced if forced is not None else (prefer if _tma_ok(tensors) else False)
    if not use:
        return 0, 0
    if use == "device" or varlen or TensorDescriptor is None or any(t.numel() == 0 for t in tensors):
        if forced in ("host", "hybrid"):
            raise ValueError(f"attention: tma={forced!r} needs a fixed-length batch and Triton >= 3.4")
        _ensure_allocator()
        return 1, 1
    if use == "hybrid":
        _ensure_allocator()
        return 1, 2
    return 2, 2


def _descs(*items):
    """The kernel's tensor arguments, from (tensor, tile rows, mode) items: in mode 2 the tensor's 4-D descriptor of
    (1, rows, 1, hs-block) tiles, else the tensor itself."""
    return [TensorDescriptor(t, list(t.shape), list(t.stride()), [1, r, 1, max(16, next_power_of_2(t.shape[-1]))])
            if mode == 2 else t for t, r, mode in items]


def _use_gluon(hs: int, causal: bool, seqlen: int) -> bool:
    """The Gluon forward (megakern._attention_gluon) is the faster one here; see GLUON_FWD."""
    limit = GLUON_FWD.get(hs, {}).get(causal, 0)
    return seqlen <= limit


def fwd(q, k, v, causal: bool, scale: float, window, cu_seqlens, max_seqlen, config=None, tma=None, gluon=None):
    """(out, lse): out like q; lse (B, nh, Tq) or (nh, total) fp32. ``config`` (BLOCK_M, BLOCK_N, warps, stages)
    overrides the CONFIGS entry; ``tma`` forces tensor descriptors on or off (tests, tuning). ``gluon``: None takes
    the Gluon kernel (Hopper, fixed-length batches, see GLUON_FWD) where it applies and neither ``config`` nor ``tma``
    is given; False never; True always (an error where it cannot run)."""
    if gluon or (gluon is None and config is None and tma is None and q.is_cuda):
        from megakern import _attention_gluon

        can = _attention_gluon.supported(q, k, v, causal, window, cu_seqlens)
        if gluon and not can:
            raise ValueError("attention: the Gluon forward needs an sm_90 GPU, a fixed-length fp16 / bf16 batch with "
                             f"head dim in {_attention_gluon.HEAD_DIMS}, no window and 16-byte aligned strides")
        if can and (gluon or _use_gluon(q.shape[-1], causal, max(q.shape[1], k.shape[1]))):
            return _attention_gluon.fwd(q, k, v, causal, scale)
    varlen, batch, tq, tk = _geometry(q, k, cu_seqlens, max_seqlen)
    q4, k4, v4 = (_as4d(t, varlen) for t in (q, k, v))
    nh, hs, nkv = q.shape[-2], q.shape[-1], k.shape[-2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    o4 = _as4d(out, varlen)
    lse = torch.empty((nh, q.shape[0]) if varlen else (batch, nh, tq), dtype=torch.float32, device=q.device)
    stride_lb, stride_lh = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))
    kind = "fwd_graph" if q.is_cuda and torch.cuda.is_current_stream_capturing() else "fwd"
    block_m, block_n, warps, stages, prefer = _tiles(config, tma, hs, q.device, kind, max(tq, tk))
    flags, left, right = _masks(causal, window)
    if batch == 0 or tq == 0:
        return out, lse
    once, loop = _pick_tma(prefer, tma, (q4, k4, v4), varlen)
    _attn_fwd_kernel[(batch * nh, cdiv(tq, block_m))](
        *_descs((q4, block_m, once), (k4, block_n, loop), (v4, block_n, loop), (o4, block_m, once)), lse, cu_seqlens,
        *_strides(q4, varlen), *_strides(k4, varlen), *_strides(v4, varlen), *_strides(o4, varlen),
        stride_lb, stride_lh,
        nh, nh // nkv, tq, tk, scale * LOG2E, left, right,
        HEAD_DIM=hs, BLOCK_D=max(16, next_power_of_2(hs)), BLOCK_M=block_m, BLOCK_N=block_n,
        VARLEN=varlen, TMA=once, TMA_LOOP=loop, num_warps=warps, num_stages=stages, **flags,
    )
    return out, lse


def _gluon_pass(choice, table, name, dout, q, k, v, g1, g2, causal, hs, window, cu_seqlens, configs, tma,
                atomic):
    """Whether a pass of the deterministic backward runs as the Gluon kernel: False or the pass's config tuple (True
    for its default tiles). ``choice`` None asks ``table`` (head dim -> the masks where it wins) unless ``configs``
    or ``tma`` are given; False never; True / a config tuple always, an error where it cannot run (``g1``, ``g2``:
    the pass's other tensors, which it reads or writes)."""
    if choice is False or atomic and not choice:
        return False
    if choice is None and (configs or tma is not None or not q.is_cuda or causal not in table.get(hs, ())):
        return False
    from megakern import _attention_gluon

    can = not atomic and _attention_gluon.supported(q, k, v, causal, window, cu_seqlens, others=(dout, g1, g2))
    if choice and not can:
        raise ValueError(f"attention: the Gluon {name} pass needs the deterministic backward and what the Gluon "
                         "forward needs, for dout and the gradients too")
    return can and (choice or True)


def _gluon_config(choice):
    """The config tuple a forced Gluon pass names, None for its default tiles."""
    return choice if isinstance(choice, tuple) else None


def bwd(dout, q, k, v, out, lse, causal: bool, scale: float, window, cu_seqlens, max_seqlen, deterministic: bool,
        configs=None, tma=None, out_grads=None, gluon=None, gluon_dq=None):
    """(dq, dk, dv). ``configs`` {'dkdv': ..., 'dq': ...} override the CONFIGS entries; ``tma`` as for ``fwd``.
    ``out_grads`` (dq, dk, dv): tensors shaped like q, k, v (any strides with unit stride along hs) to write into.
    ``gluon`` / ``gluon_dq``: the deterministic backward's dk/dv / dq pass by the Gluon kernel
    (megakern._attention_gluon.bwd_dkdv / bwd_dq): None where it applies (GLUON_BWD / GLUON_DQ) and neither
    ``configs`` nor ``tma`` is given; False never; True or a config tuple always (an error where it cannot run)."""
    configs = configs or {}
    varlen, batch, tq, tk = _geometry(q, k, cu_seqlens, max_seqlen)
    q4, k4, v4, o4, do4 = (_as4d(t, varlen) for t in (q, k, v, out, dout))
    nh, hs, nkv = q.shape[-2], q.shape[-1], k.shape[-2]
    block_d = max(16, next_power_of_2(hs))
    flags, left, right = _masks(causal, window)
    stride_lb, stride_lh = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))
    atomic = not deterministic
    if out_grads is not None:
        dq_out, dk, dv = out_grads
        if dq_out.shape != q.shape or dk.shape != k.shape or dv.shape != v.shape or any(
                t.stride(-1) != 1 or t.dtype != q.dtype or t.device != q.device for t in out_grads):
            raise ValueError("attention backward: out_grads must be shaped like q, k, v, with q's dtype and device "
                             "and unit stride along the head dim")
    else:
        dq_out = None
        dk, dv = torch.empty(k.shape, dtype=k.dtype, device=k.device), torch.empty(v.shape, dtype=v.dtype,
                                                                                   device=v.device)
    if atomic:
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    else:
        dq = dq_out if dq_out is not None else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    # which passes run as the Gluon kernels, decided (and a forced one that cannot run refused) before any work
    gluon_dq = _gluon_pass(gluon_dq, GLUON_DQ, "dq", dout, q, k, v, out, dq, causal, hs, window, cu_seqlens, configs,
                           tma, atomic)
    gluon_dkdv = _gluon_pass(gluon, GLUON_BWD, "dk/dv", dout, q, k, v, dk, dv, causal, hs, window, cu_seqlens,
                             configs, tma, atomic)
    if batch == 0 or tq == 0 or tk == 0:
        if dq_out is not None:
            dq_out.zero_()
        return (dq_out if dq_out is not None else dq.zero_().to(q.dtype)), dk.zero_(), dv.zero_()
    dk4, dv4, dq4 = (_as4d(t, varlen) for t in (dk, dv, dq))
    seqlen = max(tq, tk)
    delta = torch.empty_like(lse)
    common = dict(HEAD_DIM=hs, BLOCK_D=block_d, VARLEN=varlen, **flags)
    if atomic:  # delta = rowsum(dO * O) first; the deterministic path's dq kernel makes it as it goes, and runs first
        rows = 64 if q.device.type == "cuda" else 16
        _attn_bwd_delta_kernel[(cdiv(tq, rows), batch * nh)](
            o4, do4, delta, cu_seqlens, *_strides(o4, varlen), *_strides(do4, varlen), stride_lb, stride_lh,
            nh, tq, HEAD_DIM=hs, BLOCK_D=block_d, BLOCK_M=rows, VARLEN=varlen, num_warps=4,
        )
    elif gluon_dq:
        from megakern import _attention_gluon

        _attention_gluon.bwd_dq(dout, q, k, v, out, lse, delta, dq, causal, scale, _gluon_config(gluon_dq))
    else:
        block_m, block_n, warps, stages, prefer = _tiles(configs.get("dq"), tma, hs, q.device, "dq", seqlen)
        once, loop = _pick_tma(prefer, tma, (q4, k4, v4, o4, do4, dq4), varlen)
        _attn_bwd_dq_kernel[(batch * nh, cdiv(tq, block_m))](
            *_descs((q4, block_m, once), (k4, block_n, loop), (v4, block_n, loop), (o4, block_m, once),
                    (do4, block_m, once)), lse, delta, *_descs((dq4, block_m, once)), cu_seqlens,
            *_strides(q4, varlen), *_strides(k4, varlen), *_strides(v4, varlen), *_strides(o4, varlen),
            *_strides(do4, varlen), stride_lb, stride_lh, *_strides(dq4, varlen),
            nh, nh // nkv, tq, tk, scale * LOG2E, scale, left, right,
            BLOCK_M=block_m, BLOCK_N=block_n, TMA=once, TMA_LOOP=loop, num_warps=warps, num_stages=stages,
            **common,
        )
    if gluon_dkdv:
        from megakern import _attention_gluon

        _attention_gluon.bwd_dkdv(dout, q, k, v, lse, delta, dk, dv, causal, scale, _gluon_config(gluon_dkdv))
        return dq, dk, dv
    block_m, block_n, warps, stages, prefer = _tiles(configs.get("dkdv"), tma, hs, q.device,
                                                     "dkdv_atomic" if atomic else "dkdv", seqlen)
    once, loop = _pick_tma(prefer, tma, (q4, k4, v4, do4, dk4, dv4), varlen)
    dq_tma = int(once + loop > 0 and not _interpreting())  # dq's TMA reduce: a device-side descriptor
    if atomic and dq_tma:
        _ensure_allocator()
    q_, k_, v_, do_, dk_, dv_ = _descs((q4, block_m, loop), (k4, block_n, once), (v4, block_n, once),
                                       (do4, block_m, loop), (dk4, block_n, once), (dv4, block_n, once))
    _attn_bwd_dkdv_kernel[(batch * nkv, cdiv(tk, block_n))](
        q_, k_, v_, do_, lse, delta, dk_, dv_, dq4, cu_seqlens,
        *_strides(q4, varlen), *_strides(k4, varlen), *_strides(v4, varlen), *_strides(do4, varlen),
        stride_lb, stride_lh, *_strides(dk4, varlen), *_strides(dv4, varlen), *_strides(dq4, varlen),
        nkv, nh // nkv, tq, tk, scale * LOG2E, scale, left, right,
        BLOCK_M=block_m, BLOCK_N=block_n, ATOMIC_DQ=atomic, DQ_TMA=dq_tma, TMA=once, TMA_LOOP=loop,
        num_warps=warps, num_stages=stages, **common,
    )
    if atomic:
        return (dq_out.copy_(dq) if dq_out is not None else dq.to(q.dtype)), dk, dv
    return dq, dk, dv
