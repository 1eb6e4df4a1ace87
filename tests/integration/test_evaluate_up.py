"""`asyncrl up` evaluates the held-out prompts through the rollout engine (asyncrl/evaluate.py): greedy accuracy and
`eval.samples` draws at the training temperature, as `eval` events at the right weight versions and in summary.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EVAL_KEYS = ("eval/acc_greedy", "eval/acc_greedy_rollout", "eval/mean@3", "eval/pass@3", "eval/reward_mean@3")


@pytest.mark.slow
def test_eval_every_runs_the_rollout_engine_at_the_steps_version(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "up", str(ROOT / "configs" / "dapo_int8.yaml"), f"logging.dir={tmp_path}",
         "logging.name=ev", "model.path=builtin:tiny", "train.steps=4", "train.eval_every=2", "data.eval_size=24",
         "eval.samples=3", "train.groups_per_step=2", "train.group_size=4", "algo.filter_groups=false",
         "checkpoint.final=false", "logging.console=false"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ), cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "ev" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r.get("event") == "eval"]
    assert [r["after_steps"] for r in evals] == [2, 4]
    for row in evals:
        assert row["eval/version"] == row["after_steps"] and row["problems"] == 24 and row["eval/skipped"] == 0
        assert all(0.0 <= row[key] <= 1.0 for key in EVAL_KEYS), row
        assert row["eval/pass@3"] >= row["eval/mean@3"]
    # builtin:tiny answers most held-out sums greedily: the engine's greedy decode is the learner's, quantized
    assert evals[-1]["eval/acc_greedy_rollout"] >= 0.5 and evals[-1]["eval/acc_greedy"] >= 0.5
    summary = json.loads((tmp_path / "ev" / "summary.json").read_text())
    assert {key: summary[key] for key in EVAL_KEYS} == {key: evals[-1][key] for key in EVAL_KEYS}
