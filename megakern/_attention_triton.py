"""Triton kernels of megakern.attention (FlashAttention-2 algorithm).

Forward: a program per (block of BLOCK_M queries, batch x head); it walks the key blocks its masks allow, keeping
the running max, the running sum and the output in fp32 registers (online softmax, base 2, scale folded in), and
writes out and the row's log-sum-exp. Backward: delta = rowsum(dO * O) first; then a program per (block of BLOCK_N
keys, batch x kv head) walks every query head of its group and every query block that sees its keys, accumulating
dk and dv in registers (GQA groups reduced in the kernel, no atomics); dq either by fp32 atomic adds from that pass,
or (deterministic) by a second kernel per query block that recomputes the scores.

Packed sequences (cu_seqlens): the batch index is the document; its rows start at cu_seqlens[b]. Tensors come in
as (B, T, heads, hs) views with unit stride along hs (packed ones as (1, total, heads, hs), batch stride unused).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LN2 = 0.6931471805599453
LOG2E = 1.4426950408889634


@triton.jit
def _bounds(CU, b, TQ, TK, VARLEN: tl.constexpr):
    """(first row of q, first row of k, length of q, length of k) of batch entry / document b."""
    if VARLEN:
        start = tl.load(CU + b)
        length = tl.load(CU + b + 1) - start
        return start, start, length, length
    else:
        return 0, 0, TQ, TK


@triton.jit
def _allowed(offs_m, offs_n, len_q, len_k, win_left, win_right,
             CAUSAL: tl.constexpr, WINDOW_L: tl.constexpr, WINDOW_R: tl.constexpr):
    """(BLOCK_M, BLOCK_N) mask: key j visible to query i (bottom-right aligned diagonal)."""
    diag = len_k - len_q
    ok = (offs_m[:, None] < len_q) & (offs_n[None, :] < len_k)
    if CAUSAL:
        ok = ok & (offs_n[None, :] <= offs_m[:, None] + diag)
    if WINDOW_L:
        ok = ok & (offs_n[None, :] >= offs_m[:, None] + diag - win_left)
    if WINDOW_R:
        ok = ok & (offs_n[None, :] <= offs_m[:, None] + diag + win_right)
    return ok


@triton.jit
def _key_range(start_m, len_q, len_k, win_left, win_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, WINDOW_L: tl.constexpr, WINDOW_R: tl.constexpr):
    """[lo, hi) of key blocks that queries start_m .. start_m + BLOCK_M - 1 may see; lo a multiple of BLOCK_N."""
    diag = len_k - len_q
    lo = 0
    hi = len_k
    if CAUSAL:
        hi = tl.minimum(hi, start_m + BLOCK_M + diag)
    if WINDOW_R:
        hi = tl.minimum(hi, start_m + BLOCK_M + diag + win_right)
    if WINDOW_L:
        lo = tl.maximum(0, start_m + diag - win_left)
    lo = (lo // BLOCK_N) * BLOCK_N
    return lo, hi


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, O, LSE, CU,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lh,
    NH, GROUP, TQ, TK, scale_log2, win_left, win_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW_L: tl.constexpr, WINDOW_R: tl.constexpr, VARLEN: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // NH
    h = pid_bh % NH
    hk = h // GROUP
    q_start, k_start, len_q, len_k = _bounds(CU, b, TQ, TK, VARLEN)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < len_q
    # the query block, kept in registers
    q = tl.load(Q + b * stride_qb + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = _key_range(start_m, len_q, len_k, win_left, win_right, BLOCK_M, BLOCK_N, CAUSAL, WINDOW_L, WINDOW_R)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < len_k
        kv_rows = (k_start + offs_n)[:, None]
        k = tl.load(K + b * stride_kb + kv_rows * stride_kt + hk * stride_kh + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        # scores in base 2, masked
        s = tl.dot(q, tl.trans(k)) * scale_log2
        ok = _allowed(offs_m, offs_n, len_q, len_k, win_left, win_right, CAUSAL, WINDOW_L, WINDOW_R)
        s = tl.where(ok, s, float("-inf"))
        # online softmax: rescale what was accumulated to the new running max
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + b * stride_vb + kv_rows * stride_vt + hk * stride_vh + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    # normalize; a row that saw no key gets 0 and lse -inf
    seen = l_i > 0.0
    l_use = tl.where(seen, l_i, 1.0)
    out = acc / l_use[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(l_use)) * 0.6931471805599453, float("-inf"))
    tl.store(O + b * stride_ob + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    tl.store(LSE + b * stride_lb + h * stride_lh + q_start + offs_m, lse, mask=m_ok)


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
    o = tl.load(O + b * stride_ob + rows * stride_ot + h * stride_oh + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b * stride_db + rows * stride_dt + h * stride_dh + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + b * stride_lb + h * stride_lh + q_start + offs_m, delta, mask=offs_m < len_q)


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ_ACC, CU,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh, stride_lb, stride_lh,
    stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt, stride_dvh, stride_dqb, stride_dqt, stride_dqh,
    NKV, GROUP, TQ, TK, scale_log2, scale, win_left, win_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW_L: tl.constexpr, WINDOW_R: tl.constexpr, VARLEN: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // NKV
    hk = pid_bh % NKV
    q_start, k_start, len_q, len_k = _bounds(CU, b, TQ, TK, VARLEN)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    n_ok = offs_n < len_k
    kv_mask = n_ok[:, None] & d_ok[None, :]
    kv_rows = (k_start + offs_n)[:, None]
    k = tl.load(K + b * stride_kb + kv_rows * stride_kt + hk * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + b * stride_vb + kv_rows * stride_vt + hk * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # query blocks that can see this key block
    diag = len_k - len_q
    lo = 0
    hi = len_q
    if CAUSAL:
        lo = tl.maximum(0, start_n - diag)
    if WINDOW_R:
        lo = tl.maximum(lo, start_n - diag - win_right)
    if WINDOW_L:
        hi = tl.minimum(hi, start_n + BLOCK_N - diag + win_left)
    lo = (lo // BLOCK_M) * BLOCK_M
    for g in range(GROUP):  # every query head of this kv head's group: dk, dv summed in registers
        h = hk * GROUP + g
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            m_ok = offs_m < len_q
            q_mask = m_ok[:, None] & d_ok[None, :]
            q_rows = (q_start + offs_m)[:, None]
            q = tl.load(Q + b * stride_qb + q_rows * stride_qt + h * stride_qh + offs_d[None, :], mask=q_mask,
                        other=0.0)
            do = tl.load(DO + b * stride_dob + q_rows * stride_dot + h * stride_doh + offs_d[None, :], mask=q_mask,
                         other=0.0)
            stat = b * stride_lb + h * stride_lh + q_start + offs_m
            lse = tl.load(LSE + stat, mask=m_ok, other=0.0)
            delta = tl.load(DELTA + stat, mask=m_ok, other=0.0)
            lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
            # P^T recomputed from the saved lse, then dV += P^T dO, dS^T = P^T * (dP^T - delta), dK += dS^T Q
            s_t = tl.dot(k, tl.trans(q)) * scale_log2
            ok_t = tl.trans(_allowed(offs_m, offs_n, len_q, len_k, win_left, win_right, CAUSAL, WINDOW_L,
                                     WINDOW_R))
            p_t = tl.where(ok_t, tl.math.exp2(s_t - lse2[None, :]), 0.0)
            dv = tl.dot(p_t.to(do.dtype), do, dv)
            dp_t = tl.dot(v, tl.trans(do))
            ds_t = p_t * (dp_t - delta[None, :])
            dk = tl.dot(ds_t.to(q.dtype), q, dk)
            if ATOMIC_DQ:
                dq = tl.dot(tl.trans(ds_t).to(k.dtype), k) * scale
                tl.atomic_add(DQ_ACC + b * stride_dqb + q_rows * stride_dqt + h * stride_dqh + offs_d[None, :], dq,
                              mask=q_mask)
    dk = dk * scale
    tl.store(DK + b * stride_dkb + kv_rows * stride_dkt + hk * stride_dkh + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b * stride_dvb + kv_rows * stride_dvt + hk * stride_dvh + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, CU,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh, stride_lb, stride_lh, stride_dqb, stride_dqt, stride_dqh,
    NH, GROUP, TQ, TK, scale_log2, scale, win_left, win_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOW_L: tl.constexpr, WINDOW_R: tl.constexpr, VARLEN: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // NH
    h = pid_bh % NH
    hk = h // GROUP
    q_start, k_start, len_q, len_k = _bounds(CU, b, TQ, TK, VARLEN)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < len_q
    q_mask = m_ok[:, None] & d_ok[None, :]
    q_rows = (q_start + offs_m)[:, None]
    q = tl.load(Q + b * stride_qb + q_rows * stride_qt + h * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + b * stride_dob + q_rows * stride_dot + h * stride_doh + offs_d[None, :], mask=q_mask,
                 other=0.0)
    stat = b * stride_lb + h * stride_lh + q_start + offs_m
    lse = tl.load(LSE + stat, mask=m_ok, other=0.0)
    delta = tl.load(DELTA + stat, mask=m_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = _key_range(start_m, len_q, len_k, win_left, win_right, BLOCK_M, BLOCK_N, CAUSAL, WINDOW_L, WINDOW_R)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n < len_k)[:, None] & d_ok[None, :]
        kv_rows = (k_start + offs_n)[:, None]
        k = tl.load(K + b * stride_kb + kv_rows * stride_kt + hk * stride_kh + offs_d[None, :], mask=kv_mask,
                    other=0.0)
        v = tl.load(V + b * stride_vb + kv_rows * stride_vt + hk * stride_vh + offs_d[None, :], mask=kv_mask,
                    other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        ok = _allowed(offs_m, offs_n, len_q, len_k, win_left, win_right, CAUSAL, WINDOW_L, WINDOW_R)
        p = tl.where(ok, tl.math.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    tl.store(DQ + b * stride_dqb + q_rows * stride_dqt + h * stride_dqh + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)


# ---- launchers -------------------------------------------------------------------------------------------------
def _config(hs: int, device: torch.device, kind: str) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Small tiles under the CPU interpreter."""
    if device.type != "cuda":
        return 16, 16, 4, 1
    if kind == "fwd":
        return (128, 64, 4, 3) if hs <= 64 else (128, 64, 8, 3) if hs <= 128 else (64, 32, 4, 2)
    if kind == "dkdv":
        return (32, 128, 4, 3) if hs <= 128 else (32, 64, 4, 2)
    return (128, 32, 4, 3) if hs <= 128 else (64, 32, 4, 2)  # dq


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


