"""Supervision of the run's processes: rollout worker actors (`WorkerPool`: start, scale live, restart the dead with
backoff) and the buffer process (`BufferSupervisor`: restart it on the same run directory and port).

The driver calls `WorkerPool.poll()` every few hundred milliseconds, also while the learner trains a step. The
backoff before the n-th restart of the run is `rollout.restart_backoff_s * 2 ** (n - 1)`, capped at 60 s.

| what poll sees | what it does |
|---|---|
| a worker's call fails with an actor error (killed, OOM, crash) | `worker_crashed`; restart after a backoff |
| a worker whose loop thread died (`stats()["alive"]` false) | kill the actor, then as above |
| a restart that is due | a new actor with a fresh identity (`worker-<slot>.<n>`), `worker_started` |
| more than `rollout.max_restarts` crashes over the run | raise `SupervisionError` (the run fails with that message) |
| a removed worker's `stop` has returned | its final counters are kept, the actor is killed |

A fresh identity matters: the buffer returns the leases of a silent identity after `buffer.worker_timeout_s`
(buffer/state.py), so the prompts a dead worker held are generated again and every group is still trained once.
Counters of retired workers are kept (`totals`) so that rollout throughput never goes backwards.

The buffer (`BufferSupervisor.poll`, called by the driver with `WorkerPool.poll` and by the driver's own buffer client
while it waits): a buffer process that exited while the run goes on is started again at once, on the same run
directory and port, without a rewind. It replays its journal: queued groups are queued again, leases never resolved
return to the pool, and the batch of the last consumed step is kept for a learner that never received it
(buffer/service.py). Clients send their request in flight again when their connection drops (buffer/client.py), so
the learner waiting in FetchBatch and the workers carry on. A `buffer_restarted` event records the exit, the
downtime and what was replayed; more than `buffer.max_restarts` deaths raise SupervisionError.
"""

from __future__ import annotations

import copy
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import actors
from common.config import RayConfig, to_dict
from rollout_workers.sections import WorkerSections

MAX_BACKOFF_S = 60.0
STATS_EVERY_S = 0.5
COUNTERS = (
    "tokens", "samples", "correct", "reward_sum", "groups_pushed", "errors", "reward_errors", "reward_timeouts",
    "prompts_skipped", "env_episodes", "env_turns", "env_tool_calls", "env_errors", "env_timeouts", "env_masked_tokens",
    "env_groups_dropped",
)  # fmt: skip


class SupervisionError(RuntimeError):
    """A process of the run died more often than its `max_restarts` allows, or could not be restarted; the message is
    one line naming the process and how it ended."""


@dataclass(slots=True)
class _Worker:
    slot: int
    worker_id: str
    handle: Any
    started: Any  # ObjectRef of start(), None once it returned
    state: str = "starting"  # starting | running | stopping
    pid: int = 0
    node: str = ""  # Ray node id ("" for a local actor)
    stats: dict[str, Any] = field(default_factory=dict)
    stats_ref: Any = None
    stop_ref: Any = None


def worker_options(ray_cfg: RayConfig) -> dict[str, Any]:
    """Ray options of one rollout worker actor: `ray.worker_cpus`, its GPUs (`ray.worker_gpus`: Ray's request, after
    which the worker sees only those) and custom resources."""
    options: dict[str, Any] = {"num_cpus": ray_cfg.worker_cpus, "max_concurrency": 4}
    if ray_cfg.worker_gpus:
        options["num_gpus"] = ray_cfg.worker_gpus
    if ray_cfg.worker_resources:
        options["resources"] = dict(ray_cfg.worker_resources)
    return options


