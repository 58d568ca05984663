"""Checkpoints: torch.distributed.checkpoint (DCP) for tensors, written so that a failure never costs the last good one.

Layout of a checkpoint directory:

    <dir>/step_00000100/            one complete checkpoint
        .metadata, __0_0.distcp      DCP: the tensor tree (model, optimizer, ...), one file per rank
        rng-rank00000.pt             each rank's RNG states (torch CPU, CUDA, python, numpy) and its other random
                                     streams' states given to save() (a parallel model's dropout RNG tracker)
        state.json                   the trainer's small state (step, consumed samples, data fingerprint, ...)
        config.yaml ...              extra files given to save()
        manifest.json                written last: format version, step, world size, every file's size and sha256
    <dir>/latest                     the name of the newest complete checkpoint, replaced atomically after it
    <dir>/.tmp-step_00000200/        a save in progress (or a crashed one: removed by the next save)

The commit protocol (ASSUMPTIONS 13, 27, 31): every rank writes into the temporary directory (DCP is collective),
then hashes a share of the files; rank 0 writes the manifest, checks that every byte range DCP's metadata points at
lies inside its file (a file cut short by a full disk fails here), renames the directory to its final name (atomic
on one filesystem), syncs the parent, writes ``latest`` last, then removes checkpoints beyond ``keep``. Each phase
ends with every rank agreeing on success; any failure (ENOSPC included) removes the temporary directory and raises
``CheckpointError`` on every rank, with the cause and the intact previous checkpoint named. Nothing is ever
written into a complete checkpoint or over ``latest`` before the new checkpoint is complete.

Loading (``resolve`` + ``load``) ignores temporary and incomplete directories (no manifest): ``latest``, or when
it names something incomplete, the newest complete checkpoint (with a warning). The manifest's format version is
checked (ASSUMPTIONS 16) and, with ``verify``, every file's sha256 (31). Tensors load in place into the tree given,
on whatever device it lives, so checkpoints from GPU runs load on CPU-only machines (21); CUDA RNG states are then
skipped with a warning. A rank's other random-stream states come back as the loaded state's "rank_state" (None where
the checkpoint has none for this rank: saved without them, or by fewer ranks); restoring them is the caller's.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

FORMAT_VERSION = 1
STEP_DIR = re.compile(r"step_(\d{8,})")
MANIFEST = "manifest.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
REPLACED_PREFIX = ".replaced-"
HASH_CHUNK = 8 << 20


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message says why and what is still intact."""


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def _storage_writer(path: Path) -> dcp.FileSystemWriter:
    """DCP's writer for ``path`` (a seam: tests replace it to inject write failures)."""
    return dcp.FileSystemWriter(str(path), single_file_per_rank=True, sync_files=True, thread_count=1)


def _storage_reader(path: Path) -> dcp.FileSystemReader:
    return dcp.FileSystemReader(str(path))


