"""FP8 scaling: recipes, scaling state and the casts that turn high-precision tensors into scaled FP8.

Formats (OCP FP8): E4M3 (``torch.float8_e4m3fn``, largest finite 448: more precision, for weights and activations)
and E5M2 (``torch.float8_e5m2``, largest finite 57344: more range, for gradients). ``HYBRID`` uses E4M3 in the
forward and E5M2 for gradients, as TransformerEngine's default; ``E4M3`` uses E4M3 everywhere.

A cast computes ``x_fp8 = sat(x * scale)`` (fp32 math, round to nearest even, finite values clamped to the format's
largest, NaN kept) and returns ``scale_inv = 1 / scale``, the factor that dequantizes: ``x ~ x_fp8 * scale_inv``
(what the FP8 GEMMs take). Scales come from an amax, the largest |x| of a group:

- per tensor, delayed (``DelayedScaling``): the scale comes from the history of earlier steps' amaxes, so one pass
  reads x, casts it, and records this step's amax for the next (``quantize(x, scale=..., amax_out=...)``);
- per tensor, current (``CurrentScaling``): this tensor's own amax, then the cast (two passes over x);
- per row, or per 1 x 128 / 128 x 128 block (``BlockScaling``, DeepSeek-V3 style), fp32 scales.

scale = fmax / amax / 2^margin. An amax of 0 keeps the previous scale (delayed) or gives 1; a non-finite amax (an inf
or NaN in x: the kernels map NaN to inf) is never turned into a scale: the delayed state keeps its scale and counts
the event, and per-group casts return an inf scale_inv for that group, so ``Quantized.nonfinite()`` (a device bool,
no sync) tells the trainer to skip the step.

Backends: ``torch`` (the reference, ``quantize_ref``) and ``triton`` (megakern/_fp8_triton.py). ``gemm`` multiplies
two ``Quantized`` operands through torch._scaled_mm (cuBLASLt; per-tensor or per-row scales) or the reference.
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn

from megakern import _backend

FP8_DTYPES = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Format(str, enum.Enum):
    """Which FP8 format each role uses."""
    E4M3 = "E4M3"  # everywhere
    HYBRID = "HYBRID"  # E4M3 forward (activations, weights), E5M2 gradients

    def dtype(self, role: str) -> torch.dtype:
        """The FP8 dtype of ``role``: 'x' (activations), 'w' (weights) or 'grad'."""
        if role not in ("x", "w", "grad"):
            raise ValueError(f"fp8: role must be 'x', 'w' or 'grad', got {role!r}")
        return torch.float8_e5m2 if self is Format.HYBRID and role == "grad" else torch.float8_e4m3fn


def _int_at_least(value, low: int, power_of_2: bool = False) -> bool:
    """``value`` is an int (not a bool) >= low (and a power of 2)."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    return ok and (not power_of_2 or value & (value - 1) == 0)


