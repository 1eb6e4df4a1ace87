"""The run lock: one driver per run directory, taken before the driver writes anything there.

`runs/<name>/run.lock` holds an exclusive `flock` for the driver's whole life and its pid as text. The kernel drops
the lock when the driver's process ends, however it ends (SIGKILL included), so a stale file never blocks a resume.
A second `asyncrl up --resume` of a running run is refused at once, naming the holder, before it touches the run's
config, metrics, gate or journal; two new runs of one name started together get different directories
(`driver.new_run_dir`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

LOCK_FILE = "run.lock"


class RunLocked(RuntimeError):
    """Another live process holds the run's lock; `pid` is what its file says (0 if unreadable)."""

    def __init__(self, run_dir: Path, pid: int) -> None:
        holder = f"pid {pid}" if pid else "another process"
        super().__init__(f"{run_dir} is in use by another asyncrl driver ({holder})")
        self.run_dir, self.pid = run_dir, pid


class RunLock:
    """The held lock of `run_dir` (`acquire`); `release` (or the process's end) lets it go."""

    def __init__(self, run_dir: Path, fd: int) -> None:
        self.run_dir, self._fd = run_dir, fd

    def release(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = -1


def acquire(run_dir: Path) -> RunLock:
    """Take `run_dir`'s lock without waiting and write this process's pid into it; RunLocked if a live process holds
    it, OSError if the file cannot be made."""
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _read_pid(fd)
        os.close(fd)
        raise RunLocked(run_dir, pid) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return RunLock(run_dir, fd)


def holder(run_dir: Path) -> int | None:
    """The pid of the live driver holding `run_dir`'s lock (0 if its file does not say), or None when none does."""
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_pid(fd)
    finally:
        os.close(fd)  # a shared lock taken only to look is dropped with the descriptor
    return None


def _read_pid(fd: int) -> int:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return 0
    return int(text) if text.isdigit() else 0