def _quiet(fn, *args, **kwargs):
    """DCP's call without its warning that a single process saves or loads (that is intended here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
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
    cause = _root_cause(exc)
    if isinstance(cause, OSError) and cause.errno is not None:
        name = errno.errorcode.get(cause.errno, str(cause.errno))
        what = "disk full" if cause.errno in (errno.ENOSPC, errno.EDQUOT) else name
        return f"{cause.strerror or cause} ({what}, errno {name}){f': {cause.filename}' if cause.filename else ''}"
    return f"{type(cause).__name__}: {str(cause).strip().splitlines()[-1] if str(cause).strip() else ''}"


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


class CheckpointManager:
    """Saves and finds checkpoints under ``directory`` (layout and protocol in the module doc).

    keep: complete checkpoints kept after a save (oldest removed first; 0 keeps all).
    group: the process group whose ranks save together (None: the default group when initialized).
    log: where notes go (a callable taking a line), e.g. the run's logger.
    """

    def __init__(self, directory, *, keep: int = 3, group=None, log: Callable[[str], None] | None = None):
        self.dir = Path(directory)
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        self.keep, self.group = keep, group
        self.log = log or (lambda line: None)

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
    def save(self, step: int, tensors: dict[str, Any], *, state: dict[str, Any],
             files: Mapping[str, str | bytes] | None = None, rank_state: Mapping[str, Any] | None = None) -> Path:
        """Write checkpoint ``step``: the DCP tree ``tensors`` (collective: every rank calls with its shards),
        the JSON ``state`` and ``files`` (written by rank 0), each rank's RNG states and ``rank_state`` (this
        rank's other random-stream states: tensors, numbers, strings, lists and dicts of them, as
        torch.load(weights_only=True) reads them). Returns the final directory.

        Raises CheckpointError on every rank if any part fails, after removing the temporary directory; the
        previous checkpoints and ``latest`` are untouched.
        """
        rank, world = _world(self.group)
        final = self.dir / step_name(step)
        tmp = self.dir / f"{TMP_PREFIX}{final.name}"
        previous = self.latest(warn=False) if rank == 0 else None
        intact = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"

        def write_small():
            extra = dict(files or {})
            extra["state.json"] = json.dumps({"step": step, **state}, indent=1, allow_nan=True)
            for name, data in extra.items():
                _write_file(tmp / name, data.encode() if isinstance(data, str) else data)

        try:
            self._run(lambda: self._prepare(tmp) if rank == 0 else None, f"creating {tmp}")
            self._run(lambda: _quiet(dcp.save, tensors, storage_writer=_storage_writer(tmp),
                                     process_group=self.group, no_dist=world == 1),
                      f"writing the tensors to {tmp}")
            rng = rng_state() | ({"rank_state": dict(rank_state)} if rank_state is not None else {})
            self._run(lambda: torch.save(rng, tmp / f"rng-rank{rank:05d}.pt"), "writing the RNG states")
            self._run(write_small if rank == 0 else lambda: None, "writing the state")
            hashes = self._hash_share(tmp, rank, world)
            self._run(lambda: self._commit(step, tmp, final, hashes, world) if rank == 0 else None,
                      f"committing {final}")
        except KeyboardInterrupt:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"saving checkpoint step {step} to {self.dir} failed: {describe_error(exc)}; the "
                                  f"temporary directory was removed and {intact}") from exc
        if rank == 0:
            self._prune(final)
        _barrier(self.group)
        return final

    def _run(self, fn, what: str):
        """``fn()`` on this rank; if it fails on any rank, CheckpointError on every rank (chained to the local
        exception where this rank's failed)."""
        error, cause, result = None, None, None
        try:
            result = fn()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            error, cause = describe_error(exc), exc
        errors = [(r, e) for r, e in enumerate(_gather(error, self.group)) if e]
        if errors and isinstance(cause, CheckpointError) and len(errors) == 1:
            raise cause  # already says what and where
        if errors:
            raise CheckpointError(f"{what}: " + "; ".join(f"rank {r}: {e}" for r, e in errors)) from cause
        return result

    def _prepare(self, tmp: Path) -> None:
        """Rank 0: the checkpoint directory, stale temporary directories removed, a fresh one for this save."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob(TMP_PREFIX + "step_*"):
            self.log(f"removing {stale}, left by an interrupted save")
            shutil.rmtree(stale)
        tmp.mkdir()

    def _hash_share(self, tmp: Path, rank: int, world: int) -> dict[str, dict]:
        """Every rank hashes files rank, rank + world, ... of the sorted listing; all ranks get the union."""
        def mine():
            names = sorted(p.name for p in tmp.iterdir() if p.is_file())
            return {n: {"size": (tmp / n).stat().st_size, "sha256": sha256_file(tmp / n)} for n in names[rank::world]}

        merged = {}
        for part in _gather(self._run(mine, "checksumming the files"), self.group):
            merged.update(part)
        return merged

    def _commit(self, step: int, tmp: Path, final: Path, hashes: dict[str, dict], world: int) -> None:
        """Rank 0: verify, write the manifest, rename, sync, point ``latest`` at it."""
        self._verify_ranges(tmp, hashes)
        manifest = {"format_version": FORMAT_VERSION, "step": step, "world_size": world,
                    "torch": torch.__version__, "files": dict(sorted(hashes.items()))}
        _write_file(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        _fsync_dir(tmp)
        replaced = None
        if final.exists():  # the same step saved again (e.g. a resumed run's final step)
            replaced = self.dir / f"{REPLACED_PREFIX}{final.name}"
            shutil.rmtree(replaced, ignore_errors=True)
            os.rename(final, replaced)
        os.rename(tmp, final)
        _fsync_dir(self.dir)
        pointer_tmp = self.dir / f"{TMP_PREFIX}{LATEST}"
        _write_file(pointer_tmp, (final.name + "\n").encode())
        os.replace(pointer_tmp, self.dir / LATEST)
        _fsync_dir(self.dir)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)

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

    def _prune(self, final: Path) -> None:
        if self.keep == 0:
            return
        complete = self.complete()
        for old in complete[:max(len(complete) - self.keep, 0)]:
            if old != final:
                self.log(f"removing checkpoint {old.name} (checkpoint.keep={self.keep})")
                shutil.rmtree(old, ignore_errors=True)

    # -- loading ----------------------------------------------------------------------------------------------
    def load(self, path, tensors: dict[str, Any], *, verify: bool = True, restore_rng: bool = True) -> dict:
        """Load checkpoint ``path`` (a step directory, or a directory whose latest is used) into the DCP tree
        ``tensors`` in place; restore this rank's RNG states; return the JSON state (with 'path' added, and
        'rank_state': what save() got as this rank's ``rank_state``, None where there is none or ``restore_rng`` is
        off).

        CheckpointError names the problem: no complete checkpoint, format version, a file whose sha256 differs
        from the manifest, a world size without RNG states for this rank.
        """
        rank, world = _world(self.group)
        found = self.resolve(path)
        if found is None:
            raise CheckpointError(f"no complete checkpoint in {path}")
        manifest = read_manifest(found)
        if verify:
            names = sorted(manifest["files"])
            self._run(lambda: [self._check_file(found, n, manifest["files"][n]) for n in names[rank::world]],
                      f"verifying {found}")
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
