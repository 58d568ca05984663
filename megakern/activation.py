"""Fused activations: ``bias_gelu(h, bias)`` = gelu(h + bias) with the tanh approximation (GPT-2's), and
``swiglu(h)`` = silu(gate) * up over interleaved (gate, up) columns (Llama's MLP).

An MLP computes h = x W^T without its bias, then ``bias_gelu(h, b)``: the bias add rides in the activation's pass,
and the backward writes dh and the bias gradient (the column sums of dh) in one pass instead of a GELU backward
plus a separate reduction over dh, as Megatron's bias-GELU fusion does.

Shapes: h (..., N) in fp32 / fp16 / bf16, bias (N,) in any float dtype or None. Math in fp32; the output and dh in
h's dtype; the bias gradient summed in fp32, in the bias's dtype. Backends: ``torch`` (``bias_gelu_ref`` under
autograd) and ``triton`` (the default on a GPU); ``bias_gelu_backend`` says which one a call takes.

SwiGLU: h (..., 2F) with unit i's gate in column 2i and its up projection in column 2i + 1 (the layout of
megakern.models' MLP weights: one GEMM makes both), y (..., F) = silu(h[..., 0::2]) * h[..., 1::2]. One pass each
way: the forward reads h once and writes y; the backward reads h and dy and writes dh interleaved, where autograd
over the two strided views writes each half's gradient into a zero-filled buffer of h's size and adds them. Math in
fp32, y and dh in h's dtype; only h is kept for the backward. Backends as bias_gelu's (op "swiglu").
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


def swiglu_ref(h: torch.Tensor, *, upcast: bool = True) -> torch.Tensor:
    """The torch reference: silu(h[..., 0::2]) * h[..., 1::2] in fp32 (fp64 for fp64 input) unless ``upcast`` is
    False, cast to h's dtype."""
    compute = torch.promote_types(h.dtype, torch.float32) if upcast else h.dtype
    pairs = h.to(compute).unflatten(-1, (-1, 2))
    return (F.silu(pairs[..., 0]) * pairs[..., 1]).to(h.dtype)


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        from megakern import _activation_triton as kern

        ctx.save_for_backward(h)
        return kern.swiglu_fwd(h)

    @staticmethod
    def backward(ctx, dy):
        from megakern import _activation_triton as kern

        (h,) = ctx.saved_tensors
        return kern.swiglu_bwd(dy.contiguous(), h)


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


def swiglu_backend(h: torch.Tensor, backend: str | Mapping[str, str] | None = None) -> str:
    """The backend ``swiglu(h, backend=backend)`` takes: 'torch' | 'triton' (as ``bias_gelu_backend``, op
    "swiglu"; the size is the number of units F)."""
    explicit = backend.get("swiglu") if isinstance(backend, Mapping) else backend
    if explicit is None and h.dtype == torch.float64:
        return "torch"
    return _backend.resolve("swiglu", h.device, backend, size=h.shape[-1] // 2)


def swiglu(h: torch.Tensor, *, backend: str | Mapping[str, str] | None = None) -> torch.Tensor:
    """silu(gate) * up for h (..., 2F) holding unit i's gate in column 2i and its up projection in 2i + 1 ->
    (..., F); ``backend`` as for every megakern op."""
    if not isinstance(h, torch.Tensor) or h.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        raise TypeError(f"swiglu: h must be a float32/float16/bfloat16 tensor, got "
                        f"{getattr(h, 'dtype', type(h).__name__)}")
    if h.dim() == 0 or h.shape[-1] % 2:
        raise ValueError(f"swiglu: h's last dim holds (gate, up) pairs and must be even, got shape {tuple(h.shape)}")
    name = swiglu_backend(h, backend)
    with _nvtx.annotate(f"megakern.swiglu[{name}]"):
        if name == "torch":
            return swiglu_ref(h)
        if h.dtype == torch.float64:
            raise TypeError("swiglu: the triton backend takes float32/float16/bfloat16, got torch.float64")
        return SwiGLUFunction.apply(h.contiguous())
