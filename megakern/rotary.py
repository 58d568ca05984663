"""Rotary position embeddings (RoPE): q and k rotated pair by pair, by angles proportional to each token's position.

The math. A token at position m; pair i of a head's first ``rotary_dim`` features, 0 <= i < rotary_dim / 2, with
inverse frequency f_i = base^(-2i / rotary_dim) (or its scaled form, below) and angle theta = m * f_i:

    y_a = x_a * cos(theta) - x_b * sin(theta)
    y_b = x_b * cos(theta) + x_a * sin(theta)

GPT-NeoX / Llama layout (``interleaved=False``, "rotate half"): a = i, b = i + rotary_dim / 2.
GPT-J layout (``interleaved=True``): a = 2i, b = 2i + 1.
Partial rotary (GPT-NeoX's rotary_pct): features rotary_dim .. hs pass through unchanged.
Backward: the rotation R(theta) is orthogonal, so dx = R(theta)^T dy = R(-theta) dy, the same kernel with sin
negated. cos and sin are constants (no gradient flows to them).

Shapes (flash-attn's layout, as ``megakern.attention``): q (B, T, nh, hs) and k (B, T, nkv, hs), nkv any number of
heads (grouped-query attention: k is never repeated), any strides; or packed documents q (total, nh, hs), k
(total, nkv, hs) with ``cu_seqlens`` (ndocs + 1,) int32 offsets. k may be None (q alone). cos and sin:
(positions, rotary_dim // 2), one column per rotated pair, row m for position m (``rotary_table`` builds them).

Positions, one of:
- default: token t of each sequence is at t + ``offset``; ``offset`` an int (the KV cache length when generating)
  or a (B,) int tensor, one per sequence;
- ``cu_seqlens``: each packed document restarts at 0 (+ ``offset``, an int or one per document);
- ``position_ids``: explicit, (B, T) or (T,) for q (B, T, ...), (total,) for packed q.
Every position must lie inside the table. The default path with an int offset checks this on the host for free;
tensor positions (position_ids, cu_seqlens, an offset tensor) are checked with one host sync each.

The table: ``rotary_table(length, dim, base, scaling=, dtype=, device=)`` is built once per (length, dim, base,
scaling, dtype, device), in fp64, and cached; ``scaling`` takes the ``rope_scaling`` dict of a Llama-family
checkpoint's config: "linear" (positions / factor), "ntk" (static NTK-aware: base * factor^(dim / (dim - 2))),
"dynamic" (dynamic NTK, the base stretched for the table's length beyond original_max_position_embeddings),
"llama3" (Llama 3.1 frequency bands). ``RotaryEmbedding`` holds the parameters and fetches the cached table per
device, so every layer of a model shares one table.

Dtypes: q, k fp32 / fp16 / bf16 (the same); cos, sin fp32 or q's dtype (the same). All math in fp32; outputs in
q's dtype. ``inplace=True`` writes the rotated values into q and k (views of a fused qkv projection are fine) and
returns them; under autograd, views of one tensor take one launch and the backward copies that tensor's gradient
once (out of place moves fewer bytes in training; in place saves memory, e.g. when generating).

Backends: ``torch`` (``rotary_ref`` under autograd), ``triton`` (megakern/_rotary_triton.py), ``cuda``
(csrc/rotary/rotary.cu through megakern/_rotary_cuda.py); ``rotary_backend`` says which one a call takes.

Checked once, applied many times (a model's layers share one rotation per forward): ``check_inputs`` validates the
positions and table once and returns a ``Rotation``; ``apply_rotation`` rotates under autograd with it, and
``rotate`` runs the kernels alone (no autograd: for a caller's own autograd Function, e.g. models/gpt.py's fused qkv
split).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import nn

from megakern import _backend, _nvtx
from megakern._checks import document_lengths

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_INDEX = 2**31 - 1  # tokens, positions and table rows are 32-bit in the kernels


# ---- the table -------------------------------------------------------------------------------------------------
SCALING_TYPES = ("linear", "ntk", "dynamic", "llama3")
_SCALING_KEYS = {
    "linear": {"factor"},
    "ntk": {"factor"},
    "dynamic": {"factor", "original_max_position_embeddings"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}


def _scaling_key(scaling: Mapping | None) -> tuple:
    """A validated, hashable form of a ``rope_scaling`` dict: ('type', (key, value), ...) or ()."""
    if scaling is None:
        return ()
    if not isinstance(scaling, Mapping):
        raise TypeError(f"rotary: scaling must be a rope_scaling dict or None, got {type(scaling).__name__}")
    spec = dict(scaling)
    kind = spec.pop("rope_type", None) or spec.pop("type", None)
    spec.pop("type", None)
    if kind in (None, "default"):
        if spec:
            raise ValueError(f"rotary: scaling without a type ('rope_type') has parameters {sorted(spec)}")
        return ()
    if kind not in _SCALING_KEYS:
        raise ValueError(f"rotary: unsupported RoPE scaling type {kind!r}; supported: {', '.join(SCALING_TYPES)}")
    wanted = _SCALING_KEYS[kind]
    if unknown := set(spec) - wanted:
        raise ValueError(f"rotary: {kind} scaling takes {sorted(wanted)}; unknown keys {sorted(unknown)}")
    if missing := wanted - set(spec):
        raise ValueError(f"rotary: {kind} scaling needs {sorted(missing)}")
    for key, value in spec.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"rotary: {kind} scaling {key} must be a finite number > 0, got {value!r}")
    if spec["factor"] < 1 and kind in ("ntk", "dynamic", "llama3"):
        raise ValueError(f"rotary: {kind} scaling factor must be >= 1, got {spec['factor']}")
    if kind == "llama3" and not spec["high_freq_factor"] > spec["low_freq_factor"]:
        raise ValueError(f"rotary: llama3 scaling needs high_freq_factor > low_freq_factor, got {spec}")
    return (kind, *sorted((k, float(v)) for k, v in spec.items()))


def rotary_inv_freq(dim: int, base: float = 10000.0, scaling: Mapping | None = None, length: int | None = None,
                    device=None) -> torch.Tensor:
    """The (dim // 2,) inverse frequencies, fp64, after ``scaling`` (a rope_scaling dict); ``length`` is the table
    length, which dynamic NTK scaling depends on."""
    key = _scaling_key(scaling)
    kind, params = (key[0], dict(key[1:])) if key else (None, {})
    if kind == "ntk":
        base = base * params["factor"] ** (dim / (dim - 2))
    elif kind == "dynamic":
        original = params["original_max_position_embeddings"]
        seq = max(length or 0, original)
        base = base * (params["factor"] * seq / original - (params["factor"] - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)
    if kind == "linear":
        inv_freq = inv_freq / params["factor"]
    elif kind == "llama3":
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        original = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths (beyond original / low) slowed by factor, short ones (below original / high) kept,
        # the band between interpolated smoothly
        smooth = ((original / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        inv_freq = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return inv_freq


@functools.lru_cache(maxsize=32)
def _table(length: int, dim: int, base: float, scaling_key: tuple, dtype: torch.dtype, device: torch.device):
    scaling = dict(scaling_key[1:], rope_type=scaling_key[0]) if scaling_key else None
    inv_freq = rotary_inv_freq(dim, base, scaling, length, device=device)
    angles = torch.outer(torch.arange(length, dtype=torch.float64, device=device), inv_freq)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotary_table(length: int, dim: int, base: float = 10000.0, *, scaling: Mapping | None = None,
                 dtype: torch.dtype = torch.float32, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (length, dim // 2): row m holds cos / sin of m * inv_freq for positions 0 .. length - 1.

    Computed in fp64, rounded to ``dtype``, and cached per (length, dim, base, scaling, dtype, device): repeated
    calls return the same tensors, which must not be modified. ``dim`` is the rotary dim (even);
    ``scaling`` a Llama-family ``rope_scaling`` dict (see the module docstring).
    """
    if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= MAX_INDEX:
        raise ValueError(f"rotary_table: length must be an int in 0..{MAX_INDEX}, got {length!r}")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2 or dim % 2:
        raise ValueError(f"rotary_table: dim (the rotary dim) must be an even int >= 2, got {dim!r}")
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not math.isfinite(base) or base <= 1:
        raise ValueError(f"rotary_table: base must be a finite number > 1, got {base!r}")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"rotary_table: dtype {dtype}; supported: float32, float16, bfloat16")
    key = _scaling_key(scaling)
    if key and key[0] in ("ntk", "dynamic") and dim == 2:
        raise ValueError(f"rotary_table: {key[0]} scaling needs dim > 2")
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _table(length, dim, float(base), key, dtype, device)


