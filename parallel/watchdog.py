"""The step watchdog: a rank that hangs in a step, or is gone, is named within a step timeout, and every rank ends.

A collective that waits for a rank that never comes is caught by torch.distributed only after the process groups'
timeout (``parallel.init_timeout_s``), and gloo's or NCCL's message does not say which rank. The watchdog is shorter
and says it. Each rank runs one background thread that

- beats: every ``heartbeat_s`` it writes this rank's heartbeat into the rendezvous store (the TCPStore that
  ``init_distributed`` made, or torchrun's agent store): a counter it bumps, the phase the trainer is in ("step" 41,
  "eval" or "checkpoint" after step 40; ``begin_step`` / ``end_step``, ``phase``), for how long (on this rank's own
  clock), and where the training thread's Python stack is (its innermost frame, the innermost frame outside torch,
  and whether it waits inside torch.distributed). A counter that keeps moving tells "alive but stuck in step N" from
  "process gone" (or frozen: a stopped process, a dead node), whose counter stops;
- watches its own phase: inside one step longer than ``timeout_s`` (the first ``first_steps`` steps and the other
  phases: ``first_timeout_s``, for compilation, CUDA-graph capture, NCCL communicator creation, evals and saves),
  it raises the alarm in the store;
- on an alarm (its own or another rank's), a diagnosing rank (rank 0 and the last rank; any rank when no verdict
  comes in time) reads every rank's heartbeat and names the ranks that did not arrive and what each was last seen
  doing, in ONE message to ``log``:

      error: step watchdog: rank 3 (node4:881) has been in step 41 for 301 s, past the step timeout of 300 s
      (parallel.step_timeout_s). 2 ranks did not arrive: rank 2 (node3:17): no heartbeat for 65 s (process gone
      or frozen?), last seen in step 42 for 3.1 s at forward (model.py:210); rank 3 (node4:881) is still in step
      41 for 301 s at __next__ (loader.py:88) (heartbeat 2.0 s ago: alive, stuck). Ranks 0-1, 4-7 wait in step
      42. Every rank ends with exit code 124.

  then publishes the verdict, and every rank ends: ``log`` and ``on_timeout`` get the message, NCCL process groups
  are aborted (``ProcessGroup.abort``), output is flushed and the process exits with ``EXIT_CODE`` (a collective
  blocked in gloo or NCCL cannot be interrupted from Python: ``os._exit``). A rank that did not time out itself
  ends as soon as it sees the verdict, so none is left waiting.

Staleness is measured by each observer on its own monotonic clock ("a counter that has not changed for X s of my
time"), never by comparing ranks' clocks (contract 1, docs/contracts.md). When every live rank is in the same
phase, the ranks whose training thread is NOT inside torch.distributed are the ones the others wait for.

An exception that leaves a phase (``phase``, or the watchdog's own ``with`` block) is published too: the diagnosing
rank names the failed rank, its exception and the ranks gone or behind (gloo raises "Connection closed by peer" on
the survivors of a dead rank without saying which rank), and the exception then goes on its way. A rank still
running ``grace_s`` after such a verdict (an NCCL collective waiting for the failed rank) is ended as above.

Cost on the training thread: ``begin_step`` / ``end_step`` each replace one small tuple (microseconds), nothing
else. Every store operation is on the background thread, through its own connection (``store.clone()``), each
bounded by a deadline: a store that stops answering cannot block the watchdog, and is itself reported (with who
hosts it). Store traffic per heartbeat: one set and two adds per rank (about 200 bytes), and one multi_get of every
rank's heartbeat on each of the two diagnosing ranks.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from megakern.parallel.dims import ParallelMesh

EXIT_CODE = 124  # how a rank ended by the watchdog exits (as timeout(1) reports a command that ran out of time)
EXIT_GRACE_S = 30.0  # the most time logging, on_timeout and the NCCL abort get before the process exits anyway
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_DIST_DIR = os.path.join(_TORCH_DIR, "distributed") + os.sep
_FAILURE_CHARS = 300  # of an exception's first line in a heartbeat
DETAILED = 8  # ranks of each kind a verdict describes one by one; the rest as ranges


class WatchdogError(RuntimeError):
    """The watchdog cannot watch: its store is unreachable at start, or it is used out of order."""


class _StoreLost(Exception):
    pass


class _Phase(NamedTuple):
    """What the main thread is doing; replaced whole (one reference assignment) so the watchdog thread reads a
    consistent state without a lock."""

    name: str | None = None  # None: no phase begun yet
    step: int = 0
    seq: int = 0  # begin/end calls within this step number: orders "step 41" < "eval after 41" < "after eval"
    open: bool = False
    since: float = 0.0  # time.monotonic() at begin
    limit: float = math.inf  # seconds this phase may last
    limit_text: str = ""  # e.g. "the step timeout of 300 s (parallel.step_timeout_s)"
    failed: str | None = None  # "TypeName: message" of an exception that left the phase
    thread: int | None = None  # the thread that began it: whose stack the heartbeat shows


# ---- the store, on a thread of its own ------------------------------------------------------------------------
class _StoreLink:
    """The watchdog's connection to the store, used from one daemon thread: every call waits at most
    ``timeout_s``. After the first failure or timeout the store counts as lost (``lost`` says why) and every later
    call fails at once: one stuck call never stacks up others, and torch logs its connection error once."""

    def __init__(self, store, timeout_s: float):
        self.timeout_s, self.lost, self.lost_at = timeout_s, None, None
        try:
            self.store = store.clone()  # its own socket: the process groups' use of the store never blocks ours
        except Exception:  # noqa: BLE001 - stores without clone (HashStore) are in-process and thread-safe
            self.store = store
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="megakern-watchdog-store", daemon=True)
        self._thread.start()

    def call(self, fn, *args):
        if self.lost is not None:
            raise _StoreLost(self.lost)
        box, done = [], threading.Event()
        self._requests.put((fn, args, box, done))
        if not done.wait(self.timeout_s):
            self._lose(f"no answer within {self.timeout_s:g} s")
        elif isinstance(box[0], BaseException):
            exc = box[0]
            self._lose(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": "))
        else:
            return box[0]
        raise _StoreLost(self.lost)

    def _lose(self, why: str) -> None:
        self.lost, self.lost_at = why, time.monotonic()

    def _serve(self) -> None:
        while True:
            item = self._requests.get()
            if item is None:
                return
            fn, args, box, done = item
            try:
                box.append(fn(self.store, *args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box.append(exc)
            done.set()

    def close(self, timeout_s: float) -> bool:
        """Stop the thread; False if it is stuck in a call (it is a daemon: it cannot hold the process)."""
        self._requests.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


# ---- what one rank's heartbeat says ---------------------------------------------------------------------------
def _ranges(ranks) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    ranks, out, i = sorted(ranks), [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(out)


def _ranks_text(ranks) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranges(ranks)}"


def _seconds(s: float) -> str:
    return f"{s:.1f}" if s < 10 else f"{s:.0f}"


def _doing(state: dict, *, where: bool = True) -> str:
    """"in step 41 for 305 s at __next__ (loader.py:88)", "after eval (step 40)", "finished", ..."""
    if state.get("closed"):
        return "finished"
    name, step = state.get("phase"), state.get("step")
    if name is None:
        return "before its first step"
    what = f"step {step}" if name == "step" else f"{name} (step {step})"
    if not state.get("open"):
        return f"after {what}"
    text = f"in {what} for {_seconds(state.get('for', 0.0))} s"
    if where and state.get("where"):
        text += f" at {state['where']}"
        if state.get("via"):
            text += f" from {state['via']}"
    return text


def _progress(state: dict) -> tuple[int, int]:
    return (state.get("step") or 0, state.get("seq") or 0)


class Seen(NamedTuple):
    """One rank as a diagnosing rank saw it: its last heartbeat (None: never), how long ago (on the observer's
    clock) the heartbeat last changed, and whether that change was observed (else: unchanged all the time watched)."""

    state: dict | None
    age: float
    changed: bool = True


def verdict(trigger: str, seen: dict[int, Seen], stale_s: float, *, hang: bool,
            store_note: str | None = None) -> tuple[str, str, list[int]]:
    """The diagnosis: (summary, message, the ranks named). ``seen``: rank -> ``Seen``; a heartbeat unchanged for
    ``stale_s`` means the process is gone (or frozen). Named, in this order: ranks gone, ranks that never beat,
    ranks behind the most advanced live rank (an earlier step or phase), failed ranks; when none of those, the live
    ranks in the common phase whose main thread is not inside torch.distributed (the others wait there for them).
    Each kind lists its first ``DETAILED`` ranks in full and the rest as ranges; ranks that failed alike (same
    exception, same phase) are one entry."""
    gone, missing, failed, live = [], [], [], []
    for r, s in sorted(seen.items()):
        if s.state is None:
            missing.append(r)
        elif s.state.get("failed"):
            failed.append(r)
        elif s.state.get("closed"):
            continue
        elif s.age >= stale_s:
            gone.append(r)
        else:
            live.append(r)
    front = max((_progress(seen[r].state) for r in live), default=None)
    behind = [r for r in live if _progress(seen[r].state) < front]
    level = [r for r in live if _progress(seen[r].state) == front]
    stuck = []
    if not (gone or missing or behind or failed) and any(seen[r].state.get("comm") for r in level):
        stuck = [r for r in level if not seen[r].state.get("comm")]
    named = sorted(set(gone + missing + behind + stuck + failed))

    def who(r):
        return f"rank {r} ({seen[r].state.get('who', '?')})"

    def listed(ranks, full, brief, what):  # (details, summary entries) of one kind of rank
        details = [full(r) for r in ranks[:DETAILED]]
        if len(ranks) > DETAILED:
            details.append(f"{_ranks_text(ranks[DETAILED:])} {what} too")
        entries = [brief(r) for r in ranks[:DETAILED]] + ([f"{len(ranks) - DETAILED} more"]
                                                           if len(ranks) > DETAILED else [])
        return details, entries

    def gone_age(r):
        s = seen[r]
        return f"for {_seconds(s.age)} s" if s.changed else f"in the {_seconds(s.age)} s watched"

    kinds = [
        listed(gone, lambda r: f"{who(r)}: no heartbeat {gone_age(r)} (process gone or frozen?), last seen "
                               f"{_doing(seen[r].state)}",
               lambda r: f"rank {r} gone (no heartbeat {gone_age(r)})", "are gone"),
        listed(missing, lambda r: f"rank {r}: no heartbeat at all (it never started its watchdog: stuck or gone "
                                  "before its first step?)", lambda r: f"rank {r} never beat", "never beat"),
        listed(behind + stuck, lambda r: f"{who(r)} is still {_doing(seen[r].state)} (heartbeat "
                                         f"{_seconds(seen[r].age)} s ago: alive, stuck)",
               lambda r: f"rank {r} is still {_doing(seen[r].state, where=False).split(' for ')[0]} (alive, stuck)",
               "are stuck"),
    ]
    alike: dict[tuple[str, str], list[int]] = {}
    for r in failed:
        doing = _doing(seen[r].state, where=False).replace("after ", "in ", 1).split(" for ")[0]
        alike.setdefault((doing, seen[r].state["failed"]), []).append(r)
    failures = [(f"{who(rs[0]) if len(rs) == 1 else _ranks_text(rs)} failed {doing}: {error}",
                 f"{_ranks_text(rs)} failed {doing}") for (doing, error), rs in alike.items()]
    kinds.append(([d for d, _ in failures[:DETAILED]], [b for _, b in failures[:DETAILED]]))
    details = [d for ds, _ in kinds[:3] for d in ds]
    failed_details = [d for d in kinds[3][0] if d not in trigger]
    short = [b for _, bs in kinds for b in bs]

    def verb(rs):
        return ("wait" if named else "are") if len(rs) > 1 else ("waits" if named else "is")

    groups: dict[str, list[int]] = {}
    for r in live:
        if r not in named:
            groups.setdefault(_doing(seen[r].state, where=False).split(" for ")[0], []).append(r)
    rest = "; ".join(f"{_ranks_text(rs)} {verb(rs)} {what}" + (
        f" (at {seen[rs[0]].state['where']})" if not named and seen[rs[0]].state.get("where") else "")
        for what, rs in groups.items())
    parts = [trigger]
    if details:
        count = len(gone) + len(missing) + len(behind) + len(stuck)
        parts.append(f"{count} rank{'s' if count > 1 else ''} did not arrive: " + "; ".join(details))
    if failed_details:
        parts.append("; ".join(failed_details))
    if seen and not named:
        parts.append("no rank is behind, gone or outside torch.distributed (a rank may be stuck inside a kernel, "
                     "a collective the others never entered, or I/O)")
    if rest:
        parts.append(rest)
    if store_note:
        parts.append(store_note)
    message = ". ".join([parts[0].rstrip(".")] + [p[0].upper() + p[1:].rstrip(".") for p in parts[1:]]) + "."
    if hang:
        message = f"error: step watchdog: {message} Every rank ends with exit code {EXIT_CODE}."
    else:
        message = f"step watchdog: {message}"
    summary = "; ".join(short) or store_note or "no rank named"
    return summary, message, named


def _frame_text(frame) -> str:
    code = frame.f_code
    path = code.co_filename
    short = os.sep.join(path.split(os.sep)[-2:]) if path.startswith(_TORCH_DIR) else os.path.basename(path)
    return f"{code.co_name} ({short}:{frame.f_lineno})"


def _where(ident: int | None) -> tuple[str | None, str | None, bool]:
    """(innermost frame, innermost frame outside torch or None, whether that innermost frame is inside
    torch.distributed) of thread ``ident``'s Python stack."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    if frame is None:
        return None, None, False
    try:
        path = frame.f_code.co_filename
        inner, comm, via = _frame_text(frame), path.startswith(_DIST_DIR), None
        if path.startswith(_TORCH_DIR):
            outer = frame.f_back
            while outer is not None and outer.f_code.co_filename.startswith(_TORCH_DIR):
                outer = outer.f_back
            via = _frame_text(outer) if outer is not None else None
        return inner, via, comm
    finally:
        del frame


