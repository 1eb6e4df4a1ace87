"""`learner.threads_policy`: the learner's threads follow the loop's bound, and `measured` keeps the faster count."""

from __future__ import annotations

import pytest

from learner.threads import RECHECK_STEPS, SPLIT_PARAMS, TINY_PARAMS, TRIAL_STEPS, WARMUP_STEPS, ThreadsPolicy


def _run(policy: ThreadsPolicy, steps: range, loop_s: dict[int, float], learner_bound: bool = True) -> list[int]:
    """Drive the policy as the learner does: threads for a step, then that step's loop seconds per sample."""
    counts = []
    for step in steps:
        count = policy.threads(step, learner_bound=learner_bound)
        counts.append(count)
        policy.record(loop_s[count])
    return counts


@pytest.mark.parametrize(("loop_s", "faster"), [({1: 0.2, 2: 0.3}, 1), ({1: 0.3, 2: 0.2}, 2)])
def test_measured_tries_both_counts_interleaved_then_keeps_the_faster_loop(loop_s, faster):
    policy = ThreadsPolicy("measured", low=1, high=2)
    counts = _run(policy, range(WARMUP_STEPS + 2 * TRIAL_STEPS + 5), loop_s)
    assert counts[:WARMUP_STEPS] == [1] * WARMUP_STEPS  # start-up steps are not measured
    assert counts[WARMUP_STEPS : WARMUP_STEPS + 2 * TRIAL_STEPS] == [1, 2] * TRIAL_STEPS
    assert counts[WARMUP_STEPS + 2 * TRIAL_STEPS :] == [faster] * 5
    assert policy.decided == faster


def test_measured_starts_a_large_model_on_the_high_count_and_still_lets_the_trial_decide_when_its_cores_are_busy():
    big = ThreadsPolicy("measured", low=1, high=2, parameters=SPLIT_PARAMS)
    small = ThreadsPolicy("measured", low=1, high=2, parameters=SPLIT_PARAMS - 1)
    assert _run(small, range(WARMUP_STEPS), {1: 0.2, 2: 0.3}) == [1] * WARMUP_STEPS
    big.record_util(1.0)  # two threads kept only one core busy: another process holds the other
    counts = _run(big, range(WARMUP_STEPS + 2 * TRIAL_STEPS + 3), {1: 0.2, 2: 0.3})
    assert counts[:WARMUP_STEPS] == [2] * WARMUP_STEPS  # the prior: a large model's GEMMs split over threads
    assert counts[-3:] == [1] * 3  # the trial measured one thread faster here, and it wins over the prior
    fixed = ThreadsPolicy("fixed", low=1, high=2, parameters=SPLIT_PARAMS)
    assert fixed.threads(0, learner_bound=True) == 1  # only `measured` has a prior


def _run_busy(policy: ThreadsPolicy, steps: range, cpu_util: float, learner_bound: bool = True) -> list[int]:
    """Drive the policy with each step's CPU use (busy cores) instead of loop times."""
    counts = []
    for step in steps:
        counts.append(policy.threads(step, learner_bound=learner_bound))
        policy.record_util(cpu_util)
        policy.record(0.2)
    return counts


def test_a_large_model_whose_threads_get_their_cores_keeps_the_high_count_without_a_trial():
    big = ThreadsPolicy("measured", low=1, high=2, parameters=SPLIT_PARAMS)
    assert _run_busy(big, range(WARMUP_STEPS + 20), cpu_util=1.9) == [2] * (WARMUP_STEPS + 20)
    assert not big.trial
    # waiting for its batches too: the low count would only leave the workers a core they idle on at the staleness bound
    assert _run_busy(big, range(30, 35), cpu_util=1.9, learner_bound=False) == [2] * 5
    assert not big.trial
    assert _run_busy(big, range(35, 37), cpu_util=1.0, learner_bound=False) == [2, 1]  # its cores taken: not busy
    small = ThreadsPolicy("measured", low=1, high=2, parameters=SPLIT_PARAMS - 1)
    counts = _run_busy(small, range(WARMUP_STEPS + 2), cpu_util=1.9)
    assert counts[WARMUP_STEPS:] == [1, 2]  # a small model's GEMMs may not split: it still measures both counts


def test_a_synchronous_run_gives_the_learner_every_core_whatever_the_loop_does():
    sync = ThreadsPolicy("measured", low=1, high=2, synchronous=True)
    assert _run(sync, range(40), {1: 0.2, 2: 0.3}) == [2] * 40
    assert _run(sync, range(40, 45), {1: 0.2, 2: 0.3}, learner_bound=False) == [2] * 5
    fixed = ThreadsPolicy("fixed", low=1, high=2, synchronous=True)
    assert fixed.threads(0) == 1  # `fixed` means fixed