# ---- positions and the reference -------------------------------------------------------------------------------
def rotary_positions(q: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
                     position_ids: torch.Tensor | None = None, offset: int | torch.Tensor = 0) -> torch.Tensor:
    """The int64 position of every token of q: (B, T) for q (B, T, nh, hs), (total,) for packed q."""
    tokens = q.shape[:-2]
    if position_ids is not None:
        pos = position_ids.to(torch.int64)
        return pos.reshape(tokens) if pos.numel() == math.prod(tokens) else pos.reshape(-1, tokens[-1]).expand(tokens)
    offset_t = offset.to(torch.int64) if isinstance(offset, torch.Tensor) else offset
    if cu_seqlens is not None:
        t = torch.arange(tokens[0], device=q.device)
        doc = torch.searchsorted(cu_seqlens[1:].to(torch.int64), t, right=True)  # empty documents are skipped
        pos = t - cu_seqlens.to(torch.int64)[doc]
        return pos + (offset_t[doc] if isinstance(offset_t, torch.Tensor) else offset_t)
    pos = torch.arange(tokens[-1], device=q.device).expand(tokens)
    if isinstance(offset_t, torch.Tensor):
        offset_t = offset_t.reshape(-1, 1)
    return pos + offset_t


def _rotate_ref(x, cos, sin, rotary_dim: int, interleaved: bool, compute: torch.dtype):
    """x (..., hs) rotated by (cos, sin) (..., rotary_dim // 2) broadcast over heads, computed in ``compute``."""
    xr, rest = x[..., :rotary_dim].to(compute), x[..., rotary_dim:]
    c, s = cos.to(compute), sin.to(compute)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = xr.chunk(2, dim=-1)
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((out.to(x.dtype), rest), dim=-1)