def fwd(q, k, v, causal: bool, scale: float, window, cu_seqlens, max_seqlen, config=None):
    """(out, lse): out like q; lse (B, nh, Tq) or (nh, total) fp32. ``config`` (BLOCK_M, BLOCK_N, warps, stages)
    overrides ``_config`` (tuning)."""
    varlen, batch, tq, tk = _geometry(q, k, cu_seqlens, max_seqlen)
    q4, k4, v4 = (_as4d(t, varlen) for t in (q, k, v))
    nh, hs, nkv = q.shape[-2], q.shape[-1], k.shape[-2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    o4 = _as4d(out, varlen)
    lse = torch.empty((nh, q.shape[0]) if varlen else (batch, nh, tq), dtype=torch.float32, device=q.device)
    stride_lb, stride_lh = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))
    block_m, block_n, warps, stages = config or _config(hs, q.device, "fwd")
    flags, left, right = _masks(causal, window)
    if batch == 0 or tq == 0:
        return out, lse
    _attn_fwd_kernel[(triton.cdiv(tq, block_m), batch * nh)](
        q4, k4, v4, o4, lse, cu_seqlens,
        *_strides(q4, varlen), *_strides(k4, varlen), *_strides(v4, varlen), *_strides(o4, varlen),
        stride_lb, stride_lh,
        nh, nh // nkv, tq, tk, scale * LOG2E, left, right,
        HEAD_DIM=hs, BLOCK_D=max(16, triton.next_power_of_2(hs)), BLOCK_M=block_m, BLOCK_N=block_n,
        VARLEN=varlen, num_warps=warps, num_stages=stages, **flags,
    )
    return out, lse


