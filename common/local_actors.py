"""Local actors (`ray.launcher: local`): each actor is a child process of the driver that serves its method calls
over ZMQ, so that a run on one machine starts without Ray's services (issue 27: about 3.4 CPU-seconds and 3-4 s of a
2-core start-up). `common.actors` is the interface; `common.actor_host` is the child's side.

    driver: LocalActor --PUSH calls-->  ipc://<private dir>/<n>-calls   --PULL--> child: actor_host
            receiver   <--PULL results-- ipc://<private dir>/<n>-results <--PUSH--      (runs the methods)

- Sockets: the driver binds both, in a fresh directory of mode 0700 (only this user can connect), and every
  message carries a random per-actor token (compared in constant time) as Ray's token authentication does (issue 23).
  Messages are pickled: acceptable only because both ends are our own code started by this driver, behind the
  token and the private directory; nothing else can send one.
- Order: calls run in the order they were made, one at a time (a Ray actor), or on `max_concurrency` threads (a
  threaded Ray actor: the rollout worker answers `stats` while it `stop`s). A sender thread per actor waits for the
  refs among a call's arguments before sending it, so a call waits for its arguments without blocking the caller.
- Death: a receiver thread per actor reads results and polls the process; once it has exited, every call in flight
  and every later one fails with `ActorDiedError` ("class_name: C, pid=N, exit detail: killed by SIGKILL"), which
  the driver's restart paths handle as Ray's actor death. `kill` is SIGKILL. A constructor that raised ends the
  process: its error is the exit detail.
- Environment: a child inherits the driver's (its niceness included) and gets `OMP_NUM_THREADS` from its
  `num_cpus` as a Ray actor does (floor, at least 1; the user's value wins); torch's threads are set by each
  class from its own config (`learner.threads`, `rollout.threads`). Its stdout and stderr lines reach the driver's,
  prefixed `(Class pid=N)` as Ray prints them.
- Start: on Linux each child is forked from a zygote that imported torch and transformers once (`common.zygote`:
  about 2 CPU-seconds saved per actor), and reparented to the driver, which waits for it as for its own child;
  elsewhere, or with `ASYNCRL_ZYGOTE=0`, a child is a fresh interpreter (`python -m common.actor_host`).
- Lifetime: a child exits when the driver does (it watches its parent pid: a SIGKILLed driver leaves no actor
  behind); `shutdown` ends them all (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import math
import os
import pickle
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from common.actors import ActorDiedError, ActorTaskError, ActorTimeoutError

POLL_S = 0.1
"""How often a receiver thread checks its actor's process when no result comes (the latency of death detection)."""
STOP_GRACE_S = 3.0
_done = threading.Condition()  # notified whenever any ref is done (`wait`)
_actors: list[LocalActor] = []
_dir: dict[str, str] = {}
_ids = itertools.count()


class LocalRef:
    """The result of one call to a local actor, done once its value or error is set."""

    __slots__ = ("_ready", "_value", "_error", "label")

    def __init__(self, label: str) -> None:
        self._ready = False
        self._value: Any = None
        self._error: BaseException | None = None
        self.label = label

    def done(self) -> bool:
        return self._ready

    def _finish(self, value: Any = None, error: BaseException | None = None) -> None:
        with _done:
            if self._ready:
                return
            self._value, self._error, self._ready = value, error, True
            _done.notify_all()

    def _result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value

    def __repr__(self) -> str:
        return f"LocalRef({self.label}, {'done' if self._ready else 'pending'})"


def wait(refs: list[LocalRef], num_returns: int = 1, timeout: float | None = None) -> tuple[list, list]:
    """(ready, not ready), in the order of `refs`, once `num_returns` are done or after `timeout` seconds."""
    if num_returns > len(refs):
        raise ValueError(f"num_returns={num_returns} is more than the {len(refs)} refs given")
    deadline = None if timeout is None else time.monotonic() + timeout
    with _done:
        while sum(ref._ready for ref in refs) < num_returns:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            _done.wait(left)
        ready = [ref for ref in refs if ref._ready][:num_returns]
    chosen = {id(ref) for ref in ready}
    return ready, [ref for ref in refs if id(ref) not in chosen]


