"""Host side of csrc/norm/norm.cu: the launch geometry both CUDA paths use, the launchers, and the
``torch.library`` custom ops (``megakern::norm_fwd``, ``megakern::norm_bwd``) that torch.compile traces.

Tensors in, tensors out, no autograd (that is ``megakern._norm.NormFunction``). Inputs arrive validated and as
2-D views (rows, cols) with unit stride along cols.
"""
import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from megakern import _cuda

# Flag bits, mirrored from csrc/norm/norm.h.
RMS, VECTORIZED, HAS_WEIGHT, HAS_BIAS, W_F32 = 1, 2, 4, 8, 16
HAS_RESIDUAL, RES_F32, HAS_DRES_OUT, HAS_DRES, HAS_DW, STAGED = 32, 64, 128, 256, 512, 1024
GENERIC, TEAM, NO_PREFETCH, WEIGHT_REGS, RELOAD = 2048, 4096, 8192, 16384, 32768
# The forward's specialized instances (csrc/norm/norm.h, NORM_FWD_SPECS): 16-bit rows with 16-byte I/O whose flags
# are one of these take a kernel with them as compile-time constants (fewer registers: more blocks an SM)
SPEC_MASK = RMS | HAS_WEIGHT | HAS_BIAS | W_F32 | HAS_RESIDUAL | RES_F32
FWD_SPECS = (RMS | HAS_WEIGHT, RMS | HAS_WEIGHT | HAS_RESIDUAL, HAS_WEIGHT | HAS_BIAS,
             HAS_WEIGHT | HAS_BIAS | HAS_RESIDUAL)
# The staged backward's (NORM_BWD_SPECS): its flags as constants, a 16-bit weight loaded once for all of a block's rows
BWD_SPEC_MASK = RMS | HAS_WEIGHT | W_F32 | HAS_DW | HAS_DRES_OUT | HAS_DRES
BWD_SPECS = (RMS | HAS_WEIGHT | HAS_DW, RMS | HAS_WEIGHT | HAS_DW | HAS_DRES_OUT, HAS_WEIGHT | HAS_DW,
             HAS_WEIGHT | HAS_DW | HAS_DRES_OUT)

_CTYPES = {torch.float32: (0, "float"), torch.float16: (1, "__half"), torch.bfloat16: (2, "__nv_bfloat16")}
_VEC = {torch.float32: 4, torch.float16: 8, torch.bfloat16: 8}  # elements in 16 bytes

# Elements of a row each thread keeps in registers, and the largest block (__launch_bounds__ in csrc/norm/norm.cu):
# the budgets that compile without spills for sm_90a and ran fastest on the H200 (profiles/tune_norm.py; registers in
# docs/tuning.md, norms). Longer rows stream (NV = 0).
FWD_CAP, FWD_MAX_THREADS = 16, 1024
# 16-bit rows too wide for FWD_CAP elements a thread in FWD_WIDE_THREADS threads take up to FWD_WIDE_CAP where that
# fits the row in FWD_WIDE_THREADS threads, so that two rows run at once (csrc/norm/norm.cu, norm_fwd_cap): hidden
# 8192-16384. Wider rows stream: with 1024 threads a row the run-time-flags instance spills. Such a row takes two rows
# at once only where it fills FWD_WIDE_THREADS threads (hidden 16384); with fewer threads one row at a time ran faster
# (hidden 9216-14336, docs/tuning.md, norms).
FWD_WIDE_CAP, FWD_WIDE_THREADS = 32, 512
# The forward takes several rows at once while a block's threads x rows stay within this many (profiles/tune_norm.py;
# with the specialized instances' fewer registers, as many as the launch bounds allow)
FWD_BATCH_THREADS = FWD_MAX_THREADS
# The forward's team kernel (csrc/norm/norm.cu, norm_fwd_team_kernel): 16-bit rows with 16-byte I/O whose flags have
# a specialized instance. TEAM_CHUNKS: the 16-byte chunks a thread holds of its row (the instances built); a row of
# up to TEAM_MAX_THREADS x TEAM_CHUNKS[-1] chunks takes it. TEAM_WARP_ROWS: the one-warp teams a block.
TEAM_CHUNKS, TEAM_MAX_THREADS, TEAM_WARP_ROWS = (1, 2, 4), 512, 4
# The team kernel's instances: (prefetch, weight_regs, reload)
TEAM_MODES = ((True, True, False), (True, False, False), (False, True, False), (False, False, False),
              (False, False, True))
