"""Choosing the implementation of an op: ``torch`` | ``triton`` | ``cuda``.

Order: the explicit ``backend=`` argument of the call; the model config's kernel table (a mapping
``{op: backend}``, passed in the same ``backend=`` argument); the default for the device. Nothing is read from
module-level state or environment variables at import time.

- ``torch``: the fp32 reference of each op, differentiated by autograd (for the ops of ``TORCH_KERNEL_OPS``,
  torch's own kernel). Runs anywhere.
- ``triton``: Triton kernels; on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` is set.
- ``cuda``: the hand-written CUDA C++ kernels of csrc/, through the built extension ``megakern._C`` or, when it
  is not built, compiled at run time by NVRTC through cupy (see ``megakern._cuda``).

The default on a CUDA device is the fastest backend measured by benchmarks/ (``DEFAULTS``; the figures in
docs/tuning.md); on a CPU it is the reference. An unavailable backend asked for by name raises an error that says
why.

Optional dependencies (contract 10, docs/contracts.md) are checked by ``megakern._deps.optional_module``. Floors: ``MIN_TRITON`` (the declared dependency's, set by the Gluon kernels'
Hopper API), ``MIN_LIGER`` (the peer kernels benchmarks/ compare with), cupy's in ``megakern._cuda``.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Mapping

import torch

from megakern._deps import optional_module

BACKENDS = ("torch", "triton", "cuda")

MIN_TRITON = (3, 6)  # Gluon's Hopper API as megakern/_attention_gluon.py uses it; tl.make_tensor_descriptor
MIN_LIGER = (0, 5)  # the first minor release whose LigerRMSNormFunction takes in_place (benchmarks/bench_norm.py)

# Preference per op on CUDA devices, by size (the hidden size; rotary: the head dim; cross-entropy: the vocabulary):
# (largest size, backends fastest first). Measured with the benchmarks named per entry; the figures are in
# docs/tuning.md (backend defaults).
DEFAULTS: dict[str, tuple[tuple[int, tuple[str, ...]], ...]] = {
    # Triton at every hidden size, forward and backward (wide rows: its two-pass backward), profiles/tune_norm.py
    "rms_norm": ((1 << 30, ("triton", "cuda", "torch")),),
    "layer_norm": ((1 << 30, ("triton", "cuda", "torch")),),
    # no CUDA C++ implementation: Triton (Gluon on Hopper), then the reference
    "attention": ((1 << 30, ("triton", "torch")),),
    # Triton's forward ahead of the CUDA kernel's (benchmarks/results/h200/rotary.csv)
    "rotary": ((1 << 30, ("triton", "cuda", "torch")),),
    # Triton (every granularity), the CUDA C++ cast (per tensor), the reference (benchmarks/results/h200/fp8.csv)
    "fp8_cast": ((1 << 30, ("triton", "cuda", "torch")),),
    # the Triton kernel, then the reference (fp32 logits of every row); not yet measured on the H200
    "cross_entropy": ((1 << 30, ("triton", "torch")),),
    # Triton (the GELU backward and the bias gradient in one pass), then the reference
    "bias_gelu": ((1 << 30, ("triton", "torch")),),
    # SwiGLU on interleaved (gate, up): one Triton pass each way, then the reference (benchmarks/bench_activation.py)
    "swiglu": ((1 << 30, ("triton", "torch")),),
    # the bias gradient by a Triton column sum, then F.linear's own
    "linear": ((1 << 30, ("triton", "torch")),),
    # MoE permute / unpermute: the Triton gather and combine (the reference copies rows and its gradients scatter)
    "moe": ((1 << 30, ("triton", "torch")),),
    # the Triton grouped GEMM (the reference reads the offsets on the host and multiplies in fp32 per expert)
    "grouped_mm": ((1 << 30, ("triton", "torch")),),
    # the fused qkv rows' order: one Triton pass, ahead of the reference's two strided copies
    # (benchmarks/results/h200/qkv_order.csv)
    "qkv_order": ((1 << 30, ("triton", "torch")),),
    # (size: the table's width) torch's backward to 2048, where the Triton pass lost or was level with Zipf ids (one
    # program sums a frequent id's rows alone), the Triton pass above (profiles/h200/tune_embedding_ffb600b.txt)
    "embedding": ((2048, ("torch", "triton")), (1 << 30, ("triton", "torch"))),
}


# ops whose 'torch' backend is torch's own kernel rather than an fp32 reference: only these may put it ahead of
# megakern's where it measured faster (the embedding's backward: aten's on narrow tables)
TORCH_KERNEL_OPS = frozenset({"embedding"})


def op_backends(op: str) -> tuple[str, ...]:
    """The backends ``op`` offers (the names its ``backend=`` takes), fastest first on a GPU at small sizes; ops:
    the keys of ``DEFAULTS``. Exported as ``megakern.op_backends``."""
    if op not in DEFAULTS:
        raise ValueError(f"unknown op {op!r}; ops: {', '.join(DEFAULTS)}")
    return DEFAULTS[op][0][1]


def default_order(op: str, size: int) -> tuple[str, ...]:
    """The preference order of ``op``'s backends on a CUDA device for problem size ``size`` (the hidden size)."""
    return next(order for limit, order in DEFAULTS[op] if size <= limit)


