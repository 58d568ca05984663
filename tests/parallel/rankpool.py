"""Spawned gloo ranks for the parallel tests, kept alive across checks.

``pool(n)`` returns n worker processes that have initialized torch.distributed (gloo, through
megakern.parallel.init_distributed) once; ``pool(n).run(fn, *args)`` runs the module-level function ``fn(*args)`` on
every rank and returns the list of results by rank. Any error or a rank silent past the deadline fails the check
with every rank's traceback and retires the pool (the next ``pool(n)`` spawns a fresh one), so a hang fails instead
of blocking the suite. Workers use one thread each: 4 ranks share 2 cores. Ranks (and ``spawn``'s processes) fork
from multiprocessing's forkserver, which has imported torch and megakern.parallel once: a rank starts in a fraction
of a second instead of importing torch itself (seconds each, minutes on a loaded machine), and ranks started
together come up together (a rendezvous with a short timeout does not wait on another rank's imports).

After each check every rank releases what the check made: the ParallelMesh objects built in it
(``ParallelMesh.close()``: their process groups and torch's DTensor caches that hold their meshes), then any other
process group the check left (a pipeline's tied-embedding groups, a checkpoint's background group, groups a check
made itself). Gloo runs threads for every group (its I/O loop and workers), so groups kept across hundreds of checks
pile up hundreds of idle threads per rank that cost the machine system time; ``pool(n).run(threads)`` gives each
rank's count.

A rank that dies of a signal (a native crash inside torch or gloo: glibc's abort on a corrupted heap, a segfault) is
not a check's answer: the pool restarts its ranks and runs the check once more on fresh processes, with a warning
that names the signal; a second crash fails the check. A Python error or a wrong result is never run again.
"""
from __future__ import annotations

import atexit
import gc
import os
import queue
import signal
import time
import traceback
import warnings

import torch.multiprocessing as mp
from ports import free_port  # noqa: F401 - the parallel tests take it from here

PG_TIMEOUT_S = 45.0  # every collective in a worker; a mismatched collective raises after this
RUN_TIMEOUT_S = 120.0  # a whole check, all ranks
GRACE_S = 3.0  # after the first rank's error or death, how long to wait for the others' reports
CRASH_RETRIES = 1  # a check whose rank died of a signal runs again this many times, on fresh ranks
POLL_S = 1.0  # how often a wait for results looks for dead ranks


def _context():
    """The forkserver context, torch and megakern.parallel preloaded (test_watchdog.py's forkserver is the same)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "megakern.parallel"])
    return ctx


def _worker(rank: int, world: int, port: int, tasks, results, pg_timeout: float) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        from megakern.parallel import init_distributed

        init_distributed(backend="gloo", rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                         timeout=pg_timeout, device_type="cpu")
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", traceback.format_exc()))
        return
    results.put((rank, "ready", None))
    import torch.distributed as dist

    meshes = _track_meshes()
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=5.0)
        except queue.Empty:
            if os.getppid() != parent:  # the test process is gone without closing the pool (an xdist worker's exit)
                break
            continue
        if task is None:
            break
        fn, args, kwargs = task
        groups = set(_live_groups())
        try:
            out = fn(*args, **kwargs)
            _release(meshes, groups)
            results.put((rank, "ok", out))
        except BaseException:  # noqa: BLE001 - reported to the parent (which retires the pool)
            results.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


def _track_meshes() -> list:
    """The list every ParallelMesh made in this process from now on is appended to (as its __init__ starts: a mesh
    that fails half-way is released too)."""
    from megakern.parallel import ParallelMesh

    built, init = [], ParallelMesh.__init__

    def tracked(self, *args, **kwargs):
        built.append(self)
        init(self, *args, **kwargs)

    ParallelMesh.__init__ = tracked
    return built


def _live_groups() -> list:
    """This rank's process groups other than the default one, oldest first."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    return [g for g in _world.pg_map if g is not dist.group.WORLD]


def _release(meshes: list, before: set) -> None:
    """After a check: once every rank is done (a barrier), close the meshes it built, then destroy the groups it made
    outside them (those not in ``before``)."""
    import torch.distributed as dist

    dist.barrier()
    while meshes:
        meshes.pop(0).close()
    for group in _live_groups():
        if group not in before:
            dist.destroy_process_group(group)
    gc.collect()  # a group's threads end with its last reference, often held in a cycle of the check's objects


def threads() -> int:
    """This process's threads (the kernel's count: gloo's native threads too)."""
    return len(os.listdir("/proc/self/task"))


def settled_threads(window_s: float = 1.0) -> int:
    """The fewest of this process's threads over ``window_s`` (polled every 10 ms): a thread that is ending, as a
    destroyed group's may still be for a moment on a loaded machine, does not count; one that stays does."""
    fewest = threads()
    deadline = time.monotonic() + window_s
    while time.monotonic() < deadline:
        time.sleep(0.01)
        fewest = min(fewest, threads())
    return fewest


