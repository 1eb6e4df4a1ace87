"""The learner's torch threads per train step (`learner.threads_policy`): the cores go where the loop's bound is.

On one machine the learner and the rollout workers share the cores. When the learner is the bound (its next batch
is ready when it asks: the staleness bound holds the workers back), a second learner thread uses a core that would
idle; when generation is the bound, the workers need every core and a second learner thread only slows them. Which
count is faster also depends on the model: on a tiny model a second thread costs more than it gives (its GEMMs are
too small to split, and the workers lose a core), on a 135M one it nearly halves the step. So the default measures:

| policy | threads of step k |
|---|---|
| `fixed` | `learner.threads` |
| `throttled` | `high` when the buffer refused a lease since step k-1 (rollout throttled), else `learner.threads` |
| `measured` | see below |

`measured` (the default): at step `WARMUP_STEPS` and after each decision's `RECHECK_STEPS` steps, if the learner is
the bound (step k's batch was ready within `BOUND_WAIT_SHARE` of the previous step's training seconds), a trial:
`TRIAL_STEPS` steps at each count, interleaved (low, high, low, ...), then the count with the fewer loop seconds per
trained sample (median over its trial steps) holds until the next check; a trial stops after one step at each
count when one is `CLEAR_RATIO` times slower. If generation is the bound at a check, `learner.threads` holds and the
next step checks again.

A model of fewer than `TINY_PARAMS` parameters keeps `learner.threads` with no trial. Two cases skip the trial
and take `high`: a synchronous run (`staleness.max_lag=0`: the workers wait, idle, while
the learner trains, so its threads take every core), and a model of at least `SPLIT_PARAMS` parameters whose
threads at `high` kept at least `BUSY_SHARE` of their cores busy (`perf/learner_cpu_util` of the last step at
`high`): its GEMMs split well, so the low count only makes the learner slower (a trial's low step cost 12 of 33
seconds of a 4-step run of the 100M decode workload of `asyncrl bench e2e`). That holds while the learner waits for
its batches too: the wait is then the workers generating on every core, and a learner on the low count leaves a core
to workers that soon stand at the staleness bound, idle. On that workload with fp32 rollout (generation 12 core-s
a step against training's 29; Zen 4, 2026-12-06) the learner waited 3-8 s a step, so the low count, which this case
took before, ran every third step at 25 s instead of 14: 21.7 s a step against 20.45 with 2 threads throughout.
When the high count's threads do not get their cores (another process holds them), the trial runs as for a small
model.

`high` is `learner.threads_max`, or with 0 the cores this process may run on (at most those). The loop seconds of
step k run from the end of its batch's fetch to the end of the next one's: training, publication, the driver, and
the wait for the next batch, which grows when the learner's threads starve the workers. So the trial measures the
loop's rate, not only the learner's step.
"""

from __future__ import annotations

import os
import statistics