@functools.lru_cache(maxsize=None)
def _triton_problem() -> str:
    return optional_module("triton", MIN_TRITON, "megakern's Triton kernels")[1]


def liger_problem() -> str:
    """'' if liger_kernel (the peer provider of benchmarks/) is installed at ``MIN_LIGER`` or later, else why not."""
    return optional_module("liger_kernel", MIN_LIGER, "the liger provider")[1]


def triton_problem(device: torch.device) -> str:
    """'' if Triton kernels can run on ``device``, else the reason they cannot."""
    problem = _triton_problem()
    if problem:
        return problem
    if device.type == "cuda":
        return ""
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") == "1":
            return ""
        return "Triton kernels run on CPU tensors only under the interpreter (set TRITON_INTERPRET=1)"
    return f"Triton kernels do not run on {device.type} tensors"


def cuda_problem(device: torch.device) -> str:
    """'' if the CUDA C++ kernels can run on ``device``, else the reason they cannot."""
    if device.type != "cuda":
        return f"the CUDA kernels need a CUDA tensor, got a {device.type} tensor"
    from megakern import _cuda

    return _cuda.runtime()[1]


def available_backends(device: torch.device | str) -> dict[str, str]:
    """Every backend name mapped to '' if it can run on ``device``, else to the reason it cannot."""
    device = torch.device(device)
    return dict(_device_backends(device.type, device.index))


@functools.lru_cache(maxsize=None)
def _cuda_device_backends(index: int | None) -> tuple[tuple[str, str], ...]:
    device = torch.device("cuda", index)
    return (("torch", ""), ("triton", triton_problem(device)), ("cuda", cuda_problem(device)))


@torch.compiler.assume_constant_result
def _device_backends(device_type: str, index: int | None) -> tuple[tuple[str, str], ...]:
    """The probes run eagerly and their answer is a constant to torch.compile: traced, a failed import inside them
    (megakern._C not built) is an exception Dynamo cannot handle, and the graph break it forces around an
    autograd Function broke AOTAutograd's backward ("outs_to_grad length (1) != tangents length (2)")."""
    if device_type == "cuda":
        return _cuda_device_backends(index)  # cached: the probes import and query the driver
    device = torch.device(device_type, index)
    return (("torch", ""), ("triton", triton_problem(device)), ("cuda", cuda_problem(device)))


def resolve(op: str, device: torch.device, backend: str | Mapping[str, str] | None = None, size: int = 0) -> str:
    """The backend that runs ``op`` on ``device`` for problem size ``size``; raises ValueError / RuntimeError for a
    bad or unavailable choice."""
    if isinstance(backend, Mapping):
        backend = backend.get(op)
    if backend is not None:
        offered = op_backends(op)
        if backend not in offered:
            raise ValueError(f"{op}: unknown backend {backend!r}; choose one of {', '.join(sorted(offered))}")
        problem = available_backends(device)[backend]
        if problem:
            raise RuntimeError(f"{op}: backend {backend!r} is not available: {problem}")
        return backend
    if device.type != "cuda":
        return "torch"
    problems = available_backends(device)
    return next(name for name in default_order(op, size) if not problems[name])
