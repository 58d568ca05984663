"""Checkpoints: torch.distributed.checkpoint (DCP) for tensors, written so that a failure never costs the last good one.

Layout of a checkpoint directory:

    <dir>/step_00000100/            one complete checkpoint
        .metadata, __0_0.distcp      DCP: the tensor tree (model, optimizer, ...), one file per rank
        rng-rank00000.pt             each rank's RNG states (torch CPU, CUDA, python, numpy) and its other random
                                     streams' states given to save() (a parallel model's dropout RNG tracker)
        state.json                   the trainer's small state (step, consumed samples, data fingerprint, ...)
        config.yaml ...              extra files given to save()
        manifest.json                written last: format version, step, world size, the save's id, every file's
                                     size and sha256
    <dir>/latest                     the name of the newest complete checkpoint, replaced atomically after it
    <dir>/.tmp-step_00000200/        a save in progress (or one a kill interrupted)
    <dir>/.tmp-latest                the next text of ``latest``, written before the first rename
    <dir>/.replaced-step_00000100/   a checkpoint of the step being saved again, set aside during the renames
    <dir>/.removing-step_00000050/   a checkpoint being removed: renamed first, so that a removal cut short never
                                     leaves a directory that looks complete

The commit protocol (contracts 13, 27, 31 (docs/contracts.md)). When save() is called each rank captures its RNG
states and rank 0 the small files (state.json and ``files``). Every rank writes its tensors into the temporary
directory (DCP is collective) and its RNG states; rank 0 writes the small files; every rank hashes a share of the
files. Rank 0 then checks that every byte range DCP's metadata points at lies inside its file (a file cut short by a
full disk fails here), writes the manifest and the pointer's next text (.tmp-latest) and syncs them; from there on
there are only renames and directory syncs: a checkpoint of the same step aside (.replaced-), the temporary directory
to its final name, .tmp-latest over ``latest``. A rename that fails undoes the renames before it, so after any failure
either ``latest`` names the new checkpoint or the new checkpoint is gone (a kill between the two renames leaves it
complete, with ``latest`` naming the previous one, which is what a resume takes). Each phase ends with every rank
agreeing on success; a failure on any rank (ENOSPC included) raises ``CheckpointError`` on every rank naming the
phase, the failing rank(s) and the cause, and saying what is on disk afterwards as rank 0 finds it (the temporary
directory removed or left, which checkpoint ``latest`` names). Nothing is written into a complete checkpoint or over
``latest`` before the new checkpoint is complete.

After the commit rank 0 removes the checkpoints beyond ``keep`` (oldest first) and a set-aside one of the same step:
each is renamed to .removing-<name> and the parent synced before its files go; a failure there is logged, not
raised. ``remove_leftovers()`` (at start-up; every save does the same first) removes what killed saves and removals
leave (.tmp-*, .removing-*) and puts a .replaced- checkpoint back where a kill between the renames left its step
missing.

Asynchronous saves (``save(..., asynchronous=True)`` returns a ``PendingSave``): the tensors are staged into CPU
memory on the caller's thread, as are the RNG states and small files, so that what changes after the call does not
reach the checkpoint; DCP's ``async_save`` writes the tensors in the background and a background thread then runs
the same protocol (RNG files, hashes, range check, manifest, renames, pruning). The background collectives run on a
gloo group of their own (made collectively at the first asynchronous save; DCP's asynchronous saves need a CPU
backend), never on the group the training loop's collectives use. One save at a time: save(), load(),
remove_leftovers() and wait() first wait for a pending save, and that is where its failure surfaces (the
CheckpointError a synchronous save would raise) and its notes (pruned checkpoints) are logged. A pending save never
waited for still completes before the interpreter exits (its thread is not a daemon); a failure nobody saw is then
printed to stderr.

Loading (``resolve`` + ``load``) ignores temporary, hidden and incomplete directories (no manifest): ``latest``, or
when it names something incomplete, the newest complete checkpoint (with a warning). The manifest's format version is
checked (contract 16) and, with ``verify``, every file's sha256 (31). Tensors load in place into the tree given, on
whatever device it lives, so checkpoints from GPU runs load on CPU-only machines (21); CUDA RNG states are then
skipped with a warning. A rank's other random-stream states come back as the loaded state's "rank_state" (None where
the checkpoint has none for this rank: saved without them, or by fewer ranks); restoring them is the caller's.
"""
from __future__ import annotations

import atexit
import datetime
import errno
import hashlib
import io
import json
import os
import random
import re
import shutil
import sys
import threading
import uuid
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager, BlockingAsyncStager