# Where the team kernel is the default (team_config): rows up to TEAM_DEFAULT_COLS elements, LayerNorm's within
# TEAM_LN_WIDE; elsewhere the row-group kernel measured level or ahead
TEAM_DEFAULT_COLS, TEAM_LN_WIDE = 3072, (12288, 16384)
BWD_CAP, BWD_MAX_THREADS = 16, 512


STAGED_NV = (1, 2, 4)  # the staged backward's instances (csrc/norm/norm.cu, norm_bwd_staged_kernel)
ROW_BATCHES = (1, 2, 4)  # the forward's rows at once (norm_fwd_kernel's ROWS); more than 1 only with rows in registers


@dataclass(frozen=True)
class LaunchConfig:
    nv: int  # 16-byte groups per thread kept in registers; 0 = streaming
    threads: int  # threads per row (block.x)
    rows_per_block: int  # block.y
    staged: bool = False  # backward: the staged kernel (the next row copied into shared memory; 16-bit rows)
    row_batch: int = 1  # forward: rows each row's threads take at once, every row's loads in flight (ROW_BATCHES)
    max_registers: int = 0  # forward, tuning: a register cap a thread (NVRTC, MEGAKERN_NORM_FWD_MAXNREG; 0: none)
    # a specialized instance where the flags have one (FWD_SPECS; the staged backward: BWD_SPECS); False: GENERIC
    specialize: bool = True
    # forward: the persistent team kernel (nv: its chunks a thread, TEAM_CHUNKS; threads: a row's team; rows_per_block:
    # one-warp teams a block); per_sm: its blocks an SM at most (0: as many as fit)
    team: bool = False
    per_sm: int = 0
    prefetch: bool = True  # forward, team kernel: the next row's loads in flight during this row's reductions
    weight_regs: bool = False  # forward, team kernel: the weight (and bias) in registers for every row
    # forward, team kernel: the row read again from L1 after each reduction, nothing held across them (few registers,
    # a full SM of teams); without prefetch and weight_regs
    reload: bool = False
    # forward, team kernel: a persistent grid (as many blocks as fit at once, each team walking rows); False: a team
    # for every row, one row each
    persistent: bool = True


def staged_smem_bytes(cols: int, itemsize: int, nv: int, has_db: bool) -> int:
    """The staged backward's dynamic shared memory (csrc/norm/norm.h, norm_staged_smem_bytes): the next row's x and dy,
    plus the dweight (and dbias) sums when they live there (nv > 2)."""
    return cols * (2 * itemsize + (4 * (2 if has_db else 1) if nv > 2 else 0))


def fwd_cap(dtype: torch.dtype) -> int:
    """Elements of a row a forward thread may keep in registers for ``dtype`` rows (the instances built)."""
    return FWD_WIDE_CAP if _VEC[dtype] == 8 else FWD_CAP