class WorkerPool:
    def __init__(
        self,
        sections: WorkerSections,
        ray_cfg: RayConfig,
        model_dir: str,
        buffer_endpoint: str,
        weights_endpoint: Any,
        event: Callable[..., None],
    ) -> None:
        """Every worker is given `sections`; `ray_cfg` sizes their actors. `weights_endpoint`: the publisher's
        endpoint, or a ref of it (workers then start up while the learner still does; each worker's `start`
        waits for the ref)."""
        from rollout_workers.worker import RolloutWorker

        self.rollout = sections.rollout  # max_restarts, restart_backoff_s
        self.args = (to_dict(sections), model_dir, buffer_endpoint, weights_endpoint)
        self.actor_cls = actors.remote(RolloutWorker, **worker_options(ray_cfg))
        self.event = event
        self.workers: dict[str, _Worker] = {}
        self.generation: dict[int, int] = {}  # slot -> restarts of that slot
        self._used_ids: set[str] = set()  # every worker id this pool has given out (`_spawn`)
        self.restarts: list[tuple[float, int, str]] = []  # (due, slot, id of the dead worker)
        self.crashes = 0
        self.retired_stats: list[dict[str, Any]] = []  # the last stats of each worker scaled away or crashed
        self.recent_errors: deque[str] = deque(maxlen=10)
        self._next_stats = 0.0

    # -- membership ---------------------------------------------------------------------------------------------

    def start(self, count: int, meanwhile: Callable[[], object] | None = None) -> None:
        """Start `count` workers and wait until each runs (has weights and is generating).

        `meanwhile` runs after the actors are created and before waiting for them (the driver waits for the learner
        there, so that a learner that fails to start is reported as such, not as a worker that never started).
        """
        for _ in range(count):
            self._spawn(self._free_slot())
        if meanwhile is not None:
            meanwhile()
        for worker in list(self.workers.values()):
            actors.get(worker.started)
            self._mark_running(worker)

    def active(self) -> list[_Worker]:
        """Workers starting or running (not the ones being removed)."""
        return [w for w in self.workers.values() if w.state != "stopping"]

    def target(self) -> int:
        return len(self.active()) + len(self.restarts)

    def scale(self, count: int) -> tuple[list[str], list[str]]:
        """Add or remove workers until `count` are active (restarts pending count as active); (added, removed)."""
        added, removed = [], []
        while self.target() < count:
            added.append(self._spawn(self._free_slot()).worker_id)
        while self.target() > count and self.restarts:
            self.restarts.pop()  # a pending restart is the cheapest to give up
        for worker in sorted(self.active(), key=lambda w: -w.slot)[: max(0, self.target() - count)]:
            worker.state = "stopping"
            worker.stop_ref = worker.handle.stop.remote()  # finishes the batch in progress, pushes it
            removed.append(worker.worker_id)
            self.event("worker_removed", worker=worker.worker_id)
        return added, removed

    def _free_slot(self) -> int:
        used = {w.slot for w in self.active()} | {slot for _, slot, _ in self.restarts}
        return next(i for i in range(len(used) + 1) if i not in used)

    def _spawn(self, slot: int, replaces: str = "") -> _Worker:
        generation = self.generation.get(slot, 0)
        worker_id = f"worker-{slot}" + (f".{generation}" if generation else "")
        while worker_id in self._used_ids:  # a slot scaled away and back: a fresh identity, never a worker's that
            generation += 1  # may still be stopping (its entry, stop call and counters were overwritten: a leak)
            worker_id = f"worker-{slot}.{generation}"
        self.generation[slot] = generation
        self._used_ids.add(worker_id)
        section_values, model_dir, buffer_endpoint, weights_endpoint = self.args
        handle = self.actor_cls.remote(section_values, worker_id, model_dir, buffer_endpoint)
        worker = _Worker(slot, worker_id, handle, handle.start.remote(weights_endpoint))
        self.workers[worker_id] = worker
        self.event("worker_starting", worker=worker_id, replaces=replaces or None)
        return worker

    def _mark_running(self, worker: _Worker) -> None:
        worker.started = None
        if worker.state == "stopping":  # scaled down while it started: it stops now (its loop ends by itself)
            return
        worker.state = "running"
        if actors.launcher() == "local":  # no Ray node; `node_id` would import Ray in the worker (about 1 CPU-s)
            worker.pid, worker.node = actors.get(worker.handle.pid.remote()), ""
        else:
            worker.pid, worker.node = actors.get([worker.handle.pid.remote(), worker.handle.node_id.remote()])
        self.event("worker_started", worker=worker.worker_id, pid=worker.pid, node=worker.node)

    # -- supervision --------------------------------------------------------------------------------------------

    def poll(self) -> None:
        """One round of supervision (non-blocking); raises SupervisionError past `rollout.max_restarts` crashes."""
        errors = (*actors.died_errors(), *actors.task_errors(), RuntimeError)
        now = time.monotonic()
        for worker in list(self.workers.values()):
            try:
                if worker.started is not None and _ready(worker.started):
                    actors.get(worker.started)
                    self._mark_running(worker)
                if worker.stats_ref is not None and _ready(worker.stats_ref):
                    ref, worker.stats_ref = worker.stats_ref, None
                    worker.stats = actors.get(ref)
                    if worker.state == "running" and not worker.stats.get("alive", True):
                        actors.kill(worker.handle)
                        raise RuntimeError(f"its loop died: {worker.stats.get('last_error', '')}")
                if worker.stop_ref is not None and _ready(worker.stop_ref):
                    ref, worker.stop_ref = worker.stop_ref, None
                    worker.stats = actors.get(ref)
                    self._retire(worker)
                    actors.kill(worker.handle)
                    self.event("worker_stopped", worker=worker.worker_id)
            except errors as err:
                self._crashed(worker, err, now)
        if now >= self._next_stats:
            self._next_stats = now + STATS_EVERY_S
            for worker in self.workers.values():
                if worker.state == "running" and worker.stats_ref is None:
                    worker.stats_ref = worker.handle.stats.remote()
        for due, slot, dead in [r for r in self.restarts if r[0] <= now]:
            self.restarts.remove((due, slot, dead))
            self.generation[slot] = self.generation.get(slot, 0) + 1
            self._spawn(slot, replaces=dead)

    def _crashed(self, worker: _Worker, err: BaseException, now: float) -> None:
        self._retire(worker)
        if worker.state == "stopping":  # it was leaving anyway
            return
        self.crashes += 1
        message = f"{worker.worker_id} (pid {worker.pid or '?'}) died: {str(err).splitlines()[0][:300]}"
        self.recent_errors.append(message)
        if self.crashes > self.rollout.max_restarts:
            self.event("worker_crashed", worker=worker.worker_id, error=message, restart_in_s=None)
            raise SupervisionError(
                f"rollout workers crashed {self.crashes} times, more than `rollout.max_restarts` "
                f"({self.rollout.max_restarts}) allows; last: {message}"
            )
        delay = min(self.rollout.restart_backoff_s * 2 ** (self.crashes - 1), MAX_BACKOFF_S)
        self.restarts.append((now + delay, worker.slot, worker.worker_id))
        self.event("worker_crashed", worker=worker.worker_id, error=message, restart_in_s=delay, crashes=self.crashes)

    def _retire(self, worker: _Worker) -> None:
        self.retired_stats.append({**worker.stats, "worker": worker.worker_id, "retired": True})
        del self.workers[worker.worker_id]

    # -- reporting ----------------------------------------------------------------------------------------------

    def refresh(self, timeout_s: float = 10.0) -> None:
        """Fresh stats of every running worker (blocking, at a step boundary); failures are left to `poll`."""
        running = [w for w in self.workers.values() if w.state == "running"]
        for worker in running:
            if worker.stats_ref is None:
                worker.stats_ref = worker.handle.stats.remote()
        actors.wait([w.stats_ref for w in running], num_returns=len(running), timeout=timeout_s)
        self._next_stats = 0.0
        self.poll()

    def totals(self) -> dict[str, float]:
        """Counters summed over every worker the run had (retired ones included)."""
        every = [*self.retired_stats, *(worker.stats for worker in self.workers.values())]
        return {key: sum(float(stats.get(key, 0)) for stats in every) for key in COUNTERS}

    def describe(self) -> list[dict[str, Any]]:
        """One row per worker for `asyncrl status`: id, pid, state, weight version, samples, errors, last error."""
        rows = [
            {
                "worker": w.worker_id, "pid": w.pid, "node": w.node[:12], "state": w.state,
                "version": w.stats.get("version"),
                "samples": w.stats.get("samples", 0), "errors": w.stats.get("errors", 0),
                "last_error": w.stats.get("last_error", ""),
            }
            for w in sorted(self.workers.values(), key=lambda w: w.slot)
        ]  # fmt: skip
        now = time.monotonic()
        rows += [{"worker": dead, "state": f"restarting in {max(due - now, 0):.1f}s"} for due, _, dead in self.restarts]
        return rows

    def stop_all(self, timeout_s: float = 120.0) -> list[dict[str, Any]]:
        """Stop every worker (each finishes and pushes its batch); the final stats of every worker the run had: those
        scaled away or crashed first (`"retired": true`; summary.json listed only the last ones), then these."""
        workers = list(self.workers.values())
        refs = [w.stop_ref if w.stop_ref is not None else w.handle.stop.remote() for w in workers]
        ready, _ = actors.wait(refs, num_returns=len(refs), timeout=timeout_s)
        out = []
        for worker, ref in zip(workers, refs):
            try:
                stats = actors.get(ref) if ref in ready else worker.stats
            except (*actors.died_errors(), *actors.task_errors()):
                stats = worker.stats
            out.append(stats)
        self.restarts.clear()
        return [*self.retired_stats, *out]