FORMAT_VERSION = 1
STEP_DIR = re.compile(r"step_(\d{8,})")
MANIFEST = "manifest.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
TMP_LATEST = TMP_PREFIX + LATEST
REPLACED_PREFIX = ".replaced-"
REMOVING_PREFIX = ".removing-"
HASH_CHUNK = 8 << 20


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message says why and what is on disk."""


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def _storage_writer(path: Path) -> dcp.FileSystemWriter:
    """DCP's writer for ``path`` (a seam: tests replace it to inject write failures)."""
    return dcp.FileSystemWriter(str(path), single_file_per_rank=True, sync_files=True, thread_count=1)


def _storage_reader(path: Path) -> dcp.FileSystemReader:
    return dcp.FileSystemReader(str(path))


class _Staged(AsyncStager):
    """The stager handed to ``dcp.async_save`` for a tree already staged in CPU memory (it passes the tree on)."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def _quiet(fn, *args, **kwargs):
    """DCP's call without its warning that a single process saves or loads (that is intended here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
        return fn(*args, **kwargs)


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost OSError behind ``exc`` (through DCP's CheckpointException, causes and contexts), else exc."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, Mapping):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
    return exc


def describe_error(exc: BaseException) -> str:
    """One line: a CheckpointError's own message, else the OSError behind ``exc`` (strerror, errno name, file) or
    the innermost exception's type and last line."""
    if isinstance(exc, CheckpointError):
        return str(exc)
    cause = _root_cause(exc)
    if isinstance(cause, OSError) and cause.errno is not None:
        name = errno.errorcode.get(cause.errno, str(cause.errno))
        what = "disk full" if cause.errno in (errno.ENOSPC, errno.EDQUOT) else name
        return f"{cause.strerror or cause} ({what}, errno {name}){f': {cause.filename}' if cause.filename else ''}"
    return f"{type(cause).__name__}: {str(cause).strip().splitlines()[-1] if str(cause).strip() else ''}"


def _describe_failure(exc: BaseException, world: int) -> tuple[str, bool]:
    """(text, whether it names the failing ranks itself): DCP reports a failure of any rank to every rank, with the
    failing ranks' exceptions; those are named here, so that every rank tells the same story."""
    failures = getattr(exc, "failures", None)
    if world > 1 and isinstance(failures, Mapping) and failures:
        return "; ".join(f"rank {r}: {describe_error(f[0] if isinstance(f, tuple) else f)}"
                         for r, f in sorted(failures.items())), True
    return describe_error(exc), False


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _rename(src: Path, dst: Path) -> None:
    """Every rename of the commit and of removals (a seam: tests make one fail)."""
    os.rename(src, dst)


# ---------------------------------------------------------------------------------------------------------------
# RNG states (per rank).

def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors and plain lists (loadable with torch.load(weights_only=True))."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "python": [py_state[0], list(py_state[1]), py_state[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]), int(np_state[3]),
                  float(np_state[4])],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore ``rng_state()``'s output; CUDA states are skipped (with a warning) where CUDA is absent."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state:
        if torch.cuda.is_available():
            cuda_states = state["cuda"]
            if len(cuda_states) != torch.cuda.device_count():
                warnings.warn(f"the checkpoint has CUDA RNG states of {len(cuda_states)} devices, this process sees "
                              f"{torch.cuda.device_count()}; restoring the common ones", stacklevel=2)
            for i, s in enumerate(cuda_states[:torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s, i)
        else:
            warnings.warn("the checkpoint holds CUDA RNG states but CUDA is not available here; they are skipped "
                          "(CPU random streams are restored)", stacklevel=2)


# ---------------------------------------------------------------------------------------------------------------
# Optimizer state keyed by parameter names (so that it does not depend on parameter order).

def optimizer_state_dict(optimizer: torch.optim.Optimizer, names: Mapping[torch.Tensor, str]) -> dict:
    """{'state': {name: {key: tensor}}, 'param_groups': [hyperparameters of each group]}, the layout of
    megakern.parallel's checkpoint state, so that checkpoints move between single-process and parallel runs.

    ``names`` maps every parameter the optimizer holds (e.g. fp32 master weights) to a stable name.
    """
    by_id = {id(p): n for p, n in names.items()}
    state = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in by_id:
                raise CheckpointError(f"an optimizer parameter of shape {tuple(p.shape)} has no name")
            if p in optimizer.state:
                state[by_id[id(p)]] = dict(optimizer.state[p])
    # hyperparameters as numbers (a CUDA-graph run keeps its learning rate in a 0-d device tensor)
    groups = [{k: (v.item() if isinstance(v, torch.Tensor) and v.dim() == 0 else v) for k, v in group.items()
               if k != "params"} for group in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's per-parameter state (a step with zero gradients and lr 0, which changes no
    parameter) so that a checkpoint can be loaded into it in place. No-op if the state exists."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved = [(p, p.grad) for p in params]
    lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
        for p, grad in saved:
            p.grad = grad


def load_optimizer_state_dict(optimizer: torch.optim.Optimizer, names: Mapping[torch.Tensor, str],
                              loaded: Mapping) -> None:
    """Copy the per-parameter state of ``loaded`` (``optimizer_state_dict``'s layout) into ``optimizer``, by name.
    The hyperparameters of ``optimizer``'s groups are kept (they come from the current config)."""
    by_id = {id(p): n for p, n in names.items()}
    state = loaded["state"]
    mine = {by_id[id(p)]: p for g in optimizer.param_groups for p in g["params"]}
    missing, extra = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
    if missing or extra:
        raise CheckpointError(f"optimizer state does not match the model: missing {missing[:5]}, unexpected "
                              f"{extra[:5]} ({len(missing)} / {len(extra)} in all)")
    for name, p in mine.items():
        target = optimizer.state[p]
        for key, value in state[name].items():
            if isinstance(value, torch.Tensor) and isinstance(target.get(key), torch.Tensor):
                if target[key] is not value:
                    target[key].copy_(value)
            else:
                target[key] = value


# ---------------------------------------------------------------------------------------------------------------
# Collective agreement: every rank learns whether any rank failed.

def _world(group) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _gather(obj, group) -> list:
    rank, world = _world(group)
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def _barrier(group) -> None:
    if _world(group)[1] > 1:
        dist.barrier(group=group)


def _run(fn, what: str, group):
    """``fn()`` on this rank; if it fails on any rank of ``group``, CheckpointError on every rank, naming ``what``,
    each failing rank (where there are several ranks) and its cause, and chained to the local exception where this
    rank's failed."""
    local, cause, result = None, None, None
    world = _world(group)[1]
    try:
        result = fn()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        local, cause = _describe_failure(exc, world), exc
    parts = []
    for r, item in enumerate(_gather(local, group)):
        if item is not None:
            text, ranked = item
            part = text if ranked or world == 1 else f"rank {r}: {text}"
            if part not in parts:
                parts.append(part)
    if parts:
        raise CheckpointError(f"{what}: " + "; ".join(parts)) from cause
    return result


# ---------------------------------------------------------------------------------------------------------------

def checkpoint_keys(path) -> set[str]:
    """The flattened keys of a checkpoint's DCP tree ('model.wte.weight', 'optim.state.wte.weight.exp_avg', ...)."""
    try:
        return set(_storage_reader(Path(path)).read_metadata().state_dict_metadata)
    except (OSError, EOFError, ValueError) as exc:
        raise CheckpointError(f"{path}: the DCP metadata is unreadable ({exc})") from None


def is_complete(path: Path) -> bool:
    """A step directory with a manifest (written last)."""
    return path.is_dir() and STEP_DIR.fullmatch(path.name) is not None and (path / MANIFEST).is_file()


def read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path / MANIFEST}: unreadable ({exc})") from None
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {version!r}; this megakern reads version "
                              f"{FORMAT_VERSION}")
    return manifest