@functools.lru_cache(maxsize=None)
def launch_config(cols: int, dtype: torch.dtype, backward: bool) -> LaunchConfig:
    """Geometry for a row of ``cols`` elements: a few 16-byte groups per thread (at most the register
    budget) and about 256 threads a row; a warp per row (4 rows a block) for short rows. The forward holds as many
    groups a thread as the budget allows while a warp stays full, and takes several rows at once while a block's
    threads x rows stay within FWD_BATCH_THREADS; 16-bit rows that would take more than FWD_WIDE_THREADS threads
    hold twice the groups a thread where the row then fits FWD_WIDE_THREADS, and one row at a time unless the row
    fills FWD_WIDE_THREADS (the fastest on the H200, profiles/tune_norm.py)."""
    vec = _VEC[dtype]
    cap, max_threads = (BWD_CAP, BWD_MAX_THREADS) if backward else (FWD_CAP, FWD_MAX_THREADS)
    groups = math.ceil(cols / vec)
    wide = False
    nv = 1
    while nv * vec < cap and (math.ceil(groups / nv) > 256 or not backward and math.ceil(groups / (2 * nv)) >= 32):
        nv *= 2
    threads = 32 * math.ceil(math.ceil(groups / nv) / 32)
    if (not backward and threads > FWD_WIDE_THREADS and 2 * nv * vec <= fwd_cap(dtype)
            and math.ceil(groups / (2 * nv)) <= FWD_WIDE_THREADS):
        nv *= 2
        threads = 32 * math.ceil(math.ceil(groups / nv) / 32)
        wide = True
    if threads > max_threads:
        return LaunchConfig(0, max_threads, 1)
    rows_per_block = 4 if threads == 32 else 1
    # the forward of short rows: several rows at once, so that enough bytes are in flight on each SM
    batch = 1 if backward or wide and threads < FWD_WIDE_THREADS else max(
        (b for b in ROW_BATCHES if b * threads * rows_per_block <= FWD_BATCH_THREADS), default=1)
    return LaunchConfig(nv, threads, rows_per_block, row_batch=batch)


def team_geometry(cols: int, dtype: torch.dtype) -> Optional[LaunchConfig]:
    """The team kernel's geometry for ``dtype`` rows of ``cols`` elements, or None where it does not take them
    (32-bit rows, rows above TEAM_MAX_THREADS x TEAM_CHUNKS[-1] chunks). From the sweep on the H200
    (profiles/tune_norm.py; docs/tuning.md, norms): rows of up to 1024 elements a warp each at 4 chunks a thread,
    TEAM_WARP_ROWS warps a block; wider rows 2 chunks a thread with the weight in registers while the row fits
    TEAM_MAX_THREADS threads, else 4 (the weight read a row at a time: at 4 chunks it would spill); the next row's
    loads in flight throughout."""
    if _VEC[dtype] != 8:
        return None
    chunks = math.ceil(cols / 8)
    if chunks <= 32 * TEAM_CHUNKS[-1]:
        return LaunchConfig(TEAM_CHUNKS[-1], 32, TEAM_WARP_ROWS, team=True)
    for nv, weight_regs in ((2, True), (TEAM_CHUNKS[-1], False)):
        threads = 32 * math.ceil(chunks / (32 * nv))
        if threads <= TEAM_MAX_THREADS:
            return LaunchConfig(nv, threads, 1, team=True, weight_regs=weight_regs)
    return None


def team_config(cols: int, dtype: torch.dtype, is_rms: bool) -> Optional[LaunchConfig]:
    """The team kernel's geometry where it is the forward's default, else None (the row-group kernel): rows of up to
    TEAM_DEFAULT_COLS elements, and LayerNorm's rows within TEAM_LN_WIDE (docs/results.md, norms: where it measured
    ahead of the row-group kernel on the H200)."""
    if cols <= TEAM_DEFAULT_COLS or not is_rms and TEAM_LN_WIDE[0] <= cols <= TEAM_LN_WIDE[1]:
        return team_geometry(cols, dtype)
    return None


