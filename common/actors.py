"""The actors of a run, whichever launcher starts them: one small interface for the driver, the supervisor, the
evaluator and the learner group, so that none of them cares whether Ray runs.

| launcher (`ray.launcher`) | an actor is | calls travel | chosen by `auto` when |
|---|---|---|---|
| `ray` | a Ray actor of the run's cluster (asyncrl/raycluster.py) | Ray | `ray.address` is set, or custom resources |
| `local` | a child process of the driver (`common.local_actors`) | ZMQ over a private ipc:// socket | one machine |

The interface is Ray's own, as the run's code used it: `remote(cls, **options).remote(*args)` creates an actor,
`handle.method.remote(*args)` returns a ref, `get(refs, timeout)`, `wait(refs, num_returns, timeout)`, `kill(handle)`. A
ref may be an argument of a call: the call is sent once it is ready, as Ray does. Errors: `died_errors()` (the actor's
process ended: killed, crashed, out of memory, its constructor raised: `init_failed(err)`, as Ray's `actor_init_failed`)
and `task_errors()` (a method raised; the error has `cause`, `function_name` and `pid`, like Ray's RayTaskError). Under
`ray` they are Ray's classes, so Ray's behaviour is unchanged. Only `ray` imports Ray (about 1 CPU-second): a `local`
run never does.

`use` sets the launcher of this process (the driver's, once, before the first actor); `get`, `wait` and `kill` go
by the kind of ref or handle they are given, so they need no launcher.
"""

from __future__ import annotations

import sys
from typing import Any

from common.config import RayConfig

LAUNCHERS = ("auto", "ray", "local")
_state = {"launcher": "ray"}


class ActorDiedError(RuntimeError):
    """A local actor's process ended (killed, crashed, or its constructor raised): this call and every later one
    fail with it. The message carries `class_name:`, `pid=` and `exit detail:` as Ray's RayActorError does."""

    def __init__(self, message: str, class_name: str = "", pid: int = 0, actor_init_failed: bool = False) -> None:
        super().__init__(message)
        self.class_name, self.pid = class_name, pid
        self.actor_init_failed = actor_init_failed  # its constructor raised (Ray's RayActorError has the same field)


def init_failed(err: BaseException) -> bool:
    """The actor died because its constructor raised (`actor_init_failed`, Ray's field and a local actor's): Ray never
    restarts such an actor, whatever its `max_restarts`, since a constructor that raised once will raise again."""
    return bool(getattr(err, "actor_init_failed", False))


class ActorTaskError(RuntimeError):
    """A local actor's method raised: `cause` (the exception, or a RuntimeError with its text when it cannot be
    rebuilt here), `function_name` (`Class.method`), `pid`; the message holds the actor's traceback."""

    def __init__(self, message: str, cause: BaseException | None, function_name: str, pid: int) -> None:
        super().__init__(message)
        self.cause, self.function_name, self.pid = cause, function_name, pid


class ActorTimeoutError(TimeoutError):
    """`get` with a timeout on a local ref that was not ready in time (Ray's GetTimeoutError)."""


def resolve_launcher(ray_cfg: RayConfig) -> str:
    """`ray` or `local` for `ray.launcher`: `auto` is `local` on one machine (no `ray.address`, no custom resources
    and no GPU requests, which only Ray can place), else `ray`."""
    if ray_cfg.launcher != "auto":
        return ray_cfg.launcher
    placed = ray_cfg.worker_resources or ray_cfg.learner_resources or ray_cfg.worker_gpus or ray_cfg.learner_gpus
    return "local" if not ray_cfg.address and not placed else "ray"


def use(launcher: str) -> None:
    """Start this process's later actors with `launcher` (`ray` or `local`)."""
    if launcher not in ("ray", "local"):
        raise ValueError(f"launcher must be 'ray' or 'local', got {launcher!r}")
    _state["launcher"] = launcher
    if launcher == "local":  # its torch imports overlap the driver's start-up (the buffer, the config's checks)
        from common import zygote

        zygote.start()


def launcher() -> str:
    """The launcher `remote` uses now (`ray` unless `use` said otherwise)."""
    return _state["launcher"]


def remote(cls: type, **options: Any) -> Any:
    """An actor class of `cls` with Ray's actor options (`num_cpus`, `max_concurrency`, `resources`): call
    `.remote(*args, **kwargs)` on it to start an actor."""
    if _state["launcher"] == "local":
        from common.local_actors import LocalActorClass

        return LocalActorClass(cls, options)
    import ray

    return ray.remote(**options)(cls)


def _local_module() -> Any:
    return sys.modules.get("common.local_actors")


def _is_local(item: Any) -> bool:
    local = _local_module()
    return local is not None and isinstance(item, (local.LocalRef, local.LocalActor))


def get(refs: Any, timeout: float | None = None) -> Any:
    """The value of a ref, or the values of a list of refs (`ray.get`); raises the call's error."""
    if isinstance(refs, list) and not refs:
        return []
    first = refs[0] if isinstance(refs, list) else refs
    if _is_local(first):
        return _local_module().get(refs, timeout)
    import ray

    return ray.get(refs, timeout=timeout)


def wait(refs: list[Any], num_returns: int = 1, timeout: float | None = None) -> tuple[list[Any], list[Any]]:
    """(ready, not ready) once `num_returns` of `refs` are done or `timeout` seconds passed (`ray.wait`)."""
    if not refs:
        return [], []
    if _is_local(refs[0]):
        return _local_module().wait(refs, num_returns, timeout)
    import ray

    return ray.wait(refs, num_returns=num_returns, timeout=timeout)


def kill(handle: Any) -> None:
    """End an actor's process at once (`ray.kill`); its calls in flight and later ones fail as died."""
    if _is_local(handle):
        handle._kill()
        return
    import ray

    ray.kill(handle)


def is_pending(handle: Any) -> bool:
    """Whether a Ray actor waits for a node with the resources it asks for (read from the GCS actor table: the
    public state API needs the dashboard, which a local cluster does not start); never for a local actor, which
    starts at once. False when the table cannot be read."""
    if _is_local(handle):
        return False
    try:
        from ray._private import state

        record = state.actors(handle._actor_id.hex())
    except Exception:  # a Ray without this table, or a GCS that does not answer: `status` still answers
        return False
    return isinstance(record, dict) and record.get("State") in ("PENDING_CREATION", "DEPENDENCIES_UNREADY")


def died_errors() -> tuple[type[BaseException], ...]:
    """The errors of an actor whose process ended (Ray's RayActorError only once Ray is imported)."""
    ray = sys.modules.get("ray")
    exceptions = getattr(ray, "exceptions", None)
    return (ActorDiedError, exceptions.RayActorError) if exceptions is not None else (ActorDiedError,)


def task_errors() -> tuple[type[BaseException], ...]:
    """The errors of a method that raised (Ray's RayTaskError only once Ray is imported)."""
    ray = sys.modules.get("ray")
    exceptions = getattr(ray, "exceptions", None)
    return (ActorTaskError, exceptions.RayTaskError) if exceptions is not None else (ActorTaskError,)


def shutdown() -> None:
    """End every local actor this process started (nothing under Ray: `ray.shutdown` does that)."""
    local = _local_module()
    if local is not None:
        local.shutdown()