def _check_format(fmt) -> Format:
    try:
        return Format(fmt)
    except ValueError:
        raise ValueError(f"fp8: unknown format {fmt!r}; choose one of {', '.join(f.value for f in Format)}") from None


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Per-tensor scales from the amax history of earlier steps (TransformerEngine's default recipe).

    Defaults and why: HYBRID, since gradients need E5M2's range; a 1024-step history with ``amax_compute="max"``,
    so that one quiet step does not raise the scale into overflow on the next spike; margin 0, since saturation
    already bounds an overshoot. ``amax_compute="most_recent"`` follows the data faster and overflows more often.
    """
    fp8_format: Format = Format.HYBRID
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute: str = "max"

    def __post_init__(self):
        object.__setattr__(self, "fp8_format", _check_format(self.fp8_format))
        if not _int_at_least(self.margin, 0):
            raise ValueError(f"DelayedScaling: margin must be an int >= 0, got {self.margin!r}")
        if not _int_at_least(self.amax_history_len, 1):
            raise ValueError(f"DelayedScaling: amax_history_len must be an int >= 1, got {self.amax_history_len!r}")
        if self.amax_compute not in ("max", "most_recent"):
            raise ValueError(f"DelayedScaling: amax_compute must be 'max' or 'most_recent', got {self.amax_compute!r}")


@dataclasses.dataclass(frozen=True)
class CurrentScaling:
    """Per-tensor scales from the tensor's own amax (two passes over it; no state)."""
    fp8_format: Format = Format.HYBRID
    margin: int = 0

    def __post_init__(self):
        object.__setattr__(self, "fp8_format", _check_format(self.fp8_format))
        if not _int_at_least(self.margin, 0):
            raise ValueError(f"CurrentScaling: margin must be an int >= 0, got {self.margin!r}")


@dataclasses.dataclass(frozen=True)
class BlockScaling:
    """DeepSeek-V3 block scales: activations and gradients per 1 x ``block`` (a row's run of ``block`` features),
    weights per ``block`` x ``block`` tile; fp32 scales; E4M3 everywhere by default (the fine grain leaves little
    for E5M2's range to do)."""
    block: int = 128
    fp8_format: Format = Format.E4M3

    def __post_init__(self):
        object.__setattr__(self, "fp8_format", _check_format(self.fp8_format))
        if not _int_at_least(self.block, 32, power_of_2=True):  # an FP8 tensor-core product takes K >= 32
            raise ValueError(f"BlockScaling: block must be a power of 2 >= 32 (the K step of the block-scaled GEMM), "
                             f"got {self.block!r}")


def scale_from_amax(amax: torch.Tensor, fmax: float, margin: int = 0,
                    previous: torch.Tensor | None = None) -> torch.Tensor:
    """fmax / amax / 2^margin, elementwise; where amax is 0 or not finite, ``previous`` (default 1). On the device,
    no sync."""
    amax = amax.float()
    fallback = previous.float() if previous is not None else torch.ones_like(amax)
    ok = torch.isfinite(amax) & (amax > 0)
    fmax_t = torch.full_like(amax, fmax)  # a true division (``number / tensor`` goes through a reciprocal on GPUs)
    return torch.where(ok, (fmax_t / torch.where(ok, amax, 1.0)) / (2.0 ** margin), fallback)


class DelayedScalingState(nn.Module):
    """The amax history and scale of one tensor role under ``DelayedScaling``; buffers, so they go into checkpoints
    with the module that owns them.

    Per step: cast with ``scale`` (``quantize(x, scale=state.scale, amax_out=...)``), then ``update(amax)``: the amax
    enters the history and the next scale is computed from it. A non-finite amax is not entered: the history and
    scale stay, ``nonfinite_steps`` counts it, and ``update`` returns the device flag.
    """

    def __init__(self, recipe: DelayedScaling, fp8_dtype: torch.dtype, device=None):
        super().__init__()
        if not isinstance(recipe, DelayedScaling):
            raise TypeError(f"DelayedScalingState: recipe must be a DelayedScaling, got {type(recipe).__name__}")
        if fp8_dtype not in FP8_DTYPES:
            raise TypeError(f"DelayedScalingState: fp8_dtype must be float8_e4m3fn or float8_e5m2, got {fp8_dtype}")
        self.recipe, self.fp8_dtype, self.fmax = recipe, fp8_dtype, FP8_DTYPES[fp8_dtype]
        self.register_buffer("amax_history", torch.zeros(recipe.amax_history_len, device=device))
        self.register_buffer("scale", torch.ones(1, device=device))
        self.register_buffer("nonfinite_steps", torch.zeros((), dtype=torch.int64, device=device))

    @property
    def scale_inv(self) -> torch.Tensor:
        return 1.0 / self.scale

    @torch.no_grad()
    def update(self, amax: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
        """Enter this step's amax (a scalar tensor) and compute the next scale; returns a device bool: True if the
        amax was not finite (then nothing changed but the count). ``skip`` (a device bool): leave the history and
        scale as they are (the step is being discarded for another tensor's non-finite amax)."""
        amax = amax.reshape(()).float()
        bad = ~torch.isfinite(amax)
        hold = bad if skip is None else bad | skip.reshape(())
        rolled = torch.roll(self.amax_history, 1)
        rolled[0] = amax
        self.amax_history.copy_(torch.where(hold, self.amax_history, rolled))
        ref = self.amax_history.max() if self.recipe.amax_compute == "max" else self.amax_history[0]
        self.scale.copy_(torch.where(hold, self.scale,
                                     scale_from_amax(ref.reshape(1), self.fmax, self.recipe.margin, self.scale)))
        self.nonfinite_steps.add_(bad.to(torch.int64))
        return bad

    def extra_repr(self) -> str:
        return f"{self.recipe}, {self.fp8_dtype}"


class Quantized(NamedTuple):
    """An FP8 tensor and what dequantizes it: ``data`` (x's shape), ``scale_inv`` (per tensor: (1,); per row:
    (rows, 1); 1 x B blocks: (rows, ceil(N / B)); B x B tiles: (ceil(rows / B), ceil(N / B)), rows = numel / N),
    ``data_t`` (the (N, rows) transposed copy, when asked for), ``amax`` (per-tensor casts: x's amax), and the
    ``granularity`` and ``block`` the scales were made with."""
    data: torch.Tensor
    scale_inv: torch.Tensor
    data_t: torch.Tensor | None = None
    amax: torch.Tensor | None = None
    granularity: str = "tensor"
    block: int = 0

    def nonfinite(self) -> torch.Tensor:
        """Device bool: the input held an inf or NaN (its amax, or a group's scale, is not finite)."""
        if self.amax is not None:
            return ~torch.isfinite(self.amax).all()
        return ~torch.isfinite(self.scale_inv).all()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """data * scale_inv broadcast over its groups, in ``dtype``."""
        x = self.data.float()
        s = self.scale_inv
        x2 = x.reshape(-1, x.shape[-1])
        rows, n = x2.shape
        if self.granularity in ("tensor", "row"):
            out = x2 * (s.reshape(()) if self.granularity == "tensor" else s)
        elif self.granularity == "block":
            out = x2 * s.repeat_interleave(self.block, dim=1)[:, :n]
        else:
            out = x2 * s.repeat_interleave(self.block, dim=0)[:rows].repeat_interleave(self.block, dim=1)[:, :n]
        return out.reshape(x.shape).to(dtype)


# ---- the reference ---------------------------------------------------------------------------------------------
def _saturating_cast(y: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    fmax = FP8_DTYPES[fp8_dtype]
    return torch.where(torch.isnan(y), y, y.clamp(-fmax, fmax)).to(fp8_dtype)


def _abs_nan_inf(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(x), torch.full_like(x, float("inf")), x.abs())


def quantize_ref(x: torch.Tensor, fp8_dtype: torch.dtype, *, scale: torch.Tensor | None = None,
                 granularity: str = "tensor", block: int = 128, margin: int = 0,
                 transpose: bool = False) -> Quantized:
    """The torch reference of ``quantize``, in fp32."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    rows, n = x2.shape
    fmax = FP8_DTYPES[fp8_dtype]
    if granularity == "tensor":
        amax = _abs_nan_inf(x2).amax().reshape(1) if x2.numel() else torch.zeros(1, device=x.device)
        s = scale.float().reshape(1) if scale is not None else scale_from_amax(amax, fmax, margin)
        y = _saturating_cast(x2 * s, fp8_dtype)
        return Quantized(y.reshape(x.shape), 1.0 / s, y.t().contiguous() if transpose else None, amax)
    if granularity == "row":
        groups = x2.reshape(rows, 1, n)
    elif granularity == "block":
        pad = -n % block
        groups = torch.nn.functional.pad(x2, (0, pad)).reshape(rows, -1, block)
    elif granularity == "tile":
        pr, pc = -rows % block, -n % block
        t = torch.nn.functional.pad(x2, (0, pc, 0, pr))
        groups = t.reshape(t.shape[0] // block, block, t.shape[1] // block, block).permute(0, 2, 1, 3)
        groups = groups.reshape(groups.shape[0], groups.shape[1], block * block)
    else:
        raise ValueError(f"fp8: granularity must be 'tensor', 'row', 'block' or 'tile', got {granularity!r}")
    amax = _abs_nan_inf(groups).amax(-1) if groups.shape[-1] else torch.zeros(groups.shape[:2], device=x.device)
    # true divisions of tensors, correctly rounded on every device (torch computes ``number / tensor`` and
    # ``tensor / number`` through a reciprocal on GPUs: one more rounding, other bits than the kernels' division)
    fmax_t = torch.full_like(amax, fmax)
    s = torch.where(amax > 0, fmax_t / torch.where(amax > 0, amax, 1.0), torch.ones_like(amax))
    scale_inv = amax / fmax_t
    if granularity == "row":
        y = x2 * s
    elif granularity == "block":
        y = (groups * s[..., None]).reshape(rows, -1)[:, :n]
    else:
        b = block
        y = (groups * s[..., None]).reshape(groups.shape[0], groups.shape[1], b, b).permute(0, 2, 1, 3)
        y = y.reshape(groups.shape[0] * b, groups.shape[1] * b)[:rows, :n]
    return Quantized(_saturating_cast(y, fp8_dtype).reshape(x.shape), scale_inv, granularity=granularity,
                     block=block if granularity in ("block", "tile") else 0)


# ---- the public cast ---------------------------------------------------------------------------------------------
def check_inputs(x, fp8_dtype, scale, granularity, block, amax_out, transpose) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"fp8.quantize: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"fp8.quantize: x has dtype {x.dtype}; supported: float32, float16, bfloat16")
    if x.dim() < 1:
        raise ValueError("fp8.quantize: x must have at least one dimension (its last is the feature dimension)")
    if fp8_dtype not in FP8_DTYPES:
        raise TypeError(f"fp8.quantize: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")
    if granularity not in ("tensor", "row", "block", "tile"):
        raise ValueError(f"fp8.quantize: granularity must be 'tensor', 'row', 'block' or 'tile', got {granularity!r}")
    if granularity in ("block", "tile") and not _int_at_least(block, 16, power_of_2=True):
        raise ValueError(f"fp8.quantize: block must be a power of 2 >= 16, got {block!r}")
    if scale is not None:
        if granularity != "tensor":
            raise ValueError(f"fp8.quantize: a given scale is per tensor; granularity {granularity!r} computes its own")
        if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32:
            raise TypeError("fp8.quantize: scale must be a one-element float32 tensor")
        if scale.device != x.device:
            raise ValueError(f"fp8.quantize: scale is on {scale.device} but x is on {x.device}")
    if amax_out is not None:
        if scale is None:
            raise ValueError("fp8.quantize: amax_out records x's amax in the cast's pass (delayed scaling): give the "
                             "scale too")
        if not isinstance(amax_out, torch.Tensor) or amax_out.numel() != 1 or amax_out.dtype != torch.float32 \
                or amax_out.device != x.device:
            raise TypeError("fp8.quantize: amax_out must be a one-element float32 tensor on x's device")
    if transpose and granularity != "tensor":
        raise ValueError("fp8.quantize: transpose=True is for per-tensor scaling (the weight-gradient operand)")


def quantize(x: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn, *, scale: torch.Tensor | None = None,
             amax_out: torch.Tensor | None = None, granularity: str = "tensor", block: int = 128, margin: int = 0,
             transpose: bool = False, backend: str | Mapping[str, str] | None = None) -> Quantized:
    """Cast ``x`` (..., N) to ``fp8_dtype`` with scales of ``granularity``: 'tensor' (with ``scale`` given: delayed
    scaling, one pass, ``amax_out`` receiving x's amax by a max into it; without: current scaling, x's own amax,
    two passes), 'row', 'block' (1 x ``block`` runs of each row) or 'tile' (``block`` x ``block`` tiles of the
    (numel / N, N) matrix). ``transpose``: also the (N, numel / N) copy (per tensor only). No autograd."""
    check_inputs(x, fp8_dtype, scale, granularity, block, amax_out, transpose)
    name = _backend.resolve("fp8_cast", x.device, backend)
    if name == "torch":
        q = quantize_ref(x, fp8_dtype, scale=scale, granularity=granularity, block=block, margin=margin,
                         transpose=transpose)
        _record_amax(amax_out, q.amax)
        return q
    from megakern import _fp8_triton as kern

    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    fmax = FP8_DTYPES[fp8_dtype]
    if name == "cuda" and (granularity != "tensor" or transpose):
        raise ValueError("fp8.quantize: backend 'cuda' casts per tensor without the transposed copy; use "
                         "backend='triton' for that")
    if granularity == "tensor":
        amax = torch.zeros(1, dtype=torch.float32, device=x.device)
        if scale is None:  # current scaling: this tensor's amax first; the cast makes the scale from it
            kern.amax(x2, amax)
        if name == "cuda":  # the CUDA C++ cast (csrc/fp8/fp8.cu, megakern._C or NVRTC); current scaling's amax from Triton
            from megakern import _fp8_cuda

            s = scale_from_amax(amax, fmax, margin) if scale is None else scale.reshape(1)
            y, yt, scale_inv = _fp8_cuda.cast(x2, s, fp8_dtype, amax if scale is not None else None), None, 1.0 / s
            _record_amax(amax_out, amax)
        elif x2.numel():  # one Triton launch: the cast, the scale's inverse, and (delayed) the amaxes
            y, yt, scale_inv = kern.cast(x2, scale, fp8_dtype, fmax, transpose=transpose, amax=amax,
                                         amax_out=amax_out, margin=margin)
        else:  # nothing to cast: empty FP8 tensors, the scale's inverse still (the amaxes stay)
            m, n = x2.shape
            y = torch.empty((m, n), dtype=fp8_dtype, device=x.device)
            yt = torch.empty((n, m), dtype=fp8_dtype, device=x.device) if transpose else None
            scale_inv = 1.0 / (scale.reshape(1) if scale is not None else scale_from_amax(amax, fmax, margin))
        return Quantized(y.reshape(x.shape), scale_inv.float(), yt, amax)
    if granularity == "tile":
        y, scale_inv = kern.cast_tiles(x2, fp8_dtype, fmax, block)
    else:
        y, scale_inv = kern.cast_rows(x2, fp8_dtype, fmax, block if granularity == "block" else None)
    return Quantized(y.reshape(x.shape), scale_inv, granularity=granularity,
                     block=block if granularity in ("block", "tile") else 0)


def _record_amax(amax_out: torch.Tensor | None, amax: torch.Tensor) -> None:
    """amax_out = max(amax_out, amax), on the device (the max over the micro-batches of a step)."""
    if amax_out is not None:
        amax_out.copy_(torch.maximum(amax_out.reshape(1), amax).reshape(amax_out.shape))


# ---- GEMM ----------------------------------------------------------------------------------------------------------
GEMM_BACKENDS = ("torch", "scaled_mm", "triton")


def _gemm_backend(a: Quantized, backend: str | None) -> str:
    device = a.data.device
    if backend is not None:
        if backend not in GEMM_BACKENDS:
            raise ValueError(f"fp8.gemm: unknown backend {backend!r}; choose one of {', '.join(GEMM_BACKENDS)}")
        problem = {"scaled_mm": scaled_mm_problem(device), "triton": _backend.triton_problem(device),
                   "torch": ""}[backend]
        if problem:
            raise RuntimeError(f"fp8.gemm: backend {backend!r} is not available: {problem}")
        return backend
    if scaled_mm_problem(device):
        return "torch"
    return "scaled_mm" if a.granularity in ("tensor", "row") else "triton"


def scaled_mm_problem(device: torch.device) -> str:
    """'' if torch._scaled_mm (cuBLASLt FP8) runs on ``device``, else why not."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"FP8 GEMMs need a CUDA device with compute capability >= 8.9, got a {device.type} tensor"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"FP8 GEMMs need compute capability >= 8.9 (Ada, Hopper or newer); this GPU has {major}.{minor}"
    return ""


def gemm(a: Quantized, b: Quantized, *, out_dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None,
         backend: str | None = None) -> torch.Tensor:
    """out (M, N) = (a.data * a's scales) @ (b.data * b's scales)^T (+ bias), for a (M, K) and b (N, K), both
    K-contiguous (x and a Linear's weight as they are). Scales: both per tensor, both per row (a's rows and b's
    rows), or a per 1 x B block and b per B x B tile (DeepSeek-V3) or per 1 x B block too (the weight-gradient
    GEMM of block scaling). Backends: 'scaled_mm' (torch._scaled_mm,
    cuBLASLt: per tensor or per row; the default for those on GPUs of compute capability >= 8.9), 'triton'
    (megakern/_fp8_gemm_triton.py: every scaling; the default for block scales) and 'torch' (dequantize, fp32 matmul:
    the reference, runs anywhere; the default where FP8 GEMMs cannot run)."""
    for name, q in (("a", a), ("b", b)):
        if not isinstance(q, Quantized):
            raise TypeError(f"fp8.gemm: {name} must be a Quantized (from fp8.quantize), got {type(q).__name__}")
        if q.data.dim() != 2:
            raise ValueError(f"fp8.gemm: {name} must be 2-D (rows, K), got shape {tuple(q.data.shape)}")
    (m, k), (n, kb) = a.data.shape, b.data.shape
    if k != kb:
        raise ValueError(f"fp8.gemm: a is (M, K) = ({m}, {k}) and b is (N, K) = ({n}, {kb}): K differs")
    if a.data.dtype == b.data.dtype == torch.float8_e5m2:
        raise TypeError("fp8.gemm: both operands are E5M2; FP8 GEMMs take at most one E5M2 operand (the gradient)")
    if a.data.device != b.data.device:
        raise ValueError(f"fp8.gemm: a is on {a.data.device} but b is on {b.data.device}")
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"fp8.gemm: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    if bias is not None and (bias.shape != (n,) or bias.device != a.data.device):
        raise ValueError(f"fp8.gemm: bias must be ({n},) on {a.data.device}, got {tuple(bias.shape)} on {bias.device}")
    name = _gemm_backend(a, backend)
    if name == "torch":
        out = a.dequantize() @ b.dequantize().t()
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype)
    if name == "triton":
        from megakern import _fp8_gemm_triton as kern

        pairs = {("tensor", "tensor"): kern.TENSOR, ("row", "row"): kern.ROW, ("block", "tile"): kern.BLOCK,
                 ("block", "block"): kern.BLOCK_ROWS}
        scaling = pairs.get((a.granularity, b.granularity))
        if scaling is None or (scaling in (kern.BLOCK, kern.BLOCK_ROWS) and a.block != b.block):
            raise ValueError(f"fp8.gemm: the operands' scales must be both per tensor, both per row, or a per 1 x B "
                             f"block and b per 1 x B block or B x B tile (the same B); got {a.granularity!r} "
                             f"({a.block}) and {b.granularity!r} ({b.block})")
        if scaling in (kern.BLOCK, kern.BLOCK_ROWS) and a.block < 32:
            raise ValueError(f"fp8.gemm: block scales need B >= 32 (the GEMM's K step is B, and an FP8 tensor-core "
                             f"product takes K >= 32); got B = {a.block}")
        return kern.gemm(a.data, b.data, a.scale_inv.float(), b.scale_inv.float(), scaling, out_dtype, bias,
                         block=a.block or 128)
    if a.granularity != b.granularity or a.granularity not in ("tensor", "row"):
        raise ValueError(f"fp8.gemm: backend 'scaled_mm' takes both operands per tensor or both per row, got "
                         f"{a.granularity!r} and {b.granularity!r}")
    if k % 16 or n % 16:
        raise ValueError(f"fp8.gemm: cuBLASLt's FP8 GEMM needs K and N multiples of 16, got K={k}, N={n}; pad the "
                         "features (megakern does not pad silently) or use backend='torch'")
    if a.granularity == "row" and out_dtype != torch.bfloat16:
        raise TypeError("fp8.gemm: row-wise scales in torch._scaled_mm give bfloat16 output only")
    data_a = a.data if a.data.is_contiguous() else a.data.contiguous()
    data_b = b.data if b.data.is_contiguous() else b.data.contiguous()
    scale_a = a.scale_inv.float().reshape(()) if a.granularity == "tensor" else a.scale_inv.float().reshape(m, 1)
    scale_b = b.scale_inv.float().reshape(()) if b.granularity == "tensor" else b.scale_inv.float().reshape(1, n)
    return torch._scaled_mm(data_a, data_b.t(), scale_a, scale_b, bias=bias, out_dtype=out_dtype)


# ---- FP8 Linear ----------------------------------------------------------------------------------------------------
class _Scaling:
    """How one role (x, w or grad) of a Linear is cast: delayed (from its state, recording the amax), current,
    or block; and which dtype."""

    def __init__(self, linear: "Linear", role: str):
        self.linear, self.role = linear, role
        self.dtype = linear.recipe.fp8_format.dtype(role)

    def cast(self, t: torch.Tensor, transpose: bool) -> Quantized:
        recipe, lin = self.linear.recipe, self.linear
        backend = "torch" if lin._emulated(t) else None
        if isinstance(recipe, DelayedScaling):
            state = lin.scaling_state(self.role)
            return quantize(t, self.dtype, scale=state.scale, amax_out=lin._pending_amax(self.role),
                            transpose=transpose, backend=backend)
        if isinstance(recipe, CurrentScaling):
            return quantize(t, self.dtype, margin=recipe.margin, transpose=transpose, backend=backend)
        granularity = "tile" if self.role == "w" else "block"
        return quantize(t, self.dtype, granularity=granularity, block=recipe.block, backend=backend)


def _transposed(q: Quantized, t: torch.Tensor, scaling: _Scaling) -> Quantized:
    """The operand of ``t``'s transpose: the per-tensor cast's transposed copy, or (per-group scales, whose groups
    run along the other dimension there) a fresh cast of t^T."""
    if q.data_t is not None:
        return Quantized(q.data_t, q.scale_inv, granularity=q.granularity)
    return scaling.cast(t.t(), transpose=False)


class _FP8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias, linear):
        per_tensor = not isinstance(linear.recipe, BlockScaling)
        qx = linear._x.cast(x2, transpose=per_tensor and weight.requires_grad)
        qw = linear._weight_fp8(weight, transpose=per_tensor and x2.requires_grad)
        device_type = x2.device.type
        out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x2.dtype
        out = gemm(qx, qw, out_dtype=out_dtype, bias=None, backend=linear._gemm_backend(x2, qx))
        if bias is not None:
            out = out + bias.to(out.dtype)
        ctx.linear, ctx.has_bias = linear, bias is not None
        ctx.save_for_backward(x2, weight)
        ctx.q = (qx, qw)
        ctx.out_dtype = out_dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        x2, weight = ctx.saved_tensors
        qx, qw = ctx.q
        linear = ctx.linear
        grad = grad.contiguous()
        per_tensor = not isinstance(linear.recipe, BlockScaling)
        qg = linear._g.cast(grad, transpose=per_tensor and ctx.needs_input_grad[1])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:  # dx = grad @ w: (M, N) x (N, K), as grad (M, N) . (w^T) (K, N)^T
            qwt = _transposed(qw, weight, linear._w)
            dx = gemm(qg, qwt, out_dtype=ctx.out_dtype, backend=linear._gemm_backend(grad, qg)).to(x2.dtype)
        if ctx.needs_input_grad[1]:  # dW = grad^T @ x: (N, M) x (M, K), as grad^T (N, M) . (x^T) (K, M)^T
            qgt = _transposed(qg, grad, linear._g)
            qxt = _transposed(qx, x2, linear._x)
            dw = gemm(qgt, qxt, out_dtype=torch.float32, backend=linear._gemm_backend(grad, qgt)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = grad.float().sum(0).to(weight.dtype)
        ctx.q = None
        return dx, dw, db, None


@torch.compiler.disable
def _fp8_linear(x2, weight, bias, linear):
    """The FP8 product, run eagerly under torch.compile (a graph break): its casts record amaxes into the module's
    buffers and reuse the weight's FP8 copy across calls, state that a traced graph would not carry."""
    return _FP8LinearFunction.apply(x2, weight, bias, linear)


class Linear(nn.Module):
    """y = x W^T + b with the GEMMs in FP8: x and W in E4M3, the incoming gradient in E5M2 (HYBRID) or E4M3, scaled
    by ``recipe`` (``DelayedScaling`` by default). Master weights stay in the parameter's dtype.

    Delayed scaling: each cast records its tensor's amax in a pending buffer (a max over the micro-batches of the
    step); call ``update_scales(model)`` once per optimizer step to move them into the histories and compute the
    next scales. The weight's FP8 copy is made once and reused until the weight changes (its version counter), so
    the micro-batches of one step share it.

    Where FP8 GEMMs cannot run (CPU, compute capability < 8.9) the layer warns once and computes a plain linear,
    unless ``emulate=True``: then FP8 is emulated (casts by the reference, GEMMs by dequantize and matmul), slowly,
    for tests and for checking a recipe's numerics anywhere.

    Under torch.autocast the output takes the autocast dtype (the FP8 inputs are cast from whatever x is). Under
    torch.compile the FP8 product runs eagerly between traced graphs (a graph break per layer).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, recipe=None,
                 emulate: bool = False, device=None, dtype=None):
        super().__init__()
        recipe = recipe if recipe is not None else DelayedScaling()
        if not isinstance(recipe, (DelayedScaling, CurrentScaling, BlockScaling)):
            raise TypeError(f"fp8.Linear: recipe must be DelayedScaling, CurrentScaling or BlockScaling, got "
                            f"{type(recipe).__name__}")
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if not _int_at_least(v, 1):
                raise ValueError(f"fp8.Linear: {name} must be a positive int, got {v!r}")
        self.in_features, self.out_features, self.recipe, self.emulate = in_features, out_features, recipe, emulate
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        nn.Linear.reset_parameters(self)  # torch's init, the same as nn.Linear's
        if isinstance(recipe, DelayedScaling):
            for role in ("x", "w", "grad"):
                self.add_module(f"{role}_scaling", DelayedScalingState(recipe, recipe.fp8_format.dtype(role), device))
                self.register_buffer(f"{role}_amax_pending", torch.zeros(1, device=device), persistent=False)
        self._x, self._w, self._g = _Scaling(self, "x"), _Scaling(self, "w"), _Scaling(self, "grad")
        self._w_cache = None  # (weight version, Quantized)
        self._warned = False

    def scaling_state(self, role: str) -> DelayedScalingState:
        return getattr(self, f"{role}_scaling")

    def _pending_amax(self, role: str) -> torch.Tensor:
        return getattr(self, f"{role}_amax_pending")

    def _emulated(self, t: torch.Tensor) -> bool:
        return bool(scaled_mm_problem(t.device))

    def _gemm_backend(self, t: torch.Tensor, q: Quantized) -> str | None:
        """'torch' when emulating, else gemm's default for q's scales (cuBLASLt, or Triton for block scales)."""
        return "torch" if self._emulated(t) else None

    def _weight_fp8(self, weight: torch.Tensor, transpose: bool) -> Quantized:
        key = (weight._version, weight.data_ptr(), transpose)
        if self._w_cache is None or self._w_cache[0] != key:
            self._w_cache = (key, self._w.cast(weight.detach(), transpose=transpose))
        return self._w_cache[1]

    def pending_nonfinite(self) -> torch.Tensor:
        """Device bool: a pending amax of this step is not finite."""
        if not isinstance(self.recipe, DelayedScaling):
            return torch.zeros((), dtype=torch.bool, device=self.weight.device)
        pending = torch.cat([self._pending_amax(role) for role in ("x", "w", "grad")])
        return ~torch.isfinite(pending).all()

    @torch.no_grad()
    def update_scales(self, skip: torch.Tensor | None = None) -> torch.Tensor:
        """Delayed scaling: enter the pending amaxes into the histories, compute the next scales, reset the pending
        ones; returns a device bool (True: an amax was not finite, the step should be skipped, and no history or
        scale of this layer changed). ``skip``: discard this step's amaxes (another layer's was not finite).
        Other recipes: False."""
        bad = self.pending_nonfinite()
        if isinstance(self.recipe, DelayedScaling):
            hold = bad if skip is None else bad | skip
            for role in ("x", "w", "grad"):
                pending = self._pending_amax(role)
                self.scaling_state(role).update(pending, skip=hold)
                pending.zero_()
        # the weight's scale may have changed, and the weight itself (an FSDP2 all-gather rewrites it without
        # bumping its version): the next step casts it afresh
        self._w_cache = None
        return bad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"fp8.Linear: x has {x.shape[-1]} features, the layer takes {self.in_features}")
        if self._emulated(x) and not self.emulate:
            if not self._warned:
                import warnings

                warnings.warn(f"fp8.Linear: {scaled_mm_problem(x.device)}; computing a plain linear instead (pass "
                              "emulate=True to emulate FP8)", stacklevel=2)
                self._warned = True
            return nn.functional.linear(x, self.weight, self.bias)
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        pad = 0
        if not self._emulated(x):
            if not isinstance(self.recipe, BlockScaling) and (self.in_features % 16 or self.out_features % 16):
                raise ValueError(f"fp8.Linear: per-tensor FP8 GEMMs (cuBLASLt) need in_features and out_features "
                                 f"multiples of 16, got {self.in_features} -> {self.out_features}; pad the layer, "
                                 "or use BlockScaling (the Triton GEMM takes any size)")
            # the weight-gradient GEMM's K is the token count: zero rows make it a multiple of 16, exactly (they
            # add nothing to any product or amax)
            pad = -rows % 16
            if pad:
                x2 = nn.functional.pad(x2, (0, 0, 0, pad))
        out = _fp8_linear(x2, self.weight, self.bias, self)
        if pad:
            out = out[:rows]
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, recipe={self.recipe}")


def update_scales(model: nn.Module) -> torch.Tensor:
    """Call once per optimizer step: ``update_scales`` of every fp8.Linear in ``model``. Returns a device bool,
    True if any amax of the step was not finite: then the trainer skips the step, and no layer's history or scale
    changes (the step's amaxes are discarded everywhere)."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    if not layers:
        return torch.zeros((), dtype=torch.bool)
    bad = torch.stack([m.pending_nonfinite() for m in layers]).any()
    for m in layers:
        m.update_scales(skip=bad)
    return bad


def pending_amaxes(model: nn.Module) -> list[torch.Tensor]:
    """The pending amax buffers (one element each: x, w, grad) of every delayed-scaling fp8.Linear in ``model``, in
    module order: what a parallel run reduces over the ranks sharing a tensor before ``update_scales`` (in place)."""
    return [getattr(m, f"{role}_amax_pending") for m in model.modules()
            if isinstance(m, Linear) and isinstance(m.recipe, DelayedScaling) for role in ("x", "w", "grad")]


@torch.no_grad()
def discard_pending(model: nn.Module) -> None:
    """Forget what the casts of every fp8.Linear in ``model`` recorded since the last ``update_scales`` (the pending
    amaxes, and the weight's cached FP8 copy, so that its next cast records the weight's amax again): for a forward
    that must not count, e.g. a pipeline's shape inference on uninitialized buffers."""
    for m in model.modules():
        if isinstance(m, Linear):
            if isinstance(m.recipe, DelayedScaling):
                for role in ("x", "w", "grad"):
                    getattr(m, f"{role}_amax_pending").zero_()
            m._w_cache = None


def convert_linears(model: nn.Module, *, recipe=None, emulate: bool = False, skip=()) -> nn.Module:
    """Replace every nn.Linear of ``model`` (but those whose qualified names are in ``skip``, e.g. the output
    head) by an fp8.Linear holding the same parameters; returns the model."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear) and name not in skip and not isinstance(child, Linear):
            new = Linear(child.in_features, child.out_features, child.bias is not None, recipe=recipe,
                         emulate=emulate, device=child.weight.device, dtype=child.weight.dtype)
            new.weight, new.bias = child.weight, child.bias
            setattr(model, name, new)
        else:
            convert_linears(child, recipe=recipe, emulate=emulate,
                            skip={s.split(".", 1)[1] for s in skip if s.startswith(name + ".")})
    return model