def _ready(ref: Any) -> bool:
    ready, _ = actors.wait([ref], timeout=0)
    return bool(ready)


def describe_exit(returncode: int) -> str:
    """`killed by SIGKILL` for a negative return code (a signal), else `exit code N`."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class BufferSupervisor:
    """The buffer process of a run: started, restarted when it dies, stopped (see the module docstring)."""

    def __init__(
        self,
        config_values: dict[str, Any],
        run_dir: Path,
        event: Callable[..., None],
        info: Callable[[str], None],
        resume_step: int | None = None,
        vocab_size: int = 0,
    ) -> None:
        self.config_values = config_values
        self.vocab_size = vocab_size  # the model's: the buffer refuses token ids past it
        self.run_dir = run_dir
        self.max_restarts = int(config_values["buffer"]["max_restarts"])
        self.event = event
        self.info = info
        self.resume_step = resume_step
        self.proc: subprocess.Popen | None = None
        self.endpoint = ""
        self.crashes = 0
        self.last_exit = ""  # how the last dead buffer ended, for diagnoses ("killed by SIGKILL")
        self.stopping = False
        self._restarting = False
        self._alive_at = 0.0  # time.monotonic() of the last poll that found it running

    def start(self) -> str:
        """Start the buffer (rewound to `resume_step` when resuming); returns its endpoint."""
        from buffer.launcher import start_service

        try:
            self.proc, self.endpoint = start_service(
                self.config_values, self.run_dir, resume_step=self.resume_step, vocab_size=self.vocab_size
            )
        except RuntimeError as err:
            raise SupervisionError(f"the buffer process did not start: {err}") from None
        self._alive_at = time.monotonic()
        self.event("buffer_started", pid=self.proc.pid, endpoint=self.endpoint)
        return self.endpoint

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def poll(self) -> None:
        """Restart the buffer if it died (blocking for its start-up, about a second); raises SupervisionError past
        `buffer.max_restarts` deaths or when it cannot be started again. Reentrant calls do nothing."""
        if self.proc is None or self.stopping or self._restarting:
            return
        returncode = self.proc.poll()
        if returncode is None:
            self._alive_at = time.monotonic()
            return
        self._restarting = True
        try:
            self._restart(returncode)
        finally:
            self._restarting = False

    def _restart(self, returncode: int) -> None:
        from buffer.launcher import EXIT_JOURNAL_UNWRITABLE, start_service, stop_service

        assert self.proc is not None
        dead_pid, how = self.proc.pid, describe_exit(returncode)
        stop_service(self.proc)  # reaped already: closes its stdout
        if returncode == EXIT_JOURNAL_UNWRITABLE:  # the same disk fails a restart the same way
            self.event("buffer_crashed", pid=dead_pid, exit=how, crashes=self.crashes + 1, restart=False)
            raise SupervisionError(f"the buffer process (pid {dead_pid}) stopped: its journal in {self.run_dir} "
                                   "cannot be written (its message is above: disk full or an I/O error)")  # fmt: skip
        self.crashes += 1
        self.last_exit = f"the buffer process (pid {dead_pid}) was {how}" if how.startswith("killed") else (
            f"the buffer process (pid {dead_pid}) ended with {how}"
        )  # fmt: skip
        if self.crashes > self.max_restarts:
            self.event("buffer_crashed", pid=dead_pid, exit=how, crashes=self.crashes, restart=False)
            raise SupervisionError(
                f"{self.last_exit}; it died {self.crashes} times, more than `buffer.max_restarts` "
                f"({self.max_restarts}) allows"
            )
        self.info(f"{self.last_exit}: restarting it on {self.run_dir} (restart {self.crashes} of {self.max_restarts})")
        values = copy.deepcopy(self.config_values)
        values["buffer"]["port"] = int(self.endpoint.rsplit(":", 1)[1])  # clients reconnect to the same endpoint
        try:
            self.proc, endpoint = start_service(values, self.run_dir, redeliver=True, vocab_size=self.vocab_size)
        except RuntimeError as err:
            self.proc = None
            raise SupervisionError(f"{self.last_exit} and could not be restarted: {err}") from None
        if endpoint != self.endpoint:
            raise SupervisionError(f"{self.last_exit}; restarted, it listens on {endpoint}, not {self.endpoint}")
        downtime_s = time.monotonic() - self._alive_at  # from the last poll that saw it alive: an upper bound
        self._alive_at = time.monotonic()
        replayed = self._replayed()
        self.event("buffer_restarted", pid=self.proc.pid, dead_pid=dead_pid, exit=how, restarts=self.crashes,
                   downtime_s=round(downtime_s, 3), endpoint=endpoint, **replayed)  # fmt: skip
        queued, returned = replayed.get("replayed_groups", "?"), replayed.get("replayed_leases", "?")
        self.info(
            f"buffer restarted in {downtime_s:.1f} s (pid {self.proc.pid}): replayed {queued} queued groups, "
            f"{returned} leases returned to the pool, at step {replayed.get('step', '?')}"
        )

    def restart(self, resume_step: int) -> dict[str, Any]:
        """Stop the buffer and start it again rewound to `resume_step` (a learner restarted from a checkpoint, as on
        `--resume`); returns what the rewind did (`rewound_groups`, `rewind_dropped_groups`)."""
        self.stop()
        self.stopping, self.resume_step = False, resume_step
        self.start()
        stats = self._stats()
        if "stats_error" in stats:
            return stats
        return {key: stats.get(key, 0) for key in ("rewound_groups", "rewind_dropped_groups", "rewind_lost_groups")}

    def _stats(self) -> dict[str, Any]:
        """The buffer's counters, asked on a connection of the supervisor's own; `{"stats_error": ...}` if it does
        not answer."""
        from buffer.client import BufferClient, BufferRequestError, BufferUnavailable
        from common.curve import client_keys

        curve = client_keys(self.config_values["buffer"]["curve_keys_dir"])
        try:
            with BufferClient(self.endpoint, identity="supervisor", timeout_s=10, curve=curve) as client:
                return client.stats()
        except (BufferUnavailable, BufferRequestError) as err:
            return {"stats_error": str(err)}

    def _replayed(self) -> dict[str, Any]:
        """What the restarted buffer rebuilt from its journal (its counters)."""
        stats = self._stats()
        if "stats_error" in stats:
            return stats
        keys = ("replayed_records", "replayed_groups", "replayed_leases", "consumed_groups", "cursor")
        out: dict[str, Any] = {key: stats.get(key, 0) for key in keys}
        out["step"] = stats.get("current_step", 0)
        return out

    def stop(self) -> None:
        """Stop the buffer for good (SIGTERM: it commits its journal and exits)."""
        from buffer.launcher import stop_service

        self.stopping = True
        if self.proc is not None:
            stop_service(self.proc, timeout_s=10)
