"""Filesystem helpers every process shares: making files and directory entries durable, and checking that an output
file can be written before the work that fills it.

Used by the buffer's journal, checkpoints (`asyncrl/checkpoint.py`) and the CLI's `--json` outputs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a created, renamed or deleted file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file under `path`, then `path`'s own entries."""
    for root, _, files in os.walk(path):
        for name in files:
            with open(Path(root) / name, "rb") as handle:
                os.fsync(handle.fileno())
    fsync_dir(path)


def output_file_problem(path: str) -> str | None:
    """Why a file could not be written at `path` (after creating its missing parent directories), or None.

    Checked before minutes of work whose result goes there; nothing is created but the parent directories.
    """
    target = Path(path).expanduser()
    if not path.strip():
        return "the path is empty"
    if target.is_dir():
        return f"{path} is a directory"
    existing = next(parent for parent in target.parents if parent.exists())  # "/" or "." at the latest
    if not existing.is_dir():
        return f"{existing} is not a directory"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"cannot create its directory {err.filename or target.parent}: {err.strerror or err}"
    if target.exists() and not os.access(target, os.W_OK):
        return f"{path} is not writable"
    if not target.exists() and not os.access(target.parent, os.W_OK | os.X_OK):
        return f"its directory {target.parent} is not writable"
    return None


def write_failure(write: Callable[[], object]) -> str | None:
    """Run `write` (which writes a file whose path `output_file_problem` passed earlier); the system's reason if it
    failed since (a disk filled, a directory removed), else None."""
    try:
        write()
    except OSError as err:
        return err.strerror or str(err)
    return None
