"""`asyncrl up configs/dapo_int8.yaml rollout.backend=sglang`, its rollout servers being `asyncrl serve` processes:
the worker launches its server, applies every version through pause / update_weights_from_disk / continue, and
pushes trajectories with per-token versions; the server stops with the run."""

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
def test_up_with_sglang_backend_on_asyncrl_serve(tmp_path):
    env = dict(os.environ)
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "up", str(ROOT / "configs" / "dapo_int8.yaml"), f"logging.dir={tmp_path}",
         "logging.name=sglang", "rollout.backend=sglang", "rollout.sglang.launcher=asyncrl",
         f"rollout.sglang.ckpt_dir={tmp_path / 'ckpt'}", "model.path=builtin:micro", "train.steps=2",
         "rollout.num_workers=1", "train.groups_per_step=4", "train.group_size=4", "algo.filter_groups=false",
         "data.eval_size=16", "staleness.max_lag=0"],  # step 1 must train on version-1 tokens: no timing race
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = tmp_path / "sglang"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "event" not in row]
    assert [row["step"] for row in steps] == [0, 1]
    assert all(0 < row["rollout/weight_pause_s"] < 60 and row["rollout/server_restarts"] == 0 for row in steps)
    (worker,) = json.loads((run_dir / "summary.json").read_text())["workers"]
    assert worker["sglang_weight_updates"] >= 2 and worker["version"] >= 1 and worker["errors"] == 0, worker
    admitted = [wire.decode(r["m"]) for r in read_records(run_dir / "buffer.journal") if r.get("k") == "admit"]
    versions = set()
    for push in admitted:
        for traj in push.trajectories:
            assert len(traj.versions) == len(traj.behav_logp) == len(traj.response_ids) > 0
            assert np.isfinite(traj.behav_logp).all() and (traj.behav_logp <= 1e-4).all()
            versions.update(traj.versions.tolist())
    assert 0 in versions and max(versions) >= 1
    assert not any((tmp_path / "ckpt").iterdir())  # the worker removed its checkpoints (and stopped its server)
