"""`asyncrl up` end to end: real Ray actors, the real buffer process over ZMQ, weight publication, checkpoints."""

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


def run_up(tmp_path: Path, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    return subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "up", str(ROOT / "configs" / "dapo_int8.yaml"),
         f"logging.dir={tmp_path}", *overrides],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path,
    )  # fmt: skip


@pytest.mark.slow
def test_up_runs_async_steps_with_versions_and_publication(tmp_path):
    steps = 4
    proc = run_up(
        tmp_path, "model.path=builtin:micro", f"train.steps={steps}", "train.groups_per_step=4",
        "train.group_size=4", "algo.filter_groups=false", "logging.name=smoke", "train.eval_every=2",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = tmp_path / "smoke"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["after_steps"] for r in rows if r.get("event") == "eval"] == [2, 4]  # every 2 steps, and at the end
    step_rows = [r for r in rows if "event" not in r]
    assert [r["step"] for r in step_rows] == list(range(steps))
    for row in step_rows:
        for key in ("reward/mean", "acc/mean", "mismatch/acrl_d", "staleness/max", "perf/rollout_tok_s", "loss"):
            assert key in row, key
        assert row["staleness/max"] <= 2
        assert row["version"] == row["step"] + 1  # the learner stepped and published k + 1
    summary = json.loads((run_dir / "summary.json").read_text())
    # The workers received newer weight versions. Not necessarily each of them: on a loaded machine a worker that
    # starts late may serve a single batch of version 0 before the 4 steps are over.
    workers = summary["workers"]
    assert max(worker["version"] for worker in workers) >= 1 and max(worker["swaps"] for worker in workers) >= 2
    assert summary["buffer"]["consumed_groups"] == steps * 4
    # Every admitted trajectory carried per-token versions and behavior log-probs.
    admitted = [wire.decode(r["m"]) for r in read_records(run_dir / "buffer.journal") if r.get("k") == "admit"]
    assert admitted
    versions_seen = set()
    for push in admitted:
        for traj in push.trajectories:
            n = len(traj.response_ids)
            assert len(traj.versions) == n and len(traj.behav_logp) == n
            assert np.isfinite(traj.behav_logp).all() and (traj.behav_logp <= 1e-4).all()
            versions_seen.update(traj.versions.tolist())
    assert max(versions_seen) >= 1
    # The final checkpoint is a Hugging Face model directory.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = run_dir / "final"
    AutoModelForCausalLM.from_pretrained(final)
    assert AutoTokenizer.from_pretrained(final)("1+2=")["input_ids"]


def test_up_rejects_bad_weighting_quickly(tmp_path):
    proc = run_up(tmp_path, "loss.weighting=tsi", timeout=30)
    assert proc.returncode == 2
    assert "loss.weighting" in proc.stderr and "valid values" in proc.stderr
    assert not (tmp_path / "dapo_int8").exists()  # nothing started, nothing written


ROLLOUT_PRECISION = {"tis": "bf16", "acrl": "fp16"}
"""Half-precision rollout rides along with two weightings (the rest roll out in fp32)."""
E2E_WEIGHTINGS = ("none", "tis", "acrl", "tbpo", "pg_tis")
"""One weighting of each kind runs end to end (no correction; token-level truncation; ACRL with its reference
state; sequence-level; policy-gradient form). Every weighting, configured the same way, runs a whole train step
against stored numbers in tests/unit/learner/test_golden.py (GOLDEN_STEP)."""


@pytest.mark.slow
@pytest.mark.parametrize("weighting", E2E_WEIGHTINGS)
def test_weightings_run_end_to_end(tmp_path, weighting):
    steps = 2
    proc = run_up(
        tmp_path, "model.path=builtin:micro", f"train.steps={steps}", "train.groups_per_step=2", "train.group_size=4",
        "algo.filter_groups=false", f"loss.weighting={weighting}", "logging.name=w", "data.eval_size=0",
        "checkpoint.final=false", "rollout.num_workers=1", "ray.worker_cpus=1",
        f"precision.rollout={ROLLOUT_PRECISION.get(weighting, 'fp32')}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "event" not in r]
    assert [r["step"] for r in rows] == list(range(steps))
    assert all(r["loss"] is not None and r["skipped_steps"] == 0 for r in rows), rows
    assert rows[-1]["version"] == steps


@pytest.mark.slow
def test_up_with_fsdp2_ranks_bf16_and_the_rollout_aligned_forward(tmp_path):
    """Two FSDP2 learner ranks (gloo) in bf16, training on the published INT8 operands, end to end."""
    steps = 2
    proc = run_up(
        tmp_path, "model.path=builtin:micro", f"train.steps={steps}", "train.groups_per_step=2", "train.group_size=4",
        "algo.filter_groups=false", "logging.name=fsdp", "data.eval_size=0", "rollout.num_workers=1",
        "ray.worker_cpus=0.5", "learner.world_size=2", "precision.train=bf16", "learner.rollout_aligned=true",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "fsdp" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "event" not in r]
    assert [r["step"] for r in rows] == list(range(steps))
    assert all(r["loss"] is not None and r["skipped_steps"] == 0 and r["version"] == r["step"] + 1 for r in rows)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp" / "final")  # gathered from both ranks