def get(refs: LocalRef | list[LocalRef], timeout: float | None = None) -> Any:
    """The value (or values) of `refs`, raising the first error; ActorTimeoutError after `timeout` seconds."""
    many = isinstance(refs, list)
    items = refs if many else [refs]
    ready, _ = wait(items, len(items), timeout)
    if len(ready) < len(items):
        raise ActorTimeoutError(f"{len(items) - len(ready)} of {len(items)} calls not done after {timeout} s")
    values = [ref._result() for ref in items]
    return values if many else values[0]


SOCKET_PATH_MAX = 107
"""The longest path an ipc:// socket can have on Linux (`sizeof(sockaddr_un.sun_path)` less its terminating NUL)."""
_SOCKET_NAME_ROOM = len("/asyncrl-actors-12345678/99999-results")
"""What `_runtime_dir` and `LocalActor` add to the base directory, with room for 99,999 actors."""


def _socket_base() -> str:
    """Where the socket directory goes: the system's temporary directory ($TMPDIR), unless its path is too long for
    socket paths (per-job scratch directories on clusters), then /tmp, /dev/shm or /var/tmp, whichever works."""
    for base in (tempfile.gettempdir(), "/tmp", "/dev/shm", "/var/tmp"):
        if len(base) + _SOCKET_NAME_ROOM <= SOCKET_PATH_MAX and os.path.isdir(base) and os.access(base, os.W_OK):
            return base
    raise OSError(
        f"no directory for the local actors' sockets: $TMPDIR ({tempfile.gettempdir()}) is longer than "
        f"{SOCKET_PATH_MAX - _SOCKET_NAME_ROOM} characters and /tmp, /dev/shm, /var/tmp are not writable"
    )


ACTORS_DIR_PREFIX = "asyncrl-actors-"
"""The socket directory's name: this prefix, the driver's pid, a random part."""


def _runtime_dir() -> str:
    """This process's private socket directory (mode 0700), removed at exit; first removes those of drivers killed
    before they could (SIGKILL: no atexit)."""
    if "path" not in _dir:
        from pathlib import Path

        from common.processes import sweep_dead_owner_dirs

        base = _socket_base()
        sweep_dead_owner_dirs(Path(base), ACTORS_DIR_PREFIX)
        _dir["path"] = tempfile.mkdtemp(prefix=f"{ACTORS_DIR_PREFIX}{os.getpid()}-", dir=base)
        atexit.register(shutil.rmtree, _dir["path"], ignore_errors=True)
        atexit.register(shutdown)
    return _dir["path"]


class LocalActorClass:
    """`common.actors.remote(cls, **options)` under the local launcher."""

    def __init__(self, cls: type, options: dict[str, Any]) -> None:
        if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
            raise TypeError(f"a local actor's class must be importable by name: {cls.__qualname__} is not")
        unknown = set(options) - {"num_cpus", "num_gpus", "max_concurrency", "resources"}
        if unknown:
            raise TypeError(
                f"local actors take num_cpus, num_gpus, max_concurrency and resources, not {sorted(unknown)}"
            )
        if options.get("resources"):
            raise ValueError(f"custom resources {options['resources']} need a Ray cluster: set `ray.launcher=ray`")
        self.cls, self.options = cls, options

    def remote(self, *args: Any, **kwargs: Any) -> LocalActor:
        return LocalActor(self.cls, self.options, args, kwargs)


class _Method:
    __slots__ = ("actor", "name")

    def __init__(self, actor: LocalActor, name: str) -> None:
        self.actor, self.name = actor, name

    def remote(self, *args: Any, **kwargs: Any) -> LocalRef:
        return self.actor._call(self.name, args, kwargs)