def check_fwd_config(cfg: LaunchConfig) -> None:
    """Raise ValueError naming what the forward kernels cannot take in ``cfg`` (a tuning override)."""
    if cfg.team:
        if cfg.nv not in TEAM_CHUNKS:
            raise ValueError(f"{cfg}: the team kernel holds {TEAM_CHUNKS} chunks a thread")
        if cfg.threads % 32 or cfg.threads * cfg.rows_per_block > TEAM_MAX_THREADS or (
                cfg.rows_per_block > 1 and cfg.threads != 32):
            raise ValueError(f"{cfg}: a team is whole warps, several a block only of one warp, at most "
                             f"{TEAM_MAX_THREADS} threads a block")
        if cfg.row_batch != 1 or not cfg.specialize or cfg.per_sm < 0:
            raise ValueError(f"{cfg}: the team kernel takes no row_batch or generic flags, and per_sm >= 0")
        if cfg.per_sm and not cfg.persistent:
            raise ValueError(f"{cfg}: per_sm caps a persistent grid; a grid of a team a row has no cap")
        if cfg.reload and (cfg.prefetch or cfg.weight_regs):
            raise ValueError(f"{cfg}: reload holds nothing across a row's reductions: it takes prefetch=False and "
                             "weight_regs=False")
    elif not cfg.prefetch or cfg.per_sm or cfg.weight_regs or cfg.reload or not cfg.persistent:
        raise ValueError(f"{cfg}: prefetch, per_sm, weight_regs, reload and persistent are the team kernel's")
    if cfg.staged:
        raise ValueError(f"{cfg}: the staged kernel is a backward")
    if cfg.row_batch not in ROW_BATCHES:
        raise ValueError(f"{cfg}: row_batch must be one of {ROW_BATCHES}")
    if cfg.row_batch > 1 and cfg.nv == 0:
        raise ValueError(f"{cfg}: streaming (nv 0) takes one row at a time")
    if cfg.threads * cfg.rows_per_block * cfg.row_batch > FWD_MAX_THREADS:
        raise ValueError(f"{cfg}: threads x rows_per_block x row_batch is above {FWD_MAX_THREADS} (the kernel's "
                         "launch bounds)")
    top = 128 if cfg.team else 64  # what bounds the kernel's largest block: 512 threads (team), 1024
    if cfg.max_registers and not 24 <= cfg.max_registers <= top:
        raise ValueError(f"{cfg}: max_registers must be 0 or in [24, {top}] (a cap above {top} would not bound the "
                         "kernel's largest blocks)")


def _b(flag: bool) -> str:
    return "true" if flag else "false"


def staged_config(cols: int, dtype: torch.dtype, has_db: bool) -> Optional[LaunchConfig]:
    """The staged backward's default geometry for 16-bit rows of ``cols`` elements, or None where the register
    kernel is the one to take (rows under 1024, other dtypes, or rows too long). Fastest on the H200
    (profiles/tune_norm.py): 4 groups a thread with the dweight sums in shared memory; with the dbias sums as well,
    2 groups a thread, the sums in registers."""
    if dtype not in (torch.float16, torch.bfloat16) or cols < 1024:
        return None
    nv = 2 if has_db else 4
    threads = 32 * math.ceil(math.ceil(cols / _VEC[dtype]) / (32 * nv))
    return LaunchConfig(nv, threads, 1, staged=True) if threads <= BWD_MAX_THREADS else None


def fwd_spec(flags: int, dtype: torch.dtype) -> int:
    """The forward's SPEC for ``flags`` on ``dtype`` rows (csrc/norm/norm.h, norm_fwd_spec; 0: flags at run time)."""
    if dtype == torch.float32 or not flags & VECTORIZED or flags & GENERIC:
        return 0
    return flags & SPEC_MASK if flags & SPEC_MASK in FWD_SPECS else 0


def bwd_spec(flags: int, has_db: bool) -> int:
    """The staged backward's SPEC for a launch's ``flags`` (csrc/norm/norm.h, norm_bwd_spec; 0: flags at run time)."""
    if not flags & STAGED or flags & GENERIC or (has_db and flags & RMS):
        return 0
    return flags & BWD_SPEC_MASK if flags & BWD_SPEC_MASK in BWD_SPECS else 0


def _fwd_name(ctype: str, nv: int, vecio: bool, row_batch: int = 1, spec: int = 0) -> str:
    return f"megakern::norm_fwd_kernel<{ctype}, {nv}, {row_batch}, {_b(vecio)}, {spec}>"


def _team_name(ctype: str, nv: int, spec: int, prefetch: bool = True, weight_regs: bool = False,
               reload: bool = False) -> str:
    return (f"megakern::norm_fwd_team_kernel<{ctype}, {nv}, {spec}, {_b(prefetch)}, {_b(weight_regs)}, "
            f"{_b(reload)}>")