def _save_id(path: Path) -> str | None:
    """The id of the save that wrote checkpoint ``path`` (from its manifest), None if unreadable."""
    try:
        return json.loads((path / MANIFEST).read_text()).get("save_id")
    except (OSError, ValueError, AttributeError):
        return None


def _check_file_names(files: Mapping[str, Any]) -> None:
    reserved = {MANIFEST, ".metadata", "state.json"}
    for name in files:
        if (not isinstance(name, str) or not name or "/" in name or os.sep in name or name in (".", "..")
                or name in reserved or name.startswith("rng-rank") or name.endswith(".distcp")):
            raise CheckpointError(f"save(files=...): {name!r} is not a plain file name free for extra files (the "
                                  f"checkpoint itself writes {sorted(reserved)}, rng-rank*.pt and *.distcp)")


class PendingSave:
    """An asynchronous save in flight (``CheckpointManager.save(..., asynchronous=True)``).

    ``path``: the directory the checkpoint gets. ``done()``: whether the background work has ended, either way.
    ``wait(timeout=None)``: the path once committed on every rank, else the save's CheckpointError (the cause and what
    is on disk), raised again by every later wait(); past ``timeout`` seconds, a CheckpointError saying it is still
    running (it goes on). The background's notes (pruned checkpoints) go to the manager's log at the first wait().
    """

    def __init__(self, step: int, path: Path, log: Callable[[str], None]):
        self.step, self.path = step, path
        self._log, self._notes = log, []
        self._result: Path | None = None
        self._error: BaseException | None = None
        self._waited = False  # a wait() saw the end (and raised the failure, if any)
        self._thread: threading.Thread | None = None

    def _start(self, work: Callable[[Callable[[str], None]], Path]) -> None:
        def body():
            try:
                self._result = work(self._notes.append)
            except BaseException as exc:  # noqa: BLE001 - kept for wait()
                self._error = exc

        # not a daemon: an exit without wait() lets the save finish (the interpreter joins the thread first)
        self._thread = threading.Thread(target=body, name=f"checkpoint-{step_name(self.step)}", daemon=False)
        atexit.register(self._report_at_exit)
        self._thread.start()

    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Path:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise CheckpointError(f"the asynchronous save of checkpoint step {self.step} ({self.path}) is still "
                                  f"running after {timeout:g} s of waiting; it goes on in the background")
        atexit.unregister(self._report_at_exit)
        self._waited = True
        notes, self._notes = self._notes, []
        for line in notes:
            self._log(line)
        if self._error is not None:
            raise self._error
        return self._result

    def _report_at_exit(self) -> None:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None and not self._waited:
            print(f"megakern: the asynchronous save of checkpoint step {self.step} failed and was never waited for: "
                  f"{self._error}", file=sys.stderr, flush=True)

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._error is not None else "committed")
        return f"PendingSave(step={self.step}, path={str(self.path)!r}, {state})"


