"""`asyncrl up configs/arith_tool.yaml`, a few steps: multi-turn calculator episodes run end to end on the built-in
tool model (`builtin:micro-tool`), the episode metrics reach metrics.jsonl, and observation tokens are masked out of
the learner's loss and mismatch metrics (their behaviour log-prob 0.0 would otherwise blow the mismatch up)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_up_arith_tool_logs_episode_metrics_and_masks_observations(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "up", str(ROOT / "configs" / "arith_tool.yaml"),
         f"logging.dir={tmp_path}", "logging.name=tool", "train.steps=3", "train.groups_per_step=8",
         "model.path=builtin:micro-tool"],  # 1 minute to build on 2 cores, against 2-4 for tiny-tool
        capture_output=True, text=True, timeout=600, env=dict(os.environ), cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "tool" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step" in r and "event" not in r]
    assert len(steps) == 3
    for row in steps:
        for key in ("env/turns_mean", "env/tool_calls", "env/masked_share", "env/errors", "env/timeouts"):
            assert key in row, (key, sorted(row))
        assert row["env/errors"] == 0 and row["env/timeouts"] == 0
    measured = [r for r in steps if r["env/episodes"] > 0]
    assert measured
    # the warmed-up model calls the calculator on part of the problems: two turns and observation tokens there
    assert any(1.0 < r["env/turns_mean"] < 3.0 and 0.0 < r["env/tool_calls"] < 1.0 for r in measured)
    assert any(r["env/masked_share"] > 0.0 for r in measured)
    # observation tokens carry behaviour log-prob 0.0: were they scored, the mismatch would be of order 1 per token
    for row in steps:
        kl = row["mismatch/kl_k3"]
        assert kl is not None and math.isfinite(kl) and kl < 0.05, row
