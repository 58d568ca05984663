"""Fused attention: softmax(q k^T * scale + mask) v, forward and backward, in Triton (FlashAttention-2 algorithm);
on Hopper the forward and the backward of fixed-length batches with head dim 64 / 96 / 128 run Gluon kernels
with FlashAttention-3's structure (megakern/_attention_gluon.py; GLUON_FWD, GLUON_DQ and GLUON_BWD below say where).

Shapes (flash-attn's layout): q (B, Tq, nh, hs), k and v (B, Tk, nkv, hs), out like q. Grouped-query / multi-query
attention: nkv divides nh, and q head h reads kv head h // (nh // nkv); k and v are never repeated, and dk / dv are
summed over each group inside the kernel. Packed variable-length sequences: q (total, nh, hs), k and v
(total, nkv, hs) with ``cu_seqlens`` (B + 1,) int32 offsets of the documents (0, len0, len0 + len1, ..., total) and
``max_seqlen`` their longest length: attention stays inside each document, as for Megatron's
reset_attention_mask.

Masks: ``causal`` (aligned bottom-right when Tq != Tk, as flash-attn: query i sees keys j <= i + Tk - Tq);
``window`` = (left, right) or an int w for (w, w): query i sees keys i + Tk - Tq - left <= j <= i + Tk - Tq + right
(right is 0 under causal). A query that sees no key gets out = 0 and lse = -inf.

Dtypes: fp16 and bf16 (fp32 inputs run through the torch reference only); fp32 accumulation; softmax in base 2 with
the scale folded in. ``return_lse``: also the log-sum-exp of each row's scores (natural log, fp32), (B, nh, Tq) or
(nh, total) for packed input; ``merge_attention`` combines two partial (out, lse) pairs, as ring attention needs.

Backward: by default (``deterministic=True``) two passes: dq per query block (making delta = rowsum(dO * O) on the
way), then dk and dv per key block, which recomputes q k^T and dO v^T (7 matmuls instead of 5) but needs no atomics,
so it is bitwise reproducible; on the H200 it is also the faster one (Triton kernels, hs 128, T 4096: 321 against
291 TFLOP/s causal, 349 against 304 full; see docs/tuning.md). On Hopper both passes run Gluon kernels for what the
Gluon forward takes (GLUON_DQ, GLUON_BWD). ``deterministic=False`` computes dq in the
dk/dv pass, added into fp32 (fewer FLOPs, results that vary in the last bits from run to run): on Hopper at head dims
64, 96 and 128 by the Gluon single pass, which adds each query block's dq by TMA reduces (GLUON_BWD_ATOMIC: faster
than the deterministic pair on the H200); elsewhere by the Triton kernel's atomic adds (docs/tuning.md).

Packed q, k, v: when q, k and v are views of one fused qkv projection's output, either the three views ``[..., 0,
:]``, ``[..., 1, :]``, ``[..., 2, :]`` of a (..., heads, 3, hs) tensor or, with grouped queries, its first nh, next nkv
and last nkv heads of a (..., nh + 2 nkv, hs) tensor (``packed_qkv`` tells), the backward writes dq, dk and dv into one
tensor of that layout, so the gradient of the projection's output needs no concatenation.

Backends: ``torch`` (``attention_ref``: explicit softmax, fp32, O(T^2) memory) and ``triton`` (the Triton kernels
of megakern/_attention_triton.py, the Gluon ones where they are faster). The default is ``triton`` for fp16 /
bf16 on a GPU, else ``torch`` (fp32 and fp64 inputs, CPU tensors).

Without autograd: ``attention_forward`` -> (out, lse) and ``attention_backward`` -> (dq, dk, dv) from the forward's
(or merged) out and lse, on the same backends (what ring attention runs per block).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import torch
from torch import nn

from megakern import _backend, _nvtx
from megakern._checks import document_lengths

LOG2E = 1.4426950408889634
HEAD_DIMS = tuple(range(16, 257, 16))
TRITON_DTYPES = (torch.float16, torch.bfloat16)


# ---- the reference -------------------------------------------------------------------------------------------
def _allowed(tq: int, tk: int, causal: bool, window, device) -> torch.Tensor:
    """(Tq, Tk) bool: key j visible to query i under the masks (the causal diagonal aligned bottom-right)."""
    i = torch.arange(tq, device=device)[:, None] + (tk - tq)
    j = torch.arange(tk, device=device)[None, :]
    allowed = torch.ones(tq, tk, dtype=torch.bool, device=device)
    left, right = window
    if causal:
        allowed &= j <= i
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0 and not causal:
        allowed &= j <= i + right
    return allowed


def _ref_padded(q, k, v, causal, scale, window, upcast=True):
    """(out, lse) for (B, Tq, nh, hs) inputs; explicit scores, softmax in fp32 (or q's dtype without upcast)."""
    compute = torch.promote_types(q.dtype, torch.float32) if upcast else q.dtype
    b, tq, nh, hs = q.shape
    tk, nkv = k.shape[1], k.shape[2]
    qf, kf, vf = (t.transpose(1, 2).to(compute) for t in (q, k, v))  # (B, heads, T, hs)
    if nkv != nh:
        kf, vf = kf.repeat_interleave(nh // nkv, dim=1), vf.repeat_interleave(nh // nkv, dim=1)
    scores = (qf @ kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~_allowed(tq, tk, causal, window, q.device), float("-inf"))
    lse = torch.logsumexp(scores.to(torch.promote_types(compute, torch.float32)), dim=-1)  # (B, nh, Tq); -inf: no key
    p = torch.exp(scores - lse.to(compute)[..., None]).nan_to_num(0.0)
    out = (p @ vf).transpose(1, 2).to(q.dtype)
    return out, lse


def attention_ref(q, k, v, *, causal=True, softmax_scale=None, cu_seqlens=None, window=None, upcast=True):
    """The torch reference: (out, lse). ``upcast``: compute in fp32 (fp64 for fp64 inputs), else in q's dtype."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    win = _window(window, causal)
    if cu_seqlens is None:
        return _ref_padded(q, k, v, causal, scale, win, upcast)
    outs, lses = [], []
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        o, l = _ref_padded(q[None, s:e], k[None, s:e], v[None, s:e], causal, scale, win, upcast)
        outs.append(o[0])
        lses.append(l[0])
    return torch.cat(outs), torch.cat(lses, dim=-1)


def _ref_bwd_padded(dout, q, k, v, out, lse, causal, scale, window):
    """(dq, dk, dv) for (B, Tq, nh, hs) inputs from the given out and lse (flash-attention's backward: each score's
    probability recomputed against lse, so a block's share of a merged attention comes out exactly); fp32 (fp64 for
    fp64 inputs), results in that dtype."""
    compute = torch.promote_types(q.dtype, torch.float32)
    b, tq, nh, hs = q.shape
    tk, nkv = k.shape[1], k.shape[2]
    g = nh // nkv
    qf, kf, vf, of, dof = (t.transpose(1, 2).to(compute) for t in (q, k, v, out, dout))  # (B, heads, T, hs)
    kf, vf = kf.repeat_interleave(g, dim=1), vf.repeat_interleave(g, dim=1)
    s = (qf @ kf.transpose(-1, -2)) * scale
    s = s.masked_fill(~_allowed(tq, tk, causal, window, q.device), float("-inf"))
    p = torch.exp(s - lse.to(compute)[..., None]).nan_to_num(0.0)  # (B, nh, Tq, Tk)
    dv = p.transpose(-1, -2) @ dof
    dp = dof @ vf.transpose(-1, -2)
    ds = p * (dp - (dof * of).sum(-1, keepdim=True))
    dq = (ds @ kf) * scale
    dk = (ds.transpose(-1, -2) @ qf) * scale
    if g > 1:
        dk, dv = (t.view(b, nkv, g, tk, hs).sum(2) for t in (dk, dv))
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _ref_bwd(dout, q, k, v, out, lse, causal, scale, window, cu_seqlens):
    """``_ref_bwd_padded`` for padded or packed (cu_seqlens) inputs, document by document."""
    if cu_seqlens is None:
        return _ref_bwd_padded(dout, q, k, v, out, lse, causal, scale, window)
    grads = ([], [], [])
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        doc = (t[None, s:e] for t in (dout, q, k, v, out))
        for acc, g in zip(grads, _ref_bwd_padded(*doc, lse[None, :, s:e], causal, scale, window)):
            acc.append(g[0])
    return tuple(torch.cat(acc) for acc in grads)


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Combine attention over two disjoint key sets: (out, lse) of the union, from each part's (out, lse).

    out (..., T, nh, hs) with lse (..., nh, T) as ``attention(..., return_lse=True)`` returns them; -inf lse (no key
    seen) is handled. Math in fp32 at least; out in out_a's dtype.
    """
    compute = torch.promote_types(torch.promote_types(out_a.dtype, lse_a.dtype), torch.float32)
    lse_a, lse_b = lse_a.to(compute), lse_b.to(compute)
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    wa = torch.exp(lse_a - safe).nan_to_num(0.0).transpose(-1, -2)[..., None]  # (..., T, nh, 1)
    wb = torch.exp(lse_b - safe).nan_to_num(0.0).transpose(-1, -2)[..., None]
    return (out_a.to(compute) * wa + out_b.to(compute) * wb).to(out_a.dtype), lse


# ---- checks ----------------------------------------------------------------------------------------------------
def _window(window, causal) -> tuple[int, int]:
    """(left, right), -1 for unbounded."""
    if window is None:
        left, right = -1, -1
    elif isinstance(window, int) and not isinstance(window, bool):
        left, right = window, window
    elif isinstance(window, (tuple, list)) and len(window) == 2 and all(isinstance(w, int) for w in window):
        left, right = window
    else:
        raise ValueError(f"attention: window must be None, an int or a (left, right) pair of ints, got {window!r}")
    if left < -1 or right < -1:
        raise ValueError(f"attention: window sizes must be >= 0 (or -1 for unbounded), got {window!r}")
    return left, (0 if causal else right)


def check_inputs(q, k, v, cu_seqlens, max_seqlen, softmax_scale) -> None:
    """Raise TypeError / ValueError naming the problem."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise TypeError(f"attention: {name} has dtype {t.dtype}; supported: float16, bfloat16 (float32 via torch)")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"attention: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"attention: q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    want = 3 if cu_seqlens is not None else 4
    layout = "(total, heads, head_dim) with cu_seqlens" if want == 3 else "(batch, seq, heads, head_dim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != want:
            raise ValueError(f"attention: {name} must be {layout}, got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"attention: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    hs, nh, nkv = q.shape[-1], q.shape[-2], k.shape[-2]
    if k.shape[-1] != hs:
        raise ValueError(f"attention: head dims differ: q {hs}, k {k.shape[-1]}")
    if hs not in HEAD_DIMS:
        raise ValueError(f"attention: head dim {hs} unsupported; multiples of 16 up to 256")
    if nkv == 0 or nh % nkv:
        raise ValueError(f"attention: {nh} query heads are not divisible by {nkv} key/value heads")
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale)
                                          and softmax_scale > 0):
        raise ValueError(f"attention: softmax_scale must be a finite number > 0, got {softmax_scale!r}")
    if cu_seqlens is None:
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"attention: batch sizes differ: q {q.shape[0]}, k {k.shape[0]}")
        return
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device != q.device:
        raise ValueError(f"attention: cu_seqlens is on {cu_seqlens.device} but q is on {q.device}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"attention: packed q has {q.shape[0]} tokens but k has {k.shape[0]}")
    lengths = document_lengths("attention", cu_seqlens, q.shape[0])
    if max_seqlen is not None and max_seqlen < max(lengths):
        raise ValueError(f"attention: max_seqlen {max_seqlen} < the longest document ({max(lengths)})")


def _packings(base: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    """The layouts a fused projection's output ``base`` may hold q, k and v in, as (packed, (q, k, v) views):
    (..., heads, 3, hs) with q, k, v at ``[..., i, :]`` (as many query heads as kv heads), and (..., nh + 2 nkv, hs)
    with every query head, then every k head, then every v head."""
    lead, nh, nkv, hs = q.shape[:-2], q.shape[-2], k.shape[-2], q.shape[-1]
    if nh == nkv:
        packed = base.view(*lead, nh, 3, hs)
        yield packed, (packed[..., 0, :], packed[..., 1, :], packed[..., 2, :])
    packed = base.view(*lead, nh + 2 * nkv, hs)
    yield packed, (packed[..., :nh, :], packed[..., nh:nh + nkv, :], packed[..., nh + nkv:, :])


def _packing(q, k, v):
    """(the index in ``_packings`` of the layout q, k and v are views in, their base), else None."""
    if torch.compiler.is_compiling():
        return None
    base = q._base
    if base is None or k._base is not base or v._base is not base or not base.is_contiguous():
        return None
    if k.shape != v.shape or k.shape[:-2] != q.shape[:-2] or k.shape[-1] != q.shape[-1]:
        return None
    if base.numel() != q.numel() + k.numel() + v.numel():
        return None
    for i, (packed, parts) in enumerate(_packings(base, q, k)):
        if all(_same_elements(t, p) for t, p in zip((q, k, v), parts)):
            return i, packed
    return None


def _same_elements(t: torch.Tensor, view: torch.Tensor) -> bool:
    """t addresses the same elements as ``view`` (a dim of size 1 may have any stride)."""
    return t.data_ptr() == view.data_ptr() and t.shape == view.shape and all(
        n == 1 or a == b for n, a, b in zip(t.shape, t.stride(), view.stride()))


def packed_qkv(q, k, v):
    """The tensor of which q, k and v are views in a layout of a fused qkv projection's output, else None:
    (..., heads, 3, hs) with q, k, v its ``[..., 0, :]``, ``[..., 1, :]``, ``[..., 2, :]`` (same shapes), or
    (..., nh + 2 nkv, hs) with q its first nh heads, k the next nkv, v the last nkv (grouped queries). None under
    torch.compile, whose traced tensors do not keep their view bases."""
    found = _packing(q, k, v)
    return None if found is None else found[1]


# ---- the kernels: Gluon where it is the faster one, else Triton ----------------------------------------------------
_LONG = 1 << 62
# The Gluon forward takes fixed-length batches on sm_90 up to these sequence lengths, per head dim and causal (H200,
# profiles/probe_attention_gluon.py: faster at every length measured; docs/tuning.md, attention, Gluon).
GLUON_FWD = {128: {True: _LONG, False: _LONG}, 96: {True: _LONG, False: _LONG}, 64: {True: _LONG, False: _LONG}}
# The deterministic backward's passes by the Gluon kernels: the masks (causal, full) per head dim where each is the
# faster one; dq (GLUON_DQ, which also makes delta) runs first, then dk/dv (GLUON_BWD).
GLUON_BWD = {128: (True, False), 96: (True, False), 64: (True, False)}
GLUON_DQ = {128: (True, False), 96: (True, False), 64: (True, False)}
# The single-pass backward (``deterministic=False``) by the Gluon kernel adding dq by TMA reduces (bwd_single): the
# masks per head dim where it is the default (faster than the deterministic pair there, docs/tuning.md; elsewhere
# ``deterministic=False`` runs the pair where GLUON_BWD names it; ``gluon=True`` forces the single pass)
GLUON_BWD_ATOMIC: dict[int, tuple[bool, ...]] = {64: (True, False), 96: (True, False), 128: (True, False)}


def _use_gluon(hs: int, causal: bool, seqlen: int) -> bool:
    """The Gluon forward (megakern/_attention_gluon.py) is the faster one here; see GLUON_FWD."""
    limit = GLUON_FWD.get(hs, {}).get(causal, 0)
    return seqlen <= limit


def _fwd_kernels(q, k, v, causal: bool, scale: float, window, cu_seqlens, max_seqlen, config=None, tma=None,
                 gluon=None):
    """(out, lse) by the kernels, no autograd; arguments as megakern/_attention_triton.py's ``fwd`` takes them.
    ``gluon``: None takes the Gluon forward (Hopper, fixed-length batches, see GLUON_FWD) where it applies and neither
    ``config`` nor ``tma`` (the Triton kernel's tiles and tile moves, for tests and tuning) is given; False never;
    True always (an error where it cannot run)."""
    if gluon or (gluon is None and config is None and tma is None and q.is_cuda):
        from megakern import _attention_gluon

        can = _attention_gluon.supported(q, k, v, causal, window, cu_seqlens)
        if gluon and not can:
            raise ValueError("attention: the Gluon forward needs an sm_90 GPU, a fixed-length fp16 / bf16 batch with "
                             f"head dim in {_attention_gluon.HEAD_DIMS}, no window and 16-byte aligned strides")
        if can and (gluon or _use_gluon(q.shape[-1], causal, max(q.shape[1], k.shape[1]))):
            return _attention_gluon.fwd(q, k, v, causal, scale)
    from megakern import _attention_triton

    return _attention_triton.fwd(q, k, v, causal, scale, window, cu_seqlens, max_seqlen, config, tma)


def _gluon_pass(choice, table, name, pass_name, dout, q, k, v, others, causal, window, cu_seqlens, configs, tma,
                atomic):
    """The Gluon kernel that runs a pass of the backward (``pass_name`` of megakern/_attention_gluon.py, with its
    tiles), or None for the Triton one. ``choice`` None asks ``table`` (head dim -> the masks where it wins) unless
    ``configs`` or ``tma`` are given; False never; True / a config tuple always, an error where it cannot run.
    ``others``: the pass's other tensors, which it reads or writes beside dout, q, k, v (the gradients the Triton
    launcher allocates itself are fresh contiguous tensors, which TMA can address). ``atomic`` (the single-pass
    backward): only the dk/dv pass, which then adds dq by TMA reduces, for the head dims the Gluon kernel takes so
    (where this Triton has the TMA reduce)."""
    if choice is False:
        return None
    if choice is None and (configs or tma is not None or not q.is_cuda or causal not in table.get(q.shape[-1], ())):
        return None
    from megakern import _attention_gluon

    single_pass = (pass_name == "bwd_dkdv" and q.shape[-1] in _attention_gluon.ATOMIC_HEAD_DIMS
                   and _attention_gluon.TMA_REDUCE)
    can = (not atomic or single_pass) and _attention_gluon.supported(q, k, v, causal, window, cu_seqlens,
                                                                     others=(dout, *others))
    if choice and not can:
        raise ValueError(f"attention: the Gluon {name} pass needs what the Gluon forward needs, for dout and the "
                         "gradients too, and the deterministic backward (the single-pass backward: the dk/dv pass, "
                         f"head dims {_attention_gluon.ATOMIC_HEAD_DIMS})")
    if not can:
        return None
    return functools.partial(getattr(_attention_gluon, pass_name), config=choice if isinstance(choice, tuple) else None)


def _bwd_kernels(dout, q, k, v, out, lse, causal: bool, scale: float, window, cu_seqlens, max_seqlen,
                 deterministic: bool, configs=None, tma=None, out_grads=None, gluon=None, gluon_dq=None):
    """(dq, dk, dv) by the kernels, no autograd; arguments as megakern/_attention_triton.py's ``bwd`` takes them.
    ``gluon`` / ``gluon_dq``: the deterministic backward's dk/dv / dq pass by the Gluon kernel
    (megakern/_attention_gluon.py's bwd_dkdv / bwd_dq; without ``deterministic``, ``gluon`` is the single-pass
    backward's kernel adding dq by TMA reduces, GLUON_BWD_ATOMIC): None where it applies (the tables) and neither
    ``configs`` nor ``tma`` is given; False never; True or a config tuple always (an error where it cannot run).
    Without ``deterministic``, where no single pass is the table's choice but the deterministic Gluon pair is, the
    pair runs (the faster one there). Which passes run as the Gluon kernels is decided (and a forced one that cannot
    run refused) before any work."""
    from megakern import _attention_triton

    atomic = not deterministic
    dq, dk, dv = out_grads if out_grads is not None else (None, None, None)
    dkdv_grads = () if dk is None else (dk, dv)
    dkdv_pass = _gluon_pass(gluon, GLUON_BWD_ATOMIC if atomic else GLUON_BWD, "dk/dv", "bwd_dkdv", dout, q, k, v,
                            dkdv_grads, causal, window, cu_seqlens, configs, tma, atomic)
    if atomic and dkdv_pass is None and gluon is None and gluon_dq is None:
        # no Gluon single pass by the table here: where the deterministic Gluon pair runs, it is the faster one
        pair = _gluon_pass(None, GLUON_BWD, "dk/dv", "bwd_dkdv", dout, q, k, v, dkdv_grads, causal, window,
                           cu_seqlens, configs, tma, False)
        if pair is not None:
            atomic, dkdv_pass = False, pair
    dq_pass = _gluon_pass(gluon_dq, GLUON_DQ, "dq", "bwd_dq", dout, q, k, v,
                          (out,) if dq is None else (out, dq), causal, window, cu_seqlens, configs, tma, atomic)
    return _attention_triton.bwd(dout, q, k, v, out, lse, causal, scale, window, cu_seqlens, max_seqlen,
                                 not atomic, configs, tma, out_grads, dq_pass, dkdv_pass)


class AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, window, cu_seqlens, max_seqlen, deterministic):
        out, lse = _fwd_kernels(q, k, v, causal, scale, window, cu_seqlens, max_seqlen)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.args = (causal, scale, window, max_seqlen, deterministic)
        found = _packing(q, k, v)
        ctx.packing = None if found is None else found[0]
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        causal, scale, window, max_seqlen, deterministic = ctx.args
        grads = None
        if ctx.packing is not None:  # one gradient tensor, laid out as q, k and v were (see packed_qkv)
            buf = q.new_empty(q.numel() + k.numel() + v.numel())
            grads = list(_packings(buf, q, k))[ctx.packing][1]
        dq, dk, dv = _bwd_kernels(dout, q, k, v, out, lse, causal, scale, window, cu_seqlens, max_seqlen,
                                  deterministic, out_grads=grads)
        return dq, dk, dv, None, None, None, None, None, None


# ---- the public functions ------------------------------------------------------------------------------------
def attention_backend(q: torch.Tensor, backend: str | Mapping[str, str] | None = None) -> str:
    """The backend ``attention`` runs for q: 'torch' | 'triton'. ``backend`` as ``attention`` takes it (a name, or a
    kernel table {op: backend}); without one, 'triton' for fp16 / bf16 on a GPU, else 'torch'. Raises as
    ``attention`` does for a backend that is unknown, unavailable, or (triton) given fp32 / fp64 inputs."""
    explicit = backend.get("attention") if isinstance(backend, Mapping) else backend
    if explicit is None and q.dtype not in TRITON_DTYPES:
        name = "torch"  # the default for fp32 / fp64 inputs on any device: the kernels take fp16 / bf16
    else:
        name = _backend.resolve("attention", q.device, backend, size=q.shape[-1])
    if name == "triton" and q.dtype not in TRITON_DTYPES:
        raise TypeError(f"attention: the triton backend takes float16 / bfloat16, got {q.dtype}")
    return name


def _prepare(q, k, v, cu_seqlens, max_seqlen, softmax_scale, window, causal, backend):
    """Checks, then (scale, (left, right) window, max_seqlen, backend name)."""
    check_inputs(q, k, v, cu_seqlens, max_seqlen, softmax_scale)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    win = _window(window, causal)
    name = attention_backend(q, backend)
    if name != "torch" and cu_seqlens is not None and max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return scale, win, max_seqlen, name


def attention(q, k, v, *, causal: bool = True, softmax_scale: float | None = None,
              cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None, window=None,
              return_lse: bool = False, deterministic: bool = True,
              backend: str | Mapping[str, str] | None = None):
    """Attention of q over k, v: out (and lse with ``return_lse``). See the module docstring for shapes and masks."""
    scale, win, max_seqlen, name = _prepare(q, k, v, cu_seqlens, max_seqlen, softmax_scale, window, causal, backend)
    with _nvtx.annotate(f"megakern.attention[{name}]"):
        if name == "torch":
            out, lse = attention_ref(q, k, v, causal=causal, softmax_scale=scale, cu_seqlens=cu_seqlens, window=win)
        else:
            out, lse = AttentionFunction.apply(q, k, v, causal, scale, win, cu_seqlens, max_seqlen, deterministic)
    return (out, lse) if return_lse else out


def attention_forward(q, k, v, *, causal: bool = True, softmax_scale: float | None = None,
                      cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None, window=None,
                      backend: str | Mapping[str, str] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of ``attention`` without autograd (nothing recorded, whatever q, k, v require): out like q, lse
    (B, nh, Tq) or (nh, total) fp32, natural log, -inf for a query that sees no key. Arguments and backend as for
    ``attention``; ``attention_backward`` takes the pair (or a merge of several, ``merge_attention``)."""
    scale, win, max_seqlen, name = _prepare(q, k, v, cu_seqlens, max_seqlen, softmax_scale, window, causal, backend)
    with torch.no_grad(), _nvtx.annotate(f"megakern.attention[{name}]"):
        if name == "torch":
            return attention_ref(q, k, v, causal=causal, softmax_scale=scale, cu_seqlens=cu_seqlens, window=win)
        return _fwd_kernels(q, k, v, causal, scale, win, cu_seqlens, max_seqlen)


def attention_backward(dout, q, k, v, out, lse, *, causal: bool = True, softmax_scale: float | None = None,
                       cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None, window=None,
                       deterministic: bool = True, backend: str | Mapping[str, str] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of attention of q over k, v given the upstream gradient ``dout`` (like q) and the forward's
    statistics ``out`` and ``lse`` as ``attention_forward`` returns them, without autograd. Each score's probability
    is recomputed against ``lse`` (flash-attention's backward), so with the out and lse of a merged attention
    (``merge_attention``) a block of keys gets exactly its share of dq, dk, dv (ring attention's use).

    Arguments and backend as for ``attention``; ``deterministic`` as there. The kernels take contiguous copies of
    non-contiguous inputs and return gradients in q's dtype; the torch backend (the reference, any layout) returns
    them in fp32 (fp64 for fp64 inputs), for callers that accumulate them so."""
    scale, win, max_seqlen, name = _prepare(q, k, v, cu_seqlens, max_seqlen, softmax_scale, window, causal, backend)
    with torch.no_grad(), _nvtx.annotate(f"megakern.attention_backward[{name}]"):
        if name == "torch":
            return _ref_bwd(dout, q, k, v, out, lse, causal, scale, win, cu_seqlens)
        dout, q, k, v, out, lse = (t.contiguous() for t in (dout, q, k, v, out, lse))
        return _bwd_kernels(dout, q, k, v, out, lse, causal, scale, win, cu_seqlens, max_seqlen, deterministic)


class Attention(nn.Module):
    """Fused attention with fixed masking options: ``forward(q, k, v, cu_seqlens=None, max_seqlen=None)``."""

    def __init__(self, *, causal: bool = True, softmax_scale: float | None = None, window=None,
                 deterministic: bool = True, backend: str | Mapping[str, str] | None = None):
        super().__init__()
        self.causal, self.softmax_scale, self.window = causal, softmax_scale, window
        self.deterministic, self.backend = deterministic, backend

    def forward(self, q, k, v, cu_seqlens=None, max_seqlen=None):
        return attention(q, k, v, causal=self.causal, softmax_scale=self.softmax_scale, cu_seqlens=cu_seqlens,
                         max_seqlen=max_seqlen, window=self.window, deterministic=self.deterministic,
                         backend=self.backend)

    def extra_repr(self) -> str:
        return f"causal={self.causal}, window={self.window}, deterministic={self.deterministic}, backend={self.backend}"