# ---- the watchdog ---------------------------------------------------------------------------------------------
class StepWatchdog:
    """Watches this rank's steps and phases; names the ranks a hung or failed step waits for, then ends the run.

    Args:
        source: a ``ParallelMesh`` built with its rendezvous (``mesh.store``; rank, world and ``first_timeout_s``
            default to the mesh's), or a ``torch.distributed.Store`` every rank shares (``rank``, ``world`` and
            ``first_timeout_s`` then required; successive watchdogs on one store need distinct ``prefix``es).
        rank, world: this rank and the number of ranks.
        timeout_s: the step timeout (``parallel.step_timeout_s``): the longest one step may take after the first
            ``first_steps``.
        first_timeout_s: the first steps' and the other phases' timeout (``parallel.init_timeout_s``, the
            collectives' own); must be >= ``timeout_s``: a longer step timeout would never fire before the
            collectives' timeout, whose message names no rank.
        log: takes the message (one string); on the writer rank the run's log, elsewhere stderr (the default).
        on_timeout: called with the message before the process ends (close the run's log sinks); errors in it are
            printed and ignored.
        first_steps: how many steps, counted from ``start``, get ``first_timeout_s`` (compilation, CUDA-graph
            capture, NCCL communicators: 1 + cuda_graph_warmup + 1 with a CUDA graph).
        heartbeat_s: seconds between heartbeats (default: timeout_s / 10, at most 5 s); a heartbeat unchanged for
            ``max(4 * heartbeat_s, 2 s)`` means the process is gone.
        keys: ``timeout_s``'s and ``first_timeout_s``'s names in messages.
        prefix: the store keys' prefix (default: the mesh's ``store_prefix("watchdog")``, or
            "megakern/watchdog/<attempt>" on a bare store).

    ``start()`` (or ``with``) starts the thread; ``begin_step(n)`` / ``end_step(n)`` around each optimizer step (the
    whole loop iteration, the host's wait for the step's figures included); ``phase(name, step)`` around evals,
    checkpoint saves and anything else every rank does that can hang; ``close()`` at the end.
    """

    def __init__(self, source, rank: int | None = None, world: int | None = None, timeout_s: float = 300.0,
                 first_timeout_s: float | None = None, log: Callable[[str], object] | None = None, *,
                 on_timeout: Callable[[str], object] | None = None, first_steps: int = 1,
                 heartbeat_s: float | None = None,
                 keys: tuple[str, str] = ("parallel.step_timeout_s", "parallel.init_timeout_s"),
                 prefix: str | None = None):
        self._mesh = None
        if isinstance(source, ParallelMesh):
            if source.rendezvous is None:
                raise ValueError("StepWatchdog: this ParallelMesh has no rendezvous store (torch.distributed was "
                                 "initialized outside init_distributed); build it with ParallelDims.build("
                                 "rendezvous=<what init_distributed returned>) or pass the store itself")
            for name, given, have in (("rank", rank, source.rank), ("world", world, source.dims.world_size)):
                if given is not None and given != have:
                    raise ValueError(f"StepWatchdog: {name}={given} differs from the mesh's {have}")
            self._mesh, store, rank, world = source, source.store, source.rank, source.dims.world_size
            if first_timeout_s is None:
                first_timeout_s = source.timeout.total_seconds()
            address, host = source.rendezvous.address, source.rendezvous.host
        elif isinstance(source, dist.Store):
            store, address, host = source, "the store", "its host"
            if isinstance(source, dist.TCPStore):
                address = f"tcp://{source.host}:{source.port}"
        else:
            raise TypeError(f"StepWatchdog: source must be a ParallelMesh or a torch.distributed.Store, got "
                            f"{type(source).__name__}")
        for name, value in (("rank", rank), ("world", world)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"StepWatchdog: {name} must be an int, got {value!r}")
        if not 0 <= rank < world:
            raise ValueError(f"StepWatchdog: rank {rank} is outside the world of {world} ranks")
        step_key, first_key = keys
        for key, value in ((step_key, timeout_s), (first_key, first_timeout_s)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
                raise ValueError(f"StepWatchdog: {key} must be a finite number of seconds > 0, got {value!r}")
        if timeout_s > first_timeout_s:
            raise ValueError(f"StepWatchdog: {step_key} = {timeout_s:g} s is longer than {first_key} = "
                             f"{first_timeout_s:g} s, the collectives' own timeout, which would fire first with a "
                             f"message that names no rank; lower {step_key} or raise {first_key}")
        if not isinstance(first_steps, int) or isinstance(first_steps, bool) or first_steps < 0:
            raise ValueError(f"StepWatchdog: first_steps must be an int >= 0, got {first_steps!r}")
        if heartbeat_s is None:
            heartbeat_s = min(5.0, timeout_s / 10)
        elif (not isinstance(heartbeat_s, (int, float)) or isinstance(heartbeat_s, bool)
              or not 0 < heartbeat_s <= timeout_s / 3):
            raise ValueError(f"StepWatchdog: heartbeat_s must be > 0 and at most a third of {step_key} "
                             f"({timeout_s:g} s), got {heartbeat_s!r}")
        for name, fn in (("log", log), ("on_timeout", on_timeout)):
            if fn is not None and not callable(fn):
                raise TypeError(f"StepWatchdog: {name} must be callable, got {type(fn).__name__}")
        self.rank, self.world = rank, world
        self.timeout_s, self.first_timeout_s, self.first_steps = float(timeout_s), float(first_timeout_s), first_steps
        self.heartbeat_s = float(heartbeat_s)
        self.stale_s = max(4 * self.heartbeat_s, 2.0)
        self.grace_s = self.stale_s + 2 * self.heartbeat_s  # after a failure's verdict, before ending a live rank
        self._verdict_wait = self.stale_s + 4 * self.heartbeat_s + 1.0  # for a diagnosing rank's verdict
        self._keys = keys
        self._log_fn = log or (lambda text: print(text, file=sys.stderr, flush=True))
        self._on_timeout = on_timeout
        self._store, self._address, self._host = store, address, host
        self._prefix_arg = prefix
        self.who = f"{socket.gethostname()}:{os.getpid()}"
        self.diagnosers = sorted({0, world - 1})
        self._phase = _Phase()
        self._steps_begun = 0
        self._thread = self._link = self._exit_thread = None
        self._closed = False
        self._wake = threading.Event()
        self._verdict_seen = threading.Event()

    # -- life cycle
    def start(self) -> StepWatchdog:
        """Publish the first heartbeat (WatchdogError if the store does not answer) and start the thread."""
        if self._thread is not None or self._closed:
            raise WatchdogError("StepWatchdog.start: already started" + (" and closed" if self._closed else ""))
        if self._prefix_arg is not None:
            self.prefix = self._prefix_arg
        elif self._mesh is not None:
            self.prefix = self._mesh.store_prefix("watchdog")
        else:
            self.prefix = f"megakern/watchdog/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self._hb_keys = [f"{self.prefix}/hb/{r}" for r in range(self.world)]
        self._beat = 0
        self._history: dict[int, list] = {}  # rank -> [raw, changed at (monotonic), first seen, changed seen]
        self._present: set[int] = set()
        self._alarm = None  # (kind, text, at, published)
        self._verdict = None  # {"by", "kind", "summary", "text"}
        self._verdict_at = None
        self._diag = None  # {"trigger", "kind", "at", "deadline"} while diagnosing
        self._failure_text = None
        self._link = _StoreLink(self._store, max(self.stale_s, 5.0))
        try:
            self._link.call(_publish_first, self._hb_keys[self.rank], self._payload(), f"{self.prefix}/started")
        except _StoreLost as exc:
            self._link.close(1.0)
            raise WatchdogError(f"step watchdog: rank {self.rank} cannot write its heartbeat to the rendezvous store "
                                f"at {self._address} (hosted by {self._host}): {exc}") from None
        self._thread = threading.Thread(target=self._loop, name="megakern-watchdog", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Publish "finished", stop the thread and the store connection (waits at most a few seconds). Idempotent;
        from ``on_timeout`` (the watchdog's own thread, about to end the process) it only marks the watchdog closed."""
        if self._closed:
            return
        self._closed = True
        if self._thread is None or threading.current_thread() in (self._thread, self._exit_thread):
            return
        self._wake.set()
        self._thread.join(self.heartbeat_s + self._link.timeout_s + 1.0)
        with contextlib.suppress(_StoreLost):
            self._link.call(_publish, self._hb_keys[self.rank], self._payload(closed=True))
        self._link.close(2.0)

    def __enter__(self) -> StepWatchdog:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> bool:
        if isinstance(exc, Exception) and self._phase.open:
            self.failed(exc)
        self.close()
        return False

    # -- phases (the training thread; no store operation here)
    def begin_step(self, step: int, *, timeout_s: float | None = None) -> None:
        """Step ``step`` begins: it may take ``timeout_s`` (default: the step timeout, ``first_timeout_s`` for the
        first ``first_steps`` steps)."""
        self.begin_phase("step", step, timeout_s=timeout_s)

    def end_step(self, step: int) -> None:
        self.end_phase("step", step)

    def begin_phase(self, name: str, step: int, *, timeout_s: float | None = None) -> None:
        """``name`` ("step", "eval", "checkpoint", ...) begins at ``step``; it may last ``timeout_s`` (default: the
        step timeout for steps after the first ``first_steps``, else ``first_timeout_s``)."""
        if self._thread is None or self._closed:
            raise WatchdogError(f"StepWatchdog.begin_phase({name!r}, {step}): the watchdog is "
                                f"{'closed' if self._closed else 'not started (call start() first)'}")
        current = self._phase
        if current.open:
            raise WatchdogError(f"StepWatchdog.begin_phase({name!r}, {step}): {current.name} {current.step} is still "
                                "open (end it first)")
        step_key, first_key = self._keys
        if timeout_s is not None:
            if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0:
                raise ValueError(f"StepWatchdog.begin_phase({name!r}): timeout_s must be > 0, got {timeout_s!r}")
            limit, text = float(timeout_s), f"its timeout of {timeout_s:g} s"
        elif name == "step" and self._steps_begun >= self.first_steps:
            limit, text = self.timeout_s, f"the step timeout of {self.timeout_s:g} s ({step_key})"
        else:
            what = "the first steps'" if name == "step" else f"the {name} phase's"
            limit, text = self.first_timeout_s, f"{what} timeout of {self.first_timeout_s:g} s ({first_key})"
        if name == "step":
            self._steps_begun += 1
        seq = current.seq + 1 if current.step == step else 1
        self._phase = _Phase(name, step, seq, True, time.monotonic(), limit, text, None, threading.get_ident())

    def end_phase(self, name: str, step: int | None = None) -> None:
        current = self._phase
        if not current.open or current.name != name or (step is not None and step != current.step):
            now = f"{current.name} {current.step} is open" if current.open else "no phase is open"
            raise WatchdogError(f"StepWatchdog.end_phase({name!r}, {step}): {now}")
        self._phase = current._replace(seq=current.seq + 1, open=False)

    @contextlib.contextmanager
    def phase(self, name: str, step: int, *, timeout_s: float | None = None):
        """``with watchdog.phase("eval", step):`` begin, end; an exception leaving it goes through ``failed``."""
        self.begin_phase(name, step, timeout_s=timeout_s)
        try:
            yield self
        except Exception as exc:
            self.failed(exc)
            raise
        self.end_phase(name, step)

    def failed(self, exc: BaseException) -> None:
        """This rank's open phase ends with ``exc``: publish it, let a diagnosing rank name what the others were
        doing (in its log; the summary in this rank's), and return (at most about ``stale_s`` + a few heartbeats)
        for ``exc`` to go on its way. A rank still running ``grace_s`` after that is ended (EXIT_CODE)."""
        if self._thread is None or self._closed or self._phase.failed:
            return
        lines = str(exc).strip().splitlines()
        first = lines[0] if lines else ""
        cut = first.find(". ", 60)  # gloo's and NCCL's boilerplate after their first sentence
        if len(first) > 160 and cut > 0:
            first = first[:cut + 1]
        text = f"{type(exc).__name__}: {first}".rstrip(": ")[:_FAILURE_CHARS]
        self._phase = self._phase._replace(open=False, failed=text)
        self._failure_text = text
        self._wake.set()
        until = time.monotonic() + 2 * self._verdict_wait + self.stale_s + 2 * self.heartbeat_s
        while self._thread.is_alive() and time.monotonic() < until and not self._verdict_seen.wait(0.1):
            pass

    # -- the thread
    def _payload(self, closed: bool = False) -> bytes:
        self._beat += 1
        ph = self._phase
        state = {"beat": self._beat, "who": self.who, "phase": ph.name, "step": ph.step, "seq": ph.seq,
                 "open": ph.open}
        if ph.open:
            state["for"] = round(time.monotonic() - ph.since, 1)
            state["where"], state["via"], state["comm"] = _where(ph.thread)
        if ph.failed:
            state["failed"] = ph.failed
        if closed:
            state["closed"] = True
        return json.dumps(state).encode()

    def _loop(self) -> None:
        while not self._closed:
            self._wake.wait(self.heartbeat_s / 2 if self._diag is not None else self.heartbeat_s)
            self._wake.clear()
            if self._closed:
                return
            try:
                self._tick()
            except Exception as exc:  # noqa: BLE001 - a fault of the watchdog must not pass silently
                self._say(f"step watchdog: rank {self.rank}: internal error, watching stops: "
                          f"{type(exc).__name__}: {exc}")
                return

    def _tick(self) -> None:
        now = time.monotonic()
        ph = self._phase
        if self._alarm is None:
            if self._failure_text is not None:
                self._alarm = ["failure", f"{self._name()} failed {self._in(ph)}: {self._failure_text}", now, False]
            elif ph.open and now - ph.since > ph.limit:
                self._alarm = ["hang", f"{self._name()} has been {self._in(ph)} for {_seconds(now - ph.since)} s, "
                                       f"past {ph.limit_text}", now, False]
        diagnosing = self.rank in self.diagnosers or self._diag is not None
        try:
            alarms, verdicts, sample = self._link.call(
                _exchange, self._hb_keys[self.rank], self._payload(),
                self._alarm if self._alarm and not self._alarm[3] else None, self.prefix,
                self._sample_keys() if diagnosing else None, self._diag is not None)
            if self._alarm:
                self._alarm[3] = True
            if sample is not None:
                self._record(sample, now)
            if verdicts and self._verdict is None:
                self._verdict = json.loads(self._link.call(_read_verdict, self.prefix))
                self._verdict_at = now
            if alarms and self._diag is None and self._verdict is None and self.rank in self.diagnosers:
                alarm = json.loads(self._link.call(lambda s, k: s.get(k), f"{self.prefix}/alarm"))
                self._diag = {"trigger": alarm["text"], "kind": alarm["kind"], "at": now,
                              "deadline": now + self.stale_s + 2 * self.heartbeat_s}
        except _StoreLost:
            pass
        if self._link.lost is not None and self._verdict is None and self._alarm is not None:
            self._conclude(self._alarm[1], self._alarm[0], now)  # the store is gone: say so, from what we know
        elif self._verdict is None and self._alarm is not None and self._diag is None and (
                self.rank in self.diagnosers or now - self._alarm[2] > self._verdict_wait):
            # a diagnosing rank starts at once; any other rank after waiting for theirs in vain
            self._diag = {"trigger": self._alarm[1], "kind": self._alarm[0], "at": now,
                          "deadline": now + self.stale_s + 2 * self.heartbeat_s}
        if self._diag is not None and self._verdict is None and self._resolved(now):
            self._conclude(self._diag["trigger"], self._diag["kind"], now)
        if self._verdict is not None:
            self._act(now)

    def _name(self) -> str:
        return f"rank {self.rank} ({self.who})"

    @staticmethod
    def _in(ph: _Phase) -> str:
        return f"in step {ph.step}" if ph.name == "step" else f"in {ph.name} (step {ph.step})"

    def _sample_keys(self) -> tuple[list[str], list[int], bool]:
        missing = [r for r in range(self.world) if r not in self._present]
        return [self._hb_keys[r] for r in sorted(self._present)], missing, len(self._present) == self.world

    def _record(self, sample, now: float) -> None:
        present, values = sample
        self._present.update(present)
        for r, raw in zip(present, values):
            entry = self._history.get(r)
            if entry is None:
                self._history[r] = [raw, now, now, False]
            elif entry[0] != raw:
                entry[0], entry[1], entry[3] = raw, now, True

    def _resolved(self, now: float) -> bool:
        """Every rank either beat after the alarm (alive), or failed / finished, or has not beaten for stale_s."""
        if now >= self._diag["deadline"]:
            return True
        at = self._diag["at"]
        for r in range(self.world):
            entry = self._history.get(r)
            if entry is None:
                return False
            state = json.loads(entry[0])
            fresh, gone = entry[3] and entry[1] > at, now - entry[1] >= self.stale_s
            if not (fresh or gone or state.get("failed") or state.get("closed")):
                return False
        return True

    def _conclude(self, trigger: str, kind: str, now: float) -> None:
        seen, note = {}, None
        if self._link.lost is None:
            for r in range(self.world):
                entry = self._history.get(r)
                seen[r] = (Seen(None, math.inf) if entry is None
                           else Seen(json.loads(entry[0]), now - entry[1], entry[3]))
        else:  # every heartbeat went with the store: what it last showed says nothing about now
            ago = _seconds(max(now - self._link.lost_at, 0.0))
            note = (f"the rendezvous store at {self._address}, hosted by {self._host}, stopped answering {ago} s "
                    f"ago ({self._link.lost}): {self._host} is gone or unreachable, and with it every rank's heartbeat")
        summary, text, _ = verdict(trigger, seen, self.stale_s, hang=kind == "hang", store_note=note)
        readers = sum(1 for r, s in seen.items() if r != self.rank and s.state is not None
                      and not s.state.get("closed") and s.age < self.stale_s)
        self._verdict = {"by": self.rank, "kind": kind, "summary": summary, "text": text, "readers": readers}
        self._verdict_at = now
        self._diag = None
        with contextlib.suppress(_StoreLost):
            self._link.call(_publish_verdict, self.prefix, json.dumps(self._verdict).encode())
            self._linger()
        if kind == "hang":
            self._end(text)
        self._say(text)
        self._verdict_seen.set()

    def _linger(self) -> None:
        """Wait (at most two heartbeats and a second) until the ranks that beat have read the verdict: this rank
        may host the store (rank 0 does, outside torchrun), and the store ends with it."""
        until = time.monotonic() + 2 * self.heartbeat_s + 1.0
        readers = self._verdict.get("readers", self.world - 1)
        with contextlib.suppress(_StoreLost):
            while (self._link.call(lambda store, k: store.add(k, 0), f"{self.prefix}/verdict_read") < readers
                   and time.monotonic() < until):
                time.sleep(self.heartbeat_s / 4)

    def _act(self, now: float) -> None:
        """Another rank's verdict (this rank's own ended in ``_conclude``): a diagnosing rank logs it whole (rank 0's
        log is the run's), any other its summary; after a hang every rank ends now, after a failure it goes on."""
        v = self._verdict
        if not self._verdict_seen.is_set():
            if self.rank == 0:
                self._linger()
            if self.rank in self.diagnosers:
                text = v["text"]
            else:
                text = (f"{'error: ' if v['kind'] == 'hang' else ''}step watchdog: {v['summary']} (rank {v['by']}'s "
                        "log has the details)")
            if v["kind"] == "hang":
                self._end(f"{text} [{self._name()} ends with exit code {EXIT_CODE}]")
            self._say(text)
            self._verdict_seen.set()
        if now - self._verdict_at > self.grace_s:
            self._end(f"error: step watchdog: {self._name()} is still running {_seconds(now - self._verdict_at)} s "
                      f"after the verdict ({v['summary']}); it ends with exit code {EXIT_CODE}")

    def _say(self, text: str) -> None:
        try:
            self._log_fn(text)
        except Exception:  # noqa: BLE001 - the message must get out somewhere
            print(text, file=sys.stderr, flush=True)

    def _end(self, text: str | None) -> None:
        """Log ``text`` (None: logged already), call on_timeout, abort NCCL groups, flush, and exit the process:
        the training thread may be blocked in a collective that nothing else can end. Bounded by EXIT_GRACE_S."""
        def last_words():
            if text is not None:
                self._say(text)
            if self._on_timeout is not None:
                try:
                    self._on_timeout(text if text is not None else self._verdict["text"])
                except Exception as exc:  # noqa: BLE001
                    print(f"step watchdog: on_timeout failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            self._abort()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()

        self._exit_thread = helper = threading.Thread(target=last_words, name="megakern-watchdog-exit", daemon=True)
        helper.start()
        helper.join(EXIT_GRACE_S)
        os._exit(EXIT_CODE)

    def _abort(self) -> None:
        """Abort the NCCL process groups (their kernels and communicators; gloo needs nothing)."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        groups = [dist.group.WORLD]
        if self._mesh is not None:
            with contextlib.suppress(Exception):
                groups += list(self._mesh.mesh.get_all_groups()) + [self._mesh.dp_cp_group]
        for group in groups:
            with contextlib.suppress(Exception):
                if "nccl" in str(dist.get_backend(group)).lower():
                    group.abort()


# ---- store operations (run on the store thread) ---------------------------------------------------------------
def _publish_first(store, key: str, payload: bytes, started: str) -> None:
    store.set(key, payload)
    store.add(started, 1)


def _publish(store, key: str, payload: bytes) -> None:
    store.set(key, payload)


def _read_verdict(store, prefix: str) -> bytes:
    store.add(f"{prefix}/verdict_read", 1)
    return store.get(f"{prefix}/verdict")


def _publish_verdict(store, prefix: str, payload: bytes) -> None:
    store.set(f"{prefix}/verdict", payload)
    store.add(f"{prefix}/verdicts", 1)


def _exchange(store, key: str, payload: bytes, alarm, prefix: str, sample, diagnosing: bool):
    """One heartbeat: this rank's state; its alarm if new; the alarm and verdict counters; every present rank's
    heartbeat (diagnosing ranks; the missing ones checked one by one while a diagnosis runs)."""
    store.set(key, payload)
    if alarm is not None:
        store.set(f"{prefix}/alarm", json.dumps({"kind": alarm[0], "text": alarm[1]}).encode())
        store.add(f"{prefix}/alarms", 1)
    alarms, verdicts = store.add(f"{prefix}/alarms", 0), store.add(f"{prefix}/verdicts", 0)
    if sample is None:
        return alarms, verdicts, None
    keys, missing, complete = sample
    present = [int(k.rsplit("/", 1)[1]) for k in keys]
    if not complete and missing:
        if store.add(f"{prefix}/started", 0) >= len(present) + len(missing):
            present += missing
        elif diagnosing:
            present += [r for r in missing if store.check([f"{prefix}/hb/{r}"])]
        present.sort()
    values = store.multi_get([f"{prefix}/hb/{r}" for r in present]) if present else []
    return alarms, verdicts, (present, values)
