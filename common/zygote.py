"""A fork server for local actors: torch and transformers are imported once, and every actor process is forked from
that warm process instead of starting a fresh interpreter (`ray.launcher=local`, `common.local_actors`).

A fresh actor process spends about 2 CPU-seconds importing torch and transformers before it does anything; a run
starts a learner and two rollout workers at once, which is 6 CPU-seconds of a 2-core machine's start-up spent on the
same imports three times. The zygote (`python -m common.zygote`, started as `asyncrl up` begins, before it reads its
config: `asyncrl.startup.start_fork_server_early`) imports them once, then forks each actor from itself:

    driver --request (env, 3 pipe fds over a Unix socket)--> zygote --fork--> intermediate --fork--> actor
    driver <--actor pid-------------------------------------- zygote (after the intermediate has exited)

The intermediate exits at once, so the actor is orphaned and the kernel reparents it to the driver, which made itself
a child subreaper (`prctl(PR_SET_CHILD_SUBREAPER)`): the driver waits for it and reads its exit status (a signal
included) as for a child it started itself (`ForkedProcess`, the subset of `subprocess.Popen` the local launcher
uses). The actor's stdin, stdout and stderr are the driver's pipes (sent as file descriptors); its environment is
the one the driver gave, and its torch threads follow that environment's `OMP_NUM_THREADS` as a fresh process's
would (`import torch` sized the zygote's OpenMP pool from the zygote's own, 1: one thread, so the fork copies no
running pool; the actor sets its count before its code runs); its command line is that of a fresh actor process
(`setproctitle`: `ps` and the start-up's CPU accounting tell the learner from a worker by it); from there it runs
`common.actor_host` as a fresh process would.

The zygote runs one thread and no torch op (forking a process with other threads running, or an OpenMP pool of
several threads, is not safe), exits when the driver is gone, and is used only on Linux; anywhere it cannot start
(or with `ASYNCRL_ZYGOTE=0`) actors start as fresh interpreters, as before.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Any

PRELOAD = (
    "torch", "transformers", "transformers.models.llama.modeling_llama", "common.actor_host", "learner.trainer",
    "rollout_workers.worker", "rollout_workers.embedded.engine", "buffer.client", "quant_sync.transport",
)  # fmt: skip
"""Modules the zygote imports before it forks anything (one that fails to import is skipped: the actor imports it)."""
DISABLE_ENV = "ASYNCRL_ZYGOTE"
"""`ASYNCRL_ZYGOTE=0` starts every local actor as a fresh interpreter."""
PR_SET_CHILD_SUBREAPER = 36
PARENT_POLL_S = 0.5
MESSAGE_BYTES = 1 << 20
START_TIMEOUT_S = 60.0
"""How long the driver waits for the zygote's imports (a loaded machine) before it starts actors without it."""


