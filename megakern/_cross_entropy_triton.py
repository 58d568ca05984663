"""Triton kernel of megakern.cross_entropy: per-row loss and d(loss)/d(logits) in one program per row.

A program reads its row of logits twice in blocks of BLOCK_V: first for the running max and the running sum of
exp (online softmax, fp32; with label smoothing also the running sum of the logits), which give the row's
log-sum-exp and loss; then again, last block first (those are the likeliest to be still in L2: a 128k-vocabulary
bf16 row is 256 KB, and the rows in flight outgrow the L2), to write the gradient, softmax - target distribution,
times the row's scale, into GRAD (which may be LOGITS itself: the fused linear cross-entropy overwrites each chunk's
logits with their gradient). Ignored rows (target == ignore_index) get loss 0 and a zero gradient.

With ``softcap`` s the logits are first squashed, z = s * tanh(logit / s) (Gemma 2), and the gradient carries the
extra factor 1 - tanh^2.

The fused linear cross-entropy computes every gradient in the forward, before the loss's own gradient is known;
``scale`` multiplies one of them by it in the backward: fp32 arithmetic with the factor read on the device (no
sync, CUDA-graph safe), rounded to nearest in the gradient's dtype, vectorized loads. torch's ``t * g`` with a 0-d
CUDA g takes its broadcasting kernel there, at about a quarter of copy bandwidth on the 128k-vocabulary gradient.

Launchers take validated 2-D (rows, V) views with unit stride along V; tensors in, tensors out, no autograd.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megakern._cuda import sm_count
from megakern._gemm_shared_triton import device_index
from megakern._intmath import next_power_of_2
from megakern._round_triton import rounded

DEFAULT_BLOCK_V = 8192
SCALE_BLOCK, SCALE_WARPS = 4096, 8
SCALE_PROGRAMS_PER_SM = 8  # in place: 8 programs of 8 warps fill an SM's 64 warps


@triton.jit
def _softcapped(z, softcap, HAS_SOFTCAP: tl.constexpr):
    # softcap * tanh(z / softcap), tanh(u) = 1 - 2 / (exp(2u) + 1) (saturates to +-1 without overflow trouble)
    if HAS_SOFTCAP:
        z = softcap * (1.0 - 2.0 / (tl.exp(2.0 * z / softcap) + 1.0))
    return z


@triton.jit
def _cross_entropy_kernel(
    LOGITS, GRAD, TARGETS, LOSS, LSE, SCALE,
    stride_ln, stride_gn,
    V, ignore_index, label_smoothing, softcap,
    HAS_SMOOTHING: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits = LOGITS + row * stride_ln
    target = tl.load(TARGETS + row).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    if target == ignore_index:
        tl.store(LOSS + row, 0.0)
        tl.store(LSE + row, 0.0)
        if HAS_GRAD:
            for start in range(0, V, BLOCK_V):
                tl.store(GRAD + row * stride_gn + start + cols,
                         tl.zeros([BLOCK_V], tl.float32).to(GRAD.dtype.element_ty), mask=start + cols < V)
    else:
        # the target's logit, read before pass 1: with GRAD the same memory as LOGITS, pass 2 overwrites it, and a
        # warp may store the target's block in pass 2 while another has yet to read it; pass 1's reductions
        # synchronise the warps after every read here. A target outside [0, V) (unchecked when traced by
        # torch.compile) reads nothing and makes the loss NaN
        in_range = (target >= 0) & (target < V)
        z_t = tl.load(logits + target, mask=in_range, other=float("nan")).to(tl.float32)
        # pass 1: running max m and running sum d of exp(z - m), in fp32; the sum of z for label smoothing
        m = tl.full([], float("-inf"), tl.float32)
        d = tl.full([], 0.0, tl.float32)
        z_sum = tl.full([], 0.0, tl.float32)
        for start in range(0, V, BLOCK_V):
            mask = start + cols < V
            z = tl.load(logits + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
            if HAS_SOFTCAP:
                z = tl.where(mask, _softcapped(z, softcap, HAS_SOFTCAP), float("-inf"))
            m_new = tl.maximum(m, tl.max(z, axis=0))
            # while every logit so far is -inf, shift by 0 (-inf - -inf would make d NaN)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            d = d * tl.exp(m - m_ref) + tl.sum(tl.exp(z - m_ref), axis=0)
            if HAS_SMOOTHING:
                z_sum += tl.sum(tl.where(mask, z, 0.0), axis=0)
            m = m_new
        lse = m + tl.log(d)
        z_t = _softcapped(z_t, softcap, HAS_SOFTCAP)
        # loss = (1 - eps) (lse - z_t) + eps (lse - mean(z))
        loss = lse - z_t
        if HAS_SMOOTHING:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - z_sum / V)
        tl.store(LOSS + row, loss)
        tl.store(LSE + row, lse)
        # pass 2: grad = (softmax(z) - (1 - eps) onehot(target) - eps / V) * scale [* (1 - tanh^2)], the row's
        # blocks in reverse: the last ones pass 1 read are the likeliest to be still in L2
        if HAS_GRAD:
            scale = tl.load(SCALE).to(tl.float32)
            blocks = tl.cdiv(V, BLOCK_V)
            for i in range(0, blocks):
                start = (blocks - 1 - i) * BLOCK_V
                mask = start + cols < V
                z = tl.load(logits + start + cols, mask=mask, other=0.0).to(tl.float32)
                z = _softcapped(z, softcap, HAS_SOFTCAP)
                g = tl.exp(z - lse)
                if HAS_SMOOTHING:
                    g = g - label_smoothing / V
                    g = tl.where(start + cols == target, g - (1.0 - label_smoothing), g)
                else:
                    g = tl.where(start + cols == target, g - 1.0, g)
                if HAS_SOFTCAP:
                    t = z / softcap
                    g = g * (1.0 - t * t)
                tl.store(GRAD + row * stride_gn + start + cols, (g * scale).to(GRAD.dtype.element_ty), mask=mask)


@triton.jit
def _scale_kernel(X, OUT, FACTOR, n, BLOCK: tl.constexpr, ROUND_BY_BITS: tl.constexpr, IN_PLACE: tl.constexpr):
    # blocks pid, pid + programs, ... (``scale`` launches fewer programs than blocks in place)
    factor = tl.load(FACTOR).to(tl.float32)
    if IN_PLACE:  # x * 1 rounds to x: nothing to read or write
        n = tl.where(factor != 1.0, n, 0)
    for b in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
        offs = tl.cast(b, tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        y = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32) * factor
        tl.store(OUT + offs, rounded(y, OUT.dtype.element_ty, ROUND_BY_BITS), mask=mask)


def block_v(vocab: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_V, num_warps) for a row of ``vocab`` logits: blocks of up to 8192 at 8 warps on a GPU (4 below 1024;
    measured under graph replay at V 32000-202048, docs/tuning.md), small blocks under the interpreter."""
    if device.type != "cuda":
        return min(next_power_of_2(vocab), 64), 4
    block = min(next_power_of_2(vocab), DEFAULT_BLOCK_V)
    return block, (8 if block >= 1024 else 4)


