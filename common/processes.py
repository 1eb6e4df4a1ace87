"""Whether a process still runs, asked by pid: `asyncrl down` waiting on its driver, `asyncrl serve --parent-pid`."""

from __future__ import annotations

import os
from pathlib import Path


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


def sweep_dead_owner_dirs(directory: Path, prefix: str) -> list[Path]:
    """Remove this user's directories `<prefix><pid>-*` in `directory` whose process `pid` is gone (one killed by
    SIGKILL cannot remove its own); returns them."""
    import shutil

    removed = []
    for path in directory.glob(f"{prefix}*-*"):
        pid = path.name.removeprefix(prefix).partition("-")[0]
        try:
            ours = path.is_dir() and not path.is_symlink() and path.stat().st_uid == os.getuid()
        except OSError:
            continue
        if ours and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
