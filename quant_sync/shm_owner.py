"""Who owns a weight publisher's /dev/shm files, and the sweep of the files a dead publisher left behind.

A publisher's files (`<prefix>-v<N>`, `-spare`, `-ring<N>`, `quant_sync.publisher`) live in memory (tmpfs) until
they are unlinked. `WeightPublisher.close` unlinks them, but a learner killed by a signal (SIGKILL, the OOM killer,
a node agent, a test of faults) never closes, and every restart of a run that heals itself (issue 22) left one more
set: up to `keep_versions` + 1 copies of the rollout weights each time (98 MB for the ~100M decode model of
`asyncrl bench e2e`, 7 GB for a 7B model in INT8). On one development machine 664 such files held 5.4 GB of RAM.

Liveness by lock, not by pid: a publisher holds an exclusive `flock` on `<prefix>.lock` for its whole life, and the
kernel drops it when the process ends, however it ends. `sweep_stale` tries each other publisher's lock without
waiting: when it gets it, that owner is gone, and the files of its prefix go. A pid check would be wrong where a
container shares /dev/shm but not the pid namespace (another container's live pid is absent here). A reader that
still maps a swept version keeps its pages (unlinking only drops the name). Files of another user are left (their
lock does not open). Files from before the locks (no `.lock`) are left too: nothing says their owner is gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

SHM_DIR = "/dev/shm"
"""Where publishers put their weight files when it is writable (`quant_sync.publisher`)."""
FILE_PREFIX = "asyncrl-weights-"
"""The first part of every publisher's file names (then `<pid>-<8 hex>`, its prefix)."""
LOCK_SUFFIX = ".lock"
CLAIMING_SUFFIX = ".claiming"
"""The lock file's name while its owner takes the lock: a sweep never looks at it, so it cannot take a new lock
before its owner does (the locked file then gets its `.lock` name by a hard link, which never replaces one)."""


class ShmOwner:
    """This process's claim on the files `<shm_dir>/<prefix>-*`: an exclusive lock held until `release`."""

    def __init__(self, shm_dir: str, prefix: str) -> None:
        self.lock_path = os.path.join(shm_dir, prefix + LOCK_SUFFIX)
        claiming = os.path.join(shm_dir, prefix + CLAIMING_SUFFIX)
        self._fd: int | None = os.open(claiming, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.link(claiming, self.lock_path)  # never replaces: a prefix already claimed raises FileExistsError
            os.unlink(claiming)
        except OSError:
            os.close(self._fd)
            self._fd = None
            with contextlib.suppress(OSError):
                os.unlink(claiming)
            raise

    def remove_files(self) -> None:
        """Unlink every file of this prefix, then release: what a sweep would do once this process has ended, done
        by the process itself as it ends without closing (`common.actor_host.at_orphaned`)."""
        if self._fd is None:
            return
        shm_dir, name = os.path.split(self.lock_path)
        prefix = name[: -len(LOCK_SUFFIX)] + "-"
        with contextlib.suppress(OSError):
            for entry in os.listdir(shm_dir):
                if entry.startswith(prefix):
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(shm_dir, entry))
        self.release()

    def release(self) -> None:
        """Drop the lock file and the lock (after the owner unlinked its files)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.lock_path)
        os.close(self._fd)
        self._fd = None


def sweep_stale(shm_dir: str, keep_prefix: str = "") -> list[str]:
    """Unlink the files of every publisher in `shm_dir` whose process has ended (its lock is free), except
    `keep_prefix`'s; returns the prefixes swept."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    locks = [name for name in names if name.startswith(FILE_PREFIX) and name.endswith(LOCK_SUFFIX)]
    prefixes = [name[: -len(LOCK_SUFFIX)] for name in locks]
    swept = []
    for prefix in prefixes:
        if prefix != keep_prefix and _sweep_if_dead(shm_dir, prefix, names):
            swept.append(prefix)
    return swept


def _sweep_if_dead(shm_dir: str, prefix: str, names: list[str]) -> bool:
    lock_path = os.path.join(shm_dir, prefix + LOCK_SUFFIX)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:  # gone since the listing, or another user's
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its publisher is alive
            return False
        for name in names:
            if name.startswith(prefix + "-"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(shm_dir, name))
        with contextlib.suppress(OSError):
            os.unlink(lock_path)
        return True
    finally:
        os.close(fd)