class RankCrashed(AssertionError):
    """A check failed because a rank's process died of a signal."""


class RankPool:
    """``world`` ranks with a gloo process group, answering ``run`` calls."""

    def __init__(self, world: int, pg_timeout: float = PG_TIMEOUT_S):
        self.world, self.pg_timeout = world, pg_timeout
        self._start()

    def _start(self) -> None:
        """Spawn the ranks and wait until each has joined the process group."""
        ctx = _context()
        self.broken = False
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(self.world)]
        port = free_port()
        self.procs = [ctx.Process(target=_worker,
                                  args=(r, self.world, port, self.tasks[r], self.results, self.pg_timeout),
                                  daemon=True) for r in range(self.world)]
        for p in self.procs:
            p.start()
        self._collect("init", RUN_TIMEOUT_S, expect="ready")

    def _signalled(self) -> dict[int, str]:
        """The ranks whose process died of a signal, with the signal's name."""
        out = {}
        for rank, p in enumerate(self.procs):
            code = p.exitcode
            if code is not None and code < 0:
                try:
                    out[rank] = signal.Signals(-code).name
                except ValueError:
                    out[rank] = f"signal {-code}"
        return out

    def _collect(self, what: str, timeout: float, expect: str = "ok") -> list:
        outs, errors = {}, {}
        deadline = time.monotonic() + timeout
        while len(outs) + len(errors) < self.world:
            now = time.monotonic()
            if errors or any(not p.is_alive() for r, p in enumerate(self.procs) if r not in outs):
                deadline = min(deadline, now + GRACE_S)  # a rank that is gone will not answer
            left = deadline - now
            if left <= 0:
                break
            try:
                rank, kind, payload = self.results.get(timeout=min(left, POLL_S))
            except queue.Empty:
                continue
            (outs if kind == expect else errors)[rank] = payload
        if errors or len(outs) < self.world:
            crashed = {r: sig for r, sig in self._signalled().items() if r not in outs}
            self.close(kill=True)
            silent = [r for r in range(self.world) if r not in outs and r not in errors and r not in crashed]
            report = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            report += "".join(f"\n--- rank {r} died of {sig} ---" for r, sig in sorted(crashed.items()))
            if silent:
                report += f"\n--- ranks {silent} gave no answer within {timeout:g} s ---"
            raise (RankCrashed if crashed else AssertionError)(f"{what} failed on {self.world} ranks:{report}")
        return [outs[r] for r in range(self.world)]

    def run(self, fn, *args, timeout: float = RUN_TIMEOUT_S, **kwargs) -> list:
        """fn(*args, **kwargs) on every rank; the results by rank. A check that a rank's crash ended runs again on
        fresh ranks (CRASH_RETRIES times, with a warning)."""
        if self.broken:
            raise RuntimeError("this RankPool was retired after a failure; get a new one from pool(n)")
        what, attempt = getattr(fn, "__name__", repr(fn)), 0
        while True:
            for q in self.tasks:
                q.put((fn, args, kwargs))
            try:
                return self._collect(what, timeout)
            except RankCrashed as crash:
                if attempt == CRASH_RETRIES:
                    raise
                attempt += 1
                warnings.warn(f"{crash}\n{what} runs again on {self.world} fresh ranks", RuntimeWarning,
                              stacklevel=2)
                self._start()

    def close(self, kill: bool = False) -> None:
        self.broken = True
        if not kill:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


_POOLS: dict[int, RankPool] = {}


def pool(world: int) -> RankPool:
    """The live pool of ``world`` ranks (started on first use, or again after a failure)."""
    current = _POOLS.get(world)
    if current is None or current.broken:
        _POOLS[world] = current = RankPool(world)
    return current


@atexit.register
def _close_all() -> None:
    for p in _POOLS.values():
        if not p.broken:
            p.close()


def _one_off(fn, rank, args, results) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        results.put((rank, "ok", fn(rank, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", traceback.format_exc()))


def spawn(fn, ranks, *args, timeout: float = RUN_TIMEOUT_S) -> dict:
    """Run fn(rank, *args) in one new process per entry of ``ranks`` (no process group: fn makes its own);
    {rank: result}. A process silent past ``timeout`` is killed and fails the check."""
    ctx = _context()
    results = ctx.Queue()
    procs = [ctx.Process(target=_one_off, args=(fn, r, args, results), daemon=True) for r in ranks]
    for p in procs:
        p.start()
    outs, errors = {}, {}
    deadline = time.monotonic() + timeout
    try:
        while len(outs) + len(errors) < len(procs):
            try:
                rank, kind, payload = results.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                break
            (outs if kind == "ok" else errors)[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if errors or len(outs) < len(procs):
        report = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        silent = [r for r in ranks if r not in outs and r not in errors]
        raise AssertionError(f"{getattr(fn, '__name__', fn)} failed:{report}" +
                             (f"\n--- ranks {silent} gave no answer within {timeout:g} s ---" if silent else ""))
    return outs