def _bwd_name(ctype: str, nv: int, has_db: bool, vecio: bool) -> str:
    return f"megakern::norm_bwd_kernel<{ctype}, {nv}, {_b(has_db)}, {_b(vecio)}>"


def _bwd_staged_name(ctype: str, nv: int, has_db: bool, spec: int = 0) -> str:
    return f"megakern::norm_bwd_staged_kernel<{ctype}, {nv}, {_b(has_db)}, {spec}>"


def kernel_names() -> list[str]:
    """Every kernel instance the launchers can ask for: NVRTC name expressions, one per
    (dtype, NV, vectorized[, has_db])."""
    names = []
    for dtype, (_, ctype) in _CTYPES.items():
        vec = _VEC[dtype]
        for io in (False, True):
            specs = (0, *FWD_SPECS) if io and dtype != torch.float32 else (0,)
            names += [_fwd_name(ctype, nv, io, batch, spec) for nv in (0, 1, 2, 4, 8) if nv * vec <= fwd_cap(dtype)
                      for batch in (ROW_BATCHES if nv else (1,)) for spec in specs]
            names += [_bwd_name(ctype, nv, db, io) for nv in (0, 1, 2, 4, 8) if nv * vec <= BWD_CAP
                      for db in (False, True)]
        if dtype != torch.float32:
            names += [_team_name(ctype, nv, spec, pf, wr, rl) for nv in TEAM_CHUNKS for spec in FWD_SPECS
                      for pf, wr, rl in TEAM_MODES]
            names += [_bwd_staged_name(ctype, nv, db, spec) for nv in STAGED_NV for db in (False, True)
                      for spec in (0, *(sp for sp in BWD_SPECS if not (db and sp & RMS)))]
    return names


