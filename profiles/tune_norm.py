"""Launch-geometry sweep for the norm kernels, and host overhead per call.

Times the kernel-level launchers (no autograd) of megakern._norm_triton and megakern._norm_cuda over their tuning
knobs, bf16, against the copy roofline measured in the same run, and the host time of one public call on a tiny
input (what a launch costs the CPU). The defaults in the launchers are set from this table.

    python profiles/tune_norm.py [--hidden 8192,16384] [--ops rms,ln] [--residual] [--jobs 12] [--rep-ms 500]
                                 [--match REGEX] [--graph] [--against REV] [--against-csrc REV]

``--residual``: the backward also reads the gradient of the residual stream (the fused residual add of a pre-norm
block, as in training: one more M x N read), and the sweep covers more programs per SM. ``--jobs``: before the
timing, that many processes call every configuration once, so that the kernels compile in parallel into the
caches the timing process then reads (most of a sweep's time is compilation); 1 compiles as it times.
``--graph``: each configuration timed by CUDA-graph replay (GPU time, as a training step's graph runs it), not by
do_bench, which flushes the L2 before every call; a geometry that wins here only with a cold L2 can lose there.
``--against REV``: an A/B in one process: every matched Triton configuration is timed twice in a row, first with
megakern/_norm_triton.py as it is at the git revision REV (loaded beside the checkout's, importing the checkout's
other modules), labelled "@REV", then with the checkout's. Options the old module lacks make its row fail. REV may
also be the path of a copy of that file (a machine whose tree carries no git history, or an older one).
``--against-csrc REV``: the same for the CUDA launchers: every matched CUDA configuration timed twice in a row
through NVRTC, first compiled from csrc/ as it is at REV (or from a directory holding a copy of csrc/), labelled
"@REV", then from the checkout's csrc/ (megakern._cuda's MEGAKERN_CSRC; both rows NVRTC's, whatever path the
launcher would take).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import multiprocessing
import os
import re
import subprocess
import tarfile
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from benchmarks.common import bench, host_us, import_file, measure_copy_gbps
import megakern
from megakern import _cuda, _norm_cuda, _norm_triton
from megakern._intmath import next_power_of_2

ROWS_TOTAL = 2**27  # elements of each (M, N) tensor
OPS = {"rms": True, "ln": False}  # op -> is_rms
LAUNCHERS = ("triton fwd", "triton bwd", "cuda fwd", "cuda bwd")
REGISTER_CAPS = (48, 40, 32)  # the CUDA forward's default geometry also compiled under these caps


def cuda_geometries(n: int, backward: bool) -> list:
    """The CUDA kernels' launch shapes around the table's (bf16, 8 elements a 16-byte group): a warp per row (4 rows
    a block) holding the whole row, and a block per row at 1, 2 or 4 groups a thread, the forward taking 1, 2 or 4
    rows at once; within the kernels' thread
    bounds (1024 forward, 512 backward), the table's own left out; for the backward also the staged kernel's. Through NVRTC any groups count compiles (the
    extension's switch builds those within fwd_cap / BWD_CAP)."""
    default = _norm_cuda.launch_config(n, torch.bfloat16, backward)
    max_threads = _norm_cuda.BWD_MAX_THREADS if backward else _norm_cuda.FWD_MAX_THREADS
    groups = -(-n // 8)
    nvrtc = megakern.cuda_runtime()[0] == "nvrtc"
    out = []
    for nv in (1, 2, 4, 8):
        threads = 32 * -(-groups // (32 * nv))
        if threads > max_threads or 2 * groups <= threads * nv:  # too many threads, or half of them idle
            continue
        if nv * 8 > (_norm_cuda.BWD_CAP if backward else _norm_cuda.fwd_cap(torch.bfloat16)) and not nvrtc:
            continue  # the extension builds only the groups counts within its caps
        rows_per_block = 4 if threads == 32 else 1
        for batch in (1,) if backward else _norm_cuda.ROW_BATCHES:  # the forward: 1, 2 or 4 rows at once
            config = _norm_cuda.LaunchConfig(nv, threads, rows_per_block, row_batch=batch)
            if threads * rows_per_block * batch <= max_threads and config != default and config not in out:
                out.append(config)
    if backward:  # the staged kernel (the next row in shared memory), where its shared memory fits (LayerNorm's)
        for nv in _norm_cuda.STAGED_NV:
            threads = 32 * -(-groups // (32 * nv))
            smem = _norm_cuda.staged_smem_bytes(n, 2, nv, True)
            if threads <= max_threads and 2 * groups > threads * nv and smem <= 227 * 1024:
                out.append(_norm_cuda.LaunchConfig(nv, threads, 1, staged=True))
    return out


def specs(n: int, is_rms: bool, residual: bool) -> list[tuple[str, str, dict]]:
    """(label, launcher, keyword overrides) of every configuration swept at hidden size ``n``; launcher is one of
    'triton fwd', 'triton bwd', 'cuda fwd', 'cuda bwd'."""
    out = [("triton fwd default", "triton fwd", {})]
    # the table's geometry with the registers bounded (ptxas .maxnreg) so that one more program fits an SM: 3 of 8
    # warps at 84 or fewer, 4 at 64, 5 at 51; 6 of 4 warps at 85, 7 at 73, 8 at 64
    if n >= 2048:
        for maxnreg in (48, 64, 72, 80, 84):
            out.append((f"triton fwd maxnreg={maxnreg} (the table's geometry)", "triton fwd", dict(maxnreg=maxnreg)))
    for warps, rows_pp in ((4, 1), (8, 1), (16, 1), (4, 2), (8, 2), (16, 2), (16, 4), (4, 4), (8, 8)):
        out.append((f"triton fwd warps={warps} rows/program={rows_pp}", "triton fwd",
                    dict(num_warps=warps, rows_per_program=rows_pp, tiles=1)))
    if _norm_triton.tail_split(n):  # the row as two power-of-two tiles (fwd's tail), where they hold fewer columns
        for warps, rows_pp in ((4, 1), (8, 1), (16, 1), (8, 2), (4, 4)) + (((8, 8), (4, 2)) if n < 2048 else ()):
            out.append((f"triton fwd tail {_norm_triton.tail_split(n)} warps={warps} rows/program={rows_pp}",
                        "triton fwd", dict(num_warps=warps, rows_per_program=rows_pp, tiles=2)))
    if _norm_triton.three_split(n):  # the row as three power-of-two tiles, where they hold fewer columns than one
        for warps in (4, 8, 16):
            out.append((f"triton fwd three {_norm_triton.three_split(n)} warps={warps} rows/program=1", "triton fwd",
                        dict(num_warps=warps, rows_per_program=1, tiles=3)))
        # at 8 warps with the registers bounded, so that 3 programs fit an SM (65536 registers / 256 threads / 3)
        for maxnreg in (80, 84):
            out.append((f"triton fwd three {_norm_triton.three_split(n)} warps=8 rows/program=1 maxnreg={maxnreg}",
                        "triton fwd", dict(num_warps=8, rows_per_program=1, tiles=3, maxnreg=maxnreg)))
    # the two-pass forward for wide rows: (warps, chunk, stages; 2 pipelines its loops through shared memory, slower)
    if n >= 2048:
        for warps, chunk, stages in [(w, c, 1) for w in (4, 8, 16) for c in (1024, 2048, 4096)] + [(16, 8192, 1)]:
            if chunk > n:
                continue
            out.append((f"triton fwd wide warps={warps} chunk={chunk} stages={stages}", "triton fwd",
                        dict(num_warps=warps, wide=True, chunk=chunk, stages=stages)))
        # the same with the row's chunk count compiled in, both loops unrolled (torch.compile's RMSNorm at 9216-16384
        # is a looped reduction of 2048-column chunks at 16 warps over a row of known width)
        for warps, chunk in [(w, c) for w in (4, 8, 16, 32) for c in (512, 1024, 2048, 4096) if c <= n]:
            out.append((f"triton fwd wide unrolled warps={warps} chunk={chunk}", "triton fwd",
                        dict(num_warps=warps, wide=True, chunk=chunk, unrolled=True)))
    # LayerNorm's unrolled two-pass kernel with either statistics (shifted sums, Welford's chain), and at 8-16 warps
    # its registers bounded so that more of its programs fit an SM (at 8 warps: 4 at 64 registers, 6 at 40; 32-48
    # lost or were level at 12800-15360, profiles/h200/tune_ln_fwd_wide_bound_d321b2e.txt)
    if n > 8192 and not is_rms:
        for warps, chunk in ((4, 1024), (4, 2048), (8, 1024), (8, 2048), (16, 2048), (8, 4096), (16, 4096)):
            for sums in (True, False):
                for maxnreg in (None, 40) if chunk >= 2048 and warps >= 8 else (None,):
                    out.append((f"triton fwd wide unrolled warps={warps} chunk={chunk} sums={int(sums)} "
                                f"maxnreg={maxnreg}", "triton fwd", dict(num_warps=warps, wide=True, chunk=chunk,
                                                                          unrolled=True, sums=sums, maxnreg=maxnreg)))
    default = _norm_cuda.launch_config(n, torch.bfloat16, False)  # the row-group kernel's table geometry
    chosen = _norm_cuda.team_config(n, torch.bfloat16, is_rms) or default  # what a call without a config takes
    out.append((f"cuda fwd default {chosen}", "cuda fwd", {}))
    if chosen != default:
        out.append((f"cuda fwd row-group table {default}", "cuda fwd", dict(config=default)))
    for config in cuda_geometries(n, backward=False):
        out.append((f"cuda fwd {config}", "cuda fwd", dict(config=config)))
    # the default geometry under register caps (NVRTC --maxrregcount): more blocks an SM, so more bytes in flight
    # (sm_90: 65536 registers, 2048 threads an SM), against spills
    for cap in REGISTER_CAPS:
        config = dataclasses.replace(default, max_registers=cap)
        out.append((f"cuda fwd {config}", "cuda fwd", dict(config=config)))
    # the kernel that reads its flags at run time, where the default takes a specialized instance (csrc/norm/norm.h)
    generic = dataclasses.replace(default, specialize=False)
    out.append((f"cuda fwd {generic}", "cuda fwd", dict(config=generic)))
    # the team kernel (16-bit rows of the specialized flags): chunks a thread, with and without the next row in
    # flight, the weight in registers, or the row read again from L1 (on a persistent grid or a team a row), one-warp
    # teams a block; its table geometry also under register caps (NVRTC) and on a grid of a team a row
    team = _norm_cuda.team_geometry(n, torch.bfloat16)
    groups8 = -(-n // 8)  # 16-byte chunks of a bf16 row
    if team:
        out.append((f"cuda fwd team geometry {team}", "cuda fwd", dict(config=team)))
        for nv in _norm_cuda.TEAM_CHUNKS:
            threads = 32 * -(-groups8 // (32 * nv))
            for prefetch, weight_regs, reload in _norm_cuda.TEAM_MODES:
                for rows_per_block in (4, 8) if threads == 32 else (1,):
                    for persistent in (True, False) if reload else (True,):
                        config = _norm_cuda.LaunchConfig(nv, threads, rows_per_block, team=True, prefetch=prefetch,
                                                         weight_regs=weight_regs, reload=reload,
                                                         persistent=persistent)
                        if threads * rows_per_block <= _norm_cuda.TEAM_MAX_THREADS and config != team:
                            out.append((f"cuda fwd team {config}", "cuda fwd", dict(config=config)))
        for change in [dict(max_registers=r) for r in (96, 128)] + [dict(persistent=False)]:
            config = dataclasses.replace(team, **change)
            out.append((f"cuda fwd team {config}", "cuda fwd", dict(config=config)))
    # the backward in registers, named as such, dweight and dbias in the same kernel (where the table takes the
    # two-pass kernel or the strips, LayerNorm from 12289, these time the fused register kernel, not those):
    # (rows a step, warps, programs per SM, prefetch), warps from the
    # elements each thread holds of a step's rows (8, 16 or 32) and programs per SM filling 16 or 32 warps an SM;
    # several rows a step only up to 8192 elements a step
    geometries = set()
    for rows in (r for r in (1, 2, 4) if r == 1 or r * n <= 8192):
        for per_thread in (8, 16, 32):
            warps = rows * next_power_of_2(n) // (32 * per_thread)  # Triton's warps: a power of 2
            if not 2 <= warps <= 32:
                continue
            for warps_per_sm in (16, 32):
                for prefetch in (False, True):
                    geometries.add((rows, warps, max(1, warps_per_sm // warps), prefetch))
    if residual:
        geometries |= {(4, 4, 2, False), (4, 4, 4, False), (4, 4, 8, False), (2, 4, 8, False), (4, 8, 4, False),
                       (4, 8, 2, False), (8, 4, 4, False), (4, 2, 8, False), (2, 4, 16, False)}
    for rows, warps, per_sm, prefetch in sorted(geometries):
        out.append((f"triton bwd warps={warps} per_sm={per_sm} rows/step={rows} prefetch={int(prefetch)}",
                    "triton bwd",
                    dict(warps=warps, per_sm=per_sm, rows=rows, prefetch=prefetch, wide=False, tail=False,
                         split=False, strip_dx=False)))
    out.append(("triton bwd default", "triton bwd", {}))
    if _norm_triton.tail_split(n):  # the register backward's rows as two power-of-two tiles
        for rows, warps, per_sm, prefetch in sorted(geometries):
            out.append((f"triton bwd tail {_norm_triton.tail_split(n)} warps={warps} per_sm={per_sm} rows/step={rows} "
                        f"prefetch={int(prefetch)}", "triton bwd",
                        dict(warps=warps, per_sm=per_sm, rows=rows, prefetch=prefetch, tail=True, wide=False,
                             split=False, strip_dx=False)))
    if n >= 8192:  # the two-pass backward for wide rows: (rows a step, warps, programs per SM, chunk, stages)
        for rows, warps, per_sm, chunk, stages in ((1, 16, 1, 8192, 2), (1, 8, 2, 4096, 2), (2, 8, 2, 2048, 2),
                                                   (2, 8, 2, 4096, 2), (4, 8, 2, 1024, 2), (4, 8, 1, 2048, 2),
                                                   (2, 16, 1, 4096, 2), (4, 16, 1, 2048, 2), (2, 8, 4, 1024, 2),
                                                   (4, 8, 2, 2048, 3), (8, 8, 1, 1024, 2), (4, 4, 4, 1024, 2)):
            out.append((f"triton bwd wide rows/step={rows} warps={warps} per_sm={per_sm} chunk={chunk} "
                        f"stages={stages}", "triton bwd",
                        dict(rows=rows, warps=warps, per_sm=per_sm, wide=True, chunk=chunk, stages=stages)))
        # the same with the row's chunk count compiled in, both loops unrolled (as the forward's table has it)
        for rows, warps, per_sm, chunk in ((1, 16, 1, 4096), (1, 8, 2, 4096), (1, 8, 2, 2048), (1, 16, 1, 2048),
                                           (2, 8, 2, 2048), (2, 16, 1, 4096), (4, 8, 2, 1024), (1, 32, 1, 4096)):
            out.append((f"triton bwd wide unrolled rows/step={rows} warps={warps} per_sm={per_sm} chunk={chunk}",
                        "triton bwd", dict(rows=rows, warps=warps, per_sm=per_sm, wide=True, chunk=chunk,
                                           unrolled=True)))
    if n >= 8192:  # the split backward: dx alone (rows in registers to 16384, else two-pass), then the column sums
        dx_kernels = [dict(rows=1, warps=16, per_sm=1, wide=False, tail=False),
                      dict(rows=1, warps=8, per_sm=2, wide=False, tail=False),
                      dict(rows=1, warps=16, per_sm=1, prefetch=True, wide=False, tail=False)] if n <= 16384 else []
        dx_kernels += [dict(rows=4, warps=8, per_sm=2, wide=True, chunk=2048, stages=3),
                       dict(rows=2, warps=8, per_sm=2, wide=True, chunk=4096, stages=2),
                       dict(rows=1, warps=16, per_sm=1, wide=True, chunk=8192, stages=2)]
        for dx in dx_kernels:
            for geometry in ((256, 16, 4, 4), (128, 32, 4, 4), (512, 8, 8, 2), (256, 32, 8, 2), (1024, 4, 8, 2)):
                label = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in dx.items())
                out.append((f"triton bwd split {label} columns/rows/warps/per_sm={'/'.join(map(str, geometry))}",
                            "triton bwd", dict(dx, split=True, split_geometry=geometry)))
        # the rows' two sums alone by the two-pass kernel (x and dy read once), then dx with the column sums by the
        # strips (x and dy read again): no pass leans on rows kept in L2
        sums_kernels = [dict(rows=1, warps=16, per_sm=4, chunk=4096, unrolled=True),
                        dict(rows=1, warps=8, per_sm=8, chunk=4096, unrolled=True),
                        dict(rows=1, warps=16, per_sm=2, chunk=4096, unrolled=True),
                        dict(rows=2, warps=8, per_sm=2, chunk=2048, stages=2)]
        for sums in sums_kernels:
            for geometry in ((256, 16, 4, 4), (128, 32, 4, 4), (512, 8, 8, 2), (256, 32, 8, 2), (1024, 4, 8, 2)):
                label = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in sums.items())
                out.append((f"triton bwd strip_dx {label} columns/rows/warps/per_sm={'/'.join(map(str, geometry))}",
                            "triton bwd", dict(sums, wide=True, split=True, strip_dx=True, split_geometry=geometry)))
    out.append((f"cuda bwd default {_norm_cuda.launch_config(n, torch.bfloat16, True)}", "cuda bwd", {}))
    for config in cuda_geometries(n, backward=True):
        out.append((f"cuda bwd {config}", "cuda bwd", dict(config=config)))
    return out


class Inputs:
    """The tensors of one hidden size: x, dy (and the residual's gradient), weight, bias, and the forward's
    statistics."""

    def __init__(self, n: int, residual: bool, device: torch.device):
        m = ROWS_TOTAL // n
        self.x = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        self.dy = torch.randn_like(self.x)
        self.w = 1 + 0.1 * torch.randn(n, device=device, dtype=torch.bfloat16)
        self.b = 0.1 * torch.randn(n, device=device, dtype=torch.bfloat16)
        self.dres = torch.randn_like(self.x) if residual else None
        self.stats = {is_rms: _norm_triton.fwd(self.x, None, self.w, None if is_rms else self.b, 1e-5, is_rms)[2:]
                      for is_rms in OPS.values()}

    def call(self, launcher: str, is_rms: bool, kwargs: dict, triton_module=None, csrc: str | None = None):
        """One call of ``launcher`` with ``kwargs``; the Triton launchers from ``triton_module`` (default: the
        checkout's megakern._norm_triton); the CUDA launchers through NVRTC from the sources at ``csrc`` where it is
        given ('': the checkout's), else by the path the launcher takes."""
        bias = None if is_rms else self.b
        mean, rstd = self.stats[is_rms]
        residual_dtype = self.x.dtype if self.dres is not None else None
        triton_module = triton_module or _norm_triton
        if launcher == "triton fwd":
            return triton_module.fwd(self.x, None, self.w, bias, 1e-5, is_rms, **kwargs)
        if launcher == "triton bwd":
            return triton_module.bwd(self.dy, self.x, self.dres, self.w, mean, rstd, is_rms, residual_dtype, True,
                                     not is_rms, **kwargs)
        if csrc is not None:  # an A/B: both rows through NVRTC, each from its own sources
            kwargs = dict(kwargs, path="nvrtc")
        with csrc_sources(csrc) if csrc is not None else contextlib.nullcontext():
            if launcher == "cuda fwd":
                return _norm_cuda.fwd(self.x, None, self.w, bias, 1e-5, is_rms, **kwargs)
            return _norm_cuda.bwd(self.dy, self.x, self.dres, self.w, mean, rstd, is_rms, residual_dtype, True,
                                  not is_rms, **kwargs)


@contextlib.contextmanager
def csrc_sources(root: str):
    """The NVRTC path compiling from the kernel sources at ``root`` within the block (megakern._cuda's
    MEGAKERN_CSRC); '': the checkout's."""
    before = os.environ.get(_cuda.CSRC_ENV)
    if root:
        os.environ[_cuda.CSRC_ENV] = root
    else:
        os.environ.pop(_cuda.CSRC_ENV, None)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_cuda.CSRC_ENV, None)
        else:
            os.environ[_cuda.CSRC_ENV] = before


def load_revision(rev: str, directory: str):
    """megakern/_norm_triton.py as it is at git revision ``rev`` (or the copy at ``rev``, a path ending in .py),
    written into ``directory`` and imported as a module of its own (its imports are the checkout's modules)."""
    root = Path(__file__).resolve().parents[1]
    if rev.endswith(".py"):
        try:
            source = Path(rev).read_text()
        except OSError as exc:
            raise SystemExit(f"tune_norm: --against {rev!r}: cannot read that file: {exc}")
        if "def _fwd_config" not in source:
            raise SystemExit(f"tune_norm: --against {rev!r}: not a copy of megakern/_norm_triton.py "
                             "(no _fwd_config)")
    else:
        try:
            source = subprocess.run(["git", "show", f"{rev}:megakern/_norm_triton.py"], cwd=root,
                                    capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError) as exc:
            raise SystemExit(f"tune_norm: --against {rev!r}: cannot read megakern/_norm_triton.py there: "
                             f"{getattr(exc, 'stderr', '') or exc}".strip())
    path = Path(directory) / "_norm_triton_against.py"
    path.write_text(source)
    return import_file(path, "_norm_triton_against")


def load_csrc(rev: str, directory: str) -> str:
    """The kernel sources of --against-csrc: a directory holding a copy of csrc/ (its common/common.h, or
    csrc/common/common.h below it), else csrc/ as it is at git revision ``rev``, written into ``directory``."""
    path = Path(rev)
    for root in (path, path / "csrc"):
        if (root / "common" / "common.h").is_file():
            return str(root.resolve())
    try:
        archive = subprocess.run(["git", "archive", rev, "csrc"], cwd=Path(__file__).resolve().parents[1],
                                 capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise SystemExit(f"tune_norm: --against-csrc {rev!r}: neither a copy of csrc/ nor a revision whose csrc/ "
                         f"git can read: {getattr(exc, 'stderr', b'').decode(errors='replace') or exc}".strip())
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(directory, filter="data")
    return str(Path(directory) / "csrc")


def variants(launcher: str, against, against_csrc=None) -> list:
    """(label suffix, Triton module, CUDA sources) triples to time ``launcher`` with: the revision's first where
    there is one (``against``: (REV, module) for the Triton launchers; ``against_csrc``: (REV, csrc directory) for
    the CUDA ones, both rows then through NVRTC, the second from the checkout's sources, ''), then the checkout's."""
    if launcher.startswith("triton") and against is not None:
        rev, module = against
        return [(f" @{rev}", module, None), ("", None, None)]
    if launcher.startswith("cuda") and against_csrc is not None:
        rev, root = against_csrc
        return [(f" @{rev}", None, root), ("", None, "")]
    return [("", None, None)]


def _warm(job: tuple[int, bool, list[str], set[str], str, int, int, tuple | None, tuple | None]) -> int:
    """A worker of --jobs: calls every ``parts``-th configuration of hidden size ``n`` from the ``part``-th on once
    (compiling its kernels into the caches), with the --against revision's module and the --against-csrc sources
    too; returns how many ran."""
    n, residual, ops, launchers, pattern, part, parts, against_path, against_csrc = job
    against = None if against_path is None else (against_path[0], import_file(against_path[1], "_norm_triton_against"))
    inputs, done = Inputs(n, residual, torch.device("cuda")), 0
    for op in ops:
        chosen = [spec for spec in specs(n, OPS[op], residual) if spec[1] in launchers and re.search(pattern, spec[0])]
        for _, launcher, kwargs in chosen[part::parts]:
            for _, module, csrc in variants(launcher, against, against_csrc):
                try:
                    inputs.call(launcher, OPS[op], kwargs, module, csrc)
                    done += 1
                except Exception:  # the timing process reports it
                    pass
    torch.cuda.synchronize()
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", default="1024,4096,8192")
    parser.add_argument("--ops", default="rms,ln", help="comma-separated: rms, ln")
    parser.add_argument("--residual", action="store_true")
    parser.add_argument("--jobs", type=int, default=12, help="processes compiling the kernels first (1: none)")
    parser.add_argument("--rep-ms", type=int, default=500, help="timing window of each configuration")
    parser.add_argument("--launchers", default=",".join(LAUNCHERS),
                        help=f"comma-separated, of: {', '.join(LAUNCHERS)}")
    parser.add_argument("--match", default=None,
                        help="regular expression: only the configurations whose label it matches (e.g. 'default|tail')")
    parser.add_argument("--graph", action="store_true", help="time by CUDA-graph replay (no L2 flush)")
    parser.add_argument("--against", metavar="REV", default=None,
                        help="git revision (or a .py copy of megakern/_norm_triton.py): timed beside the "
                        "checkout's (an A/B)")
    parser.add_argument("--against-csrc", metavar="REV", default=None,
                        help="git revision (or a directory holding a copy of csrc/) whose CUDA kernels are timed "
                        "beside the checkout's, both through NVRTC (an A/B)")
    args = parser.parse_args()
    try:
        match = re.compile(args.match or "")
    except re.error as exc:
        raise SystemExit(f"tune_norm: --match {args.match!r} is not a regular expression: {exc}")
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    if unknown := set(ops) - set(OPS):
        raise SystemExit(f"tune_norm: unknown op(s) {sorted(unknown)}; known: {', '.join(OPS)}")
    hidden = [int(h) for h in args.hidden.split(",")]
    launchers = {name.strip() for name in args.launchers.split(",") if name.strip()}
    if unknown := launchers - set(LAUNCHERS):
        raise SystemExit(f"tune_norm: unknown launcher(s) {sorted(unknown)}; known: {', '.join(LAUNCHERS)}")
    against, against_path, scratch = None, None, tempfile.TemporaryDirectory(prefix="tune_norm_")
    if args.against:
        against = (args.against, load_revision(args.against, scratch.name))
        against_path = (args.against, str(Path(scratch.name) / "_norm_triton_against.py"))
    against_csrc = None
    if args.against_csrc:
        against_csrc = (args.against_csrc, load_csrc(args.against_csrc, scratch.name))
    dev = torch.device("cuda")
    if args.jobs > 1:
        start = time.perf_counter()
        parts = max(1, args.jobs // len(hidden))  # processes per hidden size, each with its own tensors
        jobs = [(n, args.residual, ops, launchers, match.pattern, part, parts, against_path, against_csrc)
                for n in hidden for part in range(parts)]
        with ProcessPoolExecutor(len(jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
            done = sum(pool.map(_warm, jobs))
        print(f"compiled: {done} configurations called once by {len(jobs)} processes in "
              f"{time.perf_counter() - start:.0f} s")
    copy = measure_copy_gbps(dev)
    print(f"copy roofline {copy:.0f} GB/s; timed by {'CUDA-graph replay' if args.graph else 'do_bench, L2 flushed'}")
    for n in hidden:
        m = ROWS_TOTAL // n
        inputs = Inputs(n, args.residual, dev)
        act = inputs.x.numel() * inputs.x.element_size()
        for op in ops:
            for name, launcher, kwargs in specs(n, OPS[op], args.residual):
                if launcher not in launchers or not match.search(name):
                    continue
                nbytes = 2 * act if launcher.endswith("fwd") else (4 if args.residual else 3) * act
                for suffix, module, csrc in variants(launcher, against, against_csrc):
                    label = name + suffix
                    try:
                        t = bench(lambda: inputs.call(launcher, OPS[op], kwargs, module, csrc), device=dev,
                                  rep_ms=args.rep_ms, graph=args.graph)["median"]
                    except Exception as exc:  # a geometry the kernel rejects: report it, keep sweeping
                        print(f"{op} {m}x{n} {label:55} failed: {(str(exc).splitlines() or [''])[0][:80]}")
                        continue
                    gbps = nbytes / t / 1e6
                    print(f"{op} {m}x{n} {label:55} {t * 1e3:8.1f} us {gbps:6.0f} GB/s {gbps / copy:5.2f}")
        del inputs
    import megakern

    xs = torch.randn(4, 1024, device=dev, dtype=torch.bfloat16)
    ws = torch.ones(1024, device=dev, dtype=torch.bfloat16)
    for backend in ("torch", "triton", "cuda"):
        us = host_us(lambda: megakern.rms_norm(xs, ws, backend=backend))
        xg = xs.clone().requires_grad_()
        us_g = host_us(lambda: megakern.rms_norm(xg, ws, backend=backend))
        print(f"host per call, rms_norm 4x1024 [{backend}]: {us:6.1f} us (no grad) {us_g:6.1f} us (x requires grad)")
    triton_us = host_us(lambda: _norm_triton.fwd(xs, None, ws, None, 1e-6, True))
    cuda_us = host_us(lambda: _norm_cuda.fwd(xs, None, ws, None, 1e-6, True))
    print(f"  kernel-only launch of triton fwd: {triton_us:6.1f} us, cuda fwd: {cuda_us:6.1f} us")


if __name__ == "__main__":
    main()