class ForkedProcess:
    """A process the zygote forked and the kernel reparented to this one: `subprocess.Popen`'s pid, stdin, stdout,
    stderr, poll, wait, kill, terminate and returncode."""

    def __init__(self, pid: int, stdin: IO[bytes], stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self.pid, self.stdin, self.stdout, self.stderr = pid, stdin, stdout, stderr
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere: its status is lost
                    self.returncode = -signal.SIGKILL
                    return self.returncode
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    """The driver's handle on its zygote process (module docstring)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket = ours
        self._lock = threading.Lock()
        args = [sys.executable, "-m", "common.zygote", str(theirs.fileno()), json.dumps(sys.path)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # torch's import-time pool: one thread, none to copy at a fork
        self.process = subprocess.Popen(args, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self._ready = False

    def spawn(self, env: dict[str, str], title: str) -> ForkedProcess:
        """Fork an actor process (`python -m common.actor_host` as it would start) with `env` and `title` as its
        command line (what `ps` and `asyncrl.startup` read); its stdin, stdout and stderr are new pipes, as
        `subprocess.Popen(..., stdin=PIPE, stdout=PIPE, stderr=PIPE)` gives."""
        pipes = [os.pipe() for _ in range(3)]
        child_ends = [pipes[0][0], pipes[1][1], pipes[2][1]]
        try:
            with self._lock:
                if not self._ready:
                    self._wait_ready()
                socket.send_fds(self._socket, [json.dumps({"env": env, "title": title}).encode()], child_ends)
                pid = int(self._recv_line())
        except BaseException:
            for read_end, write_end in pipes:
                os.close(read_end)
                os.close(write_end)
            raise
        for fd in child_ends:
            os.close(fd)
        stdin, stdout, stderr = os.fdopen(pipes[0][1], "wb"), os.fdopen(pipes[1][0], "rb"), os.fdopen(pipes[2][0], "rb")
        return ForkedProcess(pid, stdin, stdout, stderr)

    def _wait_ready(self) -> None:
        self._socket.settimeout(START_TIMEOUT_S)
        if self._recv_line() != "ready":
            raise RuntimeError("the zygote did not start")
        self._socket.settimeout(None)
        self._ready = True

    def _recv_line(self) -> str:
        data = b""
        while not data.endswith(b"\n"):
            chunk = self._socket.recv(64)
            if not chunk:
                raise RuntimeError("the zygote exited")
            data += chunk
        return data.decode().strip()

    def close(self) -> None:
        self._socket.close()
        with contextlib.suppress(OSError):
            self.process.kill()
        self.process.wait()


_zygote: Zygote | None = None
_failed = False
_start_lock = threading.Lock()


def start() -> Zygote | None:
    """Start this process's zygote (once) and make this process a child subreaper; None where it cannot run here."""
    global _zygote, _failed
    with _start_lock:
        if _zygote is not None or _failed:
            return _zygote
        if os.environ.get(DISABLE_ENV, "1") == "0" or not sys.platform.startswith("linux"):
            _failed = True
            return None
        try:
            _child_subreaper(True)
            _zygote = Zygote()
            atexit.register(_zygote.close)  # no process of the run outlives `asyncrl up` (it held the output pipes)
        except Exception as err:  # the actors start as fresh interpreters
            print(f"asyncrl: no zygote ({err}); local actors start as fresh processes", file=sys.stderr)
            _failed = True
        return _zygote


def discard() -> None:
    """End this process's zygote, started before the launcher was known (`asyncrl up` starts it early), for a run
    whose actors start under Ray: no fork server left importing, and this process no longer a child subreaper (the
    orphans of Ray's processes go to init, which reaps them)."""
    global _zygote, _failed
    with _start_lock:
        if _zygote is None:
            return
        atexit.unregister(_zygote.close)
        _zygote.close()
        _zygote, _failed = None, False
        with contextlib.suppress(OSError):
            _child_subreaper(False)


def _child_subreaper(on: bool) -> None:
    """Make this process a child subreaper (orphans of its descendants become its children), or stop being one."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def spawn(env: dict[str, str], title: str) -> ForkedProcess | None:
    """An actor process forked by the zygote (`title`: its command line), or None (start it as a fresh interpreter)
    where there is none."""
    zygote = start()
    if zygote is None:
        return None
    try:
        return zygote.spawn(env, title)
    except (OSError, RuntimeError) as err:
        global _failed
        print(f"asyncrl: the zygote failed ({err}); local actors start as fresh processes", file=sys.stderr)
        _failed = True
        return None


def _preload(sys_path: list[str]) -> None:
    import importlib

    for path in reversed(sys_path):
        if path not in sys.path:
            sys.path.insert(0, path)
    for name in PRELOAD:
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def _fork_actor(server: socket.socket, env: dict[str, str], title: str, fds: list[int]) -> int:
    """Fork the actor (through an intermediate that exits at once); its pid. Returns only in the zygote."""
    report_read, report_write = os.pipe()
    intermediate = os.fork()
    if intermediate == 0:
        os.close(report_read)
        # its pid read here, before the fork: an actor that asked for its parent's pid after the intermediate had
        # exited got the driver's, and waited out its whole adoption deadline (5 s) for an adoption already done
        intermediate_pid = os.getpid()
        actor = os.fork()
        if actor == 0:
            os.close(report_write)
            _become_actor(server, env, title, fds, intermediate_pid)
        os.write(report_write, f"{actor}\n".encode())
        os._exit(0)
    os.close(report_write)
    with os.fdopen(report_read, "rb") as report:
        line = report.readline()
    os.waitpid(intermediate, 0)  # the actor is the driver's now (the intermediate is gone)
    for fd in fds:
        os.close(fd)
    return int(line)


def _become_actor(server: socket.socket, env: dict[str, str], title: str, fds: list[int], intermediate: int) -> None:
    """In the forked actor: its pipes as stdio, its environment and command line, then `common.actor_host` (never
    returns)."""
    server.close()
    # a process group of its own (what it starts, an environment's sandbox, ends with it: local_actors), in the
    # driver's session: a session of its own would be a scheduler autogroup of its own, where SCHED_IDLE workers
    # take an equal share of the cores from the learner (the INT8 decode bench's learner step went 14 s -> 19 s)
    os.setpgid(0, 0)
    import setproctitle

    setproctitle.setproctitle(title)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = os.fdopen(0, "r", closefd=False)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:  # as a fresh process sizes its pool
        sys.modules["torch"].set_num_threads(int(threads))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    deadline = time.monotonic() + 5.0
    while os.getppid() == intermediate and time.monotonic() < deadline:  # until the driver has adopted it
        time.sleep(0.001)
    from common import actor_host

    code = 1
    try:
        code = actor_host.main()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> int:
    args = argv or sys.argv[1:]
    server = socket.socket(fileno=int(args[0]))
    parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the driver's to handle
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # so is a SIGTERM to the process group; the driver ends it by SIGKILL
    _preload(json.loads(args[1]))
    try:
        server.sendall(b"ready\n")
    except OSError:  # the driver is gone (a run that failed while this imported): nothing to serve, nothing to say
        return 0
    while os.getppid() == parent:
        readable, _, _ = select.select([server], [], [], PARENT_POLL_S)
        if not readable:
            continue
        try:
            message, fds, _, _ = socket.recv_fds(server, MESSAGE_BYTES, 3)
        except OSError:
            return 1
        if not message:  # the driver closed its end
            return 0
        request: dict[str, Any] = json.loads(message)
        pid = _fork_actor(server, dict(request["env"]), str(request["title"]), list(fds))
        try:
            server.sendall(f"{pid}\n".encode())
        except OSError:  # the driver went while this forked: no one to tell, nothing more to serve
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
