"""Triton kernel of megakern.optim.MasterAdamW: AdamW over many tensors in one launch, from a pointer table.

Each tensor is a row of an int64 table: (numel, fp32 master, gradient, exp_avg, exp_avg_sq, step, model copy); a
work list of (row, first element) pairs gives each program BLOCK elements of one tensor. A program loads its row,
casts the addresses to typed pointers (as the grouped-GEMM tutorial does), and updates its block: the gradient read
in its own dtype (bf16 straight from the backward, or fp32), divided by the clipping divisor, the master weight,
both moments and the bf16 model weight written in the same pass. A nonzero found_inf masks every access: a skipped
step reads and writes nothing.

The update is torch's fused AdamW (aten/src/ATen/native/cuda/fused_adam_utils.cuh): decoupled weight decay, then
the moments, then param -= lr / (1 - beta1^step) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2^step) + eps), with
IEEE division and square roots in fp32.
"""
from __future__ import annotations

import triton
import triton.language as tl

ROW = 7  # int64 entries per tensor in the table


@triton.jit
def _adamw_kernel(WORK, TABLE, LR, lr, beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay, SCALE, FOUND_INF,
                  LR_ON_DEVICE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr,
                  GRAD_DTYPE: tl.constexpr, MODEL_DTYPE: tl.constexpr, WRITE_MODEL: tl.constexpr,
                  BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    tensor = tl.load(WORK + 2 * pid)
    start = tl.load(WORK + 2 * pid + 1)
    row = TABLE + tensor * 7
    numel = tl.load(row)
    param = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    grad = tl.load(row + 2).to(tl.pointer_type(GRAD_DTYPE))
    exp_avg = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    exp_avg_sq = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    step = tl.load(tl.load(row + 5).to(tl.pointer_type(tl.float32)))

    if HAS_INF:  # a skipped step: no element in range
        numel = tl.where(tl.load(FOUND_INF) == 0, numel, 0)
    offs = start + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(grad + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = tl.div_rn(g, tl.load(SCALE))
    p = tl.load(param + offs, mask=mask, other=0.0)
    m = tl.load(exp_avg + offs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq + offs, mask=mask, other=0.0)
    if LR_ON_DEVICE:
        rate = tl.load(LR).to(tl.float32)
    else:
        rate = lr
    p = p - rate * weight_decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    correction1 = 1.0 - tl.exp2(step * log2_beta1)
    correction2_sqrt = tl.sqrt_rn(1.0 - tl.exp2(step * log2_beta2))
    denom = tl.div_rn(tl.sqrt_rn(v), correction2_sqrt) + eps
    p = p - tl.div_rn(tl.div_rn(rate, correction1) * m, denom)
    tl.store(param + offs, p, mask=mask)
    tl.store(exp_avg + offs, m, mask=mask)
    tl.store(exp_avg_sq + offs, v, mask=mask)
    if WRITE_MODEL:
        model = tl.load(row + 6).to(tl.pointer_type(MODEL_DTYPE))
        tl.store(model + offs, p.to(MODEL_DTYPE), mask=mask)


TL_DTYPES = {"torch.float32": tl.float32, "torch.bfloat16": tl.bfloat16, "torch.float16": tl.float16}


def launch(work, table, *, programs: int, lr, beta1: float, beta2: float, log2_beta1: float, log2_beta2: float,
           eps: float, weight_decay: float, grad_scale, found_inf, grad_dtype, model_dtype, block: int,
           warps: int) -> None:
    """One launch over ``programs`` work items. ``lr``: a float or a one-element fp32/fp64 device tensor;
    ``grad_scale`` / ``found_inf``: one-element fp32 device tensors or None; ``model_dtype`` None: no model copy."""
    lr_on_device = not isinstance(lr, float)
    _adamw_kernel[(programs,)](
        work, table, lr if lr_on_device else work, 0.0 if lr_on_device else lr, beta1, beta2, log2_beta1,
        log2_beta2, eps, weight_decay, grad_scale if grad_scale is not None else work,
        found_inf if found_inf is not None else work,
        LR_ON_DEVICE=lr_on_device, HAS_SCALE=grad_scale is not None, HAS_INF=found_inf is not None,
        GRAD_DTYPE=TL_DTYPES[str(grad_dtype)], MODEL_DTYPE=TL_DTYPES[str(model_dtype or grad_dtype)],
        WRITE_MODEL=model_dtype is not None, BLOCK=block, num_warps=warps)