class CheckpointManager:
    """Saves and finds checkpoints under ``directory`` (layout and protocol in the module doc).

    keep: complete checkpoints kept after a save (oldest removed first; 0 keeps all).
    group: the process group whose ranks save together (None: the default group when initialized).
    log: where notes go (a callable taking a line), e.g. the run's logger; called on the caller's thread only.
    timeout_s: how long a rank of an asynchronous save waits for the others at each background collective (the
        timeout of the background gloo group).
    """

    def __init__(self, directory, *, keep: int = 3, group=None, log: Callable[[str], None] | None = None,
                 timeout_s: float = 1800.0):
        self.dir = Path(directory)
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.keep, self.group, self.timeout_s = keep, group, timeout_s
        self.log = log or (lambda line: None)
        self._pending: PendingSave | None = None
        self._background = None  # the gloo group of asynchronous saves, made at the first one

    # -- finding ----------------------------------------------------------------------------------------------
    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.dir.is_dir():
            return []
        found = [p for p in self.dir.iterdir() if is_complete(p)]
        return sorted(found, key=lambda p: int(STEP_DIR.fullmatch(p.name).group(1)))

    def latest(self, warn: bool = True) -> Path | None:
        """The checkpoint ``latest`` names if it is complete, else the newest complete one (warned), else None."""
        pointer = self.dir / LATEST
        complete = self.complete()
        if pointer.is_file():
            name = pointer.read_text().strip()
            target = self.dir / name
            if STEP_DIR.fullmatch(name) and is_complete(target):
                return target
            fallback = complete[-1] if complete else None
            if warn:
                warnings.warn(f"{pointer} names {name!r}, which is missing or incomplete; using "
                              f"{fallback.name if fallback else 'nothing'}", stacklevel=2)
            return fallback
        incomplete = ([p.name for p in self.dir.iterdir() if STEP_DIR.fullmatch(p.name) and not is_complete(p)]
                      if self.dir.is_dir() else [])
        if incomplete and warn:
            warnings.warn(f"{self.dir}: ignoring incomplete checkpoint directories {incomplete} (no manifest)",
                          stacklevel=2)
        return complete[-1] if complete else None

    @staticmethod
    def resolve(path) -> Path | None:
        """A complete step directory from a step directory or a checkpoint directory (its latest), else None."""
        path = Path(path)
        if is_complete(path):
            return path
        if STEP_DIR.fullmatch(path.name) and path.is_dir():
            raise CheckpointError(f"{path} is incomplete (no {MANIFEST}): an interrupted save; choose another")
        return CheckpointManager(path).latest() if path.is_dir() else None

    # -- saving -----------------------------------------------------------------------------------------------
    @property
    def pending(self) -> PendingSave | None:
        """The asynchronous save whose end no wait() has seen yet, if any."""
        if self._pending is not None and self._pending._waited:
            self._pending = None
        return self._pending

    def wait(self, timeout: float | None = None) -> Path | None:
        """Wait for the pending asynchronous save: its path, or its CheckpointError if it failed; None where nothing
        is pending (none was started, or PendingSave.wait() has already seen its end). Past ``timeout`` seconds,
        CheckpointError saying it is still running (it stays pending)."""
        pending = self.pending
        if pending is None:
            return None
        try:
            return pending.wait(timeout)
        finally:
            if pending.done():
                self._pending = None

    def save(self, step: int, tensors: dict[str, Any], *, state: dict[str, Any],
             files: Mapping[str, str | bytes] | None = None, rank_state: Mapping[str, Any] | None = None,
             asynchronous: bool = False) -> Path | PendingSave:
        """Write checkpoint ``step``: the DCP tree ``tensors`` (collective: every rank calls with its shards),
        the JSON ``state`` and ``files`` (written by rank 0), each rank's RNG states and ``rank_state`` (this
        rank's other random-stream states: tensors, numbers, strings, lists and dicts of them, as
        torch.load(weights_only=True) reads them). Returns the final directory.

        ``asynchronous``: stage the tensors, RNG states, ``state`` and ``files`` now (into CPU memory), write and
        commit them in the background, and return a ``PendingSave`` (see the module doc). A pending save is waited
        for first, and its failure raised here.

        Raises CheckpointError on every rank if any part fails (at ``wait`` for an asynchronous save), after
        removing the temporary directory, saying what is on disk; the previous checkpoints and ``latest`` are
        untouched unless the message says the new checkpoint is in place.
        """
        self.wait()
        rank, world = _world(self.group)
        final = self.dir / step_name(step)
        tmp = self.dir / f"{TMP_PREFIX}{final.name}"
        save_id = uuid.uuid4().hex
        group = self.group
        try:
            captured = _run(lambda: self._capture(step, state, files, rank_state, rank),
                            "capturing the RNG states and the state", group)
            background = self._background_group() if asynchronous else None
            _run(lambda: self._prepare(tmp) if rank == 0 else None, f"creating {tmp}", group)
            if not asynchronous:
                _run(lambda: _quiet(dcp.save, tensors, storage_writer=_storage_writer(tmp), process_group=group,
                                    no_dist=world == 1), f"writing the tensors to {tmp}", group)
                return self._finish(step, tmp, final, captured, save_id, rank, world, group, self.log)
            writer, staged = _run(lambda: (_storage_writer(tmp), BlockingAsyncStager().stage(tensors)),
                                  "staging the tensors in CPU memory", group)
            if world == 1:  # DCP warns from its own thread, where _quiet cannot reach: a filter for that line
                warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING, category=UserWarning)
            written = _quiet(dcp.async_save, staged, storage_writer=writer, async_stager=_Staged(),
                             process_group=background, no_dist=world == 1)
        except KeyboardInterrupt:
            if rank == 0:
                self._clean_up(tmp, final, save_id)
            raise
        except BaseException as exc:
            raise self._failure(exc, step, tmp, final, save_id, group) from exc

        def work(note: Callable[[str], None]) -> Path:
            try:
                _run(written.result, f"writing the tensors to {tmp}", background)
                return self._finish(step, tmp, final, captured, save_id, rank, world, background, note)
            except BaseException as exc:
                raise self._failure(exc, step, tmp, final, save_id, background) from exc

        self._pending = PendingSave(step, final, self.log)
        self._pending._start(work)
        return self._pending

    def _background_group(self):
        """The gloo group of the background collectives of asynchronous saves (made collectively, once), or None
        where torch.distributed is not initialized."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if self._background is None:
            timeout = datetime.timedelta(seconds=self.timeout_s)
            if self.group is None:
                self._background = dist.new_group(backend="gloo", timeout=timeout)
            else:  # only the group's ranks take part
                self._background = dist.new_group(dist.get_process_group_ranks(self.group), backend="gloo",
                                                  timeout=timeout, use_local_synchronization=True)
        return self._background

    @staticmethod
    def _capture(step: int, state: Mapping[str, Any], files, rank_state, rank: int) -> tuple[bytes, dict]:
        """This rank's RNG states (and ``rank_state``) serialized now; on rank 0 also state.json and ``files``."""
        rng = rng_state() | ({"rank_state": dict(rank_state)} if rank_state is not None else {})
        buffer = io.BytesIO()
        torch.save(rng, buffer)
        small = {}
        if rank == 0:
            extra = dict(files or {})
            _check_file_names(extra)
            small = {name: data.encode() if isinstance(data, str) else bytes(data) for name, data in extra.items()}
            small["state.json"] = json.dumps({"step": step, **state}, indent=1, allow_nan=True).encode()
        return buffer.getvalue(), small

    def _prepare(self, tmp: Path) -> None:
        """Rank 0: the checkpoint directory, leftovers of interrupted saves cleared, a fresh temporary directory."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._clean_leftovers(self.log)
        tmp.mkdir()

    def _finish(self, step: int, tmp: Path, final: Path, captured: tuple[bytes, dict], save_id: str, rank: int,
                world: int, group, note: Callable[[str], None]) -> Path:
        """After the tensors: RNG states, small files, hashes, commit (rank 0), pruning (rank 0), every rank done."""
        rng, small = captured
        _run(lambda: _write_file(tmp / f"rng-rank{rank:05d}.pt", rng), "writing the RNG states", group)
        _run(lambda: [_write_file(tmp / name, data) for name, data in small.items()], "writing the state", group)
        hashes = self._hash_share(tmp, rank, world, group)
        _run(lambda: self._commit(step, tmp, final, hashes, world, save_id, note) if rank == 0 else None,
             f"committing {final}", group)
        if rank == 0:
            self._prune(final, note)
        _barrier(group)
        return final

    @staticmethod
    def _hash_share(tmp: Path, rank: int, world: int, group) -> dict[str, dict]:
        """Every rank hashes files rank, rank + world, ... of the sorted listing; all ranks get the union."""
        def mine():
            names = sorted(p.name for p in tmp.iterdir() if p.is_file())
            return {n: {"size": (tmp / n).stat().st_size, "sha256": sha256_file(tmp / n)} for n in names[rank::world]}

        merged = {}
        for part in _gather(_run(mine, "checksumming the files", group), group):
            merged.update(part)
        return merged

    def _commit(self, step: int, tmp: Path, final: Path, hashes: dict[str, dict], world: int, save_id: str,
                note: Callable[[str], None]) -> None:
        """Rank 0: verify the byte ranges, write the manifest and the pointer's next text; then only renames (each
        undone if a later one fails) and directory syncs; then remove a set-aside checkpoint of the same step."""
        self._verify_ranges(tmp, hashes)
        manifest = {"format_version": FORMAT_VERSION, "step": step, "world_size": world, "save_id": save_id,
                    "torch": torch.__version__, "files": dict(sorted(hashes.items()))}
        _write_file(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        _fsync_dir(tmp)
        pointer_tmp = self.dir / TMP_LATEST
        _write_file(pointer_tmp, (final.name + "\n").encode())
        replaced = self.dir / f"{REPLACED_PREFIX}{final.name}" if final.exists() else None
        done = []  # renames made, to undo in reverse if a later step fails
        try:
            if replaced is not None:  # the same step saved again (e.g. a resumed run's final step)
                _rename(final, replaced)
                done.append((final, replaced))
            _rename(tmp, final)
            done.append((tmp, final))
            _fsync_dir(self.dir)
            _rename(pointer_tmp, self.dir / LATEST)
        except BaseException:
            try:
                for src, dst in reversed(done):
                    _rename(dst, src)
                _fsync_dir(self.dir)
            except OSError:
                pass  # the error's message says what is where, as found on disk
            raise
        _fsync_dir(self.dir)
        if replaced is not None:
            self._remove_tree(replaced, note)

    @staticmethod
    def _verify_ranges(path: Path, hashes: dict[str, dict]) -> None:
        """Every byte range in DCP's metadata lies inside a file that was written (and hashed)."""
        metadata = _storage_reader(path).read_metadata()
        for index, info in (metadata.storage_data or {}).items():
            entry = hashes.get(info.relative_path)
            if entry is None:
                raise CheckpointError(f"{path}: DCP metadata points at {info.relative_path}, which is missing")
            if info.offset + info.length > entry["size"]:
                raise CheckpointError(f"{path / info.relative_path}: {entry['size']} bytes, but "
                                      f"{getattr(index, 'fqn', index)} needs bytes up to {info.offset + info.length} "
                                      "(the file was cut short)")

    def _prune(self, final: Path, note: Callable[[str], None]) -> None:
        if self.keep == 0:
            return
        complete = self.complete()
        for old in complete[:max(len(complete) - self.keep, 0)]:
            if old != final:
                note(f"removing checkpoint {old.name} (checkpoint.keep={self.keep})")
                self._remove_tree(old, note)

    def _remove_tree(self, path: Path, note: Callable[[str], None]) -> bool:
        """Rank 0: remove a checkpoint directory so that a removal cut short never leaves one that looks complete:
        renamed to .removing-<step>, the parent synced, then deleted. Failures are noted, not raised (the
        checkpoint stays whole, or what is left is hidden and removed at the next start). Returns whether ``path``
        is gone from its name."""
        doomed = self._doomed(path)
        try:
            if doomed.exists():
                shutil.rmtree(doomed)
            _rename(path, doomed)
        except OSError as exc:
            note(f"could not remove {path} ({describe_error(exc)}); it is left as it was")
            return False
        try:
            _fsync_dir(self.dir)  # the rename on disk before any file goes
            shutil.rmtree(doomed)
        except OSError as exc:
            note(f"removing {path} stopped after renaming it to {doomed} ({describe_error(exc)}); loads ignore "
                 "it and the next start removes it")
        return True

    def _doomed(self, path: Path) -> Path:
        """The hidden name a checkpoint directory takes while it is removed."""
        return self.dir / f"{REMOVING_PREFIX}{path.name.removeprefix(REPLACED_PREFIX)}"

    def remove_leftovers(self) -> list[Path]:
        """Clear what killed saves and removals left in the directory (for start-up; every save does it too).
        Collective over ``group``: rank 0 acts, logging one line each, the others wait. Removed: .tmp-step_*
        (temporary directories), .tmp-latest (unless it names a complete checkpoint: a commit killed between its
        last two renames, finished instead), .removing-* (removals cut short); a .replaced-step_* is moved back
        where its step directory is missing (a kill between a same-step save's renames), and removed where that
        step is complete. Returns the paths rank 0 removed or moved back (empty on other ranks). A pending
        asynchronous save is waited for first."""
        self.wait()
        rank = _world(self.group)[0]
        return _run(lambda: self._clean_leftovers(self.log) if rank == 0 else [],
                    f"clearing what interrupted saves left in {self.dir}", self.group)

    def _clean_leftovers(self, note: Callable[[str], None]) -> list[Path]:
        if not self.dir.is_dir():
            return []
        acted = []
        for path in sorted(self.dir.iterdir()):  # (.replaced-* before .tmp-latest: a same-step save's order)
            name = path.name
            if name == TMP_PREFIX + LATEST and self._finish_pointer(path, note):
                acted.append(path)
                continue
            if name.startswith(TMP_PREFIX) or name.startswith(REMOVING_PREFIX):
                what = "an interrupted removal" if name.startswith(REMOVING_PREFIX) else "an interrupted save"
                try:
                    if path.is_dir() and not path.is_symlink():
                        shutil.rmtree(path)
                    else:
                        path.unlink()
                except OSError as exc:
                    note(f"could not remove {path}, left by {what} ({describe_error(exc)}); loads ignore it")
                    continue
                note(f"removed {path}, left by {what}")
                acted.append(path)
            elif name.startswith(REPLACED_PREFIX) and STEP_DIR.fullmatch(name[len(REPLACED_PREFIX):]):
                original = self.dir / name[len(REPLACED_PREFIX):]
                if not original.exists():
                    try:
                        _rename(path, original)
                        _fsync_dir(self.dir)
                    except OSError as exc:
                        note(f"could not move {path} back to {original} ({describe_error(exc)})")
                        continue
                    note(f"moved {path} back to {original}: a save of the same step was interrupted between its "
                         "renames")
                    acted.append(path)
                elif is_complete(original):
                    if self._remove_tree(path, note) and not self._doomed(path).exists():
                        note(f"removed {path}, set aside by a save of the same step, which completed")
                        acted.append(path)
                else:
                    note(f"left {path} alone: {original} exists but is incomplete; keep the complete one of the two")
        return acted

    def _finish_pointer(self, pending: Path, note: Callable[[str], None]) -> bool:
        """A .tmp-latest that names a complete checkpoint is a commit killed between its last two renames: the
        pointer's text is written only after every rank's files are verified and the manifest is written, so the
        checkpoint it names is committed; finish the commit (``latest`` then names it). Returns whether it did."""
        try:
            name = pending.read_text().strip()
        except OSError:
            return False
        if not (STEP_DIR.fullmatch(name) and is_complete(self.dir / name)):
            return False
        try:
            _rename(pending, self.dir / LATEST)
            _fsync_dir(self.dir)
        except OSError as exc:
            note(f"could not complete the commit of {name} ({describe_error(exc)}): {pending} left as it is")
            return False
        note(f"completed the commit of {self.dir / name}, interrupted before `latest` named it: it does now")
        return True

    # -- failures ---------------------------------------------------------------------------------------------
    def _failure(self, exc: BaseException, step: int, tmp: Path, final: Path, save_id: str,
                 group) -> CheckpointError:
        """The CheckpointError every rank raises for a failed save: rank 0 clears the temporary files and says
        what is on disk (its words go to every rank)."""
        rank = _world(group)[0]
        facts = self._clean_up(tmp, final, save_id) if rank == 0 else None
        try:
            facts = _gather(facts, group)[0]
        except Exception as gather_exc:  # noqa: BLE001 - a rank gone: say so rather than hang or hide the cause
            facts = facts or (f"rank 0 could not be asked what is on disk ({describe_error(gather_exc)}); its own "
                              "message says")
        return CheckpointError(f"saving checkpoint step {step} to {self.dir} failed: {describe_error(exc)}; {facts}")

    def _clean_up(self, tmp: Path, final: Path, save_id: str) -> str:
        """Rank 0, after a failed save: remove its temporary directory and pointer text, and the new checkpoint if
        it is in place but ``latest`` does not name it (renames that could not be undone); what is on disk, in
        words."""
        existed = tmp.exists()
        left = []
        for path in (tmp, self.dir / TMP_LATEST):
            try:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                elif path.exists() or path.is_symlink():
                    path.unlink()
            except OSError as exc:
                left.append(f"{path} could not be removed ({describe_error(exc)})")
        removed_new = False
        if is_complete(final) and _save_id(final) == save_id and self.latest(warn=False) != final:
            removed_new = self._remove_tree(final, lambda line: None)
            if not removed_new:
                try:  # the manifest first: a removal cut short then leaves nothing that looks complete
                    (final / MANIFEST).unlink()
                    removed_new = True
                    shutil.rmtree(final)
                except OSError as exc:
                    left.append(f"{final} could not be removed ({describe_error(exc)})")
        words = ["the temporary directory is left" if tmp.exists() else
                 "the temporary directory was removed" if existed else
                 "the new checkpoint was removed (its renames could not be undone)" if removed_new else
                 "no temporary directory is left"]
        current = self.latest(warn=False)
        try:
            named = (self.dir / LATEST).read_text().strip() if (self.dir / LATEST).is_file() else None
        except OSError:
            named = None
        replaced = self.dir / f"{REPLACED_PREFIX}{final.name}"
        if is_complete(final) and _save_id(final) == save_id:
            if current == final:
                words.append(f"the new checkpoint {final} is complete and `latest` names it")
            else:
                words.append(f"the new checkpoint {final} is complete, but `latest` names {named or 'nothing'}, so a "
                             f"resume takes {current}")
        elif current is not None:
            pointer = f"names {named!r}" if named else "is missing"
            how = ("`latest` names it" if named == current.name else
                   f"a resume takes it (the newest complete one; `latest` {pointer})")
            words.append(f"the previous checkpoint {current} is intact and {how}")
        else:
            words.append("no checkpoint is in place" if replaced.exists() else "no earlier checkpoint exists")
        message = " and ".join(words)
        if replaced.exists():
            message += (f"; {replaced} holds the checkpoint {final.name} this save was replacing (the next start "
                        f"{'removes it' if final.exists() else 'moves it back'})")
        if left:
            message += "; " + "; ".join(left) + " (loads ignore what is hidden; the next start removes it)"
        return message

    # -- loading ----------------------------------------------------------------------------------------------
    def load(self, path, tensors: dict[str, Any], *, verify: bool = True, restore_rng: bool = True) -> dict:
        """Load checkpoint ``path`` (a step directory, or a directory whose latest is used) into the DCP tree
        ``tensors`` in place; restore this rank's RNG states; return the JSON state (with 'path' added, and
        'rank_state': what save() got as this rank's ``rank_state``, None where there is none or ``restore_rng`` is
        off).

        CheckpointError names the problem: no complete checkpoint, format version, a file whose sha256 differs
        from the manifest, a world size without RNG states for this rank. A pending asynchronous save is waited for
        first.
        """
        self.wait()
        rank, world = _world(self.group)
        found = self.resolve(path)
        if found is None:
            raise CheckpointError(f"no complete checkpoint in {path}")
        manifest = read_manifest(found)
        if verify:
            names = sorted(manifest["files"])
            _run(lambda: [self._check_file(found, n, manifest["files"][n]) for n in names[rank::world]],
                 f"verifying {found}", self.group)
        try:
            _quiet(dcp.load, tensors, storage_reader=_storage_reader(found), process_group=self.group,
                   no_dist=world == 1)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise CheckpointError(f"loading the tensors of {found} failed: {describe_error(exc)}") from exc
        state = json.loads((found / "state.json").read_text())
        state["rank_state"] = None
        if restore_rng:
            rng_file = found / f"rng-rank{rank:05d}.pt"
            if rng_file.is_file():
                saved = torch.load(rng_file, map_location="cpu", weights_only=True)
                set_rng_state(saved)
                state["rank_state"] = saved.get("rank_state")
            else:
                warnings.warn(f"{found} has no RNG states for rank {rank} (saved with world size "
                              f"{manifest.get('world_size')}); random streams start fresh", stacklevel=2)
        state["path"] = str(found)
        return state

    @staticmethod
    def _check_file(path: Path, name: str, entry: dict) -> None:
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: listed in the manifest but missing")
        size = file.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(f"{file}: {size} bytes, the manifest says {entry['size']} (truncated or changed)")
        if sha256_file(file) != entry["sha256"]:
            raise CheckpointError(f"{file}: sha256 differs from the manifest (the file is corrupt)")
