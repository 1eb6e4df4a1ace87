"""Run health: the stall watchdog of the driver, and the one line that says why a run ended early.

The watchdog (`Watchdog.check`, called by the driver between the slices of its wait on a train step):

- No step finished for `train.stall_timeout_s` (0: `max(STALL_MIN_S, STALL_STEPS x` the median step time)): a
  `stall` event and a console report of each part: the buffer's queued / leased groups and the learner's parked
  fetch, each worker's samples, skipped prompts, errors and last error, the crashes since the last step.
- Still stalled: the report again every `REPORT_EVERY` x the timeout.
- `FAILING_STEPS` steps in a row generated while every multi-turn episode failed in its environment, or every reward
  call failed (`Watchdog.step_done`): `RunFailed` naming `env.fn` or `reward.fn`; such steps train on rewards of 0
  that nothing computed (with `algo.filter_groups` the groups are dropped instead, and the stall diagnosis below says
  the same).
- Stalled, and nothing can make progress: `RunFailed` with that diagnosis: every prompt leased since the last step
  was skipped, every worker crash-looping (none running, crashes since the last step), the buffer not answering,
  every rollout failing (worker errors and no group pushed), every reward call failing, or every group pushed
  dropped by `algo.filter_groups` for equal rewards (a reward that never varies).

Divergence (`Watchdog.step_done`): `train.max_nonfinite_steps` train steps in a row skipped for a non-finite loss or
gradient (`skipped_nonfinite`: the weights stay as they were) fail the run with `RunFailed`, naming the step the
streak began at: a diverged model would otherwise skip every step to the end of the run.

A stop asked for (the first Ctrl-C, SIGTERM, `asyncrl down`) normally lets the step in flight finish; on a stalled
run, or once the step has run `STOP_WAIT_STEPS` median steps past the request (at least `STOP_WAIT_MIN_S`), the
driver stops at once instead (`stop_now`), without waiting for a step that may never come.

`failure(err, step, run_dir)`: what the CLI prints as the last line of a run that a process of ours ended: the
process, its signal or exit code, the step, and the command that resumes.
"""

from __future__ import annotations

import errno
import math
import re
import statistics
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

STALL_MIN_S = 300.0
"""The automatic stall timeout is at least this long (a first step after start-up included)."""
STALL_STEPS = 30
"""... and at least this many median step times."""
REPORT_EVERY = 0.5
"""While stalled, the report repeats every this fraction of the timeout (at least every 10 s apart)."""
STOP_WAIT_STEPS = 5
STOP_WAIT_MIN_S = 10.0


BUFFER_COUNTERS = ("filtered_groups", "admitted_groups")
"""The buffer's counters the watchdog follows from one step to the next (`BufferState.stats`)."""
SINCE_STEP = ("groups_pushed", "prompts_skipped", "errors", "samples", "reward_sum", "reward_errors", "reward_timeouts",
              "env_groups_dropped", "env_episodes", "env_errors", "env_timeouts", *BUFFER_COUNTERS)  # fmt: skip
"""What a stall report counts since the last step: the workers' counters (`supervise.COUNTERS`), then the buffer's."""


def _buffer_counters(buffer_stats: Callable[[], dict[str, Any]]) -> dict[str, float]:
    from buffer.client import BufferRequestError, BufferUnavailable

    try:
        stats = buffer_stats()
    except (BufferUnavailable, BufferRequestError):
        return {}
    return {key: float(stats.get(key, 0)) for key in BUFFER_COUNTERS}


class RunFailed(RuntimeError):
    """The run ended early; the message is one line. `detail`: a traceback worth printing before it, or ""."""

    def __init__(self, message: str, detail: str = "", exit_code: int = 1) -> None:
        super().__init__(message)
        self.detail = detail
        self.exit_code = exit_code


