"""Shared benchmark harness: timing, same-run rooflines, provider lookup, results on file.

Every benchmark measures its ceilings in the same run (`measure_copy_gbps`, `measure_matmul_tflops`),
times each provider with `bench` (median and p20/p80 in ms) and collects figures in `Results`, which
appends them to `benchmarks/results/<gpu>/<bench>.csv` with the header in `CSV_HEADER` (`file_rows`) and renders
the markdown table printed last.

A run on a CPU is a smoke test of this machinery and of each provider's outputs, on tiny shapes: what it measures is
the host time per call, dominated by Python and dispatch. It prints those milliseconds, not GB/s, TFLOP/s or
fractions of a roofline (figures of a device, meaningless for a few KiB on a shared CPU), and files no rows unless
``--out`` names a directory.
"""

import argparse
import atexit
import csv
import datetime
import importlib.util
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch

CSV_HEADER = ("date", "git_sha", "gpu", "torch", "triton", "bench", "case", "mode", "provider", "metric", "value")
RESULTS_DIR = Path(__file__).resolve().parent / "results"
# Same-run ceilings: figure metric -> roofline metric it is divided by.
ROOFLINES = {"GB/s": "copy GB/s", "TFLOP/s": "bf16 matmul TFLOP/s"}
SMOKE_NOTE = ("{device}: a smoke run on tiny shapes, each provider checked against the fp32 reference and timed; "
              "ms per call on this {device}, mostly host overhead. {metric} and fractions of the roofline are figures "
              "of a CUDA device: run this benchmark on a GPU for them.")

_VENDOR_WORDS = {"nvidia", "amd", "tesla", "geforce", "quadro", "radeon", "instinct"}


class Unavailable(Exception):
    """Raised by a provider loader whose provider cannot run here; the message says why."""


def gpu_slug(device) -> str:
    """Short accelerator name for file paths: 'NVIDIA H100 80GB HBM3' -> 'h100'; 'cpu' on CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    words = re.split(r"[\s_-]+", torch.cuda.get_device_name(device).lower())
    words = [w for w in words if w and w not in _VENDOR_WORDS]
    if len(words) > 1 and words[0] in ("rtx", "gtx"):  # 'RTX 4090' -> 'rtx4090'
        words[0] += words.pop(1)
    return re.sub(r"[^a-z0-9]", "", words[0]) if words else "gpu"


def import_file(path, name: str):
    """The Python file at ``path`` imported as a module named ``name`` (a profile script, or another version of a
    megakern module placed beside the checkout's for an A/B), not registered in sys.modules."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def git_sha() -> str:
    """MEGAKERN_GIT_SHA if set (copies of the tree without .git), else the short HEAD (+'-dirty')."""
    if sha := os.environ.get("MEGAKERN_GIT_SHA"):
        return sha
    repo = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + "-dirty" if dirty else sha


def host_us(fn: Callable[[], object], calls: int = 200) -> float:
    """Host microseconds per call of ``fn`` on a CUDA device: perf_counter around ``calls`` calls with no
    synchronization inside (after warm-up and a sync), so the figure is the time to issue the work, not to run it,
    as long as the GPU's queue does not fill."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter_ns() - start
    torch.cuda.synchronize()
    return elapsed / calls / 1e3


def bench(fn: Callable[[], object], *, device, warmup_ms: int = 100, rep_ms: int = 500,
          graph: bool = False) -> dict[str, float]:
    """Time fn: {'median', 'p20', 'p80'} in ms.

    CUDA: triton's do_bench (CUDA events, L2 flushed before every run, as many runs as fit in rep_ms), or with
    ``graph`` its do_bench_cudagraph: fn captured in a CUDA graph and replayed, i.e. the GPU time without the host
    overhead of launching (eager timings include it wherever the host cannot keep ahead of the GPU).
    CPU (smoke tests only: the interpreter's figures mean nothing): perf_counter_ns around five calls, after one
    warm-up call.
    """
    if torch.device(device).type == "cuda":
        from triton.testing import do_bench, do_bench_cudagraph

        if graph:
            median, p20, p80 = do_bench_cudagraph(fn, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
        else:
            median, p20, p80 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
        return {"median": median, "p20": p20, "p80": p80}
    fn()
    times = []
    for _ in range(5):
        start = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - start) / 1e6)
    deciles = statistics.quantiles(times, n=10, method="inclusive")
    return {"median": deciles[4], "p20": deciles[1], "p80": deciles[7]}


def init_rank(rank: int, world: int, port: int, device_type: str) -> torch.device:
    """This spawned process as rank ``rank`` of ``world`` on 127.0.0.1:``port``: NCCL on cuda:``rank``, or gloo on
    the CPU; returns the rank's device."""
    import torch.distributed as dist

    device = torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, device_id=device if device.type == "cuda" else None)
    return device


def tp_sizes(requested: list[int] | None, device, defaults: tuple[int, ...], bench: str) -> list[int]:
    """The group sizes a multi-rank benchmark runs: ``requested`` (--tp), else those of ``defaults`` this machine's
    GPUs hold (2 on a CPU: gloo ranks); SystemExit naming the GPUs when it has too few."""
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.type == "cuda" and gpus < 2:
        raise SystemExit(f"{bench} needs at least 2 GPUs, this machine has {gpus}")
    sizes = requested or ([k for k in defaults if k <= gpus] if gpus else [2])
    if gpus and (too_many := [k for k in sizes if k > gpus]):
        raise SystemExit(f"--tp {too_many}: this machine has {gpus} GPUs")
    return sizes


def run_ranks(fn: Callable, world: int, *args):
    """``fn(rank, world, port, *args, queue)`` in ``world`` spawned processes on a free local port (each calls
    init_rank; the process group is ended for it, see ``_rank_main``); returns what rank 0 put on the queue."""
    import socket

    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").Queue()
    with socket.socket() as sock:  # a free port for the run's rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(_rank_main, args=(fn, world, port, *args, queue), nprocs=world, join=True,
                       start_method="spawn")
    return queue.get()


