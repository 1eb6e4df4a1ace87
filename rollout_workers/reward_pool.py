"""The rollout worker's reward process: user reward functions run there, under a per-call timeout.

    worker --[(call_id, fn_index, response, answer, row), ...] one message per batch--> reward process (pipe)
    worker <--(call_id, result) one reply per call, in order------------------------------------ common.reward_fns.serve

One process, a fresh interpreter (`python -c`; never a fork, since the worker holds torch and threads; nor
multiprocessing's spawn, which re-runs the parent's main module), talks over a socket pair with multiprocessing's
`Connection` framing. It loads the functions once (`common.reward_fns.load_fn`) and scores whole batches, so a
batch costs one round trip (about 25 us a call batched, against 85 us for a lone round trip; measured under load).
Replies come back in call order, so the worker knows which call is running:

| what the worker sees while waiting for call k | outcome of call k | then |
|---|---|---|
| its reply, a valid result | score (and metrics) | wait for call k+1, again up to `timeout_s` |
| its reply, an error or an invalid result | 0, `error` set | the same |
| nothing for `timeout_s` | 0, `timed_out` | kill the process, start a new one, send it calls k+1.. |
| the process died (pipe closed) | 0, `error` set | the same |

A hanging or crashing function thus costs at most `timeout_s` (plus a process start-up) per call, never the worker.
Arguments and results cross the boundary as pickles: this is a boundary the worker owns (its own child process),
and every result is validated on this side (`common.reward_fns.validate_result`).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from common.reward_fns import CallOutcome, RewardFnError, combine, spec_names, validate_result

if TYPE_CHECKING:
    from common.config import RewardConfig

OUTPUT_LINES = 20
"""Lines of a reward process's own output (print, logging) shown per `OUTPUT_WINDOW_S`; the rest are counted."""
OUTPUT_WINDOW_S = 60.0
START_TIMEOUT_S = 120.0
"""How long a new reward process may take to import and load the functions (a cold math-verify import: seconds)."""


def forward_output(stream: Any, out: Any = None) -> None:
    """Copy a reward process's output to this process's stderr (`out`), at most `OUTPUT_LINES` lines (of up to 500
    characters) per `OUTPUT_WINDOW_S`, then one line counting what was not shown: a function that prints on every
    call would otherwise flood the run's output (10.7 GB in 90 s). Reads to the end, so the process never blocks on a
    full pipe; returns when the process has exited."""
    out = out or sys.stderr
    window_end, shown, hidden = time.monotonic() + OUTPUT_WINDOW_S, 0, 0

    def say_hidden() -> None:
        if hidden:
            out.write(f"reward process: {hidden} more lines of its output not shown (at most {OUTPUT_LINES} every "
                      f"{OUTPUT_WINDOW_S:g} s)\n")  # fmt: skip
            out.flush()

    for line in iter(lambda: stream.readline(1 << 16), b""):
        now = time.monotonic()
        if now >= window_end:
            say_hidden()
            window_end, shown, hidden = now + OUTPUT_WINDOW_S, 0, 0
        if shown < OUTPUT_LINES:
            out.write(line.decode(errors="replace").rstrip("\n")[:500] + "\n")
            out.flush()
            shown += 1
        else:
            hidden += 1
    say_hidden()
    stream.close()


