"""`asyncrl bench chaos`: the seeded fault schedule, and the quick bench end to end (real `asyncrl up` runs whose
buffer, learner and rollout worker processes are killed) with its behaviour ratios: completed, nothing lost or
trained twice."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from asyncrl.bench import BENCHMARKS
from asyncrl.bench.chaos_faults import KINDS, plan_faults


def test_the_fault_plan_is_seeded_and_kills_each_kind_with_both_signals_inside_the_step_range():
    plan = plan_faults(seed=7, per_kind=3, first_step=4, last_step=48)
    assert plan == plan_faults(seed=7, per_kind=3, first_step=4, last_step=48)
    assert plan != plan_faults(seed=8, per_kind=3, first_step=4, last_step=48)
    steps = [f.after_steps for f in plan]
    assert steps == sorted(steps) and len(set(steps)) == len(steps) and steps[0] >= 4 and steps[-1] < 48
    for kind in KINDS:
        signals = sorted(f.signal for f in plan if f.kind == kind)
        assert signals in (["SIGKILL", "SIGKILL", "SIGTERM"], ["SIGKILL", "SIGTERM", "SIGTERM"])
    assert all(0.0 <= f.delay_s <= 1.0 and f.at_unix == 0.0 for f in plan)


def test_a_fault_plan_that_cannot_fit_its_step_range_is_refused():
    with pytest.raises(ValueError, match="cannot place 2 faults of each kind between steps 3 and 8"):
        plan_faults(seed=0, per_kind=2, first_step=3, last_step=8)


@pytest.mark.slow
def test_quick_chaos_bench_heals_every_fault_and_trains_every_group_once(tmp_path):
    assert BENCHMARKS["chaos"] == "asyncrl.bench.chaos:run"
    out = tmp_path / "chaos.json"
    done = subprocess.run([sys.executable, "-m", "asyncrl.cli", "bench", "chaos", "--quick", "--json", str(out)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    ratios = result["ratios"]
    assert result["name"] == "chaos" and set(ratios) == {
        "chaos_completed", "chaos_groups_lost", "chaos_groups_double_trained", "chaos_acc_delta",
        "chaos_recovery_p50_s",
    }  # fmt: skip
    assert ratios["chaos_completed"] == 1 and ratios["chaos_groups_lost"] == 0
    assert ratios["chaos_groups_double_trained"] == 0
    assert result["details"]["seeds"] == 1 and "one seed" in result["details"]["accuracy_note"]
    chaos = next(run for run in result["details"]["runs"] if run["faulty"])
    assert sorted(f["kind"] for f in chaos["faults"] if f["at_unix"] and f["recovered_unix"]) == sorted(KINDS)
    assert chaos["audit"]["staleness_ok"] and chaos["returncode"] == 0
    assert all(result["metrics"][f"{kind}_faults_injected"] == 1 for kind in KINDS)
    assert "asyncrl bench chaos: faults" in done.stderr


def test_one_seed_has_no_spread() -> None:
    """`--quick` runs one seed: its held-out spread was written as 0.0, a claim of no spread; it is null now."""
    import math

    from asyncrl.bench.chaos import _spread

    assert math.isnan(_spread([0.7])) and abs(_spread([0.5, 0.7]) - 0.1414) < 1e-4