def rotary_ref(q, k, cos, sin, *, interleaved: bool = False, rotary_dim: int | None = None,
               cu_seqlens=None, position_ids=None, offset=0, upcast: bool = True):
    """The torch reference: (q_out, k_out), k_out None without k. ``upcast``: compute in fp32 (fp64 for fp64
    inputs); else in q's dtype, with cos and sin rounded to it first (what plain low-precision torch does)."""
    rotary_dim = 2 * cos.shape[-1] if rotary_dim is None else rotary_dim
    pos = rotary_positions(q, cu_seqlens=cu_seqlens, position_ids=position_ids, offset=offset)
    cos_t, sin_t = cos[pos].unsqueeze(-2), sin[pos].unsqueeze(-2)  # (..., 1, rotary_dim // 2)
    compute = torch.promote_types(q.dtype, torch.float32) if upcast else q.dtype
    if not upcast:
        cos_t, sin_t = cos_t.to(q.dtype), sin_t.to(q.dtype)
    q_out = _rotate_ref(q, cos_t, sin_t, rotary_dim, interleaved, compute)
    k_out = None if k is None else _rotate_ref(k, cos_t, sin_t, rotary_dim, interleaved, compute)
    return q_out, k_out


# ---- checks ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rotation:
    """Everything but q and k that one rotation needs, validated; positions as the kernels take them:
    ``position_ids`` (Bp, T) with Bp 1 or B, ``cu_seqlens`` (ndocs + 1,) int32, ``offsets`` (B,) or (ndocs,)."""
    cos: torch.Tensor
    sin: torch.Tensor
    rotary_dim: int
    interleaved: bool
    offset: int
    offsets: Optional[torch.Tensor]
    position_ids: Optional[torch.Tensor]
    cu_seqlens: Optional[torch.Tensor]