def _aligned(*tensors: Optional[torch.Tensor]) -> bool:
    """Every row of every tensor starts on a 16-byte boundary."""
    for t in tensors:
        if t is None:
            continue
        if t.data_ptr() % 16 or (t.dim() == 2 and (t.stride(0) * t.element_size()) % 16):
            return False
    return True


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def _stride(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.stride(0)


def _nvrtc_args(*args):
    """Kernel arguments as fixed-width numpy scalars (pointers as uint64)."""
    import numpy as np

    out = []
    for kind, value in args:
        out.append({"p": np.uint64, "i64": np.int64, "i32": np.int32, "f32": np.float32}[kind](value))
    return tuple(out)


def _persistent_grid(rows: int, cfg: LaunchConfig, regs: int, device: torch.device, smem: int = 0) -> int:
    """Persistent grid: as many blocks as the device holds at once (by registers, threads and ``smem`` bytes of
    dynamic shared memory a block; at most ``cfg.per_sm`` where it is set)."""
    threads = cfg.threads * cfg.rows_per_block
    regs_per_block = 8 * math.ceil(max(regs, 1) / 8) * threads
    per_sm = max(1, min(65536 // regs_per_block, 2048 // threads, 32, cfg.per_sm or 32))
    if smem:
        props = torch.cuda.get_device_properties(device)
        per_sm_smem = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
        per_sm = max(1, min(per_sm, per_sm_smem // (smem + 1024 + 256)))  # + the runtime's 1 KiB, the kernel's own
    return min(math.ceil(rows / cfg.rows_per_block), per_sm * _cuda.sm_count(device.index))


def _staged_problem(cfg: LaunchConfig, dy: torch.Tensor, x: torch.Tensor, vecio: bool, smem: int) -> str:
    """Why the staged backward cannot take these tensors with ``cfg`` and ``smem`` bytes of shared memory a block
    ('' if it can)."""
    if dy.dtype not in (torch.float16, torch.bfloat16):
        return f"it takes 16-bit rows, not {dy.dtype}"
    if x.dtype != dy.dtype:
        return f"x ({x.dtype}) must have dy's dtype ({dy.dtype})"
    if not vecio:
        return "the rows must start on 16-byte boundaries and hold a multiple of 8 elements"
    if cfg.nv not in STAGED_NV or cfg.rows_per_block != 1:
        return f"nv must be one of {STAGED_NV}, one row a block"
    if cfg.nv * cfg.threads * _VEC[dy.dtype] < dy.shape[1]:
        return f"{cfg.threads} threads x {cfg.nv} groups of {_VEC[dy.dtype]} do not cover a row of {dy.shape[1]}"
    if cfg.threads > BWD_MAX_THREADS:
        return f"at most {BWD_MAX_THREADS} threads a block"
    limit = getattr(torch.cuda.get_device_properties(dy.device), "shared_memory_per_block_optin", 227 * 1024)
    if smem > limit:
        return f"{smem} bytes of shared memory a block, above the device's {limit}"
    return ""


def fwd(x, residual, weight, bias, eps: float, is_rms: bool, path: Optional[str] = None,
        config: Optional[LaunchConfig] = None):
    """(y, residual_out | None, mean | None, rstd) for 2-D ``x``; see csrc/norm/norm.cu.
    ``config`` overrides ``launch_config`` (for tuning; one with ``max_registers`` is compiled by NVRTC)."""
    path = "nvrtc" if config is not None and config.max_registers else _cuda.choose_path(path)
    rows, cols = x.shape
    dtype_code, ctype = _CTYPES[x.dtype]
    y = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    res_out = None if residual is None else torch.empty((rows, cols), dtype=residual.dtype, device=x.device)
    mean = None if is_rms else torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    flags = (RMS if is_rms else 0) | (HAS_WEIGHT if weight is not None else 0) | (HAS_BIAS if bias is not None else 0)
    if weight is not None and weight.dtype == torch.float32:
        flags |= W_F32
    if residual is not None:
        flags |= HAS_RESIDUAL | (RES_F32 if residual.dtype == torch.float32 else 0)
    if cols % _VEC[x.dtype] == 0 and _aligned(x, residual, weight, bias, y, res_out):
        flags |= VECTORIZED
    if config is not None and not config.specialize:
        flags |= GENERIC
    spec = fwd_spec(flags, x.dtype)
    cfg = config or (team_config(cols, x.dtype, is_rms) if spec else None) or launch_config(cols, x.dtype,
                                                                                            backward=False)
    if config is not None:
        check_fwd_config(config)
        if config.team and not spec:
            raise ValueError(f"norm forward: the team kernel {config} takes 16-bit rows on 16-byte boundaries, a "
                             f"multiple of 8 wide, with one of the flags {FWD_SPECS} (these have {flags & SPEC_MASK})")
        if config.team and config.threads * config.nv * 8 < cols:
            raise ValueError(f"norm forward: {config.threads} threads x {config.nv} chunks of 8 do not cover a row "
                             f"of {cols}")
    if rows == 0:
        return y, res_out, mean, rstd
    cap = "MEGAKERN_NORM_TEAM_MAXNREG" if cfg.team else "MEGAKERN_NORM_FWD_MAXNREG"
    defines = (f"{cap}={cfg.max_registers}",) if cfg.max_registers else ()
    if cfg.team:
        flags |= TEAM | (0 if cfg.prefetch else NO_PREFETCH) | (WEIGHT_REGS if cfg.weight_regs else 0) | (
            RELOAD if cfg.reload else 0)
        if path == "extension":
            regs = _cuda.extension()[0].norm_fwd_kernel_regs(dtype_code, cfg.nv, flags)
        else:
            name = _team_name(ctype, cfg.nv, spec, cfg.prefetch, cfg.weight_regs, cfg.reload)
            kernel = _cuda.nvrtc_kernel("norm/norm.cu", name, defines)
            regs = kernel.num_regs
        grid = (_persistent_grid(rows, cfg, regs, x.device) if cfg.persistent
                else math.ceil(rows / cfg.rows_per_block))
    else:
        grid = math.ceil(rows / (cfg.rows_per_block * cfg.row_batch))
    if path == "extension":
        _cuda.extension()[0].norm_fwd_rows(x, residual, weight, bias, y, res_out, mean, rstd, eps, flags, dtype_code,
                                           cfg.nv, cfg.row_batch, cfg.threads, cfg.rows_per_block, grid)
    else:
        if not cfg.team:
            name = _fwd_name(ctype, cfg.nv, bool(flags & VECTORIZED), cfg.row_batch, spec)
            kernel = _cuda.nvrtc_kernel("norm/norm.cu", name, defines)
        args = _nvrtc_args(("p", _ptr(x)), ("p", _ptr(residual)), ("p", _ptr(weight)), ("p", _ptr(bias)),
                           ("p", _ptr(y)), ("p", _ptr(res_out)), ("p", _ptr(mean)), ("p", _ptr(rstd)),
                           ("i64", rows), ("i32", cols), ("i64", _stride(x)), ("i64", _stride(residual)),
                           ("i64", _stride(y)), ("i64", _stride(res_out)), ("f32", eps))
        if not cfg.team:
            args += _nvrtc_args(("i32", flags))
        _cuda.nvrtc_launch(kernel, (grid,), (cfg.threads, cfg.rows_per_block), args, x.device)
    return y, res_out, mean, rstd


def bwd(dy, x, dres_out, weight, mean, rstd, is_rms: bool, residual_dtype: Optional[torch.dtype],
        need_dw: bool, need_db: bool, path: Optional[str] = None, config: Optional[LaunchConfig] = None):
    """(dx, dresidual | None, dweight | None, dbias | None).

    ``x`` is the tensor that was normalized (the input, or residual_out when a residual was fused);
    ``dres_out`` the gradient of residual_out, if any; ``residual_dtype`` the residual's dtype, if one was fused.
    """
    path = _cuda.choose_path(path)
    rows, cols = dy.shape
    dtype_code, ctype = _CTYPES[dy.dtype]
    dx = torch.empty((rows, cols), dtype=dy.dtype, device=dy.device)
    separate_dres = residual_dtype is not None and residual_dtype != dy.dtype
    dres = torch.empty((rows, cols), dtype=torch.float32, device=dy.device) if separate_dres else None
    has_db = need_db and not is_rms
    flags = (RMS if is_rms else 0) | (HAS_WEIGHT if weight is not None else 0) | (HAS_DW if need_dw else 0)
    if weight is not None and weight.dtype == torch.float32:
        flags |= W_F32
    if x.dtype == torch.float32:
        flags |= RES_F32
    flags |= (HAS_DRES_OUT if dres_out is not None else 0) | (HAS_DRES if separate_dres else 0)
    # partial lines are fresh, contiguous, cols * 4 bytes apart: aligned whenever the rest is
    if cols % _VEC[dy.dtype] == 0 and _aligned(x, dy, dres_out, weight, dx, dres):
        flags |= VECTORIZED
    vecio = bool(flags & VECTORIZED)
    cfg = config
    if cfg is None:  # the staged kernel where it takes these tensors, else the register kernel
        cfg = staged_config(cols, dy.dtype, has_db)
        if cfg is None or _staged_problem(cfg, dy, x, vecio, staged_smem_bytes(cols, dy.element_size(), cfg.nv,
                                                                                   has_db)):
            cfg = launch_config(cols, dy.dtype, backward=True)
    smem = staged_smem_bytes(cols, dy.element_size(), cfg.nv, has_db) if cfg.staged else 0
    if cfg.staged:
        problem = _staged_problem(cfg, dy, x, vecio, smem)
        if problem:
            raise ValueError(f"norm backward: the staged kernel {cfg} does not apply: {problem}")
        flags |= STAGED
        if not cfg.specialize:
            flags |= GENERIC
    if path == "extension":
        ext = _cuda.extension()[0]
        regs = ext.norm_bwd_kernel_regs(dtype_code, cfg.nv, has_db, flags)
    else:
        name = (_bwd_staged_name(ctype, cfg.nv, has_db, bwd_spec(flags, has_db)) if cfg.staged
                else _bwd_name(ctype, cfg.nv, has_db, vecio))
        kernel = _cuda.nvrtc_kernel("norm/norm.cu", name)
        regs = kernel.num_regs
    grid = _persistent_grid(max(rows, 1), cfg, regs, dy.device, smem)
    slots = grid * cfg.rows_per_block
    dw_partial = torch.empty((slots, cols), dtype=torch.float32, device=dy.device) if need_dw else None
    db_partial = torch.empty((slots, cols), dtype=torch.float32, device=dy.device) if has_db else None
    if path == "extension":
        ext.norm_bwd(x, dy, dres_out, weight, mean, rstd, dx, dres, dw_partial, db_partial, flags, dtype_code,
                     cfg.nv, has_db, cfg.threads, cfg.rows_per_block, grid)
    else:
        args = _nvrtc_args(("p", _ptr(x)), ("p", _ptr(dy)), ("p", _ptr(dres_out)), ("p", _ptr(weight)),
                           ("p", _ptr(mean)), ("p", _ptr(rstd)), ("p", _ptr(dx)), ("p", _ptr(dres)),
                           ("p", _ptr(dw_partial)), ("p", _ptr(db_partial)), ("i64", rows), ("i32", cols),
                           ("i64", _stride(x)), ("i64", _stride(dy)), ("i64", _stride(dres_out)),
                           ("i64", _stride(dx)), ("i64", _stride(dres)), ("i32", flags))
        _cuda.nvrtc_launch(kernel, (grid,), (cfg.threads, cfg.rows_per_block), args, dy.device, smem)
    dw = dw_partial.sum(0).to(weight.dtype) if need_dw else None
    db = db_partial.sum(0).to(weight.dtype) if has_db else None
    if residual_dtype is None:
        return dx, None, dw, db
    return dx, (dres if separate_dres else dx), dw, db


# ---- torch.library custom ops: what torch.compile sees of the CUDA path ----------------------------------------
def _empty(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0)


@torch.library.custom_op("megakern::norm_fwd", mutates_args=())
def norm_fwd_op(x: torch.Tensor, residual: Optional[torch.Tensor], weight: Optional[torch.Tensor],
                bias: Optional[torch.Tensor], eps: float, is_rms: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    y, res_out, mean, rstd = fwd(x, residual, weight, bias, eps, is_rms)
    return y, (res_out if res_out is not None else _empty(x)), (mean if mean is not None else _empty(rstd)), rstd


@norm_fwd_op.register_fake
def _(x, residual, weight, bias, eps, is_rms):
    rows = x.shape[0]
    res_out = x.new_empty(x.shape, dtype=residual.dtype) if residual is not None else x.new_empty(0)
    stat = x.new_empty(rows, dtype=torch.float32)
    return x.new_empty(x.shape), res_out, (x.new_empty(0, dtype=torch.float32) if is_rms else stat), stat.clone()


@torch.library.custom_op("megakern::norm_bwd", mutates_args=())
def norm_bwd_op(dy: torch.Tensor, x: torch.Tensor, dres_out: Optional[torch.Tensor], weight: Optional[torch.Tensor],
                mean: Optional[torch.Tensor], rstd: torch.Tensor, is_rms: bool, residual_dtype: Optional[torch.dtype],
                need_dw: bool, need_db: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dres, dw, db = bwd(dy, x, dres_out, weight, mean, rstd, is_rms, residual_dtype, need_dw, need_db)
    # Outputs may not alias each other: dres is returned only when it differs from dx (an fp32 residual);
    # the caller uses dx for a residual of dx's dtype.
    dres = dres if dres is not None and dres is not dx else _empty(dy)
    return dx, dres, (dw if dw is not None else _empty(dy)), (db if db is not None else _empty(dy))


@norm_bwd_op.register_fake
def _(dy, x, dres_out, weight, mean, rstd, is_rms, residual_dtype, need_dw, need_db):
    separate = residual_dtype is not None and residual_dtype != dy.dtype
    dres = dy.new_empty(dy.shape, dtype=torch.float32) if separate else dy.new_empty(0)
    dw = weight.new_empty(weight.shape) if need_dw else dy.new_empty(0)
    db = weight.new_empty(weight.shape) if (need_db and not is_rms) else dy.new_empty(0)
    return dy.new_empty(dy.shape), dres, dw, db