def resume_hint(run_dir: Path) -> str:
    """`resume with: asyncrl up --resume RUN (from checkpoint step_k)`, or from the initial model if none yet."""
    from asyncrl import checkpoint

    latest = checkpoint.latest_whole(run_dir)
    source = f"checkpoint {latest.name}" if latest is not None else "the initial model: no checkpoint yet"
    return f"resume with `asyncrl up --resume {run_dir}` (from {source})"


def failure(err: BaseException, step: int, run_dir: Path, resumable: bool = True) -> RunFailed:
    """The one-line reason a run ended at train step `step` because of `err` (see the module docstring); not
    `resumable`: a constructor that raised at the first start (a config or model fault: it raises again), so the line
    says to fix it rather than to resume."""
    import traceback

    from asyncrl.supervise import SupervisionError

    again = resume_hint(run_dir) if resumable else "fix what it names, then run the command again"
    where = f"at step {step}; {_disk_full(run_dir)}{again}"
    if isinstance(err, RunFailed):
        return RunFailed(f"{err} {where}", err.detail, err.exit_code)
    if isinstance(err, SupervisionError):
        return RunFailed(f"{_one_line(str(err))}; the run stopped {where}")
    if isinstance(err, KeyboardInterrupt):
        return RunFailed(f"stopped at once ({_one_line(str(err)) or 'interrupted'}) {where}", exit_code=130)
    from common import actors

    if isinstance(err, actors.died_errors()):
        return RunFailed(f"{actor_death(str(err))}; the run stopped {where}")
    if isinstance(err, actors.task_errors()):
        cause = err.cause if isinstance(getattr(err, "cause", None), BaseException) else None
        what = f"{type(cause).__name__}: {_one_line(str(cause))}" if cause is not None else _one_line(str(err))
        process = _process_name(getattr(err, "function_name", ""))
        return RunFailed(f"{process} (pid {getattr(err, 'pid', '?')}) failed: {what}; the run stopped {where}",
                         detail=str(err))  # fmt: skip
    detail = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        detail = ""  # the disk, not the code: the line says it all
    return RunFailed(f"the driver failed: {type(err).__name__}: {_one_line(str(err))}; the run stopped {where}", detail)


FAILING_STEPS = 5
"""Train steps in a row generated while every environment episode, or every reward call, failed that fail a run
(`Watchdog.step_done`)."""
FAILING_SHARE = 0.95
"""The share of a step's episodes (or reward calls) that must have failed for it to count as "every": the workers'
counters are sampled while they roll out, so an episode's error and its completion can fall in different steps."""
DISK_FULL_BYTES = 64 << 20
"""Free space under which a failed run's last line says that the disk holding the run is full."""


def failing_calls(since: dict[str, float]) -> tuple[str, str, str] | None:
    """(key, what, counts) when every multi-turn episode counted in `since` failed in its environment, or else every
    reward call did (at least `FAILING_SHARE` of them: counters are sampled mid-rollout); None otherwise."""
    failed_episodes = since.get("env_errors", 0.0) + since.get("env_timeouts", 0.0)
    failed_rewards = since.get("reward_errors", 0.0) + since.get("reward_timeouts", 0.0)
    episodes, samples = since.get("env_episodes", 0.0), since.get("samples", 0.0)
    if episodes > 0 and failed_episodes >= FAILING_SHARE * episodes:
        return ("env.fn", "every multi-turn episode failed in its environment",
                f"{failed_episodes:.0f} errors and timeouts in {episodes:.0f} episodes")  # fmt: skip
    if samples > 0 and failed_rewards >= FAILING_SHARE * samples:
        return "reward.fn", "every reward call failed", f"{failed_rewards:.0f} of {samples:.0f} samples"
    return None


def _disk_full(run_dir: Path) -> str:
    """`the disk holding RUN is full (N MiB free); free space, then ` when it is, else "": whatever failed (a
    checkpoint's writer, the journal, the metrics), that is the cause to fix before resuming."""
    import shutil

    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        return ""
    return (
        f"the disk holding {run_dir} is full ({free >> 20} MiB free): free space, then "
        if free < DISK_FULL_BYTES
        else ""
    )