def _check_index_tensor(name: str, t, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"apply_rotary: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"apply_rotary: {name} has dtype {t.dtype}; expected torch.int32 or torch.int64")
    if t.device != device:
        raise ValueError(f"apply_rotary: {name} is on {t.device} but q is on {device}")


def _beyond(what: str, last: int, length: int) -> ValueError:
    return ValueError(f"apply_rotary: positions beyond the table: {what} reaches position {last}, but the cos/sin "
                      f"table holds {length} positions (0..{length - 1}); build a longer table")


def check_inputs(q, k, cos, sin, rotary_dim, interleaved, cu_seqlens, position_ids, offset) -> Rotation:
    """Raise TypeError / ValueError naming the problem; return the validated ``Rotation``."""
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if t is None and name == "k":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"apply_rotary: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"apply_rotary: {name} has dtype {t.dtype}; supported: float32, float16, bfloat16")
    if k is not None and k.dtype != q.dtype:
        raise TypeError(f"apply_rotary: q has dtype {q.dtype} but k has {k.dtype}; they must match")
    if cos.dtype != sin.dtype:
        raise TypeError(f"apply_rotary: cos has dtype {cos.dtype} but sin has {sin.dtype}; they must match")
    if cos.dtype not in (torch.float32, q.dtype):
        raise TypeError(f"apply_rotary: cos/sin have dtype {cos.dtype}; expected float32 or q's dtype ({q.dtype})")
    for name, t in (("k", k), ("cos", cos), ("sin", sin)):
        if t is not None and t.device != q.device:
            raise ValueError(f"apply_rotary: {name} is on {t.device} but q is on {q.device}")
    packed = q.dim() == 3
    if q.dim() not in (3, 4):
        raise ValueError(f"apply_rotary: q must be (batch, seq, heads, head_dim) or packed (total, heads, head_dim), "
                         f"got shape {tuple(q.shape)}")
    if packed and cu_seqlens is None and position_ids is None:
        raise ValueError(f"apply_rotary: q of shape {tuple(q.shape)} is packed (total, heads, head_dim): pass "
                         "cu_seqlens or position_ids (or q[None] for one sequence)")
    if not packed and cu_seqlens is not None:
        raise ValueError(f"apply_rotary: cu_seqlens needs packed q (total, heads, head_dim), got {tuple(q.shape)}")
    hs = q.shape[-1]
    if k is not None:
        if k.dim() != q.dim() or k.shape[:-2] != q.shape[:-2] or k.shape[-1] != hs:
            layout = "(total, heads, head_dim)" if packed else "(batch, seq, heads, head_dim)"
            raise ValueError(f"apply_rotary: k {tuple(k.shape)} must be {layout} with q's tokens and head dim, "
                             f"q is {tuple(q.shape)}")
    if cos.dim() != 2 or sin.shape != cos.shape:
        raise ValueError(f"apply_rotary: cos and sin must both be (positions, rotary_dim // 2), got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if rotary_dim is None:
        rotary_dim = 2 * cos.shape[1]
        if rotary_dim > hs:
            raise ValueError(f"apply_rotary: rotary_dim = 2 * cos.shape[1] = {rotary_dim} is larger than the head dim "
                             f"{hs}; cos/sin hold one column per rotated pair (a duplicated (positions, rotary_dim) "
                             "table, as transformers builds, takes [:, :rotary_dim // 2])")
    else:
        if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
            raise TypeError(f"apply_rotary: rotary_dim must be an int or None, got {type(rotary_dim).__name__}")
        if rotary_dim % 2:
            raise ValueError(f"apply_rotary: rotary_dim {rotary_dim} is odd; features are rotated in pairs")
        if not 0 < rotary_dim <= hs:
            raise ValueError(f"apply_rotary: rotary_dim {rotary_dim} must be in 2..{hs} (the head dim)")
        if cos.shape[1] != rotary_dim // 2:
            raise ValueError(f"apply_rotary: cos/sin have {cos.shape[1]} columns, expected rotary_dim // 2 = "
                             f"{rotary_dim // 2} (one per rotated pair)")
    if rotary_dim == 0:
        raise ValueError("apply_rotary: cos/sin have no columns (rotary_dim 0)")
    if not isinstance(interleaved, bool):
        raise TypeError(f"apply_rotary: interleaved must be a bool, got {interleaved!r}")
    length = cos.shape[0]
    tokens = q.shape[0] if packed else q.shape[1]
    batch = 1 if packed else q.shape[0]
    if batch * tokens > MAX_INDEX:
        raise ValueError(f"apply_rotary: {batch * tokens} tokens; at most {MAX_INDEX} per call")

    offsets = None
    if isinstance(offset, torch.Tensor):
        _check_index_tensor("offset", offset, q.device)
        n = cu_seqlens.numel() - 1 if cu_seqlens is not None and isinstance(cu_seqlens, torch.Tensor) else batch
        if offset.dim() != 1 or offset.shape[0] != n:
            per = "document" if cu_seqlens is not None else "sequence"
            raise ValueError(f"apply_rotary: offset tensor must be ({n},), one per {per}, got {tuple(offset.shape)}")
        offsets, offset = offset, 0
    elif isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= MAX_INDEX:
        raise ValueError(f"apply_rotary: offset must be an int in 0..{MAX_INDEX} or an int tensor, got {offset!r}")
    if position_ids is not None:
        if cu_seqlens is not None:
            raise ValueError("apply_rotary: pass position_ids or cu_seqlens, not both (position_ids are absolute)")
        if offsets is not None or offset:
            raise ValueError("apply_rotary: position_ids are absolute positions; offset must be 0 with them")
        _check_index_tensor("position_ids", position_ids, q.device)
        allowed = [(tokens,)] if packed else [(tokens,), (1, tokens), (batch, tokens)]
        if tuple(position_ids.shape) not in allowed:
            raise ValueError(f"apply_rotary: position_ids has shape {tuple(position_ids.shape)}; expected one of "
                             f"{', '.join(map(str, allowed))} for q of shape {tuple(q.shape)}")
        if position_ids.numel():
            lo, hi = (int(v) for v in torch.aminmax(position_ids))
            if lo < 0:
                raise ValueError(f"apply_rotary: position_ids has a negative position ({lo})")
            if hi >= length:
                raise _beyond("position_ids", hi, length)
        position_ids = position_ids.reshape(-1, tokens)  # (1 or B, T)
    elif cu_seqlens is not None:
        _check_index_tensor("cu_seqlens", cu_seqlens, q.device)
        lengths = document_lengths("apply_rotary", cu_seqlens, tokens)
        starts = offsets.tolist() if offsets is not None else [offset] * len(lengths)
        if min(starts) < 0:
            raise ValueError(f"apply_rotary: offset has a negative entry ({min(starts)})")
        ends = [s + n - 1 for s, n in zip(starts, lengths) if n]
        if ends and max(ends) >= length:
            doc = max(range(len(lengths)), key=lambda i: starts[i] + lengths[i] if lengths[i] else -1)
            raise _beyond(f"document {doc} (length {lengths[doc]}, offset {starts[doc]})", max(ends), length)
        cu_seqlens = cu_seqlens.contiguous()
    elif tokens:
        if offsets is not None and offsets.numel():
            lo, hi = (int(v) for v in torch.aminmax(offsets))
            if lo < 0:
                raise ValueError(f"apply_rotary: offset has a negative entry ({lo})")
            offset_hi = hi
        else:
            offset_hi = offset
        if offset_hi + tokens - 1 >= length:
            raise _beyond(f"offset {offset_hi} + sequence length {tokens}", offset_hi + tokens - 1, length)
    cos, sin = (t.detach() if t.stride(-1) == 1 else t.detach().contiguous() for t in (cos, sin))
    return Rotation(cos, sin, rotary_dim, interleaved, offset, offsets, position_ids, cu_seqlens)


# ---- the autograd Function -------------------------------------------------------------------------------------
def rotary_outputs(q: torch.Tensor, k: torch.Tensor | None, inplace: bool):
    """What a launcher writes: q and k themselves (in place), else fresh contiguous tensors of their shapes."""
    if inplace:
        return q, k
    return torch.empty_like(q, memory_format=torch.contiguous_format), (
        None if k is None else torch.empty_like(k, memory_format=torch.contiguous_format))


def _triton_impl():
    from megakern import _rotary_triton

    return _rotary_triton.fwd


def _cuda_impl():
    from megakern import _rotary_cuda

    return _rotary_cuda.apply


# backend -> () -> launcher(q, k, q_out, k_out, cos, sin, position_ids, cu_seqlens, offsets, offset, rotary_dim,
# interleaved, conj, inplace) -> (q_out, k_out) on 4-D (B, T, heads, hs) views with unit stride along hs; q_out,
# k_out from rotary_outputs (q and k themselves in place); "torch" runs the reference under autograd instead
_LAUNCHERS = {"triton": _triton_impl, "cuda": _cuda_impl}


def _as_4d(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.dim() == 4 else t.unsqueeze(0)


def _shaped(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``out`` (the launcher's 4-D result) in ``like``'s shape: itself for 4-D inputs, a view for packed ones (a view
    costs host time and, as a Function's output, autograd's view handling)."""
    return out if out.dim() == like.dim() else out.view(like.shape)


def _launch(launcher, q4, k4, rot: Rotation, conj: bool, inplace: bool):
    """Run ``launcher`` on 4-D views; a view whose head dim is strided is copied first (and copied back in place)."""
    qc = q4 if q4.stride(-1) == 1 else q4.contiguous()
    kc = k4 if k4 is None or k4.stride(-1) == 1 else k4.contiguous()
    q_out, k_out = rotary_outputs(qc, kc, inplace)
    q_out, k_out = launcher(qc, kc, q_out, k_out, rot.cos, rot.sin, rot.position_ids, rot.cu_seqlens, rot.offsets,
                            rot.offset, rot.rotary_dim, rot.interleaved, conj, inplace)
    if inplace:
        if qc is not q4:
            q4.copy_(qc)
        if k4 is not None and kc is not k4:
            k4.copy_(kc)
        return q4, k4
    return q_out, k_out


class RotaryFunction(torch.autograd.Function):
    """(q_out, k_out) = (R q, R k) with the kernels of ``launcher``; with ``inplace`` q and k themselves. Backward:
    dq = R^T dq_out, dk = R^T dk_out. Without k, forward returns q_out alone."""

    @staticmethod
    def forward(ctx, q, k, rot: Rotation, inplace: bool, launcher):
        q_out, k_out = _launch(launcher, _as_4d(q), _as_4d(k), rot, False, inplace)
        ctx.rot, ctx.launcher = rot, launcher
        if inplace:
            ctx.mark_dirty(*(t for t in (q, k) if t is not None))
            return (q, k) if k is not None else q
        return (_shaped(q_out, q), _shaped(k_out, k)) if k is not None else _shaped(q_out, q)

    @staticmethod
    def backward(ctx, dq, dk=None):
        dq_in, dk_in = _launch(ctx.launcher, _as_4d(dq), _as_4d(dk), ctx.rot, True, False)
        return _shaped(dq_in, dq), (_shaped(dk_in, dk) if dk is not None else None), None, None, None


class RotaryInBaseFunction(torch.autograd.Function):
    """In place on q and k, views of one tensor ``base`` (a fused qkv projection): one launch, seen by autograd as
    one in-place op on ``base`` (autograd lets a Function that modifies views return only one tensor). Backward:
    a copy of the gradient with the q and k regions rotated back."""

    @staticmethod
    def forward(ctx, base, views: tuple, rot: Rotation, launcher):
        q, k = views
        _launch(launcher, _as_4d(q), _as_4d(k), rot, False, True)
        ctx.mark_dirty(base)
        ctx.rot, ctx.launcher = rot, launcher
        # the gradient's copy takes base's strides, so q's and k's strides and offsets address it the same way
        ctx.base_stride = base.stride()
        ctx.views = [(t.shape, t.stride(), t.storage_offset() - base.storage_offset()) for t in (q, k)]
        return base

    @staticmethod
    def backward(ctx, grad):
        d = torch.empty_strided(grad.shape, ctx.base_stride, dtype=grad.dtype, device=grad.device)
        d.copy_(grad)
        dq, dk = (d.as_strided(shape, stride, d.storage_offset() + rel) for shape, stride, rel in ctx.views)
        _launch(ctx.launcher, _as_4d(dq), _as_4d(dk), ctx.rot, True, True)
        return d, None, None, None


def _bump_version(*tensors) -> None:
    """Tell autograd that kernels wrote into these tensors (as torch's own in-place ops do)."""
    for t in tensors:
        if t is not None and not t.is_inference():
            torch.autograd.graph.increment_version(t)


def _apply(q, k, rot: Rotation, inplace: bool, launcher):
    """The kernels' path, after the checks: ``launcher`` as in ``_LAUNCHERS``."""
    if not (torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad))):
        # no autograd graph to record: straight to the kernel
        q_out, k_out = _launch(launcher, _as_4d(q), _as_4d(k), rot, False, inplace)
        if inplace:
            _bump_version(q, k)
            return q, k
        return _shaped(q_out, q), (_shaped(k_out, k) if k is not None else None)
    if inplace and torch.compiler.is_compiling():
        # traced: rotate out of place, then torch's own copy_ into q and k, which autograd handles on views of a
        # fused tensor too (a custom Function may not return a view it modified in place)
        out = RotaryFunction.apply(q, k, rot, False, launcher)
        q_out, k_out = out if k is not None else (out, None)
        q.copy_(q_out)
        if k is not None:
            k.copy_(k_out)
        return q, k
    if inplace and k is not None and (q._base is not None or k._base is not None):
        base = q._base
        if base is not None and k._base is base:
            # views of one fused tensor: one launch (its view geometry, storage offsets, is opaque to tracing)
            RotaryInBaseFunction.apply(base, (q, k), rot, launcher)
            return q, k
        # views of different tensors: one launch each
        return RotaryFunction.apply(q, None, rot, True, launcher), RotaryFunction.apply(k, None, rot, True, launcher)
    out = RotaryFunction.apply(q, k, rot, inplace, launcher)
    return out if k is not None else (out, None)


def _apply_ref(q, k, rot: Rotation, inplace: bool):
    q_out, k_out = rotary_ref(q, k, rot.cos, rot.sin, interleaved=rot.interleaved, rotary_dim=rot.rotary_dim,
                              cu_seqlens=rot.cu_seqlens, position_ids=rot.position_ids,
                              offset=rot.offsets if rot.offsets is not None else rot.offset)
    if not inplace:
        return q_out, k_out
    q.copy_(q_out)
    if k is not None:
        k.copy_(k_out)
    return q, k


def rotary_backend(q: torch.Tensor, backend: str | Mapping[str, str] | None = None) -> str:
    """The backend ``apply_rotary`` takes for q: 'torch' | 'triton' | 'cuda'. ``backend`` as ``apply_rotary`` takes
    it (a name, or a kernel table {op: backend}); without one, the fastest available on q's device for its head dim
    (the reference on a CPU). Raises ValueError / RuntimeError for an unknown or unavailable backend."""
    return _backend.resolve("rotary", q.device, backend, size=q.shape[-1])


def apply_rotation(q: torch.Tensor, k: torch.Tensor | None, rot: Rotation, backend: str, *,
                   inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``apply_rotary`` after its checks: (q_out, k_out) under autograd, for q and k of the shapes ``rot`` was
    checked with (``check_inputs``) and a backend name (``rotary_backend``)."""
    if backend == "torch":
        return _apply_ref(q, k, rot, inplace)
    return _apply(q, k, rot, inplace, _LAUNCHERS[backend]())


def rotate(q: torch.Tensor, k: torch.Tensor | None, rot: Rotation, backend: str, *, conj: bool = False,
           inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rotation alone: (q_out, k_out) = (R q, R k), or by -theta with ``conj`` (a backward), no autograd and no
    version counter bumped (a caller's autograd Function accounts for them). q, k and ``rot`` as for
    ``apply_rotation``; ``backend`` 'triton' | 'cuda' runs one kernel launch for both, 'torch' the reference.
    ``inplace``: written into q and k (views of one fused tensor are fine), which are returned."""
    if backend == "torch":
        if conj:
            rot = replace(rot, sin=-rot.sin)
        with torch.no_grad():
            return _apply_ref(q, k, rot, inplace)
    q_out, k_out = _launch(_LAUNCHERS[backend](), _as_4d(q), _as_4d(k), rot, conj, inplace)
    if inplace:
        return q, k
    return _shaped(q_out, q), (_shaped(k_out, k) if k is not None else None)


def apply_rotary(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, *,
                 interleaved: bool = False, rotary_dim: int | None = None, cu_seqlens: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, offset: int | torch.Tensor = 0, inplace: bool = False,
                 backend: str | Mapping[str, str] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate q and k (one launch) by the angles of their tokens' positions: returns (q_out, k_out).

    q (B, T, nh, hs) / k (B, T, nkv, hs), or packed (total, heads, hs) with ``cu_seqlens`` or ``position_ids``;
    cos, sin (positions, rotary_dim // 2) from ``rotary_table``. ``interleaved``: GPT-J pairs (2i, 2i + 1), else
    GPT-NeoX halves (i, i + rotary_dim / 2). ``rotary_dim`` (default 2 * cos.shape[1]): features beyond it pass
    through. Positions: t + ``offset`` (an int, or a tensor of one per sequence / document), restarting at each
    document of ``cu_seqlens``, or ``position_ids``. ``inplace``: write into q and k and return them. ``backend``:
    'torch' | 'triton' | 'cuda', or a config's kernel table {op: backend}; None picks the fastest on q's device.
    """
    rot = check_inputs(q, k, cos, sin, rotary_dim, interleaved, cu_seqlens, position_ids, offset)
    if not isinstance(inplace, bool):
        raise TypeError(f"apply_rotary: inplace must be a bool, got {inplace!r}")
    name = rotary_backend(q, backend)
    with _nvtx.annotate(f"megakern.apply_rotary[{name}]"):
        return apply_rotation(q, k, rot, name, inplace=inplace)


class RotaryEmbedding(nn.Module):
    """RoPE with fixed parameters: ``forward(q, k=None, *, cu_seqlens=None, position_ids=None, offset=0,
    inplace=False)`` -> (q_out, k_out).

    ``dim``: the rotary dim (head dim, or head dim * rotary_pct, even); ``max_seqlen``: the table length (positions
    0 .. max_seqlen - 1); ``base`` (rope_theta) and ``scaling`` (a rope_scaling dict) as ``rotary_table``. The
    module holds no tensors: each call fetches the cached table for q's device, so every layer shares one.
    """

    def __init__(self, dim: int, max_seqlen: int, base: float = 10000.0, *, scaling: Mapping | None = None,
                 interleaved: bool = False, table_dtype: torch.dtype = torch.float32,
                 backend: str | Mapping[str, str] | None = None):
        super().__init__()
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or not 0 < max_seqlen <= MAX_INDEX:
            raise ValueError(f"RotaryEmbedding: max_seqlen must be an int in 1..{MAX_INDEX}, got {max_seqlen!r}")
        rotary_table(0, dim, base, scaling=scaling, dtype=table_dtype)  # validates the parameters now
        self.dim, self.max_seqlen, self.base = dim, max_seqlen, base
        self.scaling = dict(scaling) if scaling is not None else None
        self.interleaved, self.table_dtype, self.backend = interleaved, table_dtype, backend
        self._key = (max_seqlen, dim, float(base), _scaling_key(scaling), table_dtype)

    def table(self, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached (cos, sin) on ``device``."""
        return rotary_table(self.max_seqlen, self.dim, self.base, scaling=self.scaling, dtype=self.table_dtype,
                            device=device)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None = None, *, cu_seqlens: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, offset: int | torch.Tensor = 0, inplace: bool = False):
        cos, sin = _table(*self._key, q.device)  # validated at construction; a tensor's device has its index
        return apply_rotary(q, k, cos, sin, interleaved=self.interleaved, cu_seqlens=cu_seqlens,
                            position_ids=position_ids, offset=offset, inplace=inplace, backend=self.backend)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, max_seqlen={self.max_seqlen}, base={self.base}, scaling={self.scaling}, "
                f"interleaved={self.interleaved}, backend={self.backend}")