class RewardPool:
    def __init__(
        self, specs: Sequence[str], timeout_s: float, start_timeout_s: float = START_TIMEOUT_S, key: str = "reward.fns"
    ) -> None:
        """Start the reward process and load `specs` (set by config key `key`) there; raises RewardFnError if a
        function cannot be loaded."""
        self.specs = list(specs)
        self.key = key
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._proc: Any = None
        self._conn: Any = None
        self.batched: list[bool] = []
        """Per function: a TRL reward function, called once per message on all its calls (`is_batched`)."""
        self.restarts = 0
        """Processes started after the first (each after a timeout or a crash)."""
        self._start()

    def _start(self) -> None:
        parent_sock, child_sock = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        child_fd = child_sock.fileno()
        code = f"from common.reward_fns import serve_fd; serve_fd({child_fd}, {self.specs!r}, {self.key!r})"
        try:
            # its own process group (start_new_session): `_kill` ends what the user's functions started with it
            proc = subprocess.Popen(
                [sys.executable, "-c", code], pass_fds=(child_fd,), env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        finally:
            child_sock.close()  # the process holds its own copy: its death reads as EOF here
        self._output = threading.Thread(target=forward_output, args=(proc.stdout,), name="reward-output", daemon=True)
        self._output.start()
        self._proc, self._conn = proc, Connection(parent_sock.detach())
        if not self._conn.poll(self.start_timeout_s):
            self._kill()
            raise RuntimeError(f"the reward process did not load {self.specs} within {self.start_timeout_s} s")
        try:
            status, message, *batched = self._conn.recv()
        except (EOFError, OSError) as err:
            self._kill()
            raise RuntimeError(f"the reward process died while loading {self.specs} (exit {proc.poll()})") from err
        if status != "ready":
            self._kill()
            raise RewardFnError(message)
        self.batched = list(batched[0])

    def _kill(self) -> None:
        """End the reward process and every process of its group (programs a function started and left running,
        which a timeout used to orphan)."""
        if self._conn is not None:
            self._conn.close()
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)  # the group outlives its leader's exit: kill it first
            self._proc.kill()
            self._proc.wait(timeout=10)
        self._proc = self._conn = None

    def _restart(self) -> None:
        self._kill()
        self.restarts += 1
        self._start()

    def score(self, calls: Sequence[tuple]) -> list[CallOutcome]:
        """One outcome per call `(fn_index, response, answer, row[, response ids])`, in order; never raises for what
        a function does (raises, hangs, crashes the process, returns garbage): that call scores 0 with its error. A
        TRL function's calls are one call (`reward.timeout_s` for all of them): when it fails the process, they all
        do."""
        outcomes: list[CallOutcome | None] = [None] * len(calls)
        pending = list(range(len(calls)))
        while pending:
            if self._proc is None:
                self._start()
            self._conn.send([(i, *calls[i]) for i in pending])
            for position, call_id in enumerate(pending):
                outcome, healthy = self._receive(call_id)
                outcomes[call_id] = outcome
                if not healthy:  # the process is killed: the calls after this one go to a new one
                    self._restart()
                    pending = pending[position + 1 :]
                    fn_index = calls[call_id][0]
                    if self.batched[fn_index]:  # the same one call again would end so again
                        for other in [i for i in pending if calls[i][0] == fn_index]:
                            outcomes[other] = outcome
                        pending = [i for i in pending if calls[i][0] != fn_index]
                    break
            else:
                pending = []
        return [o if o is not None else CallOutcome(error="not scored") for o in outcomes]

    def _receive(self, call_id: int) -> tuple[CallOutcome, bool]:
        """The outcome of call `call_id` and whether the process can go on (False: timed out, died or misspoke)."""
        if not self._conn.poll(self.timeout_s):
            return CallOutcome(timed_out=True, error=f"timed out after {self.timeout_s} s"), False
        try:
            reply = self._conn.recv()
        except (EOFError, OSError):
            try:
                code = self._proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                code = None
            return CallOutcome(error=f"the reward process died (exit code {code})"), False
        if not isinstance(reply, tuple) or len(reply) not in (2, 3) or reply[0] != call_id:
            return CallOutcome(error=f"the reward process answered {reply!r:.200} to call {call_id}"), False
        if len(reply) == 3:
            return CallOutcome(error=str(reply[2])), True
        try:
            score, metrics = validate_result(reply[1])
        except ValueError as err:
            return CallOutcome(error=str(err)), True
        return CallOutcome(score=score, metrics=metrics), True

    def close(self) -> None:
        """Ask the process to exit; kill it if it does not within a second."""
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.send(None)
            if self._proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=1.0)
        self._kill()


