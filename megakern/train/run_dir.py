"""A run's directories: named once for every rank, and held by one run at a time.

``claim_run_dirs`` is called by every rank of a run before anything is written. The writer rank (global rank 0)
decides the paths and takes the lock; the other ranks receive its decision through the process group, so ranks
whose clocks differ still write into one directory (a rank never names a directory from its own clock). Each rank
then resolves the paths as it sees them; a rank that sees another absolute path than rank 0 (another working
directory, another mount) is an error naming both paths.

The lock (``RunLock``) is an exclusive ``flock`` on ``<dir>/.lock``, held for the run's life by the writer rank on
the run directory and, when ``checkpoint.dir`` lies outside it, on the checkpoint directory: a second run given the
same directory (or the same checkpoint directory) stops before it writes anything, with an error naming the run
that holds it (host, pid, start). The kernel releases a flock when its process ends, however it ends, so a lock
left by a dead process is no lock: the next run takes it and says whose it was. The lock file itself is never
removed (removing it would let two runs lock two different files of the same name).

A fresh run directory without ``log.run_dir`` is ``runs/<date-time>`` from the writer's clock, made with an
exclusive ``mkdir`` (``-2``, ``-3`` ... appended when another run took that second).
"""
from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

LOCK_NAME = ".lock"


class RunDirError(RuntimeError):
    """The run's directories cannot be used: held by another run, not writable, or seen differently by ranks."""


class RunLock:
    """An exclusive, non-blocking flock on ``<directory>/.lock``; ``release()`` (or the process's end) frees it.

    ``previous``: what the lock file said of its last holder when this lock was taken (None for a new file): a run
    that ended, cleanly or not."""

    def __init__(self, directory: Path, what: str):
        self.path = Path(directory) / LOCK_NAME
        self._fd = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise RunDirError(f"cannot create the lock file of the {what} {self.path.parent}: {exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunDirError(f"the {what} {self.path.parent} is in use by another run ({_describe(holder)}); "
                              f"choose another directory, or stop that run first") from None
        self.previous = _read_holder(fd)
        self._fd = fd
        record = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": datetime.datetime.now().isoformat(timespec="seconds")}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        except OSError as exc:
            self.release()
            raise RunDirError(f"cannot write the lock file {self.path}: {exc}") from None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __del__(self):  # a lock whose owner is gone (a Trainer never run nor closed) is released with it
        if getattr(self, "_fd", None) is not None:
            self.release()


def _read_holder(fd: int) -> dict | None:
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        return json.loads(text) if text else None
    except (OSError, ValueError):
        return None


def _describe(holder: dict | None) -> str:
    if not isinstance(holder, dict):
        return "holder unknown"
    return f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"


def new_run_dir(root: Path = Path("runs")) -> Path:
    """``root/<date-time>`` from this process's clock, created exclusively (a suffix when the name is taken)."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    root.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        path = root / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RunDirError(f"cannot create a new run directory under {root}: {stamp} ... {stamp}-999 all exist")


@dataclass
class RunDirs:
    """The run's directories as every rank uses them, and the writer's locks (empty on other ranks)."""

    run_dir: Path
    ckpt_dir: Path
    locks: tuple[RunLock, ...] = ()

    def release(self) -> None:
        for lock in self.locks:
            lock.release()
        self.locks = ()

    def notes(self) -> list[str]:
        """Lines for the log: locks taken over from runs that ended without a clean exit or ran before."""
        return [f"note: {lock.path} was last held by {_describe(lock.previous)}, which has ended"
                for lock in self.locks if lock.previous is not None]


def claim_run_dirs(run_dir: str | None, ckpt_dir: str | None, *, writer: bool, distributed: bool) -> RunDirs:
    """Decide (writer rank), share (every rank) and lock (writer rank) the run and checkpoint directories.

    ``run_dir`` / ``ckpt_dir``: ``log.run_dir`` and ``checkpoint.dir`` as configured (None: ``runs/<date-time>`` and
    ``<run_dir>/checkpoints``). ``distributed``: the default process group is initialized and every rank calls this
    (collective). RunDirError on every rank if the writer cannot claim the directories or a rank sees other paths.
    """
    decided: list = [None]
    if writer:
        try:
            run = Path(run_dir) if run_dir else new_run_dir()
            ckpt = Path(ckpt_dir) if ckpt_dir else run / "checkpoints"
            locks = [RunLock(run, "run directory")]
            if not _inside(ckpt, run):
                try:
                    locks.append(RunLock(ckpt, "checkpoint directory (checkpoint.dir)"))
                except RunDirError:
                    locks[0].release()
                    raise
            decided = [{"run": str(run), "ckpt": str(ckpt), "abs": [_absolute(run), _absolute(ckpt)]}]
        except RunDirError as exc:
            decided = [{"error": str(exc)}]
            locks = []
    if distributed:
        dist.broadcast_object_list(decided, src=0)
    choice = decided[0]
    if "error" in choice:
        raise RunDirError(choice["error"] if writer else f"rank 0: {choice['error']}")
    dirs = RunDirs(Path(choice["run"]), Path(choice["ckpt"]), tuple(locks) if writer else ())
    if distributed:
        mine = [_absolute(dirs.run_dir), _absolute(dirs.ckpt_dir)]
        seen: list = [None] * dist.get_world_size()
        dist.all_gather_object(seen, mine)
        differ = [(r, s) for r, s in enumerate(seen) if s != choice["abs"]]
        if differ:
            dirs.release()
            r, (run_abs, ckpt_abs) = differ[0]
            raise RunDirError(
                f"ranks see the run's directories at different paths: rank 0 has run directory {choice['abs'][0]} "
                f"and checkpoints {choice['abs'][1]}, rank {r} has {run_abs} and {ckpt_abs}"
                f"{f' ({len(differ)} ranks differ)' if len(differ) > 1 else ''}; give log.run_dir and checkpoint.dir "
                "as absolute paths every rank reaches alike, or start every rank in the same working directory")
    return dirs


def _absolute(path: Path) -> str:
    return os.path.abspath(path)


def _inside(path: Path, parent: Path) -> bool:
    try:
        Path(_absolute(path)).relative_to(_absolute(parent))
        return True
    except ValueError:
        return False