def _one_line(text: str) -> str:
    """The first line of `text`, a traceback in it replaced by its last line (the exception)."""
    head, marker, tail = text.strip().partition("Traceback (most recent call last):")
    if marker:
        last = [line.strip() for line in tail.splitlines() if line.strip()]
        text = f"{head.strip()} {last[-1] if last else ''}".strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[0] if lines else "")[:300]


def _process_name(function_name: str) -> str:
    if function_name.startswith("Learner"):
        return "the learner"
    if function_name.startswith("RolloutWorker"):
        return "a rollout worker"
    if function_name.startswith("EvalWorker"):
        return "the evaluation worker"
    return f"a Ray task ({function_name or 'unknown'})"


def actor_death(message: str) -> str:
    """`the learner (pid 123) died: <exit detail>` from a RayActorError's text (its format is Ray's; Ray does not
    say which signal ended the process: its parent is the raylet) or a local actor's ActorDiedError (the same
    fields; its exit detail names the signal: the driver is its parent)."""
    message = re.sub(r"\x1b\[[0-9;]*m", "", message)  # Ray colours the function's name
    klass = re.search(r"class_name:\s*(\w+)|ray::(\w+)\.__init__", message)
    pid = re.search(r"(?:pid[=:]|Worker PID:)\s*(\d+)", message, flags=re.IGNORECASE)
    process = _process_name(next(filter(None, klass.groups())) if klass else "Learner" if "Learner" in message else "")
    if process.startswith("a Ray task"):
        process = "an actor of the run"  # a Ray actor, or a local one (`ray.launcher=local`)
    # the detail's first sentence: up to a period that ends it (`learner.device=cuda` in an error keeps its dots)
    detail = re.search(r"exit detail:\s*(.+?)(?:\.\s|\.?$)", message, flags=re.IGNORECASE | re.MULTILINE)
    how = detail.group(1).strip() if detail else "it exited unexpectedly"
    if "raised in its creation task" in message:  # Ray's wording: its traceback, whose last line is the error
        how = "its constructor raised " + [line for line in message.splitlines() if line.strip()][-1].strip()
    if how.startswith("its constructor raised"):  # an error it reported, not a crash
        return f"{process} (pid {pid.group(1) if pid else '?'}) died ({how})"
    return f"{process} (pid {pid.group(1) if pid else '?'}) died ({how}: killed by a signal, out of memory or a crash)"


