"""Host side of csrc/fp8/fp8.cu: per-tensor FP8 casts with the CUDA C++ kernel, through the built extension
(``megakern._C.fp8_cast``) or, where it is not built, NVRTC (cupy). Tensors in, tensors out, no autograd.
"""
from __future__ import annotations

import torch

from megakern import _cuda
from megakern._intmath import cdiv

_CTYPES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # Fp8DType of csrc/fp8/fp8.h
THREADS, BLOCKS_PER_SM = 256, 8


def kernel_name(dtype: torch.dtype, e4m3: bool, vecio: bool, write_amax: bool) -> str:
    b = lambda flag: "true" if flag else "false"  # noqa: E731
    return f"megakern::fp8_cast_kernel<{_CTYPES[dtype]}, {b(e4m3)}, {b(vecio)}, {b(write_amax)}>"


def kernel_names() -> list[str]:
    """Every instance the launcher can ask for (NVRTC name expressions)."""
    return [kernel_name(d, e, v, w) for d in _CTYPES for e in (True, False) for v in (True, False)
            for w in (True, False)]


def problem() -> str:
    """'' if this path can run, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device is available to torch"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return f"FP8 conversions need compute capability >= 8.9; this GPU has {major}.{minor}"
    return _cuda.runtime()[1]


def cast(x2: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, amax_out: torch.Tensor | None):
    """y (x2's shape) = sat(x2 * scale) in ``fp8_dtype``; with ``amax_out`` (an fp32 scalar holding 0) also x2's
    amax (NaN counted as inf). x2 is made contiguous first if it is not."""
    import numpy as np

    if reason := problem():
        raise RuntimeError(f"fp8: the CUDA cast is unavailable: {reason}")
    x = x2 if x2.is_contiguous() else x2.contiguous()
    y = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    n = x.numel()
    if n == 0:
        return y
    vec = 16 // x.element_size()
    vecio = x.data_ptr() % 16 == 0 and y.data_ptr() % vec == 0 and n % vec == 0
    e4m3 = fp8_dtype == torch.float8_e4m3fn
    grid = max(1, min(cdiv(n, THREADS * vec), _cuda.sm_count(x.device.index) * BLOCKS_PER_SM))
    if _cuda.choose_path() == "extension":
        _cuda.extension()[0].fp8_cast(x, y, scale, amax_out, _DTYPE_CODES[x.dtype], e4m3, vecio, grid)
        return y
    kernel = _cuda.nvrtc_kernel("fp8/fp8.cu", kernel_name(x.dtype, e4m3, vecio, amax_out is not None))
    amax_ptr = amax_out.data_ptr() if amax_out is not None else scale.data_ptr()
    args = (np.uint64(x.data_ptr()), np.uint64(y.data_ptr()), np.uint64(scale.data_ptr()), np.uint64(amax_ptr),
            np.int64(n))
    _cuda.nvrtc_launch(kernel, (grid,), (THREADS,), args, x.device)
    return y
