"""Host side of csrc/rotary/rotary.cu: the launch geometry both CUDA paths use, the launcher, and the
``torch.library`` custom ops (``megakern::rotary``, ``megakern::rotary_``) that torch.compile traces.

Tensors in, tensors out, no autograd (that is ``megakern.rotary.RotaryFunction``). Inputs arrive validated, as
4-D (B, T, heads, hs) views with unit stride along hs, with the outputs to write (megakern/rotary.py allocates them);
positions as ``megakern.rotary.Rotation`` holds them.
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch

from megakern import _cuda

# Flag bits, mirrored from csrc/rotary/rotary.h.
VECTORIZED, CONJ, COPY_REST, POS_IDS, POS_I64, CU_SEQLENS, OFFSETS, OFFSETS_I64, WHOLE_CHUNKS, ROWS = \
    1, 2, 4, 8, 16, 32, 64, 128, 256, 512
MAX_TOKENS, MAX_THREADS = 256, 256  # ROTARY_MAX_TOKENS, ROTARY_MAX_THREADS
ITEMS = (1, 2, 4)  # the instances compiled

_CTYPES = {torch.float32: (0, "float"), torch.float16: (1, "__half"), torch.bfloat16: (2, "__nv_bfloat16")}
_VEC = {torch.float32: 4, torch.float16: 8, torch.bfloat16: 8}  # elements in 16 bytes


@dataclass(frozen=True)
class LaunchConfig:
    threads: int  # block.x
    items: int  # heads each thread loads before any math (template ITEMS)
    tokens_per_block: int
    head_runs: int = 1  # grid.y: the heads cut into this many runs
    # tuning: a cap on the kernel's registers a thread (NVRTC, MEGAKERN_ROTARY_MAXNREG; 0: the launch bounds' choice)
    max_registers: int = 0

    def __post_init__(self):
        if self.max_registers and not 24 <= self.max_registers <= 255:
            raise ValueError(f"rotary launch: max_registers must be 0 or in [24, 255], got {self.max_registers}")


# Defaults (benchmarks/bench_rotary.py --tune sweeps them; docs/tuning.md, rotary): a block of DEFAULT_THREADS
# threads, one (token, group) item each, DEFAULT_ITEMS heads a step, and enough head runs that the grid has about
# MIN_BLOCKS blocks.
DEFAULT_THREADS, DEFAULT_ITEMS, MIN_BLOCKS = 128, 4, 4096
MAX_HEAD_RUNS = 65535  # grid.y


def launch_config(heads: int, groups: int, threads: Optional[int] = None, items: Optional[int] = None,
                  tokens_per_block: Optional[int] = None, tokens: Optional[int] = None,
                  head_runs: Optional[int] = None, narrow: bool = False) -> LaunchConfig:
    """Geometry for ``heads`` (q's + k's) rows of ``groups`` groups a token: a thread per (token, group) of a block
    (whole tokens, at most MAX_TOKENS), walking the heads of its run; with ``tokens`` (B * T) given, the heads cut
    into runs until the grid has MIN_BLOCKS blocks (each thread then walks fewer heads; a short sequence still
    fills the GPU). ``narrow``: some chunk moves in narrower transactions than 16 bytes (a partial rotary dim
    whose second half starts mid-chunk): then a run per head and one head a step by default, each thread a single
    row's group, as many threads in flight as there are groups. Arguments override the defaults (tuning)."""
    threads = threads or DEFAULT_THREADS
    items = items or (1 if narrow else DEFAULT_ITEMS)
    if threads % 32 or not 32 <= threads <= MAX_THREADS or items not in ITEMS:
        raise ValueError(f"rotary launch: threads must be a multiple of 32 up to {MAX_THREADS} and items in {ITEMS}, "
                         f"got {threads}, {items}")
    per_block = max(1, min(MAX_TOKENS, tokens_per_block or threads // max(1, groups)))
    heads = max(1, heads)
    if head_runs is None and narrow:
        head_runs = min(heads, MAX_HEAD_RUNS)
    if head_runs is None:
        blocks = math.ceil(tokens / per_block) if tokens else MIN_BLOCKS
        head_runs = min(heads, max(1, MIN_BLOCKS // blocks))
    if not 1 <= head_runs <= min(heads, MAX_HEAD_RUNS):
        raise ValueError(f"rotary launch: head_runs must be in [1, {min(heads, MAX_HEAD_RUNS)}], got {head_runs}")
    # runs of equal length (the kernel's ceil(heads / runs)), none of them empty
    per_run = math.ceil(heads / head_runs)
    return LaunchConfig(threads, items, per_block, math.ceil(heads / per_run))


# element by element; aligned rows, each chunk as wide as its column allows; whole 16-byte chunks; rows of whole
# chunks staged in shared memory
IO_MODES = (0, 1, 2, 3)


def io_mode(flags: int) -> int:
    """The kernel instance's IO template argument for a launch's flags."""
    if not flags & VECTORIZED:
        return 0
    return 2 if flags & WHOLE_CHUNKS else 3 if flags & ROWS else 1


def kernel_name(dtype: torch.dtype, table_f32: bool, interleaved: bool, io: int, items: int) -> str:
    ctype = _CTYPES[dtype][1]
    table = "float" if table_f32 else ctype
    return f"megakern::rotary_kernel<{ctype}, {table}, {'true' if interleaved else 'false'}, {io}, {items}>"


def kernel_names() -> list[str]:
    """Every kernel instance the launcher can ask for: NVRTC name expressions, one per
    (dtype, table dtype, layout, I/O mode, items)."""
    names = []
    for dtype in _CTYPES:
        for table_f32 in ((True,) if dtype == torch.float32 else (True, False)):
            names += [kernel_name(dtype, table_f32, il, io, it) for il in (False, True) for io in IO_MODES
                      for it in ITEMS]
    return names


def whole_chunks(head_dim: int, rotary_dim: int, dtype: torch.dtype, copy_rest: bool) -> bool:
    """Every chunk of every group of a row is whole (on 16-byte aligned rows: the instance with the 16-byte path
    alone; otherwise the launch is ``narrow``)."""
    vec = _VEC[dtype]
    return rotary_dim // 2 % vec == 0 and (not copy_rest or (head_dim - rotary_dim) % (2 * vec) == 0)


def row_chunks(head_dim: int, rotary_dim: int, dtype: torch.dtype, copy_rest: bool) -> int:
    """16-byte chunks of a row that the staged-rows instance (IO 3) gives a thread each: the whole row when the
    features past rotary_dim are copied, else those holding the rotary part."""
    vec = _VEC[dtype]
    return head_dim // vec if copy_rest else math.ceil(rotary_dim / vec)


def rows_fit(head_dim: int, rotary_dim: int, dtype: torch.dtype, copy_rest: bool,
             threads: int = DEFAULT_THREADS) -> bool:
    """Rows of whole chunks, few enough for a block of ``threads`` to give each chunk of a row a thread: what the
    staged-rows instance can take (on 16-byte aligned rows)."""
    return head_dim % _VEC[dtype] == 0 and row_chunks(head_dim, rotary_dim, dtype, copy_rest) <= threads


def staged_rows(head_dim: int, rotary_dim: int, dtype: torch.dtype, copy_rest: bool,
                threads: int = DEFAULT_THREADS) -> bool:
    """On 16-byte aligned rows (and table) whose groups are not whole chunks: the staged-rows instance, rather than
    the narrow per-chunk transactions. (With whole groups it runs only where the table is not aligned.)"""
    return rows_fit(head_dim, rotary_dim, dtype, copy_rest, threads) and not whole_chunks(head_dim, rotary_dim, dtype,
                                                                                          copy_rest)


def work_units(head_dim: int, rotary_dim: int, dtype: torch.dtype, copy_rest: bool, rows: bool) -> tuple[int, bool]:
    """(a token's items per head, narrow) for ``launch_config``: the staged-rows instance takes a thread per chunk
    of a row; the others a thread per group, narrow where some group is not whole chunks."""
    if rows:
        return row_chunks(head_dim, rotary_dim, dtype, copy_rest), False
    return groups_per_row(head_dim, rotary_dim, dtype, copy_rest)[1], not whole_chunks(head_dim, rotary_dim, dtype,
                                                                                          copy_rest)


def groups_per_row(head_dim: int, rotary_dim: int, dtype: torch.dtype, copy_rest: bool) -> tuple[int, int]:
    """(rotary groups, all groups) of one head row: a group is two chunks of 16 bytes (see rotary.cu)."""
    vec = _VEC[dtype]
    rot = math.ceil(rotary_dim // 2 / vec)
    return rot, rot + (math.ceil((head_dim - rotary_dim) / (2 * vec)) if copy_rest else 0)


def _aligned_rows(tensors, vec: int) -> bool:
    """Every row of q / k / outputs starts 16-byte aligned: the staged-rows instance moves whole 16-byte chunks."""
    return all(t is None or (t.data_ptr() % 16 == 0 and not any(s % vec for s in t.stride()[:3])) for t in tensors)


def _aligned_table(cos, sin) -> bool:
    """Every row of the (cos, sin) table starts 16-byte aligned: the group instances load its chunks whole."""
    table_vec = 16 // cos.element_size()
    return all(t.data_ptr() % 16 == 0 and t.stride(0) % table_vec == 0 for t in (cos, sin))


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def _nvrtc_args(*args):
    """Kernel arguments as fixed-width numpy scalars (pointers as uint64)."""
    import numpy as np

    kinds = {"p": np.uint64, "i64": np.int64, "i32": np.int32}
    return tuple(kinds[kind](value) for kind, value in args)


def fwd(q, k, q_out, k_out, cos, sin, position_ids, cu_seqlens, offsets, offset: int, rotary_dim: int,
        interleaved: bool, conj: bool, inplace: bool, path: Optional[str] = None,
        config: Optional[LaunchConfig] = None):
    """(q_out, k_out | None), written, for 4-D q (B, T, nh, hs), k (B, T, nkv, hs) or None; see
    csrc/rotary/rotary.cu. ``q_out``, ``k_out``: tensors of q's and k's shapes, or with ``inplace`` q and k
    themselves. ``conj``: rotate by -theta (the backward). ``config`` overrides ``launch_config`` (tuning; one with
    ``max_registers`` compiles the kernel by NVRTC under that cap)."""
    capped = config is not None and config.max_registers
    if capped and path == "extension":
        raise ValueError("rotary launch: a register cap (max_registers) is compiled by NVRTC, not the extension")
    path = "nvrtc" if capped else _cuda.choose_path(path)
    batch, seqlen, nh, hs = q.shape
    nkv = k.shape[2] if k is not None else 0
    tokens = batch * seqlen
    if tokens == 0 or nh + nkv == 0:
        return q_out, k_out
    rot_half = rotary_dim // 2
    copy_rest = not inplace and rotary_dim < hs
    dtype_code = _CTYPES[q.dtype][0]
    table_f32 = cos.dtype == torch.float32
    flags = (CONJ if conj else 0) | (COPY_REST if copy_rest else 0)
    if position_ids is not None:
        flags |= POS_IDS | (POS_I64 if position_ids.dtype == torch.int64 else 0)
    if cu_seqlens is not None:
        flags |= CU_SEQLENS
    if offsets is not None:
        flags |= OFFSETS | (OFFSETS_I64 if offsets.dtype == torch.int64 else 0)
    # Wide I/O: the group instances need every row of q / k / outputs and of the table 16-byte aligned; they move
    # each whole chunk in 16 bytes, 8-byte aligned pieces (a second NeoX half or a pass-through part that starts
    # mid-chunk) in 8 bytes, the rest element by element. The staged-rows instance needs the rows alone (it loads
    # each feature's table entry by itself).
    if _aligned_rows((q, k, q_out, k_out), _VEC[q.dtype]):
        table = _aligned_table(cos, sin)
        if table and whole_chunks(hs, rotary_dim, q.dtype, copy_rest):
            flags |= VECTORIZED | WHOLE_CHUNKS  # every chunk whole and 16-byte aligned: the 16-byte path alone
        elif rows_fit(hs, rotary_dim, q.dtype, copy_rest, config.threads if config else DEFAULT_THREADS):
            flags |= VECTORIZED | ROWS  # a thread per chunk of whole rows, partners through shared memory
        elif table:
            flags |= VECTORIZED
    units, _ = work_units(hs, rotary_dim, q.dtype, copy_rest, bool(flags & ROWS))
    # narrow: any instance but the 16-byte-only and the staged-rows ones
    cfg = config or launch_config(nh + nkv, units, tokens=tokens, narrow=not flags & (WHOLE_CHUNKS | ROWS))
    if flags & ROWS and cfg.tokens_per_block * units > cfg.threads:
        raise ValueError(f"rotary launch: the staged-rows kernel needs a thread per chunk: {cfg.tokens_per_block} "
                         f"tokens of {units} chunks a block exceed its {cfg.threads} threads")
    grid = math.ceil(tokens / cfg.tokens_per_block)
    if path == "extension":
        _cuda.extension()[0].rotary(q, k, q_out, k_out, cos, sin, position_ids, cu_seqlens, offsets, offset, rot_half,
                                    flags, dtype_code, table_f32, interleaved, cfg.items, cfg.threads,
                                    cfg.tokens_per_block, grid, cfg.head_runs)
        return q_out, k_out
    defines = (f"MEGAKERN_ROTARY_MAXNREG={cfg.max_registers}",) if cfg.max_registers else ()
    kernel = _cuda.nvrtc_kernel("rotary/rotary.cu",
                                kernel_name(q.dtype, table_f32, interleaved, io_mode(flags), cfg.items), defines)
    ks = k.stride()[:3] if k is not None else (0, 0, 0)
    kos = k_out.stride()[:3] if k is not None else (0, 0, 0)
    stride_pb = position_ids.stride(0) if position_ids is not None and position_ids.shape[0] > 1 else 0
    stride_pt = position_ids.stride(1) if position_ids is not None else 0
    ndocs = cu_seqlens.numel() - 1 if cu_seqlens is not None else 1
    args = _nvrtc_args(
        ("p", _ptr(q)), ("p", _ptr(k)), ("p", _ptr(q_out)), ("p", _ptr(k_out)), ("p", _ptr(cos)), ("p", _ptr(sin)),
        ("p", _ptr(position_ids)), ("p", _ptr(cu_seqlens)), ("p", _ptr(offsets)), ("i64", tokens), ("i64", seqlen),
        ("i32", nh), ("i32", nkv), ("i32", hs), ("i32", rot_half), ("i32", cfg.tokens_per_block),
        *(("i64", s) for s in (*q.stride()[:3], *ks, *q_out.stride()[:3], *kos)),
        ("i64", cos.stride(0)), ("i64", sin.stride(0)), ("i64", stride_pb), ("i64", stride_pt), ("i32", ndocs),
        ("i64", offset), ("i32", flags))
    _cuda.nvrtc_launch(kernel, (grid, cfg.head_runs), (cfg.threads,), args, q.device)
    return q_out, k_out


# ---- torch.library custom ops: what torch.compile sees of the CUDA path ----------------------------------------
@torch.library.custom_op("megakern::rotary", mutates_args=())
def rotary_op(q: torch.Tensor, k: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
              position_ids: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], offsets: Optional[torch.Tensor],
              offset: int, rotary_dim: int, interleaved: bool, conj: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # a functional op allocates its outputs (as megakern.rotary.rotary_outputs does out of place)
    q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    k_out = None if k is None else torch.empty_like(k, memory_format=torch.contiguous_format)
    fwd(q, k, q_out, k_out, cos, sin, position_ids, cu_seqlens, offsets, offset, rotary_dim, interleaved, conj, False)
    return q_out, (k_out if k_out is not None else q.new_empty(0))


@rotary_op.register_fake
def _(q, k, cos, sin, position_ids, cu_seqlens, offsets, offset, rotary_dim, interleaved, conj):
    return q.new_empty(q.shape), (k.new_empty(k.shape) if k is not None else q.new_empty(0))


@torch.library.custom_op("megakern::rotary_", mutates_args=("q", "k"))
def rotary_inplace_op(q: torch.Tensor, k: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                      position_ids: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                      offsets: Optional[torch.Tensor], offset: int, rotary_dim: int, interleaved: bool,
                      conj: bool) -> None:
    fwd(q, k, q, k, cos, sin, position_ids, cu_seqlens, offsets, offset, rotary_dim, interleaved, conj, True)


@rotary_inplace_op.register_fake
def _(q, k, cos, sin, position_ids, cu_seqlens, offsets, offset, rotary_dim, interleaved, conj):
    return None


def apply(q, k, q_out, k_out, cos, sin, position_ids, cu_seqlens, offsets, offset, rotary_dim, interleaved, conj,
          inplace):
    """The launcher ``megakern.rotary`` uses: eager calls go straight to ``fwd``; under torch.compile the custom
    ops keep the kernel opaque to tracing (out of place, the functional op returns outputs of its own: the traced
    q_out, k_out go unused, and the compiler drops their allocation)."""
    if not torch.compiler.is_compiling():
        return fwd(q, k, q_out, k_out, cos, sin, position_ids, cu_seqlens, offsets, offset, rotary_dim, interleaved,
                   conj, inplace)
    args = (q, k, cos, sin, position_ids, cu_seqlens, offsets, offset, rotary_dim, interleaved, conj)
    if inplace:
        torch.ops.megakern.rotary_(*args)
        return q, k
    q_out, k_out = torch.ops.megakern.rotary(*args)
    return q_out, (k_out if k is not None else None)