def test_measured_checks_again_after_recheck_steps_and_follows_a_change():
    policy = ThreadsPolicy("measured", low=1, high=2)
    end_of_trial = WARMUP_STEPS + 2 * TRIAL_STEPS
    assert _run(policy, range(end_of_trial), {1: 0.3, 2: 0.2})[-1] == 2
    held = _run(policy, range(end_of_trial, end_of_trial + RECHECK_STEPS), {1: 0.15, 2: 0.2})
    assert held == [2] * RECHECK_STEPS  # the decision holds between checks, whatever the loop does
    start = end_of_trial + RECHECK_STEPS
    again = _run(policy, range(start, start + 2 * TRIAL_STEPS + 1), {1: 0.15, 2: 0.2})
    assert again == [1, 2] * TRIAL_STEPS + [1]  # a new trial, and the now faster count


def test_measured_leaves_the_cores_to_generation_when_the_learner_is_not_the_bound():
    policy = ThreadsPolicy("measured", low=1, high=2)
    assert _run(policy, range(20), {1: 0.2, 2: 0.15}, learner_bound=False) == [1] * 20  # no trial, workers keep cores
    assert _run(policy, range(20, 20 + 2 * TRIAL_STEPS + 1), {1: 0.2, 2: 0.15}) == [1, 2] * TRIAL_STEPS + [2]


@pytest.mark.parametrize(("loop_s", "faster"), [({1: 0.2, 2: 2.0}, 1), ({1: 0.5, 2: 0.2}, 2)])
def test_a_clear_case_ends_the_trial_after_one_step_at_each_count(loop_s, faster):
    policy = ThreadsPolicy("measured", low=1, high=2)  # e.g. two threads oversubscribed on a loaded machine: 10x
    counts = _run(policy, range(WARMUP_STEPS + 5), loop_s)
    assert counts[WARMUP_STEPS:] == [1, 2] + [faster] * 3 and not policy.trial


def test_a_step_outside_the_trial_does_not_count_as_a_trial_step():
    policy = ThreadsPolicy("measured", low=1, high=3)
    policy.record(0.01)  # before any step: ignored
    assert policy.threads(WARMUP_STEPS, learner_bound=True) == 1
    policy.record(0.5)
    assert policy.threads(WARMUP_STEPS + 1, learner_bound=False) == 3  # a running trial runs on
    assert policy.timings == {1: [0.5], 3: []}


def test_fixed_throttled_and_a_single_count():
    fixed = ThreadsPolicy("fixed", low=1, high=2)
    assert [fixed.threads(s, throttled=True, learner_bound=True) for s in range(10)] == [1] * 10
    throttled = ThreadsPolicy("throttled", low=1, high=2)
    assert throttled.needs_throttle_signal() and not fixed.needs_throttle_signal()
    assert [throttled.threads(s, throttled=t) for s, t in enumerate([False, True, False])] == [1, 2, 1]
    one_core = ThreadsPolicy("measured", low=2, high=1)  # the high count never below learner.threads
    assert [one_core.threads(s, learner_bound=True) for s in range(10)] == [2] * 10
    assert not ThreadsPolicy("throttled", low=2, high=2).needs_throttle_signal()  # nothing to ask the buffer for


def test_a_bad_policy_is_refused_naming_the_key():
    from common.config import ConfigError, load_config

    with pytest.raises(ValueError, match="learner.threads_policy"):
        ThreadsPolicy("auto", low=1, high=2)
    with pytest.raises(ConfigError, match="threads_policy"):
        load_config(None, ["learner.threads_policy=auto"])


def test_a_tiny_model_keeps_the_low_count_without_a_trial_unless_synchronous():
    tiny = ThreadsPolicy("measured", low=1, high=2, parameters=TINY_PARAMS - 1)
    counts = [tiny.threads(step, learner_bound=True) for step in range(WARMUP_STEPS + 3 * RECHECK_STEPS)]
    assert counts == [1] * len(counts) and not tiny.trial
    unknown = ThreadsPolicy("measured", low=1, high=2)  # no parameter count: the trial runs
    assert _run(unknown, range(WARMUP_STEPS + 2), {1: 0.2, 2: 0.3})[-2:] == [1, 2]
    assert ThreadsPolicy("measured", low=1, high=2, parameters=1000, synchronous=True).threads(5) == 2