THREADS_POLICIES = ("fixed", "throttled", "measured")
WARMUP_STEPS = 2
"""Steps at the start of a run that no trial measures (the first step allocates AdamW's state, workers start)."""
TRIAL_STEPS = 3
"""Steps a trial runs at each of the two counts (interleaved, so that a drift of the machine's load hits both)."""
RECHECK_STEPS = 50
"""Steps a trial's decision holds before the policy checks again."""
BOUND_WAIT_SHARE = 0.25
"""The learner is the bound when it waited for its batch at most this share of the previous step's training time."""
SPLIT_PARAMS = 20_000_000
"""`measured` starts at the high count, before its first trial, for a model of at least this many parameters: its
GEMMs split well over threads (a learner step on 2 threads: 1.5x faster at 100M parameters, 1.9x at 135M) and a run
of a few steps (or one that never settles a trial) should not spend them all on one thread. Below it, the low count:
on the built-in 0.8M model a second thread made the loop slower."""
TINY_PARAMS = 2_000_000
"""`measured` keeps the low count, with no trial, for a model of fewer parameters (a count given; 0 is unknown): its
GEMMs are too small to split, and a trial's steps at the high count only cost (the built-in 0.8M model, 60-step runs
on 2 Zen 4 cores: 61-66 ms per loop step with `fixed` 1 thread, 83-99 ms with 2; `measured` spent its trial steps
at 2 threads, 0.09-0.19 s each)."""
BUSY_SHARE = 0.75
"""A large model skips the trial while its learner at the high count kept at least this share of its threads busy."""
CLEAR_RATIO = 2.0
"""A trial ends early once both counts have run and one's median loop time is this many times the other's: a clear
case (oversubscribed threads on a loaded machine make a step 10x slower) costs one slow step, not `TRIAL_STEPS`."""


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity; the machine's count where affinity is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class ThreadsPolicy:
    """Each step's torch threads from the loop's recent behaviour (`learner.threads_policy`, module docstring).

    A pure component: before each step the learner calls `threads(step, ...)` with what it saw, and once that step's
    loop time is known (at the next step's fetch) `record(seconds_per_sample)`.
    """

    def __init__(self, policy: str, low: int, high: int, parameters: int = 0, synchronous: bool = False):
        if policy not in THREADS_POLICIES:
            raise ValueError(f"learner.threads_policy must be one of {', '.join(THREADS_POLICIES)}, got {policy!r}")
        if low < 1:
            raise ValueError(f"learner.threads must be >= 1, got {low}")
        self.policy, self.low, self.high = policy, low, max(low, high)
        self.large = parameters >= SPLIT_PARAMS
        self.tiny = 0 < parameters < TINY_PARAMS
        self.synchronous = synchronous
        self.decided = self.high if self.large or synchronous else low
        """The count a finished trial chose (`measured`); before the first, the model size's prior (`SPLIT_PARAMS`)."""
        self.trial: list[int] = []  # the counts of the running trial's remaining steps
        self.timings: dict[int, list[float]] = {}  # the running trial's loop seconds per sample, by count
        self.next_check = WARMUP_STEPS
        self.step = -1  # the step that last asked for its threads
        self.current: int | None = None  # its count: the one whose loop time `record` is given
        self.busy_at_high = False  # the last step at the high count kept BUSY_SHARE of its threads busy

    def threads(self, step: int, throttled: bool = False, learner_bound: bool = False) -> int:
        """The torch threads of step `step`. `throttled`: the buffer refused a lease since the previous step (the
        `throttled` policy); `learner_bound`: this step's batch was ready without waiting (`measured`)."""
        self.step = step
        if self.policy == "fixed" or self.high == self.low:
            count = self.low
        elif self.policy == "throttled":
            count = self.high if throttled else self.low
        else:
            count = self._measured(step, learner_bound)
        self.current = count
        return count

    def needs_throttle_signal(self) -> bool:
        """Whether `threads` reads `throttled` (a request to the buffer): the `throttled` policy only."""
        return self.policy == "throttled" and self.high > self.low

    def _measured(self, step: int, learner_bound: bool) -> int:
        if self.synchronous:  # the workers idle while the learner trains: every core is the learner's
            return self.high
        if self.tiny:  # GEMMs too small to split: a second thread only takes a core from the workers
            return self.low
        if not self.trial and step >= self.next_check and self.large and self.busy_at_high:
            self.decided = self.high  # GEMMs that split well, on cores they got: the low count only idles a core
            self.next_check = step + 1
        elif not self.trial and step >= self.next_check:
            if learner_bound:  # compare the two counts on the loop's rate
                self.trial = [self.low, self.high] * TRIAL_STEPS
                self.timings = {self.low: [], self.high: []}
            else:  # generation is the bound: the workers keep the cores; check again next step
                self.decided = self.low
                self.next_check = step + 1
        return self.trial[0] if self.trial else self.decided

    def record_util(self, cpu_util: float) -> None:
        """The CPU use (busy cores, `perf/learner_cpu_util`) of the step that last asked for its threads."""
        if self.current == self.high:
            self.busy_at_high = cpu_util >= BUSY_SHARE * self.high

    def record(self, seconds_per_sample: float) -> None:
        """The loop seconds per trained sample of the step that last asked for its threads."""
        if not self.trial or self.current != self.trial[0]:
            return
        self.timings[self.trial.pop(0)].append(seconds_per_sample)
        if not (self.timings[self.low] and self.timings[self.high]):
            return
        low, high = (statistics.median(self.timings[count]) for count in (self.low, self.high))
        if not self.trial or max(low, high) >= CLEAR_RATIO * min(low, high):
            self.trial = []
            self.decided = self.high if high < low else self.low
            self.next_check = self.step + 1 + RECHECK_STEPS
