"""Filesystem helpers every process shares: making files and directory entries durable.

Used by the buffer's journal and by checkpoints (`asyncrl/checkpoint.py`).
"""

from __future__ import annotations

import os
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
