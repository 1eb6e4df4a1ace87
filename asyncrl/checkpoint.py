"""Resumable checkpoints of a run: runs/<name>/checkpoints/step_<k>/, written atomically, the last N kept.

    step_<k>/                 k = train steps completed = the weight version the learner publishes next
      model/                  Hugging Face model directory (AutoModelForCausalLM / AutoTokenizer load it)
      training_state.pt       optimizer, LR schedule, loss scaler, ACRL reference, RNG states (learner/trainer.py)
      meta.json               {"step": k, "version": k, "buffer": cursor and counters, "live": {key: value}, ...}

Atomic: everything is written into `.step_<k>.tmp`, fsynced, then renamed to `step_<k>`; a directory named
`step_<k>` is therefore complete, and leftovers of a crash (`.*.tmp`) are ignored and removed by the next save. Old
checkpoints are deleted likewise: renamed to `.step_<k>.del.tmp`, then removed.

The buffer is not copied: its journal (runs/<name>/buffer.journal) already records every lease, admission and
consumption. On resume the buffer replays it and rewinds to the checkpoint's step (buffer/recovery.py `rewind`): groups
consumed after the checkpoint go back to the queue, groups generated with the lost versions are dropped.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.fsutil import fsync_dir, fsync_tree

CHECKPOINTS = "checkpoints"
META = "meta.json"
_STEP_DIR = re.compile(r"step_(\d+)")


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """The complete checkpoints of a run, oldest first."""
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.fullmatch(p.name))]
    return [p for _, p in sorted(found) if (p / META).is_file()]


def latest(run_dir: Path) -> Path | None:
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1] if dirs else None


def newest_run(base: Path) -> Path | None:
    """The newest run directory of a config whose runs are `base`, `base-2`, `base-3`, ... (`driver.new_run_dir`):
    the one with the highest number that holds a config.json, or None."""
    runs = [(1, base)] if (base / "config.json").is_file() else []
    if base.parent.is_dir():
        for path in base.parent.glob(f"{base.name}-*"):
            suffix = path.name[len(base.name) + 1 :]
            if suffix.isascii() and suffix.isdigit() and (path / "config.json").is_file():
                runs.append((int(suffix), path))
    return max(runs)[1] if runs else None


def read_meta(checkpoint_dir: Path) -> dict[str, Any]:
    return json.loads((checkpoint_dir / META).read_text())


def save(run_dir: Path, step: int, write: Callable[[str], Any], meta: dict[str, Any], keep_last: int) -> Path:
    """Write checkpoint `step_<step>` with `write(tmp_dir)` (the learner's files) plus meta.json, atomically;
    then delete all but the newest `keep_last` checkpoints. Returns the checkpoint directory."""
    root = run_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    target = root / f"step_{step}"
    staging = root / f".step_{step}.tmp"
    staging.mkdir()
    write(str(staging))
    (staging / META).write_text(json.dumps({"step": step, **meta}, indent=2, default=str))
    fsync_tree(staging)
    replaced = root / f".step_{step}.old.tmp"
    if replaced.exists():  # left by a crash during an earlier resave: in the way of the rename below
        shutil.rmtree(replaced, ignore_errors=True)
    if target.exists():  # the same step saved again (`down` right after a periodic save): moved aside, not deleted
        target.rename(replaced)  # in place, so that a crash never leaves a half-deleted step_<k> as the latest
    staging.rename(target)
    fsync_dir(root)
    shutil.rmtree(replaced, ignore_errors=True)
    kept = checkpoint_dirs(run_dir)[-keep_last:]
    for old in root.iterdir():  # older checkpoints, and a step_<k> a kill left half deleted (no meta.json)
        if _STEP_DIR.fullmatch(old.name) and old not in kept:
            _delete(old)
    return target


def _delete(directory: Path) -> None:
    """Renamed out of the `step_<k>` names first (atomic), then deleted: a kill partway through the deletion leaves
    a `.*.tmp`, which the next save removes, never a half-deleted `step_<k>` that no listing shows and none prunes."""
    doomed = directory.with_name(f".{directory.name}.del.tmp")
    try:
        directory.rename(doomed)
    except OSError:
        doomed = directory
    shutil.rmtree(doomed, ignore_errors=True)
