"""Stopping a run on purpose: SIGTERM / SIGINT, and a stop that every rank agrees on.

Schedulers send SIGTERM before they preempt a job (Slurm, Kubernetes, torchrun's agent forwarding its own), and a
user presses Ctrl-C (SIGINT). ``StopSignals`` turns the first of either into a request: the training loop finishes
the step it is in, saves a checkpoint, logs it and exits with ``EXIT_INTERRUPTED``; before the loop runs (start-up)
a signal stops the process at once, as there is nothing to save. A second signal exits at once
(``Interrupted`` raised in the main thread; if the main thread has not unwound to ``restore()`` within ``grace_s``,
stuck in a blocked collective say, the process ends with ``os._exit``): nothing is saved, and a checkpoint save it cuts
short leaves only a temporary directory, removed at the next start.

Over several ranks the decision must be the same on every rank at the same step, or the ranks that stop would wait
in the save's collectives for ranks that went on. ``StopVote.agree`` is called by every rank after every step: one
all-reduce (max) of a few integers over a gloo group of the host (no device synchronization, whatever the training
backend), carrying this rank's reasons to stop: a signal received, or an error it found (the data files changed on
disk). A signal that reaches one rank only stops every rank at the same step; an error found by one rank is raised
on every rank with that rank's message. One process needs no group: the vote is its own. ``StopVote.start`` issues
the all-reduce without waiting (gloo runs it in the background), so the training loop reads each step's vote after
the next step is queued: a stop lands one step later, and the host never waits on the vote's latency.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

EXIT_INTERRUPTED = 75  # sysexits' EX_TEMPFAIL: stopped by a signal after saving; run it again to continue
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(KeyboardInterrupt):
    """A signal that stops the process now, without saving: a second SIGTERM / SIGINT, or one that arrives before
    the training loop runs. A KeyboardInterrupt, so whatever cleans up after Ctrl-C (a checkpoint save removing its
    temporary directory) does so for SIGTERM too."""


class StopSignals:
    """Handlers for SIGTERM and SIGINT, installed with ``install()`` (main thread only) until ``restore()``.

    ``received``: the name of the first signal ('SIGTERM'), or None. ``graceful``: whether a first signal is a
    request (set while the training loop runs) or stops the process at once (start-up: there is no step to finish
    and nothing to save). ``log``: where a line about an immediate stop goes (a request is logged by the loop,
    outside the handler)."""

    def __init__(self, log=None, grace_s: float = 10.0):
        self.received: str | None = None
        self.count = 0
        self.graceful = False
        self.log = log or (lambda line: None)
        self.grace_s = grace_s
        self._previous: dict = {}
        self._backstop: threading.Timer | None = None

    def install(self) -> "StopSignals":
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("StopSignals.install() must run in the main thread (Python delivers signals there)")
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        """The previous handlers back; a second signal's backstop called off (the main thread got here)."""
        if self._backstop is not None:
            self._backstop.cancel()
            self._backstop = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        self.count += 1
        if self.count == 1 and self.graceful:
            self.received = name
            return
        why = "second signal" if self.count > 1 else "signal before the first step"
        try:
            self.log(f"{why} ({name}): exiting now, without a checkpoint")
        except Exception:  # noqa: BLE001 - the handler must raise below whatever the log does
            pass
        # the main thread may sit in a blocked collective, where no Python runs: a backstop ends the process unless
        # restore() (the main thread unwinding to the end) calls it off first
        if self._backstop is None:
            self._backstop = threading.Timer(self.grace_s, _exit_now)
            self._backstop.daemon = True
            self._backstop.start()
        raise Interrupted(f"{name} ({why}): stopped without saving")


def _exit_now() -> None:
    sys.stderr.write(f"megakern-train: the main thread did not stop after the signal; exiting with "
                     f"{EXIT_INTERRUPTED}\n")
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


@dataclass
class Vote:
    """The outcome of one ``StopVote.agree``: whether a signal reached any rank (``signal``: the first rank's
    signal name and that rank), and the errors ranks found ({rank: message})."""

    signal: str | None = None
    signal_rank: int | None = None
    errors: dict[int, str] | None = None


class StopVote:
    """Every rank's reasons to stop, agreed after each step (module doc). ``distributed``: the default process
    group is initialized; a gloo group over all ranks is made for the vote (collective: every rank constructs it).
    """

    def __init__(self, distributed: bool, timeout=None):
        self.group = None
        self.world, self.rank = 1, 0
        if distributed:
            self.world, self.rank = dist.get_world_size(), dist.get_rank()
            kwargs = {"timeout": timeout} if timeout is not None else {}
            self.group = dist.new_group(backend="gloo", **kwargs)

    def agree(self, signal_name: str | None, error: str | None) -> Vote:
        """Every rank calls this at the same point with its own reasons; all get the same Vote."""
        return self.start(signal_name, error).result()

    def start(self, signal_name: str | None, error: str | None) -> "PendingVote":
        """``agree`` in two halves: the all-reduce is issued now and runs in gloo's background thread while the
        caller goes on (the next step); ``result()`` waits for it. Every rank calls ``result()`` of its votes in
        the order it started them, at the same points (one vote in flight at a time)."""
        if self.group is None:
            return PendingVote(self, None, error, None,
                               Vote(signal_name, 0 if signal_name else None, {0: error} if error else None))
        code = SIGNALS.index(getattr(signal, signal_name)) + 1 if signal_name else 0
        # (signal code, rank + 1 of the lowest rank that has one, whether any rank found an error), by max
        flags = torch.tensor([code, (self.world - self.rank) if code else 0, 1 if error else 0], dtype=torch.int64)
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return PendingVote(self, flags, error, work)

    def close(self) -> None:
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
        self.group = None


class PendingVote:
    """A vote in flight (``StopVote.start``): ``result()`` waits for the ranks' all-reduce and gathers the error
    messages when any rank had one (all ranks then take part, in the same order)."""

    def __init__(self, voter: StopVote, flags, error: str | None, work, done: Vote | None = None):
        self.voter, self.flags, self.error, self.work, self._vote = voter, flags, error, work, done

    def result(self) -> Vote:
        if self._vote is not None:
            return self._vote
        self.work.wait()
        v, flags, vote = self.voter, self.flags, Vote()
        if flags[0]:
            vote.signal, vote.signal_rank = SIGNALS[int(flags[0]) - 1].name, v.world - int(flags[1])
        if flags[2]:
            messages: list = [None] * v.world
            dist.all_gather_object(messages, self.error, group=v.group)
            vote.errors = {r: m for r, m in enumerate(messages) if m}
        self._vote = vote
        return vote
