"""What the Triton GEMM kernels share: the MMA step that keeps fp32 products exact, the masked pointer-load K loop
(for tiles TMA cannot move), and launch helpers (the device's SM count and generation, whether a launch uses tensor
descriptors (TMA) and whether TMA can address a tensor, the allocator Triton asks for when a kernel makes
descriptors on the device)."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def mma(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b. fp32 ("ieee"): each step's product is summed on its own and then added, a blocked sum whose
    rounding grows with BLOCK_K plus the number of steps, not with the whole reduction; bf16 / fp16 operands
    accumulate in the MMA. Written as a subtraction of (-a) b: Triton folds acc + dot(a, b) back into dot(a, b, acc)."""
    if PRECISION == "ieee":
        return acc - tl.dot(-a, b, input_precision=PRECISION)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def pointer_k_loop(a_base, b_base, rows, cols, row_end, N, K, stride_am, stride_ak, stride_bk, stride_bn, acc,
                   BLOCK_K: tl.constexpr, STAGES: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a[rows, :] @ b[:, cols] by masked pointer loads, BLOCK_K at a time (where TMA cannot be used): a's
    element (i, k) at a_base + i * stride_am + k * stride_ak, b's (k, j) at b_base + k * stride_bk + j * stride_bn;
    rows from row_end on and columns from N on read zeros. UPCAST: 16-bit tiles to fp32 first (the interpreter)."""
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_base + rows.to(tl.int64)[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_base + ks[:, None] * stride_bk + cols.to(tl.int64)[None, :] * stride_bn
    for kb in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=STAGES):
        k_ok = kb * BLOCK_K + ks < K
        a = tl.load(a_ptrs, mask=(rows < row_end)[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & (cols < N)[None, :], other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = mma(a, b, acc, PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


def interpreting() -> bool:
    """True under Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def device_index(device: torch.device) -> int:
    """The CUDA device index of ``device`` (the current device for a bare 'cuda')."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def hopper_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def _scratch(size: int, alignment: int, stream):
    """Global scratch for device-side tensor descriptors (Triton asks for it at launch)."""
    device = "cpu" if interpreting() or not torch.cuda.is_available() else torch.cuda.current_device()
    return torch.empty(size, dtype=torch.int8, device=device)


def ensure_allocator() -> None:
    """Device-side descriptors need a Triton allocator; set one unless the application has its own."""
    try:
        from triton.runtime import _allocation

        if not isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            return
    except (ImportError, AttributeError):
        pass
    triton.set_allocator(_scratch)


def tma_usable(device: torch.device, tma: bool | None, op: str) -> bool:
    """Tensor descriptors asked for (``tma`` True / False) or by default: on Hopper or newer GPUs. ``op`` names the
    caller in the error for tma=True on an older GPU."""
    if tma is not None:
        if tma and device.type == "cuda" and not hopper_or_newer(device_index(device)):
            raise ValueError(f"{op}: tma=True needs a Hopper or newer GPU (sm_90+)")
        return tma
    return device.type == "cuda" and hopper_or_newer(device_index(device))


def tma_strides_ok(t: torch.Tensor, unit_dim: int) -> bool:
    """TMA can address ``t``: unit stride along ``unit_dim``, 16-byte aligned base and other strides."""
    size = t.element_size()
    if t.stride(unit_dim) != 1 or t.data_ptr() % 16:
        return False
    return all((s * size) % 16 == 0 for d, s in enumerate(t.stride()) if d != unit_dim)
