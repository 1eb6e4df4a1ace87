"""`asyncrl up ... rollout.backend=sglang model.lora.rank=4` on `asyncrl serve --enable-lora`: the worker loads the
published base once and every version's adapters through SGLang's LoRA API; tokens carry their adapter's version,
and with an fp32 base the learner's log-probs equal the behaviour log-probs the server returned under the loaded
adapter (`mismatch/*` at fp32 rounding)."""

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


@pytest.mark.slow
def test_up_with_lora_on_the_sglang_backend(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "up", str(ROOT / "configs" / "dapo_int8.yaml"), f"logging.dir={tmp_path}",
         "logging.name=sglang_lora", "rollout.backend=sglang", "rollout.sglang.launcher=asyncrl",
         f"rollout.sglang.ckpt_dir={tmp_path / 'ckpt'}", "model.path=builtin:micro", "model.lora.rank=4",
         "model.lora.alpha=8", "optim.lr=3e-3", "quant.scheme=none", "train.steps=3", "rollout.num_workers=1",
         "train.groups_per_step=4", "train.group_size=4", "algo.filter_groups=false", "data.eval_size=0",
         "staleness.max_lag=0", "logging.console=false"],  # max_lag 0: step k trains on version k's tokens only
        capture_output=True, text=True, timeout=600, env=dict(os.environ), cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = tmp_path / "sglang_lora"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "step" in row and "event" not in row]
    assert [row["step"] for row in steps] == [0, 1, 2]
    assert all(0 < row["sync/bytes_per_version"] < 1e6 for row in steps[1:])  # adapters only after version 0
    assert steps[-1]["lora/norm_B"] > 0
    for row in steps:  # learner (fp32 base + adapters) == server (base + the same adapter) to fp32 rounding
        assert row["mismatch/log_ppl_abs_diff"] < 1e-5 and abs(row["mismatch/kl_k1"]) < 1e-6, row
    (worker,) = json.loads((run_dir / "summary.json").read_text())["workers"]
    assert worker["sglang_weight_updates"] == 1, worker  # the base, once
    assert worker["sglang_lora_loads"] >= 3 and worker["version"] >= 2 and worker["errors"] == 0, worker
    admitted = [wire.decode(r["m"]) for r in read_records(run_dir / "buffer.journal") if r.get("k") == "admit"]
    versions = set()
    for push in admitted:
        for traj in push.trajectories:
            assert len(traj.versions) == len(traj.behav_logp) == len(traj.response_ids) > 0
            assert np.isfinite(traj.behav_logp).all() and (traj.behav_logp <= 1e-4).all()
            versions.update(traj.versions.tolist())
    assert {0, 1, 2} <= versions  # each step's tokens from its own adapter version
    assert not any((tmp_path / "ckpt").iterdir())  # checkpoints and adapter directories removed with the worker
