"""Learning-rate schedules: warmup, cosine / linear / WSD / constant decay, endpoints and shapes."""
import math

import pytest

from megakern.config import ScheduleConfig
from megakern.train.schedule import LRSchedule, lr_at

LR, MIN = 1e-3, 1e-4


def test_warmup_is_linear_from_the_first_step_to_the_peak():
    values = [lr_at(s, lr=LR, total_steps=100, warmup_steps=10, min_lr=MIN) for s in range(10)]
    assert values == pytest.approx([LR * (s + 1) / 11 for s in range(10)])
    assert lr_at(10, lr=LR, total_steps=100, warmup_steps=10, min_lr=MIN) == pytest.approx(LR)


@pytest.mark.parametrize("decay, middle", [("cosine", (LR + MIN) / 2), ("linear", (LR + MIN) / 2),
                                           ("constant", LR)])
def test_decay_endpoints_and_middle(decay, middle):
    total, warmup = 111, 10  # decay steps 10 .. 110, the middle at 60
    at = lambda s: lr_at(s, lr=LR, total_steps=total, warmup_steps=warmup, decay=decay, min_lr=MIN)  # noqa: E731
    assert at(warmup) == pytest.approx(LR)
    assert at(60) == pytest.approx(middle)
    assert at(total - 1) == pytest.approx(LR if decay == "constant" else MIN)
    assert at(total + 50) == at(total - 1)  # past the end: the last value
    values = [at(s) for s in range(warmup, total)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # never rises after warmup


def test_cosine_quarter_point():
    # p = 1/4 -> min + (lr - min) * (1 + cos(pi/4)) / 2
    assert lr_at(25, lr=LR, total_steps=101, warmup_steps=0, min_lr=MIN) == pytest.approx(
        MIN + (LR - MIN) * (1 + math.cos(math.pi / 4)) / 2)


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt"])
def test_wsd_stable_then_decay(shape):
    total, warmup, frac = 100, 5, 0.2  # decay over the last 20 steps: 80 .. 99
    at = lambda s: lr_at(s, lr=LR, total_steps=total, warmup_steps=warmup, decay="wsd", min_lr=MIN,  # noqa: E731
                         wsd_decay_fraction=frac, wsd_decay_shape=shape)
    assert all(at(s) == LR for s in range(warmup, 81))
    assert at(99) == pytest.approx(MIN)
    q = (90 - 80) / 19
    expected = {"linear": 1 - q, "cosine": (1 + math.cos(math.pi * q)) / 2, "1-sqrt": 1 - math.sqrt(q)}[shape]
    assert at(90) == pytest.approx(MIN + (LR - MIN) * expected)


def test_wsd_decay_never_eats_warmup():
    values = [lr_at(s, lr=LR, total_steps=10, warmup_steps=8, decay="wsd", min_lr=MIN, wsd_decay_fraction=0.9)
              for s in range(10)]
    assert values[:8] == pytest.approx([LR * (s + 1) / 9 for s in range(8)])
    assert values[-1] == pytest.approx(MIN)


@pytest.mark.parametrize("kwargs, message", [
    (dict(decay="step"), "decay must be one of"),
    (dict(min_lr=2e-3), "min_lr 0.002 must be in"),
    (dict(total_steps=0), "total_steps >= 1"),
    (dict(wsd_decay_shape="exp"), "wsd_decay_shape must be one of"),
])
def test_bad_arguments(kwargs, message):
    args = dict(lr=LR, total_steps=10, warmup_steps=2, min_lr=MIN) | kwargs
    with pytest.raises(ValueError, match=message):
        lr_at(3, **args)


def test_schedule_object_state_and_differences():
    schedule = LRSchedule(ScheduleConfig(warmup_steps=3, decay="linear", min_lr=0.0), lr=1.0, total_steps=7)
    assert [schedule(s) for s in range(7)] == pytest.approx([1 / 4, 2 / 4, 3 / 4, 1, 2 / 3, 1 / 3, 0])
    state = schedule.state_dict()
    assert schedule.differences(state) == []
    other = LRSchedule(ScheduleConfig(warmup_steps=3, decay="cosine", min_lr=0.0), lr=1.0, total_steps=7)
    assert other.differences(state) == ["decay: 'linear' -> 'cosine'"]