class Watchdog:
    """Notices a run where no step finishes, says what each part is doing, and fails one that cannot progress."""

    def __init__(
        self,
        stall_timeout_s: float,
        start_step: int,
        event: Callable[..., None],
        info: Callable[[str], None],
        max_nonfinite_steps: int = 0,
    ) -> None:
        self.stall_timeout_s = stall_timeout_s  # 0: automatic
        self.max_nonfinite_steps = max_nonfinite_steps  # 0: never fail for it
        self.nonfinite_since: int | None = None  # the first step of the current streak of skipped steps
        self.step = start_step  # train steps completed
        self.event = event
        self.info = info
        self.step_times: deque[float] = deque(maxlen=50)
        self.last_step_at = time.monotonic()
        self.stalled = False
        self.reports = 0
        self._next_report = 0.0
        self._baseline: dict[str, float] = {}
        self._buffer_baseline: dict[str, float] | None = None  # the buffer's counters soon after the last step
        self._crashes_at_step = 0
        self._stop_asked_at: float | None = None
        self._failing_since: int | None = None  # the first step of a streak of steps whose env/reward calls all failed

    def timeout_s(self) -> float:
        if self.stall_timeout_s > 0:
            return self.stall_timeout_s
        median = statistics.median(self.step_times) if self.step_times else 0.0
        return max(STALL_MIN_S, STALL_STEPS * median)

    def step_done(self, step: int, pool: Any, metrics: dict[str, Any] | None = None) -> None:
        """Train step `step - 1` finished with `metrics`; RunFailed when it ends a streak of `max_nonfinite_steps`
        skipped steps."""
        now = time.monotonic()
        self.step_times.append(now - self.last_step_at)
        self.step, self.last_step_at = step, now
        self.stalled, self.reports = False, 0
        previous, self._baseline, self._crashes_at_step = self._baseline, pool.totals(), pool.crashes
        self._buffer_baseline = None
        self._check_failing_calls(
            step, pool, {key: value - previous.get(key, 0.0) for key, value in self._baseline.items()}
        )
        if not (metrics or {}).get("skipped_nonfinite"):
            self.nonfinite_since = None
            return
        if self.nonfinite_since is None:
            self.nonfinite_since = step - 1
        streak = step - self.nonfinite_since
        if not self.max_nonfinite_steps or streak < self.max_nonfinite_steps:
            return
        reward_sum = self._baseline.get("reward_sum", 0.0)  # the workers' running sum of every reward
        self.event("diverged", first_step=self.nonfinite_since, steps=streak, reward_sum=reward_sum)
        if not math.isfinite(reward_sum):  # the rewards, not the weights (reward/mean is nan for a step without
            raise RunFailed(  # samples too, so it cannot tell)
                f"{streak} train steps in a row (from step {self.nonfinite_since}) were skipped for a non-finite loss "
                f"(`train.max_nonfinite_steps`), and the rewards do not sum to a finite number (their sum is "
                f"{reward_sum}): a reward function returns numbers too large (`reward.fn`);"
            )
        scale, loss = (metrics or {}).get("loss_scale", 1.0), (metrics or {}).get("loss", math.nan)
        if isinstance(scale, float) and scale > 1.0 and isinstance(loss, float) and math.isfinite(loss):
            raise RunFailed(  # fp16: the loss is finite, its scaled gradient overflows while the scale still falls
                f"{streak} train steps in a row (from step {self.nonfinite_since}) were skipped with a finite loss "
                f"({loss:.4g}): fp16's scaled gradients overflowed while the loss scale fell to {scale:g} "
                f"(`train.max_nonfinite_steps`); start from a lower `precision.loss_scale_init` (the default is "
                f"65536), or allow more steps; the weights did not change in these steps;"
            )
        raise RunFailed(
            f"the model diverged: {streak} train steps in a row (from step {self.nonfinite_since}) had a non-finite "
            f"loss or gradient and were skipped (`train.max_nonfinite_steps`); lower `optim.lr` or look for bad rows; "
            f"checkpoint step_{self.nonfinite_since} and later ones hold the weights that diverged (delete them to "
            f"resume from an earlier one);"
        )

    def _check_failing_calls(self, step: int, pool: Any, since: dict[str, float]) -> None:
        """RunFailed once `FAILING_STEPS` steps in a row were generated while every multi-turn episode failed in its
        environment, or every reward call failed: such a run trains on rewards of 0 that no one computed, and
        without `algo.filter_groups` (which stalls it) it went on to its last step and exited 0."""
        if since.get("env_episodes", 0.0) <= 0 and since.get("samples", 0.0) <= 0:  # the workers' counters did not
            return  # move (they are sampled twice a second): no news
        failing = failing_calls(since)
        if failing is None:
            self._failing_since = None
            return
        if self._failing_since is None:
            self._failing_since = step - 1
        if step - self._failing_since < FAILING_STEPS:
            return
        key, what, counts = failing
        errors = [_one_line(str(row.get("last_error") or "")) for row in pool.describe()]
        last = next((line for line in reversed(errors) if line), "")
        self.event("calls_failing", key=key, first_step=self._failing_since, steps=step - self._failing_since)
        raise RunFailed(
            f"{what} ({counts}) for the {step - self._failing_since} train steps since step {self._failing_since}: "
            f"their rewards of 0 were not computed by anyone; fix `{key}`{f' (last error: {last})' if last else ''};"
        )

    def stop_now(self, stop_requested: bool) -> bool:
        """Whether a requested stop should abandon the step in flight (stalled, or it runs far past the request)."""
        if not stop_requested:
            return False
        now = time.monotonic()
        if self._stop_asked_at is None:
            self._stop_asked_at = now
        median = statistics.median(self.step_times) if self.step_times else 0.0
        return self.stalled or now - self._stop_asked_at > max(STOP_WAIT_MIN_S, STOP_WAIT_STEPS * median)

    def check(self, pool: Any, buffer_stats: Callable[[], dict[str, Any]], buffer_alive: bool) -> None:
        """Report a stall when due; raise RunFailed when nothing can make progress (see the module docstring)."""
        now = time.monotonic()
        since = now - self.last_step_at
        if self._buffer_baseline is None:  # once a step, at the first check after it
            self._buffer_baseline = _buffer_counters(buffer_stats)
        timeout = self.timeout_s()
        if since < timeout or now < self._next_report:
            return
        self.stalled = True
        self.reports += 1
        self._next_report = now + max(10.0, REPORT_EVERY * timeout)
        report = self.report(pool, buffer_stats, buffer_alive, since)
        diagnosis = self.diagnose(report)
        self.event("stall", step=self.step, since_s=round(since, 1), timeout_s=round(timeout, 1),
                   diagnosis=diagnosis or None, **report)  # fmt: skip
        self.info(self.format(report, since))
        if diagnosis:  # the first failed reward call's traceback (logged at a step boundary, which never came)
            first = next((w.stats.get("reward_first_error") for w in pool.workers.values()
                          if w.stats.get("reward_first_error")), "")  # fmt: skip
            raise RunFailed(f"stalled: no step finished for {since:.0f} s: {diagnosis};", detail=str(first))

    def report(self, pool: Any, buffer_stats: Callable[[], dict[str, Any]], alive: bool, since: float) -> dict:
        """What each part is doing: `buffer` (its counters, or the error), `workers` (one row each, with what they
        did since the last step), `crashes` since the last step, `learner` (its wait)."""
        from buffer.client import BufferRequestError, BufferUnavailable

        buffer: dict[str, Any] = {"alive": alive}
        try:
            stats = buffer_stats()
            keys = ("queued_groups", "leased_groups", "returned_groups", "parked_fetches", "waiting_fetches",
                    "consumed_groups", "cursor", "expired_leases", "lease_throttled", "skipped_prompts",
                    *BUFFER_COUNTERS)  # fmt: skip
            buffer.update({key: stats.get(key, 0) for key in keys})
        except (BufferUnavailable, BufferRequestError) as err:
            buffer["error"] = _one_line(str(err))
        totals = pool.totals()
        since_step = {key: totals.get(key, 0.0) - self._baseline.get(key, 0.0) for key in totals}
        for key, value in (self._buffer_baseline or {}).items():
            if isinstance(buffer.get(key), int | float):
                since_step[key] = buffer[key] - value
        workers = [
            {"worker": row["worker"], "state": row["state"], "samples": row.get("samples", 0),
             "prompts_skipped": w.stats.get("prompts_skipped", 0) if (w := pool.workers.get(row["worker"])) else 0,
             "errors": row.get("errors", 0), "last_error": _one_line(str(row.get("last_error") or ""))}
            for row in pool.describe()
        ]  # fmt: skip
        waiting = buffer.get("waiting_fetches", 0)  # parked, or answered empty a moment ago and about to ask again
        learner = f"waiting in FetchBatch for step {self.step}" if waiting else f"in step {self.step}"
        return {
            "buffer": buffer,
            "workers": workers,
            "since_step": {key: since_step.get(key, 0.0) for key in SINCE_STEP},
            "crashes": pool.crashes - self._crashes_at_step,
            "recent_errors": list(pool.recent_errors)[-3:],
            "learner": learner,
        }

    def diagnose(self, report: dict[str, Any]) -> str:
        """Why nothing can make progress, or "" if something still can."""
        buffer, since_step = report["buffer"], report["since_step"]
        if not buffer["alive"] or "error" in buffer:
            return f"the buffer is gone ({buffer.get('error') or 'its process is not running'})"
        if since_step["prompts_skipped"] > 0 and since_step["groups_pushed"] == 0:
            reasons = [w["last_error"] for w in report["workers"] if "skipped" in w["last_error"]]
            why = f" (last: {reasons[-1]})" if reasons else ""
            return (f"the rollout workers skipped every prompt they leased since step {self.step} "
                    f"({since_step['prompts_skipped']:.0f} prompts){why}")  # fmt: skip
        running = [w for w in report["workers"] if w["state"] == "running"]
        if report["workers"] and not running and report["crashes"] > 0:
            last = report["recent_errors"][-1] if report["recent_errors"] else ""
            return f"every rollout worker is crash-looping ({report['crashes']} crashes since step {self.step}; {last})"
        last = next((w["last_error"] for w in reversed(report["workers"]) if w["last_error"]), "")
        if since_step["errors"] > 0 and since_step["groups_pushed"] == 0:
            return (f"every rollout failed since step {self.step} ({since_step['errors']:.0f} errors, no group pushed;"
                    f" last: {last})")  # fmt: skip
        if since_step["env_groups_dropped"] > 0 and since_step["groups_pushed"] == 0:
            return (f"every multi-turn episode failed since step {self.step} ({since_step['env_groups_dropped']:.0f} "
                    f"groups dropped, none pushed; last: {last}): fix the environment (`env.fn`)")  # fmt: skip
        failing = failing_calls(since_step)
        if failing is not None:
            key, what, counts = failing
            fix = "the environment (`env.fn`)" if key == "env.fn" else "the reward function"
            return f"{what} since step {self.step} ({counts}; last error: {last}): fix {fix}"
        pushed, filtered = since_step["groups_pushed"], since_step.get("filtered_groups", 0.0)
        if pushed > 0 and filtered >= pushed and since_step.get("admitted_groups", 0.0) == 0:
            mean = since_step["reward_sum"] / since_step["samples"] if since_step["samples"] else float("nan")
            return (f"every group pushed since step {self.step} ({pushed:.0f}) had equal rewards (mean {mean:.3g}) and "
                    "was dropped by `algo.filter_groups`: the reward never varies within a group (a reward function "
                    "that returns a constant, or a task the model gets all right or all wrong); check the reward, or "
                    "set algo.filter_groups=false")  # fmt: skip
        return ""

    def format(self, report: dict[str, Any], since: float) -> str:
        buffer = report["buffer"]
        parts = [f"stall: no step for {since:.0f} s (step {self.step}); learner {report['learner']}"]
        if "error" in buffer:
            parts.append(f"buffer: {buffer['error']}")
        else:
            parts.append(f"buffer: {buffer['queued_groups']} groups queued, {buffer['leased_groups']} leased, "
                         f"{buffer['returned_groups']} returned to the pool, cursor {buffer['cursor']}")  # fmt: skip
        for w in report["workers"]:
            last = f", last: {w['last_error']}" if w["last_error"] else ""
            parts.append(f"{w['worker']} {w['state']}: {w['samples']} samples, {w['prompts_skipped']} prompts "
                         f"skipped, {w['errors']} errors{last}")  # fmt: skip
        done = report["since_step"]
        parts.append(f"since step {self.step}: {done['groups_pushed']:.0f} groups pushed, "
                     f"{done['prompts_skipped']:.0f} prompts skipped, {report['crashes']} worker crashes")  # fmt: skip
        return "\n  ".join(parts)
