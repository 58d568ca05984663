"""``linear(x, weight, bias)``: y = x W^T + b, as torch.nn.functional.linear, with the bias gradient (the column sums
of dy) made by a Triton reduction that reads dy once at full bandwidth (megakern._linear_triton) instead of torch's
reduction over rows.

Under autocast x, W and b are cast to the autocast dtype as autocast casts them for F.linear; the gradients come back
in the dtypes of x, W and b. Shapes: x (..., K), weight (N, K), bias (N,) or None (then this is F.linear).
Backends: ``torch`` (F.linear under autograd) and ``triton`` (the default on a GPU); ``linear_backend`` says which
one a call takes.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from megakern import _backend, _nvtx


class LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        xc, wc, bc = x.to(dtype), weight.to(dtype), bias.to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            y = torch.addmm(bc, xc.reshape(-1, xc.shape[-1]), wc.t())
        ctx.save_for_backward(xc, wc)
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        from megakern import _linear_triton as kern

        xc, wc = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        dy2 = dy.reshape(-1, dy.shape[-1])
        if dy2.stride(-1) != 1:
            dy2 = dy2.contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = dy2.mm(wc).view(*xc.shape).to(x_dtype)
        if ctx.needs_input_grad[1]:
            dw = dy2.t().mm(xc.reshape(-1, xc.shape[-1])).to(w_dtype)
        if ctx.needs_input_grad[2]:
            db = kern.colsum(dy2, b_dtype)
        return dx, dw, db, None


def linear_backend(x: torch.Tensor, weight: torch.Tensor, backend: str | Mapping[str, str] | None = None) -> str:
    """The backend ``linear(x, weight, bias, backend=backend)`` takes with a bias: 'torch' (F.linear) | 'triton'.
    ``backend`` a name or a kernel table {op: backend}; without one, 'triton' on a GPU. float64 x takes F.linear.
    Raises ValueError / RuntimeError for an unknown or unavailable backend."""
    name = _backend.resolve("linear", x.device, backend, size=weight.shape[0])
    return "torch" if x.dtype == torch.float64 else name


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           backend: str | Mapping[str, str] | None = None) -> torch.Tensor:
    """x W^T + b; ``backend`` as for every megakern op."""
    if bias is None:
        return F.linear(x, weight)
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and isinstance(bias, torch.Tensor)):
        raise TypeError("linear: x, weight and bias must be tensors")
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1] or bias.shape != (weight.shape[0],):
        raise ValueError(f"linear: shapes do not fit: x {tuple(x.shape)}, weight {tuple(weight.shape)}, bias "
                         f"{tuple(bias.shape)} (want x (..., K), weight (N, K), bias (N,))")
    if not x.device == weight.device == bias.device:
        raise ValueError(f"linear: x, weight and bias are on {x.device}, {weight.device}, {bias.device}")
    if linear_backend(x, weight, backend) == "torch":
        return F.linear(x, weight, bias)
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    with _nvtx.annotate("megakern.linear[triton]"):
        return LinearFunction.apply(x, weight, bias, dtype)


def bias_grad(dy: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The bias gradient of y = x W^T + b from dy (..., N): its column sums (N,), summed in fp32 for 16-bit dy, in
    ``dtype`` (default dy's). On a GPU the Triton reduction of ``linear``'s backward (reads dy once), else torch."""
    if not isinstance(dy, torch.Tensor) or dy.dim() < 1:
        raise ValueError(f"bias_grad: dy must be a tensor of at least one dim, got {type(dy).__name__}"
                         + (f" of shape {tuple(dy.shape)}" if isinstance(dy, torch.Tensor) else ""))
    dtype = dtype or dy.dtype
    dy2 = dy.reshape(-1, dy.shape[-1])
    if dy2.is_cuda and dy2.dtype in (torch.float16, torch.bfloat16, torch.float32):
        from megakern import _linear_triton as kern

        return kern.colsum(dy2 if dy2.stride(-1) == 1 else dy2.contiguous(), dtype)
    wide = torch.float32 if dy2.dtype in (torch.float16, torch.bfloat16) else dy2.dtype
    return dy2.sum(0, dtype=wide).to(dtype)