class RewardScorer:
    """A worker's reward step: the task's own reward in-process (no `reward.fn`), or the user's functions in a
    `RewardPool`, combined with `reward.weights`. Keeps the counts the worker reports: `errors` and `timeouts`
    (calls), the sum and count of each `reward/<key>` metric, and the first failure's message."""

    def __init__(self, reward_cfg: RewardConfig, task_reward: Callable[[str, str], float]) -> None:
        self.specs, self.weights = reward_cfg.specs(), reward_cfg.weight_list()
        self.names = spec_names(self.specs)
        self.task_reward = task_reward
        key = reward_cfg.specs_key()
        self.pool = RewardPool(self.specs, reward_cfg.timeout_s, key=key) if self.specs else None
        self.errors = 0
        self.timeouts = 0
        self.metric_sums: dict[str, list[float]] = {}
        """`reward/<key>` -> [sum, count] over every scored response."""
        self.first_error = ""

    def score(
        self, items: Sequence[tuple[str, str, dict[str, Any]]], response_ids: Sequence[list[int]] | None = None
    ) -> list[float]:
        """The reward of each `(response, answer, row)`, in one round trip to the reward process; `response_ids`:
        each response's token ids, which TRL functions get as `completion_ids`."""
        if self.pool is None:
            return [float(self.task_reward(response, answer)) for response, answer, _ in items]
        n_fns = len(self.specs)
        calls = [(f, *item) for item in items for f in range(n_fns)]
        if response_ids is not None:  # then each call's response's token ids (`common.reward_fns.serve`)
            calls = [(*call, response_ids[i // n_fns]) for i, call in enumerate(calls)]
        outcomes = self.pool.score(calls)
        rewards = []
        for i, (_, _, row) in enumerate(items):
            mine = outcomes[i * n_fns : (i + 1) * n_fns]
            for outcome, name in zip(mine, self.names):
                if outcome.error:
                    self._count_failure(outcome, name, row)
            reward, metrics = combine(mine, self.weights, self.names)
            if not math.isfinite(reward):  # each finite, their weighted sum past float's range (2 x 1e308)
                message = f"the weighted sum of the scores {[o.score for o in mine]} is {reward} (reward.weights "
                self._count_failure(CallOutcome(error=message + f"{list(self.weights)})"), "+".join(self.names), row)
                reward = 0.0
            for key, value in metrics.items():
                total = self.metric_sums.setdefault(key, [0.0, 0.0])
                total[0] += value
                total[1] += 1.0
            rewards.append(reward)
        return rewards

    def _count_failure(self, outcome: CallOutcome, name: str, row: dict[str, Any]) -> None:
        if outcome.timed_out:
            self.timeouts += 1
        else:
            self.errors += 1
        if not self.first_error:  # the driver logs the run's first (`RewardMetrics`); later ones are only counted
            self.first_error = (
                f"reward function {name!r} {'timed out' if outcome.timed_out else 'failed'} on row "
                f"{row.get('index')} (scored 0; later failures are only counted in reward/errors and "
                f"reward/timeouts): {outcome.error}"
            )

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


class RewardMetrics:
    """The driver's view of the workers' reward counts, one `update` per step (`asyncrl/driver.py`):

    - `reward/errors`, `reward/timeouts`: run totals (from the supervisor's `totals`, which keep retired workers'
      counts, when it has them; else the live workers');
    - `reward/<key>`: each extra metric's mean over the responses scored since the previous update;
    - the first failure of the run (traceback and row index), handed to `log` once, whichever worker saw it."""

    def __init__(self) -> None:
        self.last_sums: dict[str, list[float]] = {}
        """`f"{worker}/{key}"` -> that worker's [sum, count] at the previous update."""
        self.logged_error = False

    def update(
        self,
        worker_stats: Sequence[dict[str, Any]],
        totals: dict[str, float] | None = None,
        log: Callable[[str], None] | None = None,
    ) -> dict[str, float]:
        totals = totals or {}
        out = {
            f"reward/{name}": float(totals[f"reward_{name}"])
            if f"reward_{name}" in totals
            else float(sum(s.get(f"reward_{name}", 0) for s in worker_stats))
            for name in ("errors", "timeouts")
        }
        interval: dict[str, list[float]] = {}
        for stats in worker_stats:
            for key, (total, count) in stats.get("reward_metrics", {}).items():
                before = self.last_sums.get(f"{stats.get('worker')}/{key}", [0.0, 0.0])
                self.last_sums[f"{stats.get('worker')}/{key}"] = [total, count]
                into = interval.setdefault(key, [0.0, 0.0])
                into[0] += total - before[0]
                into[1] += count - before[1]
        out.update({f"reward/{key}": total / count for key, (total, count) in interval.items() if count > 0})
        first = next((s for s in worker_stats if s.get("reward_first_error")), None)
        if log is not None and first is not None and not self.logged_error:
            self.logged_error = True
            log(f"{first.get('worker')}: {first['reward_first_error']}")
        return out