def _rank_main(rank: int, fn: Callable, *args) -> None:
    """A spawned rank: ``fn(rank, *args)``, then the end of its process group, whether fn returned or raised. After
    a normal return every rank waits for the others (a barrier) before destroying it, and the objects that still
    hold the group (often in reference cycles of fn's closures) are collected at once: gloo's threads then end here,
    not in the interpreter's teardown, where a thread left running aborted the process ("terminate called without an
    active exception", a rank killed by SIGABRT now and then)."""
    import gc

    import torch.distributed as dist

    finished = False
    try:
        fn(rank, *args)
        finished = True
    finally:
        if dist.is_initialized():
            if finished:
                dist.barrier()
            dist.destroy_process_group()
        gc.collect()


def timed_on_ranks(fn: Callable[[], object], device, calls: int, warmup: int, align: bool = False) -> dict[str, float]:
    """{'median', 'p20', 'p80'} ms of ``calls`` calls of ``fn`` after ``warmup``, for benchmarks run on the ranks of
    a process group: every rank makes the same number of calls (their collectives must pair up; triton's do_bench
    picks its repetitions per rank and would deadlock them), each timed by CUDA events (the host's clock on a CPU),
    and the slowest rank's figures are returned on every rank. ``align``: the ranks start each call together (a
    barrier and a device sync first), so that a rank's wait for a late peer is not counted as the op's time."""
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        if device.type == "cuda":
            if align:
                dist.barrier()
                torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter_ns()
            fn()
            times.append((time.perf_counter_ns() - t0) / 1e6)
    q = statistics.quantiles(times, n=10, method="inclusive")
    figures = torch.tensor([q[4], q[1], q[7]], dtype=torch.float64, device=device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    return dict(zip(("median", "p20", "p80"), figures.tolist()))


def peak_gib(step: Callable[[], object], device) -> float | None:
    """GiB allocated at the peak of one ``step`` beyond what was allocated before it (CUDA), else None."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**30


def measure_copy_gbps(device) -> float:
    """Device-to-device copy throughput in GB/s, counting bytes read + written (2 GiB on CUDA)."""
    device = torch.device(device)
    numel = 2**29 if device.type == "cuda" else 2**22  # fp32: 2 GiB on CUDA, 16 MiB on CPU
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), device=device)["median"]
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def measure_matmul_tflops(device) -> float:
    """Dense matmul throughput in TFLOP/s: 8192^3 bf16 on CUDA, a small fp32 one on CPU."""
    device = torch.device(device)
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    out = torch.empty(n, n, device=device, dtype=dtype)
    ms = bench(lambda: torch.mm(a, b, out=out), device=device)["median"]
    return 2 * n**3 / (ms * 1e-3) / 1e12


def import_peer(device, package: str, importer: Callable):
    """``importer()`` (the import of a frontier peer: flash-attn-4, quack-kernels, cut-cross-entropy), or Unavailable
    saying why not: they need CUDA, and the GPU machines get them as ../shared/peers/README.md says."""
    if torch.device(device).type != "cuda":
        raise Unavailable(f"{package} needs CUDA")
    try:
        return importer()
    except ImportError as e:
        raise Unavailable(f"{package} is not installed ({e}; ../shared/peers/README.md brings it)") from e


def load_providers(loaders: dict[str, Callable], device, wanted: set[str] | None = None) -> dict:
    """Call each loader(device) and keep what it returns; a loader that fails is skipped with one line.

    Loaders import their provider lazily and raise (ImportError, Unavailable, anything) when it cannot
    run here, so a missing peer or an unbuilt backend never stops the benchmark.
    """
    if unknown := (wanted or set()) - loaders.keys():
        raise SystemExit(f"unknown providers {sorted(unknown)}; choose from {sorted(loaders)}")
    providers = {}
    for name, load in loaders.items():
        if wanted and name not in wanted:
            continue
        try:
            providers[name] = load(torch.device(device))
        except Exception as e:
            print(f"skip {name}: {_reason(e)}")
    return providers


def _reason(e: Exception) -> str:
    return str(e) if isinstance(e, Unavailable) else f"{type(e).__name__}: {e}"


def report_failure(provider: str, case: str, e: Exception) -> None:
    """One line for a provider that raised or was wrong at run time; the benchmark goes on without it."""
    print(f"skip {provider} on {case}: {_reason(e)}")


def _fmt(value: float) -> str:
    return f"{value:.1f}" if abs(value) >= 1000 else f"{value:.4g}"


def _fmt_short(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:#.3g}"


class Results:
    """Figures of one benchmark run, saved as CSV rows and rendered as a markdown table.

    Every figure whose metric has a same-run roofline (GB/s, TFLOP/s) is also put on file as a
    `roofline_frac` row (value / roofline) right after it.
    """

    def __init__(self, device):
        try:
            import triton

            triton_version = triton.__version__
        except ImportError:
            triton_version = "none"
        self.meta = {"gpu": gpu_slug(device), "git_sha": git_sha(), "torch": torch.__version__,
                     "triton": triton_version}
        # Not a CUDA device: rates of tiny shapes against a roofline mean nothing; ms per call is what is shown.
        self.smoke = torch.device(device).type != "cuda"
        self.figures: list[tuple[str, str, str, str, float]] = []
        self.rooflines: dict[str, float] = {}  # figure metric ('GB/s') -> roofline value
        self.filed = False  # file_rows has been called (see keep_rows_on_exit)
        self.on_exit = None  # keep_rows_on_exit's atexit handler, dropped once file_rows runs

    def add(self, case: str, mode: str, provider: str, metric: str, value: float) -> None:
        self.figures.append((case, mode, provider, metric, float(value)))

    def add_roofline(self, metric: str, value: float) -> None:
        """Record a same-run ceiling: metric is a key of ROOFLINES ('GB/s' for the copy roofline)."""
        self.rooflines[metric] = float(value)
        self.add("roofline", "-", "roofline", ROOFLINES[metric], value)

    def frac(self, metric: str, value: float) -> float | None:
        roofline = self.rooflines.get(metric)
        return value / roofline if roofline else None

    def rows(self) -> list[tuple[str, str, str, str, float]]:
        """All figures, each followed by its roofline_frac row where it has a roofline."""
        rows = []
        for case, mode, provider, metric, value in self.figures:
            rows.append((case, mode, provider, metric, value))
            if provider != "roofline" and (frac := self.frac(metric, value)) is not None:
                rows.append((case, mode, provider, "roofline_frac", frac))
        return rows

    def save(self, bench_name: str, out_dir=RESULTS_DIR, date: str | None = None) -> Path:
        """Append the rows to <out_dir>/<gpu>/<bench_name>.csv; the header is written to new files only. ``date``:
        the run's UTC date (default: today's)."""
        path = Path(out_dir) / self.meta["gpu"] / f"{bench_name}.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists() or path.stat().st_size == 0
        date = date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
        meta = (date, self.meta["git_sha"], self.meta["gpu"], self.meta["torch"], self.meta["triton"], bench_name)
        with path.open("a", newline="") as f:
            writer = csv.writer(f, lineterminator="\n")
            if new:
                writer.writerow(CSV_HEADER)
            writer.writerows(meta + (case, mode, provider, metric, _fmt(value))
                             for case, mode, provider, metric, value in self.rows())
        return path

    def markdown(self, metric: str) -> str:
        """Table of one metric: a row per (case, mode), a column per provider, cells 'value unit (frac)'.

        In a smoke run a metric with a roofline (GB/s, TFLOP/s) is not shown: the table gives the same cells' ms per
        call instead, under a line saying what was measured (``SMOKE_NOTE``)."""
        shown = "ms" if self.smoke and metric in ROOFLINES else metric
        wanted = {(case, mode, provider) for case, mode, provider, m, _ in self.figures if m == metric}
        cells: dict[tuple[str, str], dict[str, str]] = {}
        providers: list[str] = []
        for case, mode, provider, m, value in self.figures:
            if m != shown or provider == "roofline" or (case, mode, provider) not in wanted:
                continue
            if provider not in providers:
                providers.append(provider)
            frac = None if shown == "ms" else self.frac(metric, value)
            cells.setdefault((case, mode), {})[provider] = (
                f"{_fmt_short(value)} {shown}" + (f" ({frac:.2f})" if frac is not None else ""))
        lines = []
        if shown != metric:
            lines += [SMOKE_NOTE.format(device=self.meta["gpu"], metric=metric), ""]
        elif metric in self.rooflines:
            lines += [f"Same-run roofline, {ROOFLINES[metric]}: {_fmt_short(self.rooflines[metric])}", ""]
        lines += ["| " + " | ".join(["case", "mode", *providers]) + " |",
                  "|" + "---|" * (2 + len(providers))]
        lines += ["| " + " | ".join([case, mode, *(row.get(p, "-") for p in providers)]) + " |"
                  for (case, mode), row in cells.items()]
        return "\n".join(lines)


def check_outputs(names, outs, ref, tol: float, floor: float = 1.0) -> None:
    """Raise AssertionError naming the first output off its fp32 reference: max |out - ref| > tol * max(floor,
    max |ref|) (NaN fails too). Every benchmark checks each provider this way before timing it."""
    for name, out, expected in zip(names, outs, ref):
        err = ((out.float() - expected).abs().max() / expected.abs().max().clamp_min(floor)).item()
        if not err <= tol:  # catches NaN too
            raise AssertionError(f"{name} is off the fp32 reference: scaled max abs error {err:.3g} > {tol}")


def record(results: "Results", case: str, mode: str, provider: str, timing: dict[str, float], metric: str,
           value: float) -> None:
    """File the median time and one figure for (case, mode, provider), and print the line (in a smoke run the time
    alone: see ``Results.smoke``)."""
    results.add(case, mode, provider, "ms", timing["median"])
    results.add(case, mode, provider, metric, value)
    line = (f"{case:<34} {mode:<14} {provider:<16} {timing['median']:9.4f} ms "
            f"[p20 {timing['p20']:.4f}, p80 {timing['p80']:.4f}]")
    if not results.smoke:
        frac = results.frac(metric, value)
        line += f" {value:9.2f} {metric}" + (f" ({frac:.2f})" if frac is not None else "")
    print(line)


def file_rows(results: "Results", bench_name: str, out: Path | None, no_save: bool = False) -> Path | None:
    """Append the run's rows under ``out`` (default: benchmarks/results/ for a GPU run) and say where; a smoke run
    files none unless ``out`` is given. Returns the CSV written, if any."""
    results.filed = True
    _KEPT[:] = [kept for kept in _KEPT if kept is not results]
    if results.on_exit is not None:
        atexit.unregister(results.on_exit)
        results.on_exit = None
    if no_save:
        return None
    if out is None and results.smoke:
        print(f"no rows filed: a {results.meta['gpu']} run is a smoke test, not figures for {RESULTS_DIR} "
              "(--out DIR files them under DIR)")
        return None
    path = results.save(bench_name, RESULTS_DIR if out is None else out)
    print(f"saved {path}")
    return path


SIGTERM_GRACE_S = 20.0
"""Seconds a benchmark stopped by SIGTERM may take to unwind before it ends at once (os._exit)."""
_KEPT: list = []  # the Results of keep_rows_on_exit, filed first by a SIGTERM
_PREVIOUS_SIGTERM: list = []  # the Python SIGTERM handler that keep_rows_on_exit's replaced, called after the filing


def _end_now(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _exit_on_sigterm(signum, _frame):
    """File the measured rows before anything else runs (another library's exit handlers, such as torch.compile's
    worker pools, can hang and run before keep_rows_on_exit's), then unwind; past SIGTERM_GRACE_S the process ends
    without waiting further, with the same status."""
    for results in _KEPT:
        if results.on_exit is not None:
            results.on_exit()
    stop = threading.Timer(SIGTERM_GRACE_S, _end_now, (128 + signum,))
    stop.daemon = True
    stop.start()
    for previous in _PREVIOUS_SIGTERM:  # a library's own handler (its clean-up), once the rows are safe
        previous(signum, _frame)
    raise SystemExit(128 + signum)


def keep_rows_on_exit(results: "Results", bench_name: str, out: Path | None, no_save: bool = False) -> None:
    """File the run's rows (``file_rows``, same arguments) even when the run ends before its own call: stopped by
    SIGTERM (``timeout``, a scheduler) or by an exception, the figures measured so far are appended, after a line
    saying so. For benchmarks of one process: under torchrun every rank would file its own."""
    def on_exit():
        measured = len(results.figures) - len(results.rooflines)
        if not results.filed and measured > 0:
            print(f"the run ended early: filing the {measured} figures it measured")
            file_rows(results, bench_name, out, no_save)
    results.on_exit = on_exit
    atexit.register(on_exit)
    _KEPT.append(results)
    # SIGTERM then files the rows and unwinds, so atexit handlers run; a Python handler installed before (by a library
    # the benchmark imported) is called after the filing. One that ignores SIGTERM, or one installed outside Python,
    # is left in place.
    current = signal.getsignal(signal.SIGTERM)
    if current is not _exit_on_sigterm and (current is signal.SIG_DFL or callable(current)):
        _PREVIOUS_SIGTERM[:] = [current] if callable(current) else []
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


def int_list(text: str) -> list[int]:
    """A comma-separated list of ints, as options such as --chunks 1024,4096 take (empty items skipped)."""
    return [int(item) for item in text.split(",") if item.strip()]


def parse_args(description: str, argv: list[str] | None = None,
               extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """Options every benchmark takes: --quick, --out, --no-save, --device, --providers, --graph; ``extra`` adds a
    benchmark's own."""
    parser = argparse.ArgumentParser(description=description)
    if extra is not None:
        extra(parser)
    parser.add_argument("--quick", action="store_true", help="fewer cases")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"results root (default: {RESULTS_DIR} for a GPU run; a CPU run files no rows without it)")
    parser.add_argument("--no-save", action="store_true", help="print the table, write no CSV rows")
    parser.add_argument("--device", type=torch.device, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--providers", type=lambda s: {p.strip() for p in s.split(",") if p.strip()},
                        help="comma-separated providers to run (default: all)")
    parser.add_argument("--graph", action="store_true",
                        help="time CUDA-graph replays (GPU time without launch overhead); modes get a ' graph' suffix")
    return parser.parse_args(argv)


# ---- launches of several processes (torchrun) ----------------------------------------------------------------
def stop_launch(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """Stop a launch started in a session of its own, with its ranks: SIGTERM to torchrun first (it stops its ranks,
    which run in sessions of their own, so that killing torchrun or its session alone leaves them running as
    orphans), then SIGKILL to its session after ``grace`` seconds or once torchrun has gone."""
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=grace)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_launch(cmd: list[str], *, timeout: float, cwd=None, env=None) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout) for a launch such as torchrun: in a
    session of its own, its output through temporary files (a rank left running cannot hold a pipe open); past
    ``timeout`` it is stopped with its ranks (``stop_launch``) and subprocess.TimeoutExpired raised with its output."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err, text=True, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_launch(proc)
            out.seek(0)
            err.seek(0)
            raise subprocess.TimeoutExpired(cmd, timeout, out.read(), err.read()) from None
        except BaseException:  # interrupted: nothing of the launch left behind
            stop_launch(proc)
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())
