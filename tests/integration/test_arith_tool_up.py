"""`asyncrl up configs/arith_tool.yaml`, a few steps: multi-turn calculator episodes run end to end on the built-in
tool model (`builtin:micro-tool`), the episode metrics reach metrics.jsonl, and observation tokens are masked out of
the learner's loss and mismatch metrics (their behaviour log-prob 0.0 would otherwise blow the mismatch up). The
calculator is wrapped so that some of its calls raise and some sleep past `env.timeout_s`: the run completes and
counts them (issue 21's acceptance)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FLAKY_ENV = textwrap.dedent(
    '''
    import itertools
    import time

    from common.tasks.arith_tool import CalculatorEnv

    CALLS = itertools.count(1)  # per worker process


    class FlakyCalculator(CalculatorEnv):
        """The built-in calculator, except that every 5th step call raises and every 7th sleeps past the timeout."""

        def step(self, model_text):
            n = next(CALLS)
            if n % 5 == 0:
                raise RuntimeError(f"flaky calculator: call {n}")
            if n % 7 == 0:
                time.sleep(2.0)
            return super().step(model_text)
    '''
)


@pytest.mark.slow
def test_up_arith_tool_logs_episode_metrics_masks_observations_and_survives_a_failing_env(tmp_path):
    (tmp_path / "flaky_env.py").write_text(FLAKY_ENV)
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "up", str(ROOT / "configs" / "arith_tool.yaml"),
         f"logging.dir={tmp_path}", "logging.name=tool", "train.steps=3", "train.groups_per_step=8",
         "model.path=builtin:micro-tool",  # 1 minute to build on 2 cores, against 2-4 for tiny-tool
         f"env.fn={tmp_path / 'flaky_env.py'}:FlakyCalculator", "env.timeout_s=0.5", "data.eval_size=0"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ), cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "tool" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step" in r and "event" not in r]
    assert len(steps) == 3
    for row in steps:
        for key in ("env/turns_mean", "env/tool_calls", "env/masked_share", "env/errors", "env/timeouts"):
            assert key in row, (key, sorted(row))
    # run totals: the raising and the sleeping calls ended their episodes (reward 0) and were counted
    assert steps[-1]["env/errors"] > 0 and steps[-1]["env/timeouts"] > 0, steps[-1]
    measured = [r for r in steps if r["env/episodes"] > 0]
    assert measured
    # the warmed-up model calls the calculator on part of the problems: two turns and observation tokens there
    assert any(1.0 < r["env/turns_mean"] < 3.0 and 0.0 < r["env/tool_calls"] < 1.0 for r in measured)
    assert any(r["env/masked_share"] > 0.0 for r in measured)
    # observation tokens carry behaviour log-prob 0.0: were they scored, the mismatch would be of order 1 per token
    for row in steps:
        kl = row["mismatch/kl_k3"]
        assert kl is not None and math.isfinite(kl) and kl < 0.05, row
