"""Triton kernel of megakern.optim.MasterAdamW: AdamW over many tensors in one launch, from a pointer table.

Each tensor is a row of an int64 table: (numel, fp32 master, gradient, exp_avg, exp_avg_sq, step, model copy,
unused); a work list of (row, first element) pairs gives each program BLOCK elements of one tensor. The work list
depends on the tensors' sizes only; the table (a few hundred rows) is rewritten when an address changes. A program
loads its row, casts the addresses to typed pointers (as the grouped-GEMM tutorial does) and updates its block: the gradient read
in its own dtype (bf16 straight from the backward, or fp32), divided by the clipping divisor, the master weight,
both moments and the bf16 model weight written in the same pass. A nonzero found_inf masks every access: a skipped
step reads and writes nothing. Where every tensor of a launch starts 16-byte aligned (ALIGNED, the host checks), a
whole block is read and written unmasked through pointers declared aligned, in 16-byte vectors; the table's
addresses otherwise tell the compiler nothing, and a block would move element by element (8 loads of a thread's 8
fp32 values instead of 2).

The update is torch's fused AdamW (aten/src/ATen/native/cuda/fused_adam_utils.cuh): decoupled weight decay, then
the moments, then param -= lr / (1 - beta1^step) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2^step) + eps), in
fp32 with IEEE division and square root. Divisions by a per-program scalar (the clipping divisor, the second bias
correction) are multiplications by its reciprocal: within an ulp of torch's, one division and one square root an
element.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megakern._round_triton import rounded

ROW = 8  # int64 entries per tensor in the table


@triton.jit
def _untouched(g, m, v, eps, step_size, inv_correction2_sqrt):
    """Where the update leaves both moments +0 and subtracts a quotient of +0 from the decayed master: a zero gradient
    (after the clipping divisor), both moments +0, and step scalars with eps > 0, a positive finite step size and a
    finite bias correction. Then m = beta1 * 0 + (1 - beta1) * (+-0) = +0, v = +0, and (step_size * 0) / (0 * c + eps)
    = +0, contracted into fused multiply-adds or not."""
    zero_bits = (m.to(tl.int32, bitcast=True) == 0) & (v.to(tl.int32, bitcast=True) == 0)
    scalars = ((eps > 0.0) & (step_size > 0.0) & (step_size < float("inf"))
               & (tl.abs(inv_correction2_sqrt) < float("inf")))
    return (g == 0.0) & zero_bits & scalars


@triton.jit
def _adamw_block(param, grad, exp_avg, exp_avg_sq, model, offs, numel, rate, weight_decay, beta1, beta2, eps,
                 step_size, inv_correction2_sqrt, inv_scale, HAS_SCALE: tl.constexpr, WRITE_MODEL: tl.constexpr,
                 MODEL_DTYPE: tl.constexpr, ROUND_BY_BITS: tl.constexpr, MASKED: tl.constexpr):
    """One block's update; MASKED: elements past numel neither read nor written (else the whole block exists)."""
    if MASKED:
        mask = offs < numel
        g = tl.load(grad + offs, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(param + offs, mask=mask, other=0.0)
        m = tl.load(exp_avg + offs, mask=mask, other=0.0)
        v = tl.load(exp_avg_sq + offs, mask=mask, other=0.0)
    else:
        mask = None
        g = tl.load(grad + offs).to(tl.float32)
        p = tl.load(param + offs)
        m = tl.load(exp_avg + offs)
        v = tl.load(exp_avg_sq + offs)
    if HAS_SCALE:
        g = g * inv_scale
    # p - 0 * p is p for a finite p other than -0 (which turns +0)
    kept = ((weight_decay == 0.0) & (tl.abs(rate) < float("inf")) & (p.to(tl.int32, bitcast=True) != -2147483648)
            & (tl.abs(p) < float("inf")))
    p = p - rate * weight_decay * p
    if tl.min(_untouched(g, m, v, eps, step_size, inv_correction2_sqrt).to(tl.int32)) == 1:
        # a block no token touched yet (an embedding's rows: zero gradients, both moments +0): the moments stay +0 and
        # the master is the decayed one, so the moments are not written, nor the master where it kept its bits (no
        # weight decay), and no square root or division runs (their slow paths for zeros)
        if tl.min(kept.to(tl.int32)) == 0:
            tl.store(param + offs, p, mask=mask)
    else:
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        denom = tl.sqrt_rn(v) * inv_correction2_sqrt + eps
        p = p - tl.div_rn(step_size * m, denom)
        tl.store(param + offs, p, mask=mask)
        tl.store(exp_avg + offs, m, mask=mask)
        tl.store(exp_avg_sq + offs, v, mask=mask)
    if WRITE_MODEL:
        tl.store(model + offs, rounded(p, MODEL_DTYPE, ROUND_BY_BITS), mask=mask)


@triton.jit
def _adamw_kernel(WORK, TABLE, LR, lr, beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay, SCALE, FOUND_INF,
                  LR_ON_DEVICE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr,
                  GRAD_DTYPE: tl.constexpr, MODEL_DTYPE: tl.constexpr, WRITE_MODEL: tl.constexpr,
                  ROUND_BY_BITS: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    item = WORK + tl.program_id(0) * 2
    row = TABLE + tl.load(item) * 8
    start = tl.multiple_of(tl.load(item + 1), BLOCK)
    numel = tl.load(row)
    param = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    grad = tl.load(row + 2).to(tl.pointer_type(GRAD_DTYPE))
    exp_avg = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    exp_avg_sq = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    step = tl.load(tl.load(row + 5).to(tl.pointer_type(tl.float32)))
    model = tl.load(row + 6).to(tl.pointer_type(MODEL_DTYPE))
    if ALIGNED:  # every tensor of the launch starts 16-byte aligned: whole blocks move in 16-byte vectors
        param, grad, model = tl.multiple_of(param, 16), tl.multiple_of(grad, 16), tl.multiple_of(model, 16)
        exp_avg, exp_avg_sq = tl.multiple_of(exp_avg, 16), tl.multiple_of(exp_avg_sq, 16)
    if HAS_INF:  # a skipped step: no element in range
        numel = tl.where(tl.load(FOUND_INF) == 0, numel, 0)
    offs = start + tl.arange(0, BLOCK)
    inv_scale = 1.0
    if HAS_SCALE:
        inv_scale = tl.div_rn(1.0, tl.load(SCALE))
    if LR_ON_DEVICE:
        rate = tl.load(LR).to(tl.float32)
    else:
        rate = lr
    # the program's scalars: bias corrections of this step, the step size
    step_size = tl.div_rn(rate, 1.0 - tl.exp2(step * log2_beta1))
    inv_correction2_sqrt = tl.div_rn(1.0, tl.sqrt_rn(1.0 - tl.exp2(step * log2_beta2)))
    if start + BLOCK <= numel:  # a whole block: no mask, so that ALIGNED loads and stores are vectorized
        _adamw_block(param, grad, exp_avg, exp_avg_sq, model, offs, numel, rate, weight_decay, beta1, beta2, eps,
                     step_size, inv_correction2_sqrt, inv_scale, HAS_SCALE, WRITE_MODEL, MODEL_DTYPE, ROUND_BY_BITS,
                     False)
    else:
        _adamw_block(param, grad, exp_avg, exp_avg_sq, model, offs, numel, rate, weight_decay, beta1, beta2, eps,
                     step_size, inv_correction2_sqrt, inv_scale, HAS_SCALE, WRITE_MODEL, MODEL_DTYPE, ROUND_BY_BITS,
                     True)


TL_DTYPES = {"torch.float32": tl.float32, "torch.bfloat16": tl.bfloat16, "torch.float16": tl.float16}


def launch(work, table, *, programs: int, lr, beta1: float, beta2: float, log2_beta1: float, log2_beta2: float,
           eps: float, weight_decay: float, grad_scale, found_inf, grad_dtype, model_dtype, block: int,
           warps: int, aligned: bool = False) -> None:
    """One launch over ``programs`` work items. ``lr``: a float or a one-element fp32/fp64 device tensor;
    ``grad_scale`` / ``found_inf``: one-element fp32 device tensors or None; ``model_dtype`` None: no model copy;
    ``aligned``: every tensor of the table starts at a 16-byte aligned address (whole blocks then move in vectors)."""
    lr_on_device = not isinstance(lr, float)
    _adamw_kernel[(programs,)](
        work, table, lr if lr_on_device else work, 0.0 if lr_on_device else lr, beta1, beta2, log2_beta1,
        log2_beta2, eps, weight_decay, grad_scale if grad_scale is not None else work,
        found_inf if found_inf is not None else work,
        LR_ON_DEVICE=lr_on_device, HAS_SCALE=grad_scale is not None, HAS_INF=found_inf is not None,
        GRAD_DTYPE=TL_DTYPES[str(grad_dtype)], MODEL_DTYPE=TL_DTYPES[str(model_dtype or grad_dtype)],
        WRITE_MODEL=model_dtype is not None, ALIGNED=aligned, BLOCK=block, num_warps=warps,
        # on CPU tensors (the interpreter) bf16 is rounded by hand, so CPU runs match torch's .to(torch.bfloat16)
        ROUND_BY_BITS=model_dtype == torch.bfloat16 and not work.is_cuda)
