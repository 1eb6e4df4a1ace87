"""A whole `Learner.train_step` (the builtin micro model, batches handed in): proximal modes and perf metrics."""

from __future__ import annotations

import math

import pytest
from tiny_learner import random_groups

from common.builtin_model import resolve_model_path
from common.config import load_config, to_dict
from learner.sections import LearnerSections
from learner.trainer import Learner
from learner.update import PHASES


def _learner(*overrides: str) -> Learner:
    model_dir = str(resolve_model_path("builtin:micro", log=lambda *_: None))
    cfg = load_config(None, ["model.path=builtin:micro", *overrides])
    return Learner(to_dict(LearnerSections.pick(cfg)), model_dir, "tcp://127.0.0.1:9")  # fetch is replaced below


def _run(learner: Learner, steps: int) -> list[dict[str, float]]:
    """`steps` train steps; each step's batch mixes the current version with one and two steps of staleness."""
    out = []
    for step in range(steps):
        groups = random_groups(learner.model.config.vocab_size, [step, max(step - 1, 0), max(step - 2, 0)])
        learner.fetch = lambda _step, groups=groups: (groups, 0, 0.0)
        out.append(learner.train_step(step))
    return out


def test_a_learner_step_reports_its_phases_threads_and_cpu_use():
    learner = _learner("learner.threads=1")
    try:
        metrics = _run(learner, 1)[0]
    finally:
        learner.close()
    for phase in (*PHASES, "publish"):
        assert metrics[f"perf/{phase}_s"] >= 0.0, phase
    assert metrics["perf/forward_s"] > 0 and metrics["perf/backward_s"] > 0 and metrics["perf/publish_s"] > 0
    assert metrics["learner/threads"] == 1.0
    assert 0.0 < metrics["perf/learner_cpu_util"] < 64.0  # CPU seconds per wall second, all threads


@pytest.mark.parametrize("minibatches", [1, 2])
def test_loglinear_runs_through_learner_steps(minibatches):
    learner = _learner("learner.prox=loglinear", f"learner.minibatches={minibatches}", "loss.weighting=decoupled")
    try:
        history = _run(learner, 3)
    finally:
        learner.close()
    assert [m["version"] for m in history] == [1, 2, 3]  # every step published
    for metrics in history:  # one minibatch: lc is at the step's start, lp itself; two: the second's lc moved on
        alpha = metrics["prox/loglinear_alpha"]
        assert alpha == 1.0 if minibatches == 1 else 0.0 < alpha < 1.0, metrics
    assert history[2]["perf/proximal_s"] == 0.0  # no proximal forward
    for metrics in history:
        assert all(math.isfinite(v) for k, v in metrics.items() if k != "norm_quant_err"), metrics


def test_threads_rise_to_threads_max_for_a_step_after_rollout_was_throttled():
    learner = _learner("learner.threads=1", "learner.threads_max=2", "learner.threads_policy=throttled")
    counts = iter([0, 3, 3, 5])  # the buffer's refused leases at each step: none, 3 new, none new, 2 new
    learner.client.stats = lambda: {"lease_throttled": next(counts)}
    try:
        threads = [m["learner/threads"] for m in _run(learner, 4)]
    finally:
        learner.close()
    assert threads == [1.0, 2.0, 1.0, 2.0]


def test_the_default_threads_policy_measures_both_counts_when_the_learner_is_the_bound(monkeypatch):
    from learner import threads as threads_module
    from learner.threads import TRIAL_STEPS, WARMUP_STEPS

    monkeypatch.setattr(threads_module, "CLEAR_RATIO", float("inf"))  # the whole trial, whatever this machine's load
    monkeypatch.setattr(threads_module, "TINY_PARAMS", 0)  # the built-in model would keep one thread with no trial
    learner = _learner("learner.threads=1", "learner.threads_max=2")  # threads_policy: measured by default
    learner.client.stats = lambda: pytest.fail("the measured policy asks the buffer nothing")
    try:
        history = _run(learner, WARMUP_STEPS + 2 * TRIAL_STEPS + 1)  # batches ready at once: the learner is the bound
    finally:
        learner.close()
    threads = [m["learner/threads"] for m in history]
    assert threads[:-1] == [1.0] * WARMUP_STEPS + [1.0, 2.0] * TRIAL_STEPS
    assert not learner.threads_policy.trial and threads[-1] == learner.threads_policy.decided  # the trial's choice
    assert "perf/prev_loop_s" not in history[0] and all(m["perf/prev_loop_s"] > 0 for m in history[1:])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [(["learner.threads=2", "learner.threads_max=1"], "learner.threads_max"),
     (["learner.threads_max=2", "learner.world_size=2"], "learner.world_size=1")],
)  # fmt: skip
def test_a_bad_threads_max_is_refused_naming_the_key(overrides, message):
    from common.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
