"""LR schedules (docs/algorithms.md, "Optimizer and LR schedules"; length-decay paper alg. 1): warmup, cosine,
length_decay."""

from __future__ import annotations

import json

import pytest

from common.config import OptimConfig
from learner.schedules import LrSchedule


def run(schedule: LrSchedule, lengths: list[float], start: int = 0) -> list[float]:
    return [schedule.lr(start + i, length) for i, length in enumerate(lengths)]


def test_constant_with_linear_warmup():
    schedule = LrSchedule(OptimConfig(lr=1.0, sched="constant", warmup_steps=4), total_steps=10)
    assert [schedule.lr(step) for step in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def test_constant_without_warmup():
    schedule = LrSchedule(OptimConfig(lr=3e-6), total_steps=10)
    assert schedule.lr(0) == 3e-6


def test_cosine_endpoints():
    schedule = LrSchedule(OptimConfig(lr=1.0, sched="cosine", warmup_steps=2), total_steps=10)
    lrs = [schedule.lr(step) for step in range(12)]
    assert lrs[:3] == pytest.approx([0.5, 1.0, 1.0])  # warmup, then the peak at the end of warmup
    assert lrs[6] == pytest.approx(0.5)  # halfway through the 8 cosine steps
    assert lrs[9] > 0
    assert lrs[10] == pytest.approx(0.0, abs=1e-12)
    assert lrs[11] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))


# k = 3, factor 1.5: baseline 10; windows at t = 5, 6 are 13.3 and 16.7, so the surge is at t_s = 6 (step 5).
SURGE = [10.0, 10.0, 10.0, 10.0, 20.0, 20.0] + [20.0] * 60


def length_decay(**overrides) -> LrSchedule:
    cfg = OptimConfig(lr=1.0, sched="length_decay", surge_factor=1.5, surge_window=3, **overrides)
    return LrSchedule(cfg, total_steps=100)


def test_length_decay_triggers_on_surge_and_halves_to_floor():
    schedule = length_decay()
    lrs = run(schedule, SURGE)
    assert schedule.surge_step == 5
    assert schedule.decay_period == 11  # round(1.8 * 6)
    # halvings at t = 11, 22, 33, 44 (steps 10, 21, 32, 43); floor 0.1 after 0.125
    assert lrs[:10] == [1.0] * 10
    assert lrs[10:21] == [0.5] * 11
    assert lrs[21:32] == [0.25] * 11
    assert lrs[32:43] == [0.125] * 11
    assert lrs[43:] == pytest.approx([0.1] * (len(SURGE) - 43))
    assert schedule.metrics() == {"lr/surge_step": 5.0, "lr/decay_period": 11.0}


def test_length_decay_keeps_lr_without_surge():
    schedule = length_decay()
    assert run(schedule, [10.0] * 50) == [1.0] * 50
    assert schedule.surge_step is None
    assert schedule.metrics() == {"lr/surge_step": -1.0, "lr/decay_period": 0.0}


def test_length_decay_period_override_still_waits_for_surge():
    schedule = length_decay(decay_period=4)
    lrs = run(schedule, SURGE[:17])
    assert schedule.decay_period == 4
    # t = 4 precedes the surge (t_s = 6): no halving; then t = 8, 12, 16 (steps 7, 11, 15)
    assert lrs == pytest.approx([1.0] * 7 + [0.5] * 4 + [0.25] * 4 + [0.125] * 2)


def test_length_decay_state_round_trip():
    straight = length_decay()
    expected = run(straight, SURGE)
    first = length_decay()
    head = run(first, SURGE[:15])
    state = json.loads(json.dumps(first.state_dict()))  # checkpointable as plain JSON
    resumed = length_decay()
    resumed.load_state_dict(state)
    assert head + run(resumed, SURGE[15:], start=15) == expected
    assert resumed.surge_step == straight.surge_step and resumed.decay_period == straight.decay_period


def test_steps_in_order():
    schedule = length_decay()
    assert schedule.lr(0, 10.0) == schedule.lr(0, 99.0)  # a repeated step returns the same value
    with pytest.raises(ValueError, match="in order"):
        schedule.lr(2, 10.0)
    with pytest.raises(ValueError, match="response length"):
        schedule.lr(1)


def test_unknown_schedule():
    with pytest.raises(ValueError, match="optim.sched"):
        LrSchedule(OptimConfig(sched="linear"), total_steps=10)
