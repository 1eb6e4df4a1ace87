"""`asyncrl up configs/arith_tool.yaml rollout.backend=sglang`, its servers `asyncrl serve` processes (issue 21 item
5): calculator episodes run turn by turn on the SGLang backend (the next turn's `input_ids` hold the observation
tokens), their trajectories reach the buffer with a loss mask and per-token versions, and the held-out evaluation
runs episodes with the tool on the backend too (`eval/acc_greedy_rollout`, `eval/tool_calls`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from buffer.journal import read_records
from common import wire

ROOT = Path(__file__).resolve().parents[2]
EVAL_KEYS = ("eval/acc_greedy_rollout", "eval/tool_calls", "eval/turns_mean", "eval/mean@2", "eval/pass@2")


@pytest.mark.slow
def test_up_arith_tool_on_the_sglang_backend_runs_episodes_and_evaluates_them(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "up", str(ROOT / "configs" / "arith_tool.yaml"),
         f"logging.dir={tmp_path}", "logging.name=toolsg", "model.path=builtin:micro-tool", "train.steps=2",
         "rollout.backend=sglang", "rollout.sglang.launcher=asyncrl", f"rollout.sglang.ckpt_dir={tmp_path / 'ckpt'}",
         "rollout.num_workers=1", "train.groups_per_step=4", "train.group_size=4", "algo.filter_groups=false",
         "train.eval_every=0", "data.eval_size=8", "eval.samples=2", "checkpoint.final=false",
         "logging.console=false"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ), cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = tmp_path / "toolsg"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "event" not in r]
    assert [r["step"] for r in steps] == [0, 1]
    assert all(r["env/errors"] == 0 and r["env/timeouts"] == 0 for r in steps)
    (worker,) = json.loads((run_dir / "summary.json").read_text())["workers"]
    assert worker["errors"] == 0 and worker["sglang_weight_updates"] >= 2, worker
    # the warmed-up model calls the calculator on part of the problems: episodes of two turns, observations masked
    assert worker["env_turns"] > worker["env_episodes"] and worker["env_tool_calls"] > 0, worker
    admitted = [wire.decode(r["m"]) for r in read_records(run_dir / "buffer.journal") if r.get("k") == "admit"]
    masked = 0
    for push in admitted:
        for traj in push.trajectories:
            assert len(traj.versions) == len(traj.behav_logp) == len(traj.response_ids) > 0
            model_tokens = wire.model_token_mask(traj)  # no mask: every token is the model's (answered directly)
            assert (traj.behav_logp[~model_tokens] == 0.0).all() and (traj.behav_logp[model_tokens] < 0.0).all()
            assert np.isfinite(traj.behav_logp).all()
            masked += int((~model_tokens).sum())
    assert masked > 0
    (event,) = [r for r in rows if r.get("event") == "eval"]
    assert event["after_steps"] == 2 and event["problems"] == 8 and event["eval/version"] == 2
    assert all(0.0 <= event[key] <= 1.0 for key in EVAL_KEYS if "@" in key or "acc" in key), event
    assert 0.0 <= event["eval/tool_calls"] <= 2.0 and 1.0 <= event["eval/turns_mean"] <= 3.0, event
    assert "eval/acc_greedy" not in event  # the learner's single-turn decode cannot call the calculator
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {key: summary[key] for key in EVAL_KEYS} == {key: event[key] for key in EVAL_KEYS}
    assert not any((tmp_path / "ckpt").iterdir())  # the servers stopped and their checkpoints are gone
