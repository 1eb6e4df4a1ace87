"""The child's side of a local actor (`common.local_actors`): `python -m common.actor_host actor:<Class>`.

It reads its spec (class, socket addresses, token, parent pid, `max_concurrency`, the driver's `sys.path`) as JSON on
stdin, connects to the driver's two sockets, builds the object from the first call (`__init__`), then runs each call
and sends back its value or its error. With `max_concurrency` 1 the calls run one after another on the main thread,
in order (a Ray actor); with more, on that many threads (a threaded Ray actor). A constructor that raises ends the
process (exit code 1) after sending its error: the actor is dead, as in Ray. The process exits as soon as its parent
(the driver) is gone, and ignores SIGINT (a terminal's Ctrl-C is the driver's to handle) and a SIGTERM that does not
come from the driver: `kill -TERM -PGID`, `timeout`, Slurm's scancel and systemd's stop signal the whole process group,
and the driver's graceful stop (the step finishes, workers stop, a checkpoint) needs its actors alive; the driver's
own SIGTERM (`local_actors.shutdown`) ends the process as before (SIGTERM is blocked in every thread and taken by one
that `sigwaitinfo`s it and reads its sender). Messages are pickled: both
ends are this package's code, started by the same driver; a message without the actor's token is dropped unread.
"""

from __future__ import annotations

import contextlib
import hmac
import importlib
import json
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

PARENT_POLL_S = 0.5
ORPHAN_HOOKS_S = 5.0
"""The most an orphaned actor spends on its `at_orphaned` hooks before it exits regardless."""
_orphan_hooks: list[Callable[[], object]] = []


def at_orphaned(hook: Callable[[], object]) -> None:
    """Run `hook` before this process exits because its driver is gone (a killed driver never stops its actors):
    what only the process itself can undo, such as a weight publisher's /dev/shm files. A hook must be quick and
    safe to run from another thread; its errors are ignored."""
    _orphan_hooks.append(hook)


def _watch_parent(parent_pid: int) -> None:
    """Exit at once when the driver is gone (its pid is no longer our parent): no actor outlives its run."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    deadline = threading.Timer(ORPHAN_HOOKS_S, os._exit, args=(1,))
    deadline.daemon = True
    deadline.start()
    for hook in list(_orphan_hooks):
        with contextlib.suppress(Exception):
            hook()
    os._exit(1)


def _error_payload(err: BaseException) -> tuple[str, str, bytes | None]:
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    try:
        cause = pickle.dumps(err, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(cause)  # an exception that pickles but cannot be rebuilt would fail on the driver's side
    except Exception:
        cause = None
    return type(err).__name__, text, cause


class _Host:
    def __init__(self, spec: dict[str, Any]) -> None:
        import zmq

        self.token = bytes.fromhex(spec["token"])
        context = zmq.Context.instance()
        self.calls = context.socket(zmq.PULL)
        self.calls.connect(spec["calls"])
        self.results = context.socket(zmq.PUSH)
        self.results.setsockopt(zmq.LINGER, 10_000)  # the last result of an exiting process is still delivered
        self.results.connect(spec["results"])
        self.send_lock = threading.Lock()
        self.cls = getattr(importlib.import_module(spec["module"]), spec["qualname"])
        self.instance: Any = None

    def receive(self) -> tuple[int, str, tuple, dict[str, Any]]:
        while True:
            frames = self.calls.recv_multipart()
            if len(frames) == 2 and hmac.compare_digest(frames[0], self.token):
                return pickle.loads(frames[1])

    def send(self, call_id: int, ok: bool, payload: Any) -> None:
        try:
            message = pickle.dumps((call_id, ok, payload), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # a return value that cannot be pickled is this call's error
            message = pickle.dumps((call_id, False, _error_payload(err)), protocol=pickle.HIGHEST_PROTOCOL)
        with self.send_lock:
            self.results.send_multipart([self.token, message])

    def run(self, call_id: int, method: str, args: tuple, kwargs: dict[str, Any]) -> None:
        try:
            value = getattr(self.instance, method)(*args, **kwargs)
        except BaseException as err:  # the driver gets it as this call's error; the actor goes on, as in Ray
            self.send(call_id, False, _error_payload(err))
            return
        self.send(call_id, True, value)

    def serve(self, max_concurrency: int) -> int:
        call_id, method, args, kwargs = self.receive()
        if method != "__init__":
            raise RuntimeError(f"the first call to a local actor must build it, got {method!r}")
        try:
            self.instance = self.cls(*args, **kwargs)
        except BaseException as err:
            self.send(call_id, False, _error_payload(err))
            return 1
        self.send(call_id, True, None)
        if max_concurrency <= 1:
            while True:
                self.run(*self.receive())
        with ThreadPoolExecutor(max_concurrency, thread_name_prefix="actor-call") as pool:
            while True:
                pool.submit(self.run, *self.receive())


def _sigterm_from(driver_pid: int) -> None:
    """Take SIGTERM in a thread of its own: the driver's ends the process (SIGTERM's default action), anyone else's
    is left to the driver, which got it too (a signal to the process group)."""
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid == driver_pid:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # this thread takes the one sent next
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)  # the default action ends the process meanwhile


def main() -> int:
    # Ctrl-C on a terminal signals the whole process group: the driver's first one stops the run gracefully (the
    # step finishes, workers stop, a checkpoint), which needs its actors alive; they end with the driver.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a fork of the zygote inherits its SIG_IGN
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # before any thread: every later one inherits it
    spec = json.loads(sys.stdin.buffer.read())
    threading.Thread(target=_sigterm_from, args=(spec["parent_pid"],), name="sigterm", daemon=True).start()
    threading.Thread(target=_watch_parent, args=(spec["parent_pid"],), name="parent-watch", daemon=True).start()
    for path in reversed(spec["sys_path"]):  # the driver's import path: the same classes import here
        if path not in sys.path:
            sys.path.insert(0, path)
    host = _Host(spec)
    code = host.serve(int(spec["max_concurrency"]))
    host.results.close()  # lingers until the constructor's error is delivered
    return code


if __name__ == "__main__":
    sys.exit(main())