def fwd(logits: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor | None, scale: torch.Tensor | None,
        ignore_index: int, label_smoothing: float, softcap: float | None, block: int | None = None,
        warps: int | None = None):
    """(loss, lse), each (rows,) fp32; writes the gradient (times ``scale``, a 1-element tensor) into ``grad`` (which
    may be ``logits``) when given. ``logits`` (rows, V), ``grad`` the same shape, unit stride along V. ``block`` and
    ``warps`` override ``block_v`` (tuning: profiles/tune_cross_entropy.py)."""
    rows, vocab = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return loss, lse
    block_size, default_warps = block_v(vocab, logits.device)
    if block is not None:
        if block < 16 or block & (block - 1):
            raise ValueError(f"cross-entropy kernel: block must be a power of two >= 16, got {block}")
        block_size = block
    if warps is not None and (warps < 1 or warps > 32 or warps & (warps - 1)):
        raise ValueError(f"cross-entropy kernel: warps must be a power of two in [1, 32], got {warps}")
    warps = warps or default_warps
    has_grad = grad is not None
    _cross_entropy_kernel[(rows,)](
        logits, grad if has_grad else logits, targets, loss, lse, scale if has_grad else loss,
        logits.stride(0), grad.stride(0) if has_grad else 0,
        vocab, ignore_index, float(label_smoothing), float(softcap or 1.0),
        HAS_SMOOTHING=label_smoothing > 0, HAS_SOFTCAP=softcap is not None, HAS_GRAD=has_grad, BLOCK_V=block_size,
        num_warps=warps,
    )
    return loss, lse


def scale(x: torch.Tensor, factor: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """x * factor in x's dtype, a new tensor, or with ``inplace`` x itself (each element read before it is written by
    the same program, and where the factor is 1 nothing read or written: the fused linear cross-entropy's backward
    when the loss's gradient arrives as announced, so that launch is a few programs an SM that end at once): ``x``
    contiguous, ``factor`` a one-element tensor on x's device (any float dtype, read as fp32)."""
    out = x if inplace else torch.empty_like(x)
    n = x.numel()
    if n:
        block = SCALE_BLOCK if x.is_cuda else 64
        programs = triton.cdiv(n, block)
        if inplace:  # a factor of 1 then ends every program at once: few programs, each looping over blocks
            programs = min(programs, SCALE_PROGRAMS_PER_SM * sm_count(device_index(x.device)) if x.is_cuda else 2)
        _scale_kernel[(programs,)](x, out, factor, n, BLOCK=block, num_warps=SCALE_WARPS, IN_PLACE=inplace,
                                   ROUND_BY_BITS=x.dtype == torch.bfloat16 and not x.is_cuda)
    return out
