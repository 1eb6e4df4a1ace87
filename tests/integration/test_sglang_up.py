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


@pytest.mark.slow
def test_a_worker_whose_sglang_server_failed_past_its_restarts_is_restarted(tmp_path):
    """Past `rollout.sglang.max_restarts` the worker's engine fails every batch: its loop went on leasing groups it
    could not generate (each back only after lease_timeout_s, 60 s steps) and it still reported itself alive, so its
    supervisor never restarted it. Now the loop ends and the worker is restarted with a fresh server."""
    import psutil
    from test_operations import kill_if_running, records, wait_for

    run_dir = tmp_path / "heal"
    proc = subprocess.Popen(  # in its own process group: kill_if_running kills the group
        [sys.executable, "-m", "asyncrl.cli", "up", str(ROOT / "configs" / "dapo_int8.yaml"), f"logging.dir={tmp_path}",
         "logging.name=heal", "rollout.backend=sglang", "rollout.sglang.launcher=asyncrl", "logging.console=false",
         f"rollout.sglang.ckpt_dir={tmp_path / 'ckpt'}", "model.path=builtin:micro", "train.steps=30",
         "rollout.num_workers=1", "train.groups_per_step=2", "train.group_size=4", "algo.filter_groups=false",
         "data.eval_size=0", "checkpoint.final=false", "rollout.sglang.max_restarts=0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, start_new_session=True,
    )  # fmt: skip
    try:
        wait_for(lambda: any("loss" in r for r in records(run_dir)), 240, "the first step", proc)

        def servers() -> list[psutil.Process]:
            found = []
            for process in psutil.process_iter(["cmdline"]):
                line = " ".join(process.info["cmdline"] or [])
                if " serve " in line and str(tmp_path / "ckpt") in line:
                    found.append(process)
            return found

        (server,) = wait_for(lambda: servers() or None, 60, "the worker's server", proc)
        server.kill()
        output, _ = proc.communicate(timeout=400)
    finally:
        kill_if_running(proc)
    assert proc.returncode == 0, output[-4000:]
    rows = records(run_dir)
    crashed = [r for r in rows if r.get("event") == "worker_crashed"]
    assert crashed and "SGLang server failed 1 times (rollout.sglang.max_restarts)" in crashed[0]["error"], crashed
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 30 and max(r["perf/step_s"] for r in steps) < 30  # no step waited out a lease (60 s)
    buffer = json.loads((run_dir / "summary.json").read_text())["buffer"]
    assert buffer["left_workers"] == 2 and buffer["dead_workers"] == 0, buffer  # the failed one said it left, too
