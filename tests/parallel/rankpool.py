"""Spawned gloo ranks for the parallel tests, kept alive across checks.

``pool(n)`` returns n worker processes that have initialized torch.distributed (gloo, through
megakern.parallel.init_distributed) once; ``pool(n).run(fn, *args)`` runs the module-level function ``fn(*args)`` on
every rank and returns the list of results by rank. Any error or a rank silent past the deadline fails the check
with every rank's traceback and retires the pool (the next ``pool(n)`` spawns a fresh one), so a hang fails instead
of blocking the suite. Workers use one thread each: 4 ranks share 2 cores.
"""
from __future__ import annotations

import atexit
import os
import queue
import socket
import time
import traceback

import torch.multiprocessing as mp

PG_TIMEOUT_S = 45.0  # every collective in a worker; a mismatched collective raises after this
RUN_TIMEOUT_S = 120.0  # a whole check, all ranks
GRACE_S = 3.0  # after the first rank's error, how long to wait for the others' reports


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        try:
            results.put((rank, "ok", fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the parent
            results.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """``world`` spawned ranks with a gloo process group, answering ``run`` calls."""

    def __init__(self, world: int, pg_timeout: float = PG_TIMEOUT_S):
        ctx = mp.get_context("spawn")
        self.world, self.broken = world, False
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        port = free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, world, port, self.tasks[r], self.results, pg_timeout),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()
        self._collect("init", RUN_TIMEOUT_S, expect="ready")

    def _collect(self, what: str, timeout: float, expect: str = "ok") -> list:
        outs, errors = {}, {}
        deadline = time.monotonic() + timeout
        while len(outs) + len(errors) < self.world:
            left = deadline - time.monotonic()
            if errors:
                left = min(left, GRACE_S)
            try:
                rank, kind, payload = self.results.get(timeout=max(left, 0.01))
            except queue.Empty:
                break
            (outs if kind == expect else errors)[rank] = payload
        if errors or len(outs) < self.world:
            self.close(kill=True)
            silent = [r for r in range(self.world) if r not in outs and r not in errors]
            report = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            if silent:
                report += f"\n--- ranks {silent} gave no answer within {timeout:g} s ---"
            raise AssertionError(f"{what} failed on {self.world} ranks:{report}")
        return [outs[r] for r in range(self.world)]

    def run(self, fn, *args, timeout: float = RUN_TIMEOUT_S, **kwargs) -> list:
        """fn(*args, **kwargs) on every rank; the results by rank."""
        if self.broken:
            raise RuntimeError("this RankPool was retired after a failure; get a new one from pool(n)")
        for q in self.tasks:
            q.put((fn, args, kwargs))
        return self._collect(getattr(fn, "__name__", repr(fn)), timeout)

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
    """The live pool of ``world`` ranks (spawned on first use, or again after a failure)."""
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
    """Run fn(rank, *args) in one fresh process per entry of ``ranks`` (no process group: fn makes its own);
    {rank: result}. A process silent past ``timeout`` is killed and fails the check."""
    ctx = mp.get_context("spawn")
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
