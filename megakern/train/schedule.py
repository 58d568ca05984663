"""Learning-rate schedules: linear warmup, then cosine | linear | WSD | constant decay to min_lr.

With W warmup steps, S total steps, peak lr and floor m, the lr of step s (0-based: the lr the s-th optimizer step
uses) is

    s < W:   lr * (s + 1) / (W + 1)                             (never 0: the first step already moves)
    after:   p = (s - W) / max(S - W - 1, 1), clipped to [0, 1]  (0 at the first decay step, 1 at the last)
             cosine   m + (lr - m) * (1 + cos(pi p)) / 2
             linear   m + (lr - m) * (1 - p)
             constant lr
    wsd:     lr until the last D = ceil(f * S) steps (at least W of them excluded), then over those steps with
             q = (s - (S - D)) / max(D - 1, 1):  linear  m + (lr - m) (1 - q);  cosine  m + (lr - m)(1 + cos pi q)/2;
             1-sqrt  m + (lr - m) (1 - sqrt q)  (Hägele et al. 2024)

so step W is the one step at the peak, and the last step runs at exactly min_lr. The schedule is a pure function of the step: its state in a checkpoint is
the step count alone, and ``lr_at`` can be called for any step (tests, plots). Steps past S stay at the last value.
"""
from __future__ import annotations

import math

from megakern.config import ScheduleConfig

DECAYS = ("cosine", "linear", "wsd", "constant")
WSD_SHAPES = ("linear", "cosine", "1-sqrt")


def lr_at(step: int, *, lr: float, total_steps: int, warmup_steps: int = 0, decay: str = "cosine",
          min_lr: float = 0.0, wsd_decay_fraction: float = 0.2, wsd_decay_shape: str = "1-sqrt") -> float:
    """The learning rate of 0-based optimizer step ``step`` (formulas in the module doc)."""
    if decay not in DECAYS:
        raise ValueError(f"decay must be one of {DECAYS}, got {decay!r}")
    if wsd_decay_shape not in WSD_SHAPES:
        raise ValueError(f"wsd_decay_shape must be one of {WSD_SHAPES}, got {wsd_decay_shape!r}")
    if total_steps < 1 or warmup_steps < 0 or step < 0:
        raise ValueError(f"need total_steps >= 1, warmup_steps >= 0, step >= 0; got {total_steps}, {warmup_steps}, "
                         f"{step}")
    if not 0 <= min_lr <= lr:
        raise ValueError(f"min_lr {min_lr} must be in [0, lr={lr}]")
    step = min(step, total_steps - 1)
    if step < warmup_steps:
        return lr * (step + 1) / (warmup_steps + 1)
    if decay == "constant":
        return lr
    if decay == "wsd":
        if not 0 < wsd_decay_fraction <= 1:
            raise ValueError(f"wsd_decay_fraction must be in (0, 1], got {wsd_decay_fraction}")
        decay_steps = min(math.ceil(wsd_decay_fraction * total_steps), total_steps - warmup_steps)
        start = total_steps - decay_steps
        if step < start:
            return lr
        q = (step - start) / max(decay_steps - 1, 1)
        shape = {"linear": 1 - q, "cosine": (1 + math.cos(math.pi * q)) / 2, "1-sqrt": 1 - math.sqrt(q)}
        return min_lr + (lr - min_lr) * shape[wsd_decay_shape]
    p = min(max((step - warmup_steps) / max(total_steps - warmup_steps - 1, 1), 0.0), 1.0)
    if decay == "cosine":
        return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * p)) / 2
    return min_lr + (lr - min_lr) * (1 - p)


class LRSchedule:
    """``lr_at`` bound to a config: ``schedule(step) -> lr``. ``state_dict()`` records the parameters in checkpoints
    and ``from_state`` rebuilds that schedule (a resumed run keeps it unless schedule.on_resume=config);
    ``differences`` names what another schedule changes, ``describe`` what is left of it."""

    def __init__(self, config: ScheduleConfig, *, lr: float, total_steps: int):
        self.config, self.lr, self.total_steps = config, lr, total_steps
        self.kwargs = dict(lr=lr, total_steps=total_steps, warmup_steps=config.warmup_steps, decay=config.decay,
                           min_lr=config.min_lr, wsd_decay_fraction=config.wsd_decay_fraction,
                           wsd_decay_shape=config.wsd_decay_shape)
        lr_at(0, **self.kwargs)  # argument checks now, not at the first step

    def __call__(self, step: int) -> float:
        return lr_at(step, **self.kwargs)

    @classmethod
    def from_state(cls, state: dict) -> "LRSchedule":
        """The schedule a checkpoint recorded (``state_dict()``'s output); ValueError naming what is missing or
        wrong."""
        keys = ("lr", "total_steps", "warmup_steps", "decay", "min_lr", "wsd_decay_fraction", "wsd_decay_shape")
        if not isinstance(state, dict) or (missing := [k for k in keys if k not in state]):
            raise ValueError(f"a schedule state needs {list(keys)}; missing "
                             f"{missing if isinstance(state, dict) else 'everything'}")
        config = ScheduleConfig(warmup_steps=state["warmup_steps"], decay=state["decay"], min_lr=state["min_lr"],
                                wsd_decay_fraction=state["wsd_decay_fraction"],
                                wsd_decay_shape=state["wsd_decay_shape"])
        return cls(config, lr=state["lr"], total_steps=state["total_steps"])

    def describe(self, done: int) -> str:
        """What the schedule does after ``done`` optimizer steps, in the 1-based step numbers of the log (step n
        runs at ``self(n - 1)``): the next step's lr, then each phase still ahead."""
        k = self.kwargs
        S, W, peak, floor = k["total_steps"], k["warmup_steps"], k["lr"], k["min_lr"]
        n = done + 1
        parts = [f"step {n} at lr {self(done):.3e}"]
        if n > S:
            return parts[0] + f", past the schedule's end (step {S}): its final lr from here on"
        if n <= W:
            parts.append(f"warmup to {peak:.3e} at step {W + 1}")
        if k["decay"] == "constant":
            parts.append(f"constant {peak:.3e} to step {S}")
        elif k["decay"] == "wsd":
            decay_steps = min(math.ceil(k["wsd_decay_fraction"] * S), S - W)
            if n <= S - decay_steps:
                parts.append(f"stable at {peak:.3e} to step {S - decay_steps}")
            parts.append(f"{k['wsd_decay_shape']} decay to {floor:.3e} at step {S}")
        else:
            parts.append(f"{k['decay']} decay to {floor:.3e} at step {S}")
        return ", ".join(parts) + "; later steps stay at the final lr"

    def state_dict(self) -> dict:
        return dict(self.kwargs)

    def differences(self, state: dict) -> list[str]:
        """'name: checkpoint -> now' for every parameter that differs from a checkpoint's ``state``."""
        return [f"{k}: {state.get(k)!r} -> {v!r}" for k, v in self.kwargs.items() if state.get(k) != v]
