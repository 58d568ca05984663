"""A step's figures and time on their way to the host: StepFigures (loss, gradient norm, skipped; a pinned copy behind
a CUDA event, read without waiting for later steps), StepClock / StepTime (each step timed on this rank's own clock
or by CUDA events where it runs), and ``wait_for_event`` (a bounded wait for a replayed graph's collectives)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class StepFigures:
    """One optimizer step's figures on their way to the host: ``values`` fp32 = (loss, gradient norm, 1.0 if the
    step was skipped, then the MoE layers' figures if any); on CUDA a pinned host copy behind ``event``, so reading
    them waits for this step only, not for the steps queued after it. ``time``: the step's duration (StepClock),
    attached by the loop. ``extra``: the values after the first three, once read."""

    step: int
    values: torch.Tensor
    event: object = None
    timeout: float | None = None  # seconds to wait for the event before calling the step stalled (graph replays)
    time: "StepTime | None" = None
    extra: "list[float] | None" = None

    def read(self) -> tuple[float, float, bool]:
        """(loss, norm, stepped), waiting for the step if it is still running."""
        if self.event is not None:
            if self.timeout is None:
                self.event.synchronize()
            else:
                wait_for_event(self.event, self.timeout, f"step {self.step}")
        values = self.values.tolist()
        loss, norm, skipped = values[:3]
        self.extra = values[3:]
        return loss, norm, skipped == 0


@dataclass
@dataclass
class StepTime:
    """When one step began and ended (perf_counter_ns on the host, or CUDA events on the step's stream) and when
    the step before it ended, if it ran back to back with this one."""

    begin: object
    end: object
    previous_end: object = None

    def ns(self) -> int:
        """The step's duration in ns: from the end of the step before it (back to back: so the host's time
        between steps counts) or from its own beginning (the first step, or the first after an eval or a save),
        to its end. Waits for the end on CUDA."""
        start = self.previous_end if self.previous_end is not None else self.begin
        if isinstance(self.end, int):
            return self.end - start
        self.end.synchronize()
        return round(start.elapsed_time(self.end) * 1e6)


class StepClock:
    """Times steps as the device runs them (contracts 1 and 9, docs/contracts.md: this rank's own monotonic clock
    or CUDA events, integer ns): ``begin()`` before a step is queued, ``end()`` after, giving its StepTime;
    ``pause()`` after anything that is not a step (eval, a checkpoint), so the next step is timed from its own
    beginning. On CUDA the step's queued work runs after ``end()`` returns: events time it on the device, where it
    runs, instead of crediting it to the step whose figures happen to be read then."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._begin = self._last_end = None

    def _now(self):
        if not self.cuda:
            return time.perf_counter_ns()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin(self) -> None:
        self._begin = self._now()

    def end(self) -> StepTime:
        end = self._now()
        timed = StepTime(self._begin, end, self._last_end)
        self._last_end = end
        return timed

    def pause(self) -> None:
        self._last_end = None


def wait_for_event(event, timeout: float, what: str) -> None:
    """Wait for a CUDA event, polling, and raise if it has not completed after ``timeout`` seconds. For CUDA-graph
    replays over several ranks: NCCL's watchdog does not watch collectives captured in a graph, so a stalled or lost
    rank would otherwise leave the others waiting forever without a word."""
    deadline = time.monotonic() + timeout
    pause = 1e-5
    while not event.query():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: the replayed CUDA graph has not finished after {timeout:g} s "
                               "(parallel.init_timeout_s): a rank is stalled or gone; its collectives, captured in the "
                               "graph, are not watched by NCCL's watchdog")
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)

