"""Names inside a run directory that more than one process reads: the checkpoints' folder and its `step_<k>` names.

The learner's side writes them (asyncrl/checkpoint.py); the buffer reads which steps a resume could start from, so
that a journal compaction keeps the groups such a resume would train again (buffer/recovery.py `keep_from`).
"""

from __future__ import annotations

import re
from pathlib import Path

CHECKPOINTS = "checkpoints"
"""The run directory's folder of resumable checkpoints."""
STEP_DIR = re.compile(r"step_(\d+)")
"""A checkpoint's folder name: `step_<k>`, k = train steps completed = the next step a resume from it trains."""


def checkpoint_steps(run_dir: Path) -> list[int]:
    """The k of every `checkpoints/step_<k>` folder of `run_dir`, ascending; whole or not (a resume passes over a
    damaged one to an older one, so a caller deciding what a resume could need must count it)."""
    root = run_dir / CHECKPOINTS
    try:
        names = [entry.name for entry in root.iterdir()]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(m.group(1)) for name in names if (m := STEP_DIR.fullmatch(name)))