class LocalActor:
    """A handle on one local actor: `handle.method.remote(...)` returns a LocalRef (see the module docstring)."""

    def __init__(self, cls: type, options: dict[str, Any], args: tuple, kwargs: dict[str, Any]) -> None:
        import zmq

        self._class_name = cls.__name__
        self._token = secrets.token_bytes(32)
        self._pending: dict[int, tuple[LocalRef, str]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._dead: ActorDiedError | None = None
        self._killed = False
        self._init_error = ""
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        base = os.path.join(_runtime_dir(), str(next(_ids)))
        self._context = zmq.Context.instance()
        self._calls = self._context.socket(zmq.PUSH)
        self._results = self._context.socket(zmq.PULL)
        for sock in (self._calls, self._results):
            sock.setsockopt(zmq.LINGER, 0)
        self._calls.bind(f"ipc://{base}-calls")
        self._results.bind(f"ipc://{base}-results")
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(max(math.floor(float(options.get("num_cpus", 1))), 1)))  # as Ray does
        env["PYTHONUNBUFFERED"] = "1"  # its lines reach the driver as they are printed
        spec = {
            "module": cls.__module__, "qualname": cls.__qualname__, "calls": f"ipc://{base}-calls",
            "results": f"ipc://{base}-results", "token": self._token.hex(), "parent_pid": os.getpid(),
            "max_concurrency": int(options.get("max_concurrency", 1)), "sys_path": sys.path,
        }  # fmt: skip
        from common import zygote

        argv = [sys.executable, "-m", "common.actor_host", f"actor:{self._class_name}"]
        self._proc: subprocess.Popen | zygote.ForkedProcess | None = zygote.spawn(env, " ".join(argv))  # warm imports
        if self._proc is None:
            self._proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                process_group=0,  # a process group of its own in the driver's session, as the zygote's actors have
            )  # fmt: skip
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(spec).encode())
        self._proc.stdin.close()
        self._pid = self._proc.pid
        for stream, out in ((self._proc.stdout, sys.stdout), (self._proc.stderr, sys.stderr)):
            threading.Thread(target=_forward, args=(stream, out, f"({self._class_name} pid={self._pid}) "),
                             name=f"{self._class_name}-{self._pid}-log", daemon=True).start()  # fmt: skip
        _actors.append(self)
        self._call("__init__", args, kwargs)
        threading.Thread(target=self._send_loop, name=f"{self._class_name}-{self._pid}-send", daemon=True).start()
        threading.Thread(target=self._receive_loop, name=f"{self._class_name}-{self._pid}-recv", daemon=True).start()

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)

    def __repr__(self) -> str:
        return f"LocalActor({self._class_name}, pid={self._pid})"

    def _call(self, method: str, args: tuple, kwargs: dict[str, Any]) -> LocalRef:
        ref = LocalRef(f"{self._class_name}.{method}")
        with self._lock:
            if self._dead is not None:
                ref._finish(error=self._dead)
                return ref
            call_id = 0 if method == "__init__" else next(self._ids)
            self._pending[call_id] = (ref, method)
        self._outbox.put((call_id, method, args, kwargs))
        return ref

    def _send_loop(self) -> None:
        while True:
            call_id, method, args, kwargs = self._outbox.get()
            if call_id < 0:
                self._calls.close()
                return
            try:  # a ref among the arguments is waited for here, not by the caller (Ray does the same)
                args = tuple(_resolved(a) for a in args)
                kwargs = {key: _resolved(value) for key, value in kwargs.items()}
                payload = pickle.dumps((call_id, method, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
            except BaseException as err:  # a failed argument fails this call, as in Ray
                self._finish(call_id, error=err)
                continue
            if self._dead is not None:
                continue
            try:
                self._calls.send_multipart([self._token, payload])
            except Exception as err:  # the socket closed by shutdown
                self._finish(call_id, error=ActorDiedError(f"{self._class_name}: {err}", self._class_name, self._pid))

    def _finish(self, call_id: int, value: Any = None, error: BaseException | None = None) -> None:
        with self._lock:
            entry = self._pending.pop(call_id, None)
        if entry is not None:
            entry[0]._finish(value, error)

    def _receive_loop(self) -> None:
        import hmac

        while self._dead is None:
            if self._results.poll(int(POLL_S * 1000)):
                frames = self._results.recv_multipart()
                if len(frames) == 2 and hmac.compare_digest(frames[0], self._token):
                    self._deliver(pickle.loads(frames[1]))
                continue
            if self._proc.poll() is not None:
                while self._results.poll(50):  # results sent just before the exit (a constructor's error)
                    frames = self._results.recv_multipart()
                    if len(frames) == 2 and hmac.compare_digest(frames[0], self._token):
                        self._deliver(pickle.loads(frames[1]))
                self._mark_dead(self._exit_detail())
        self._results.close()
        self._outbox.put((-1, "", (), {}))

    def _deliver(self, message: tuple) -> None:
        call_id, ok, payload = message
        with self._lock:
            method = self._pending.get(call_id, (None, ""))[1]
        if ok:
            self._finish(call_id, value=payload)
            return
        type_name, text, cause_bytes = payload
        if call_id == 0:  # the constructor raised: the process exits, and that is this actor's death
            last = _last_line(text)  # a traceback's last line names its type already (module-qualified, or not)
            named = last.partition(":")[0].rpartition(".")[2] == type_name
            error = f"{type_name}:{last.partition(':')[2]}" if named else f"{type_name}: {last}"
            self._init_error = f"its constructor raised {error}"
        try:
            cause = pickle.loads(cause_bytes) if cause_bytes else None
        except Exception:
            cause = None
        if not isinstance(cause, BaseException):
            cause = RuntimeError(f"{type_name}: {_last_line(text)}")
        name = f"{self._class_name}.{method}"
        error = ActorTaskError(f"{name} (pid {self._pid}) raised {type_name}:\n{text}", cause, name, self._pid)
        self._finish(call_id, error=error)

    def _exit_detail(self) -> str:
        if self._init_error:
            return self._init_error
        if self._killed:
            return "killed by the driver (SIGKILL)"
        code = self._proc.returncode
        if code is not None and code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"the process ended with exit code {code}"

    def _mark_dead(self, detail: str) -> None:
        error = ActorDiedError(
            f"The actor died unexpectedly. class_name: {self._class_name}, pid={self._pid}, exit detail: {detail}.",
            self._class_name, self._pid, actor_init_failed=bool(self._init_error),
        )  # fmt: skip
        with self._lock:
            if self._dead is not None:
                return
            self._dead = error
            pending, self._pending = self._pending, {}
        if self in _actors:  # a restarted run keeps no handle of its dead actors
            _actors.remove(self)
        for ref, _ in pending.values():
            ref._finish(error=error)

    def _alive(self) -> bool:
        return self._dead is None and self._proc.poll() is None

    def _kill(self) -> None:
        """SIGKILL the process and fail its calls at once (`common.actors.kill`)."""
        if self._proc.poll() is None:
            self._killed = True
            self._proc.kill()
        self._proc.wait()
        self._end_group()
        self._mark_dead(self._exit_detail())

    def _stop(self, deadline: float) -> None:
        """SIGKILL if it has not exited by `deadline` (after the SIGTERM of `shutdown`)."""
        try:
            self._proc.wait(max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._end_group()
        self._mark_dead("stopped by the driver as the run ended")

    def _end_group(self) -> None:
        """SIGKILL what is left of the actor's process group once the actor is gone: processes its code started
        (an environment's sandbox, a `subprocess` a reward or tool left running) would otherwise outlive the run,
        reparented to init. The group's id is the actor's pid, which Linux does not reuse while the group exists."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._pid, signal.SIGKILL)


def _resolved(value: Any) -> Any:
    return get(value) if isinstance(value, LocalRef) else value


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else ""


def _forward(stream: Any, out: Any, prefix: str) -> None:
    """Copy a child's output lines to the driver's stream with the actor's prefix, until the child closes it."""
    for raw in iter(stream.readline, b""):
        try:
            out.write(prefix + raw.decode(errors="replace"))
            out.flush()
        except (OSError, ValueError):  # the driver's stream closed at exit
            return
    stream.close()


def shutdown() -> None:
    """End every local actor of this process: SIGTERM, then SIGKILL to those still there after `STOP_GRACE_S`; the
    driver calls it as a run ends."""
    stopping, _actors[:] = list(_actors), []
    for actor in stopping:
        if actor._proc.poll() is None:
            actor._proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for actor in stopping:
        actor._stop(deadline)
