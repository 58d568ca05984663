"""Triton kernels of megakern.attention (FlashAttention-2 algorithm, laid out for Hopper).

Forward: a program per (batch x head, block of BLOCK_M queries); it walks the key blocks its masks allow, keeping
the running max, the running sum and the output in fp32 registers (online softmax, base 2, scale folded into one
multiply-add), and writes out and the row's log-sum-exp. The key range is cut in three: blocks that the masks cut
(causal diagonal, window edges, the ragged end) get the mask, the blocks between them run without one. On sm_90,
megakern/attention.py runs the Gluon forward (megakern/_attention_gluon.py) instead where that is the faster one;
same outputs.

Backward, deterministic (the default): first a program per (batch x head, block of BLOCK_M queries) computes its
rows' delta = rowsum(dO * O) (kept for the next kernel) and walks the key blocks its rows see, accumulating dq;
then a program per (batch x kv head, block of BLOCK_N keys) walks every query head of its group and every query
block that sees its keys, accumulating dk and dv in registers (GQA groups reduced in the kernel). No atomics: the
same inputs give the same bits. With atomics: delta by its own small kernel, then the dk/dv pass also adds each
block's dq in fp32 (a TMA reduce where tensor descriptors are used; element atomics under the interpreter, which
has no TMA reduce): two fewer matmuls per block pair, results that vary in the last bits. Either pass of the
deterministic backward can be handed in as another implementation (``bwd``'s ``dq_pass`` / ``dkdv_pass``: the Gluon
kernels, chosen by megakern/attention.py).

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

from megakern._intmath import cdiv, next_power_of_2, tma_aligned

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
# (packed documents always take these), False masked pointer loads. Measured with profiles/tune_attention.py; the
# figures behind each entry, and what was tried and left out, are in docs/tuning.md (attention, Triton).
_LONG = 1 << 62
CONFIGS = {
    # the launcher's descriptors past T 1024 (faster on the GPU), device-side ones up to it (less host time)
    "fwd": {32: ((_LONG, (128, 64, 4, 3, "host")),),
            64: ((1024, (128, 32, 4, 4, "device")), (_LONG, (128, 64, 4, 3, "host"))),
            128: ((1024, (128, 32, 4, 4, "device")), (_LONG, (128, 128, 8, 3, "host"))),
            256: ((_LONG, (128, 64, 8, 2, "device")),)},
    # while a CUDA graph is captured launch cost is paid once: the launcher's descriptors at every length
    "fwd_graph": {32: ((_LONG, (128, 64, 4, 3, "host")),),
                  64: ((_LONG, (128, 64, 4, 3, "host")),),
                  128: ((1024, (128, 32, 4, 4, "host")), (_LONG, (128, 128, 8, 3, "host"))),
                  256: ((_LONG, (128, 64, 8, 2, "device")),)},
    # "hybrid": the loaded-once k and v tiles in registers, the loop's through the launcher's descriptors
    "dkdv": {32: ((_LONG, (32, 64, 4, 3, "device")),),
             64: ((1024, (32, 128, 4, 3, False)), (_LONG, (32, 64, 4, 3, "hybrid"))),
             128: ((1024, (64, 64, 4, 2, "device")), (_LONG, (64, 64, 4, 2, "hybrid"))),
             256: ((_LONG, (64, 64, 8, 2, "device")),)},
    # the single pass with atomic dq (deterministic=False), at its best tiles
    "dkdv_atomic": {32: ((_LONG, (64, 64, 4, 2, "device")),), 64: ((_LONG, (64, 64, 4, 2, "device")),), 128: ((_LONG, (32, 128, 8, 3, "device")),),
                    256: ((_LONG, (32, 64, 8, 2, "device")),)},
    # "hybrid" as for dk/dv, with the loaded-once q and dO tiles in registers
    "dq": {32: ((_LONG, (64, 64, 4, 3, "device")),),
           64: ((1024, (128, 32, 4, 4, False)), (_LONG, (64, 64, 4, 3, "hybrid"))),
           128: ((1024, (128, 32, 4, 3, "device")), (_LONG, (128, 64, 8, 3, "hybrid"))),
           256: ((_LONG, (128, 32, 8, 2, "device")),)},
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


def fwd(q, k, v, causal: bool, scale: float, window, cu_seqlens, max_seqlen, config=None, tma=None):
    """(out, lse): out like q; lse (B, nh, Tq) or (nh, total) fp32. ``config`` (BLOCK_M, BLOCK_N, warps, stages)
    overrides the CONFIGS entry; ``tma`` forces tensor descriptors on or off (tests, tuning)."""
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


def bwd(dout, q, k, v, out, lse, causal: bool, scale: float, window, cu_seqlens, max_seqlen, deterministic: bool,
        configs=None, tma=None, out_grads=None, dq_pass=None, dkdv_pass=None):
    """(dq, dk, dv). ``configs`` {'dkdv': ..., 'dq': ...} override the CONFIGS entries; ``tma`` as for ``fwd``.
    ``out_grads`` (dq, dk, dv): tensors shaped like q, k, v (any strides with unit stride along hs) to write into.
    ``dq_pass`` / ``dkdv_pass``: another implementation of a pass of the deterministic backward, run instead of the
    Triton kernel (megakern/attention.py hands in the Gluon kernels where they are the faster ones):
    ``dq_pass(dout, q, k, v, out, lse, delta, dq, causal, scale)`` writes dq and delta = rowsum(dO * O) (like lse);
    ``dkdv_pass(dout, q, k, v, lse, delta, dk, dv, causal, scale)`` writes dk and dv; without ``deterministic`` it
    is the single-pass backward's kernel and adds dq into the fp32 tensor it is given as ``dq_acc``."""
    if not deterministic and dq_pass is not None:
        raise ValueError("attention backward: dq_pass replaces the deterministic backward's dq pass")
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
    elif dq_pass is not None:
        dq_pass(dout, q, k, v, out, lse, delta, dq, causal, scale)
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
    if dkdv_pass is not None:
        if atomic:
            dkdv_pass(dout, q, k, v, lse, delta, dk, dv, causal, scale, dq_acc=dq)
            return (dq_out.copy_(dq) if dq_out is not None else dq.to(q.dtype)), dk, dv
        dkdv_pass(dout, q, k, v, lse, delta, dk, dv, causal, scale)
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
