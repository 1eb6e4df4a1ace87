"""The driver's side of live operations: control requests (asyncrl/control.py), live config changes applied at
step boundaries, and resumable checkpoints (asyncrl/checkpoint.py).

| request | answered | takes effect |
|---|---|---|
| status | at once (also while the learner trains) | - |
| scale rollout=N | at once: workers added or told to stop | new workers generate once placed and given weights |
| set key=value | at once (validated like the config) | at the next step boundary, logged as a `set` event |
| down | at once | after the step in progress: workers stop, checkpoint, exit 0 |

`Operations` reads only its config sections (`OperationsSections`). A live change is validated against the whole
config by the `check_live` the driver gives it (`common.config.live_update` on the root config, whose live
sections are this bundle's very objects: `OperationsSections.pick` shares them), and applied to the bundle with
`set_key` at the step boundary.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from asyncrl import checkpoint
from asyncrl.control import ControlError, ControlServer
from asyncrl.metrics import MetricsLogger
from asyncrl.supervise import WorkerPool
from common.config import (
    LIVE_KEYS,
    BufferConfig,
    CheckpointConfig,
    ConfigError,
    LossConfig,
    OptimConfig,
    RayConfig,
    StalenessConfig,
    TrainConfig,
    get_key,
    set_key,
)

BUFFER_KEYS = ("cursor", "cursor_epoch", "cursor_position", "consumed_groups", "admitted_groups", "current_step")
STATUS_BUFFER_S = 2.0
"""How long `status` waits for the buffer's counters before it answers without them."""


@dataclass(kw_only=True, slots=True)
class OperationsSections:
    """The config sections the driver's operations read."""

    train: TrainConfig
    """`steps`, for `status`."""
    # the sections of the live keys (common.config.LIVE_KEYS): `status` shows them, `set` changes them
    staleness: StalenessConfig
    loss: LossConfig
    optim: OptimConfig
    ray: RayConfig
    """What `scale` checks a new worker count against."""
    buffer: BufferConfig
    """The CurveZMQ keys of the driver's buffer client."""
    checkpoint: CheckpointConfig

    @classmethod
    def pick(cls, root: object) -> OperationsSections:
        """These sections of `root` (the root config): the same section objects, not copies."""
        return cls(**{f.name: getattr(root, f.name) for f in fields(cls)})


