"""The built-in model cache: a damaged copy is rebuilt, builds killed midway are cleaned up, others can read it."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from common.builtin_model import BUILT_FILES, resolve_model_path


def test_a_damaged_cached_model_is_rebuilt_and_abandoned_builds_are_removed(tmp_path: Path) -> None:
    built = resolve_model_path("builtin:micro", cache_dir=str(tmp_path), log=lambda *a: None)
    assert all((built / name).is_file() for name in BUILT_FILES)
    assert stat.S_IMODE(built.stat().st_mode) == 0o755  # a shared cache: readable by every user
    (built / "tokenizer.json").unlink()  # a copy cut short, or a file removed by hand
    abandoned = built.parent / ".micro-killedbuild"  # the staging directory of a build killed two hours ago
    abandoned.mkdir()
    os.utime(abandoned, (time.time() - 7200, time.time() - 7200))
    fresh = built.parent / ".micro-inprogress"  # one that another process is writing right now: kept
    fresh.mkdir()
    again = resolve_model_path("builtin:micro", cache_dir=str(tmp_path), log=lambda *a: None)
    assert again == built and all((again / name).is_file() for name in BUILT_FILES)
    assert not abandoned.exists() and fresh.exists()
    assert sorted(p.name for p in built.parent.iterdir()) == sorted([built.name, fresh.name])
