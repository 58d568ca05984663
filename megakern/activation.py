"""Fused activations: ``bias_gelu(h, bias)`` = gelu(h + bias) with the tanh approximation (GPT-2's).

An MLP computes h = x W^T without its bias, then ``bias_gelu(h, b)``: the bias add rides in the activation's pass,
and the backward writes dh and the bias gradient (the column sums of dh) in one pass instead of a GELU backward
plus a separate reduction over dh, as Megatron's bias-GELU fusion does.

Shapes: h (..., N) in fp32 / fp16 / bf16, bias (N,) in any float dtype or None. Math in fp32; the output and dh in
h's dtype; the bias gradient summed in fp32, in the bias's dtype. Backends: ``torch`` (``bias_gelu_ref`` under
autograd) and ``triton`` (the default on a GPU); ``bias_gelu_backend`` says which one a call takes.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from megakern import _backend, _nvtx


def bias_gelu_ref(h: torch.Tensor, bias: torch.Tensor | None = None, *, upcast: bool = True) -> torch.Tensor:
    """The torch reference: gelu(h + bias, tanh approximation), in fp32 (fp64 for fp64 input) unless ``upcast``
    is False."""
    compute = torch.promote_types(h.dtype, torch.float32) if upcast else h.dtype
    x = h.to(compute)
    if bias is not None:
        x = x + bias.to(compute)
    return F.gelu(x, approximate="tanh").to(h.dtype)


class BiasGeluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, bias):
        from megakern import _activation_triton as kern

        ctx.save_for_backward(h, bias)
        return kern.fwd(h, bias)

    @staticmethod
    def backward(ctx, dy):
        from megakern import _activation_triton as kern

        h, bias = ctx.saved_tensors
        dh, dbias = kern.bwd(dy.contiguous(), h, bias)
        return dh, (dbias if bias is not None and ctx.needs_input_grad[1] else None)


def _check(h, bias) -> None:
    if not isinstance(h, torch.Tensor) or h.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        raise TypeError(f"bias_gelu: h must be a float32/float16/bfloat16 tensor, got "
                        f"{getattr(h, 'dtype', type(h).__name__)}")
    if h.dim() == 0:
        raise ValueError("bias_gelu: h must have at least one dimension (features last)")
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
        raise TypeError(f"bias_gelu: bias must be a floating-point tensor, got {getattr(bias, 'dtype', type(bias))}")
    if bias.shape != (h.shape[-1],):
        raise ValueError(f"bias_gelu: bias has shape {tuple(bias.shape)}, expected ({h.shape[-1]},) for h of shape "
                         f"{tuple(h.shape)}")
    if bias.device != h.device:
        raise ValueError(f"bias_gelu: bias is on {bias.device} but h is on {h.device}")


def bias_gelu_backend(h: torch.Tensor, backend: str | Mapping[str, str] | None = None) -> str:
    """The backend ``bias_gelu(h, bias, backend=backend)`` takes: 'torch' | 'triton'. ``backend`` a name or a kernel
    table {op: backend}; without one, 'triton' on a GPU, the reference for float64 h and on a CPU. Raises ValueError /
    RuntimeError for an unknown or unavailable backend."""
    explicit = backend.get("bias_gelu") if isinstance(backend, Mapping) else backend
    if explicit is None and h.dtype == torch.float64:
        return "torch"
    return _backend.resolve("bias_gelu", h.device, backend, size=h.shape[-1])


def bias_gelu(h: torch.Tensor, bias: torch.Tensor | None = None, *,
              backend: str | Mapping[str, str] | None = None) -> torch.Tensor:
    """gelu(h + bias) (tanh approximation) over the last dim of h; ``backend`` as for every megakern op."""
    _check(h, bias)
    name = bias_gelu_backend(h, backend)
    with _nvtx.annotate(f"megakern.bias_gelu[{name}]"):
        if name == "torch":
            return bias_gelu_ref(h, bias)
        if h.dtype == torch.float64:
            raise TypeError("bias_gelu: the triton backend takes float32/float16/bfloat16, got torch.float64")
        return BiasGeluFunction.apply(h.contiguous(), bias)