def bwd(dout, q, k, v, out, lse, causal: bool, scale: float, window, cu_seqlens, max_seqlen, deterministic: bool,
        configs=None):
    """(dq, dk, dv). ``configs`` {'dkdv': ..., 'dq': ...} override ``_config`` (tuning)."""
    configs = configs or {}
    varlen, batch, tq, tk = _geometry(q, k, cu_seqlens, max_seqlen)
    q4, k4, v4, o4, do4 = (_as4d(t, varlen) for t in (q, k, v, out, dout))
    nh, hs, nkv = q.shape[-2], q.shape[-1], k.shape[-2]
    block_d = max(16, triton.next_power_of_2(hs))
    flags, left, right = _masks(causal, window)
    stride_lb, stride_lh = (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))
    dk, dv = torch.empty(k.shape, dtype=k.dtype, device=k.device), torch.empty(v.shape, dtype=v.dtype, device=v.device)
    atomic = not deterministic
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if atomic else torch.empty_like(q, memory_format=torch.contiguous_format)
    if batch == 0 or tq == 0 or tk == 0:
        return dq.to(q.dtype) if atomic else dq.zero_(), dk.zero_(), dv.zero_()
    dk4, dv4, dq4 = (_as4d(t, varlen) for t in (dk, dv, dq))
    delta = torch.empty_like(lse)
    block_m, _, warps, _ = _config(hs, q.device, "dq")
    _attn_bwd_delta_kernel[(triton.cdiv(tq, block_m), batch * nh)](
        o4, do4, delta, cu_seqlens, *_strides(o4, varlen), *_strides(do4, varlen), stride_lb, stride_lh,
        nh, tq, HEAD_DIM=hs, BLOCK_D=block_d, BLOCK_M=block_m, VARLEN=varlen, num_warps=warps,
    )
    common = dict(HEAD_DIM=hs, BLOCK_D=block_d, VARLEN=varlen, **flags)
    block_m, block_n, warps, stages = configs.get("dkdv") or _config(hs, q.device, "dkdv")
    _attn_bwd_dkdv_kernel[(triton.cdiv(tk, block_n), batch * nkv)](
        q4, k4, v4, do4, lse, delta, dk4, dv4, dq4, cu_seqlens,
        *_strides(q4, varlen), *_strides(k4, varlen), *_strides(v4, varlen), *_strides(do4, varlen),
        stride_lb, stride_lh, *_strides(dk4, varlen), *_strides(dv4, varlen), *_strides(dq4, varlen),
        nkv, nh // nkv, tq, tk, scale * LOG2E, scale, left, right,
        BLOCK_M=block_m, BLOCK_N=block_n, ATOMIC_DQ=atomic, num_warps=warps, num_stages=stages, **common,
    )
    if atomic:
        return dq.to(q.dtype), dk, dv
    block_m, block_n, warps, stages = configs.get("dq") or _config(hs, q.device, "dq")
    _attn_bwd_dq_kernel[(triton.cdiv(tq, block_m), batch * nh)](
        q4, k4, v4, do4, lse, delta, dq4, cu_seqlens,
        *_strides(q4, varlen), *_strides(k4, varlen), *_strides(v4, varlen), *_strides(do4, varlen),
        stride_lb, stride_lh, *_strides(dq4, varlen),
        nh, nh // nkv, tq, tk, scale * LOG2E, scale, left, right,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **common,
    )
    return dq, dk, dv