class Operations:
    def __init__(
        self,
        sections: OperationsSections,
        check_live: Callable[[list[str]], dict[str, Any]],
        run_dir: Path,
        pool: WorkerPool,
        learner: Any,
        buffer_endpoint: str,
        logger: MetricsLogger,
        start_step: int,
    ) -> None:
        """`check_live(items)`: `key=value` live changes validated against the whole config -> {key: new value}
        (raises ConfigError)."""
        from buffer.client import BufferClient
        from common.curve import client_keys

        self.sections, self.check_live = sections, check_live
        self.run_dir, self.pool, self.learner, self.logger = run_dir, pool, learner, logger
        curve = client_keys(sections.buffer.curve_keys_dir)
        self.buffer = BufferClient(buffer_endpoint, identity="driver", timeout_s=10, curve=curve)
        # `status` asks with a short wait of its own: a stalled buffer must not hold the driver's loop (and the
        # CLI's 10 s) on an answer that is only for display
        self.status_buffer = BufferClient(buffer_endpoint, identity="driver-status", timeout_s=STATUS_BUFFER_S,
                                          curve=curve)  # fmt: skip
        self.control = ControlServer(run_dir)
        self.step = start_step  # train steps completed
        self.pending: dict[str, Any] = {}  # validated live changes waiting for the step boundary
        self.stopping = False
        self.last_metrics: dict[str, Any] = {}
        self.last_totals = {"tokens": 0.0, "samples": 0.0, "correct": 0.0, "reward_sum": 0.0}

    # -- requests -----------------------------------------------------------------------------------------------

    def stop_requested(self, reason: str) -> bool:
        """Record a graceful stop asked for by `reason` (`down`, `SIGINT`, ...; "" asks nothing); whether stopping."""
        if reason and not self.stopping:
            self.stopping = True
            self.logger.event("down", step=self.step, reason=reason)
            self.control.mark_stopping(self.step, reason)
        return self.stopping

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        cmd = request["cmd"]
        if cmd == "status":
            return self.status()
        if cmd in ("scale", "set") and self.stopping:  # a stopping run starts no worker and applies no change
            raise ControlError(
                f"the run is stopping after step {self.step} (asyncrl down or a signal): {cmd} is refused; after it "
                f"stops, `asyncrl up --resume {self.run_dir}` with the change"
            )
        if cmd == "scale":
            return self.scale(request.get("rollout"))
        if cmd == "set":
            return self.set(request.get("items"))
        if cmd == "down":
            self.stop_requested("down")
            return {"message": f"stopping after step {self.step}: workers stop, then a checkpoint is written"}
        raise ControlError(f"unknown command {cmd!r}; commands: status, scale, set, down")

    def status(self) -> dict[str, Any]:
        metrics = self.last_metrics
        return {
            "run": str(self.run_dir),
            "step": self.step,
            "steps": self.sections.train.steps,
            "version": metrics.get("version", self.step),
            "stopping": self.stopping,
            "workers": self.describe_workers(),
            "buffer": self._buffer_stats(),
            "staleness": {
                "mean": metrics.get("staleness/mean"),
                "max": metrics.get("staleness/max"),
                "max_lag": self.sections.staleness.max_lag,
            },
            "throughput": {
                "rollout_tok_s": metrics.get("perf/rollout_tok_s", 0.0),
                "step_s": metrics.get("perf/step_s", 0.0),
            },
            "live": {key: get_key(self.sections, key) for key in LIVE_KEYS},
            "pending": self.pending,
            "errors": self.recent_errors(),
        }

    def _buffer_stats(self) -> dict[str, Any]:
        """The buffer's counters, or {"unavailable": why} when it does not answer within STATUS_BUFFER_S."""
        from buffer.client import BufferRequestError, BufferUnavailable

        try:
            return dict(self.status_buffer.stats())
        except (BufferUnavailable, BufferRequestError) as err:
            return {"unavailable": f"no answer within {STATUS_BUFFER_S:g} s ({type(err).__name__})"}

    def describe_workers(self) -> list[dict[str, Any]]:
        """`WorkerPool.describe`, with state `pending` for a starting worker that Ray has not placed yet (no node has
        the CPUs or resources it asks for)."""
        rows = self.pool.describe()
        for row in rows:
            worker = self.pool.workers.get(row["worker"])
            if row.get("state") == "starting" and worker is not None and actor_pending(worker.handle):
                row["state"] = "pending"
        return rows

    def recent_errors(self) -> list[str]:
        """Worker crashes (supervision) and the last error each live worker reported, newest last."""
        worker_errors = [f"{w['worker']}: {w['last_error']}" for w in self.pool.describe() if w.get("last_error")]
        return [*self.pool.recent_errors, *worker_errors][-10:]

    def scale(self, count: Any) -> dict[str, Any]:
        """Add or remove rollout workers until `count` are active.

        A local cluster (`ray.address` empty) refuses a count past its logical CPUs (`RayConfig.local_cpus`: no node can
        join it, the workers would wait forever) and names the key to raise. A cluster started elsewhere refuses
        nothing: workers that do not fit its free resources are created and wait for them, shown as `pending` by
        `status`, and start when a node joins or resources free up.
        """
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ControlError(f"rollout=N needs a whole number N >= 1, got {count!r}")
        if not self.sections.ray.address:
            self._check_local_capacity(count)
        added, removed = self.pool.scale(count)
        self._kill_pending(removed)
        self.logger.event("scale", rollout=count, added=added, removed=removed, step=self.step)
        return {"added": added, "removed": removed}

    def _check_local_capacity(self, count: int) -> None:
        from common import actors

        ray_cfg = self.sections.ray
        need = {"CPU": ray_cfg.learner_cpus + count * ray_cfg.worker_cpus}
        for name, amount in ray_cfg.worker_resources.items():
            need[name] = need.get(name, 0.0) + count * amount
        if actors.launcher() == "local":  # the same logical CPUs as a local Ray cluster would declare
            total = {"CPU": float(ray_cfg.local_cpus())}
        else:
            import ray

            total = ray.cluster_resources()
        for name, amount in need.items():
            have = total.get(name, 0.0)
            if amount <= have + 1e-9:
                continue
            if name != "CPU":
                raise ControlError(f"{count} rollout workers need {amount:g} {name} (`ray.worker_resources`) but the "
                                   f"local cluster has {have:g}")  # fmt: skip
            most = int((have - ray_cfg.learner_cpus) / ray_cfg.worker_cpus + 1e-9) if ray_cfg.worker_cpus else 0
            raise ControlError(
                f"{count} rollout workers need {amount:g} logical CPUs but the local cluster declares {have:g} "
                f"(`ray.num_cpus` {ray_cfg.num_cpus} x `ray.local_oversubscribe` {ray_cfg.local_oversubscribe:g}): at "
                f"most {most} workers of `ray.worker_cpus`={ray_cfg.worker_cpus:g} fit. For more, restart with "
                f"`asyncrl down`, then `asyncrl up --resume RUN ray.local_oversubscribe=...` (or a smaller "
                f"`ray.worker_cpus`)"
            )

    def _kill_pending(self, removed: list[str]) -> None:
        """A removed worker that Ray never placed is killed: its `stop` would wait for resources that may never come."""
        from common import actors

        for worker_id in removed:
            worker = self.pool.workers.get(worker_id)
            if worker is not None and worker.started is not None and actor_pending(worker.handle):
                actors.kill(worker.handle)

    def set(self, items: Any) -> dict[str, Any]:
        if not isinstance(items, list) or not items or not all(isinstance(i, str) for i in items):
            raise ControlError("set needs one or more key=value items")
        try:
            changes = self.check_live(items)  # against the applied values: only keys that would change come back
        except ConfigError as err:
            raise ControlError(str(err)) from None
        # A key named again replaces what is pending for it: set back to its applied value, the pending one is
        # dropped (it used to stay, so "oops, back to 0.2" within one step still applied the mistaken value).
        named = {item.split("=", 1)[0].strip() for item in items}
        cancelled = {key: get_key(self.sections, key) for key in named if key in self.pending and key not in changes}
        for key in cancelled:
            del self.pending[key]
        self.pending.update(changes)
        return {"changes": {**cancelled, **changes}, "applies_at_step": self.step + 1}

    # -- step boundary ------------------------------------------------------------------------------------------

    def step_done(self, step: int, metrics: dict[str, Any]) -> None:
        """Called after train step `step - 1`: apply the pending live changes before step `step` starts."""
        self.step, self.last_metrics = step, metrics
        if not self.pending:
            return
        changes, self.pending = self.pending, {}
        if "staleness.max_lag" in changes:
            self.buffer.set_max_lag(int(changes["staleness.max_lag"]))
        learner_changes = {k: v for k, v in changes.items() if k != "staleness.max_lag"}
        if learner_changes:
            self.learner.set_live(learner_changes)
        for key, value in changes.items():
            old = get_key(self.sections, key)
            set_key(self.sections, key, value)
            self.logger.event("set", key=key, value=value, old=old, step=step)
            self.logger.info(f"set {key}={value} (was {old}) from step {step}")

    def save_checkpoint(self, step: int) -> Path:
        from buffer.client import BufferRequestError, BufferUnavailable

        try:  # recorded for the reader only (resume rewinds the journal itself): a dead buffer must not cost the model
            buffer_stats = self.buffer.stats()
        except (BufferUnavailable, BufferRequestError):
            buffer_stats = {}
        meta = {
            "version": step,
            "time": time.time(),
            "buffer": {key: buffer_stats.get(key) for key in BUFFER_KEYS},
            "live": {key: get_key(self.sections, key) for key in LIVE_KEYS},
        }
        path = checkpoint.save(
            self.run_dir, step, self.learner.save_checkpoint, meta, self.sections.checkpoint.keep_last
        )
        self.logger.event("checkpoint", step=step, path=str(path))
        return path


def actor_pending(handle: Any) -> bool:
    """Whether Ray has not yet placed the actor `handle` (`common.actors.is_pending`; never for a local actor)."""
    from common import actors

    return actors.is_pending(handle)
