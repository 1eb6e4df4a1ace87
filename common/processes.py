"""Whether a process still runs, asked by pid: `asyncrl down` waiting on its driver, `asyncrl serve --parent-pid`."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs: it exists (another user's counts) and is not a zombie (dead, not yet reaped by its
    parent; read from /proc where there is one)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc (macOS), or it just went
        return True
