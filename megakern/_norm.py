"""What LayerNorm and RMSNorm share: input checks, the autograd Function, and backend dispatch.

The two ops run the same kernels (an ``IS_RMS`` switch in Triton, a flag in CUDA), so everything but their
references and public signatures lives here; megakern/rmsnorm.py and megakern/layernorm.py are the entry points.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from megakern import _backend, _nvtx

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HIDDEN = 65536


def _triton_impl():
    from megakern import _norm_triton

    return _norm_triton.fwd, _norm_triton.bwd


def _cuda_fwd(x, residual, weight, bias, eps, is_rms):
    from megakern import _norm_cuda

    if not torch.compiler.is_compiling():  # eager: straight to the launcher, no dispatcher round trip
        return _norm_cuda.fwd(x, residual, weight, bias, eps, is_rms)
    y, res_out, mean, rstd = torch.ops.megakern.norm_fwd(x, residual, weight, bias, eps, is_rms)
    return y, (res_out if residual is not None else None), (None if is_rms else mean), rstd


def _cuda_bwd(dy, x, dres_out, weight, mean, rstd, is_rms, residual_dtype, need_dw, need_db):
    from megakern import _norm_cuda

    if not torch.compiler.is_compiling():
        return _norm_cuda.bwd(dy, x, dres_out, weight, mean, rstd, is_rms, residual_dtype, need_dw, need_db)
    dx, dres, dw, db = torch.ops.megakern.norm_bwd(dy, x, dres_out, weight, mean, rstd, is_rms, residual_dtype,
                                                   need_dw, need_db)
    if residual_dtype is None:
        dres = None
    elif residual_dtype == dy.dtype:
        dres = dx
    return dx, dres, (dw if need_dw else None), (db if need_db and not is_rms else None)


def _cuda_impl():
    # Eager calls go straight to the launchers; under torch.compile the torch.library custom ops
    # (megakern::norm_fwd / norm_bwd, registered on import of _norm_cuda) keep the kernels opaque to tracing.
    return _cuda_fwd, _cuda_bwd


# backend -> () -> (fwd launcher, bwd launcher); "torch" runs the reference under autograd instead
_LAUNCHERS = {"triton": _triton_impl, "cuda": _cuda_impl}


def module_params(x: torch.Tensor, weight, bias):
    """A norm module's (weight, bias) in a dtype the kernels take with ``x``: parameters stored in another low
    precision than x's (bf16 compute parameters of FSDP2 mixed precision meeting the fp32 residual stream) are read
    as fp32, which holds their values exactly; autograd casts their gradients back."""
    def fit(t):
        if t is None or t.dtype in (x.dtype, torch.float32) or not t.is_floating_point():
            return t
        return t.float()
    return fit(weight), fit(bias)


def check_inputs(op: str, x, weight, bias, residual, eps) -> None:
    """Raise TypeError / ValueError naming the problem with any argument."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: x has dtype {x.dtype}; supported: float32, float16, bfloat16")
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have at least one dimension (the hidden size), got a scalar")
    hidden = x.shape[-1]
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"{op}: hidden size (last dim of x) is {hidden}; supported: 1..{MAX_HIDDEN}")
    if isinstance(eps, bool) or not isinstance(eps, (float, int)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {eps!r}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor or None, got {type(t).__name__}")
        if t.shape != (hidden,):
            raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}, expected ({hidden},) to match x's last dim")
        if t.dtype not in (x.dtype, torch.float32):
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected x's dtype ({x.dtype}) or float32")
        if t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device} but x is on {x.device}")
    if weight is not None and bias is not None and bias.dtype != weight.dtype:
        raise TypeError(f"{op}: bias has dtype {bias.dtype} but weight has {weight.dtype}; they must match")
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"{op}: residual must be a torch.Tensor or None, got {type(residual).__name__}")
        if residual.shape != x.shape:
            raise ValueError(f"{op}: residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}")
        if residual.dtype not in (x.dtype, torch.float32):
            raise TypeError(f"{op}: residual has dtype {residual.dtype}; expected x's dtype ({x.dtype}) or float32")
        if residual.device != x.device:
            raise ValueError(f"{op}: residual is on {residual.device} but x is on {x.device}")


def ref_input(x, residual, upcast: bool):
    """For the torch references: (tensor to normalize, in the compute dtype; h = x + residual rounded to the
    residual's dtype, or None; the compute dtype). ``upcast``: fp32 (fp64 for fp64 inputs), else x's dtype."""
    compute = torch.promote_types(x.dtype, torch.float32) if upcast else x.dtype
    h = None
    if residual is not None:
        h = (x.to(compute) + residual.to(compute)).to(residual.dtype)
        x = h
    return x.to(compute), h, compute


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A (rows, hidden) view with unit stride along hidden; copies only when no such view exists."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] == 1 else t2.contiguous()


class NormFunction(torch.autograd.Function):
    """y = norm(x [+ residual]) with kernels from ``launchers``; returns y, or (y, x + residual)."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, eps, is_rms, launchers):
        fwd, bwd = launchers
        x2 = _rows(x)
        res2 = None if residual is None else _rows(residual)
        y, res_out, mean, rstd = fwd(x2, res2, weight, bias, float(eps), is_rms)
        ctx.save_for_backward(x2 if res_out is None else res_out, weight, mean, rstd)
        ctx.bwd, ctx.is_rms, ctx.shape = bwd, is_rms, x.shape
        ctx.residual_dtype = None if residual is None else residual.dtype
        ctx.has_bias = bias is not None
        if residual is None:
            return y.view(x.shape)
        return y.view(x.shape), res_out.view(x.shape)

    @staticmethod
    def backward(ctx, dy, dres_out=None):
        x2, weight, mean, rstd = ctx.saved_tensors
        dres_out2 = None if dres_out is None else _rows(dres_out)
        need_dw = weight is not None and ctx.needs_input_grad[1]
        need_db = ctx.has_bias and ctx.needs_input_grad[2]
        dx, dres, dw, db = ctx.bwd(_rows(dy), x2, dres_out2, weight, mean, rstd, ctx.is_rms, ctx.residual_dtype,
                                   need_dw, need_db)
        dres = None if dres is None else dres.view(ctx.shape)
        return dx.view(ctx.shape), dw, db, dres, None, None, None


def norm(op: str, reference, x, weight, bias, residual, eps, backend: str | Mapping[str, str] | None, is_rms: bool):
    """Check, pick the backend, and run; ``reference`` is the op's fp32 torch reference (the torch backend)."""
    check_inputs(op, x, weight, bias, residual, eps)
    name = _backend.resolve(op, x.device, backend, size=x.shape[-1])
    with _nvtx.annotate(f"megakern.{op}[{name}]"):
        if name == "torch":
            return reference(x, weight, bias, eps, residual)
        return NormFunction.apply(x, weight, bias, residual, eps, is_rms, _LAUNCHERS[name]())
