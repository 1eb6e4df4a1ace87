"""`asyncrl bench chaos`: a run of the built-in task that heals itself while its processes are killed at random.

For each seed, two runs of `asyncrl up configs/dapo_int8.yaml` with the same settings and seed, one after the
other: a baseline without faults, then a chaos run during which `asyncrl.bench.chaos_faults` kills each process
kind (rollout workers, the buffer, a learner rank) `per_kind` times, with SIGKILL and SIGTERM, at seeded random
points (each fault after the previous one's recovery). Both runs checkpoint every `checkpoint_every` steps (a
killed learner restarts from the latest checkpoint) and allow more restarts than there are faults.

Then `asyncrl.bench.chaos_audit` checks each chaos run's journal, metrics and summary: the run completed all its
steps (and exited 0), every consumed group was trained exactly once, no committed group was lost, and the staleness
bound held on every step. The held-out greedy accuracy of both runs' final models (the shared evaluation of
`bench e2e`) gives the accuracy delta: |mean over seeds of chaos - mean of baseline|, with the spreads in the
metrics (an accuracy claim needs several seeds: 3 by default; `--quick` uses 1 and says so in `details`).

Ratios (targets): `chaos_completed` (1: every chaos run completed, exit 0), `chaos_groups_lost` (0),
`chaos_groups_double_trained` (0), `chaos_acc_delta` (<= 0.03), `chaos_recovery_p50_s` (<= 10: from the signal to
the first step logged after the restart). `--quick` (CI): `builtin:micro`, 2 x 4 samples a step, one fault of each
kind; the full run: `builtin:tiny` with the config's 16 x 8 samples, three faults of each kind.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.bench import BenchResult
from asyncrl.bench.chaos_audit import RunAudit, audit
from asyncrl.bench.chaos_faults import KINDS, Fault, inject, kill_session, plan_faults

CONFIG_PATH = Path(__file__).resolve().parents[2] / "configs" / "dapo_int8.yaml"
MAX_LAG = 2
"""`staleness.max_lag` of the config: the bound checked on every step."""


@dataclass(frozen=True, slots=True)
class Shape:
    model: str
    steps: int
    groups_per_step: int
    group_size: int
    checkpoint_every: int
    per_kind: int
    """Faults of each kind in a chaos run."""
    first_fault_step: int
    last_fault_step: int
    timeout_s: float
    """A run's wall-clock limit (also each fault's wait for its step and its recovery)."""


QUICK = Shape("builtin:micro", steps=50, groups_per_step=2, group_size=4, checkpoint_every=8, per_kind=1,
              first_fault_step=6, last_fault_step=34, timeout_s=240.0)  # fmt: skip
"""Micro steps take 0.1-0.6 s on 2 busy cores: enough steps that the faults land while the run trains."""
FULL = Shape("builtin:tiny", steps=100, groups_per_step=16, group_size=8, checkpoint_every=5, per_kind=3,
             first_fault_step=4, last_fault_step=50, timeout_s=1800.0)  # fmt: skip
"""Faults in the first half: each waits for the previous one's recovery while training goes on (~0.5 s a step)."""


def overrides(shape: Shape, seed: int, runs_dir: Path, name: str) -> list[str]:
    """The settings both runs of a seed share (restart limits above the faults injected, a stall fails the run)."""
    faults = shape.per_kind
    return [
        f"model.path={shape.model}", f"train.steps={shape.steps}", f"train.seed={seed}",
        f"train.groups_per_step={shape.groups_per_step}", f"train.group_size={shape.group_size}",
        f"staleness.max_lag={MAX_LAG}", "data.eval_size=0", "checkpoint.final=true",
        f"checkpoint.every={shape.checkpoint_every}", f"buffer.max_restarts={faults + 2}",
        f"learner.max_restarts={faults + 2}", f"rollout.max_restarts={2 * faults + 4}",
        "rollout.restart_backoff_s=0.2", "buffer.worker_timeout_s=5", "train.stall_timeout_s=120",
        f"logging.dir={runs_dir}", f"logging.name={name}", "logging.console=false",
    ]  # fmt: skip


@dataclass(slots=True)
class ChaosRun:
    seed: int
    faulty: bool
    run_dir: Path
    returncode: int
    wall_s: float
    faults: list[Fault]
    audit: RunAudit
    heldout_acc: float = math.nan

    def to_json(self) -> dict[str, Any]:
        return {"seed": self.seed, "faulty": self.faulty, "run_dir": str(self.run_dir), "returncode": self.returncode,
                "wall_s": round(self.wall_s, 2), "heldout_acc": self.heldout_acc, "audit": self.audit.to_json(),
                "faults": [f.to_json() for f in self.faults]}  # fmt: skip


def run_one(shape: Shape, seed: int, faulty: bool, work: Path) -> ChaosRun:
    """One `asyncrl up` run (in a session of its own), with the seed's faults when `faulty`; audited."""
    name = f"{'chaos' if faulty else 'base'}-s{seed}"
    argv = [sys.executable, "-m", "asyncrl.cli", "up", str(CONFIG_PATH), *overrides(shape, seed, work / "runs", name)]
    faults = plan_faults(seed, shape.per_kind, shape.first_fault_step, shape.last_fault_step) if faulty else []
    run_dir = work / "runs" / name
    log_path = work / f"{name}.log"
    started = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
        try:
            inject(proc, run_dir, faults, seed, shape.timeout_s)
            proc.wait(timeout=max(1.0, shape.timeout_s - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            pass
        finally:
            kill_session(proc)
    wall_s = time.monotonic() - started
    result = ChaosRun(seed, faulty, run_dir, proc.returncode, wall_s, faults,
                      audit(run_dir, shape.steps, shape.groups_per_step, MAX_LAG))  # fmt: skip
    if proc.returncode != 0 or not result.audit.completed:
        tail = log_path.read_text()[-600:].strip().splitlines()
        print(f"chaos: {name} exited with {proc.returncode} (completed: {result.audit.completed}); log {log_path}: "
              f"{tail[-1] if tail else ''}", file=sys.stderr)  # fmt: skip
    return result


def heldout(run: ChaosRun, shape: Shape) -> float:
    from asyncrl.bench.e2e_workloads import data_config, heldout_greedy_accuracy
    from common.builtin_model import resolve_model_path

    final = run.run_dir / "final"
    if not final.is_dir():
        return math.nan
    return heldout_greedy_accuracy(str(final), str(resolve_model_path(shape.model)), data_config(), 8)


def _spread(values: list[float]) -> float:
    """The sample standard deviation; NaN (JSON null) for fewer than two values: one seed has no spread."""
    return statistics.stdev(values) if len(values) > 1 else math.nan


def _p50(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def summarize(runs: list[ChaosRun], seeds: int, quick: bool) -> BenchResult:
    chaos = [r for r in runs if r.faulty]
    base = [r for r in runs if not r.faulty]
    faults = [f for r in chaos for f in r.faults]
    metrics: dict[str, float] = {}
    for kind in KINDS:
        mine = [f for f in faults if f.kind == kind]
        recovered = [f.recovery_s for f in mine if f.recovered_unix]
        metrics[f"{kind}_faults_planned"] = float(len(mine))
        metrics[f"{kind}_faults_injected"] = float(sum(1 for f in mine if f.at_unix))
        metrics[f"{kind}_faults_sigkill"] = float(sum(1 for f in mine if f.at_unix and f.signal == "SIGKILL"))
        metrics[f"{kind}_faults_sigterm"] = float(sum(1 for f in mine if f.at_unix and f.signal == "SIGTERM"))
        metrics[f"{kind}_recovered"] = float(len(recovered))
        metrics[f"{kind}_recovery_p50_s"] = _p50(recovered)
        metrics[f"{kind}_recovery_max_s"] = max(recovered, default=math.nan)
    recoveries = [f.recovery_s for f in faults if f.recovered_unix]
    injected = [f for f in faults if f.at_unix]
    metrics["recovery_p50_s"] = _p50(recoveries)
    metrics["recovery_max_s"] = max(recoveries, default=math.nan)
    metrics["groups_replayed"] = float(sum(r.audit.groups_replayed for r in chaos))
    metrics["groups_rewound"] = float(sum(r.audit.groups_rewound for r in chaos))
    metrics["groups_lost"] = float(sum(r.audit.groups_lost for r in chaos))
    metrics["groups_double_trained"] = float(sum(r.audit.groups_double_trained for r in chaos))
    metrics["staleness_max"] = max((r.audit.staleness_max for r in runs), default=math.nan)
    metrics["faults_not_injected"] = float(len(faults) - len(injected))
    base_acc, chaos_acc = [r.heldout_acc for r in base], [r.heldout_acc for r in chaos]
    metrics["baseline_heldout_acc_mean"] = statistics.fmean(base_acc) if base_acc else math.nan
    metrics["baseline_heldout_acc_spread"] = _spread(base_acc)
    metrics["chaos_heldout_acc_mean"] = statistics.fmean(chaos_acc) if chaos_acc else math.nan
    metrics["chaos_heldout_acc_spread"] = _spread(chaos_acc)
    metrics["baseline_wall_s_mean"] = statistics.fmean(r.wall_s for r in base) if base else math.nan
    metrics["chaos_wall_s_mean"] = statistics.fmean(r.wall_s for r in chaos) if chaos else math.nan
    completed = all(r.returncode == 0 and r.audit.completed for r in chaos) and len(injected) == len(faults)
    completed = completed and all(r.audit.staleness_ok for r in runs)
    ratios = {
        "chaos_completed": 1.0 if completed else 0.0,
        "chaos_groups_lost": metrics["groups_lost"],
        "chaos_groups_double_trained": metrics["groups_double_trained"],
        "chaos_acc_delta": abs(metrics["chaos_heldout_acc_mean"] - metrics["baseline_heldout_acc_mean"]),
        "chaos_recovery_p50_s": metrics["recovery_p50_s"],
    }
    details: dict[str, Any] = {
        "seeds": seeds, "quick": quick,
        "accuracy_note": "one seed: the accuracy delta is a smoke figure, not a claim (use 3 seeds)" if seeds < 2
        else f"{seeds} seeds: mean and spread (sample stdev) of the held-out greedy accuracy",
        "completed_means": "every chaos run exited 0 with all its steps, every planned fault injected, staleness "
        f"<= {MAX_LAG} on every step",
        "recovery_means": "seconds from the signal to the first step logged after the restart event",
        "runs": [r.to_json() for r in runs],
    }  # fmt: skip
    return BenchResult(name="chaos", metrics=metrics, ratios=ratios, details=details)


def print_faults_table(result: BenchResult) -> None:
    """Faults injected per kind, recovery p50 / max, and the groups replayed / rewound / lost."""
    from rich.console import Console
    from rich.table import Table

    m = result.metrics
    table = Table(title="asyncrl bench chaos: faults")
    for column in ("process", "injected", "SIGKILL", "SIGTERM", "recovered", "recovery p50 s", "recovery max s"):
        table.add_column(column, justify="left" if column == "process" else "right")
    for kind in KINDS:
        table.add_row(kind, *(f"{m[f'{kind}_{key}']:.0f}" for key in ("faults_injected", "faults_sigkill",
                      "faults_sigterm", "recovered")), f"{m[f'{kind}_recovery_p50_s']:.1f}",
                      f"{m[f'{kind}_recovery_max_s']:.1f}")  # fmt: skip
    console = Console(stderr=True)
    console.print(table)
    console.print(f"groups replayed {m['groups_replayed']:.0f} / rewound {m['groups_rewound']:.0f} / lost "
                  f"{m['groups_lost']:.0f}; double trained {m['groups_double_trained']:.0f}; held-out accuracy "
                  f"baseline {m['baseline_heldout_acc_mean']:.3f} chaos {m['chaos_heldout_acc_mean']:.3f} "
                  f"({result.details['seeds']} seed(s))")  # fmt: skip


def run(quick: bool, seeds: int | None = None) -> BenchResult:
    """The bench (see the module docstring); `seeds` defaults to 3 (1 with `quick`)."""
    seeds = (1 if quick else 3) if seeds is None else seeds
    if seeds < 1:
        raise ValueError(f"--seeds must be at least 1, got {seeds}")
    shape = QUICK if quick else FULL
    work = Path(tempfile.mkdtemp(prefix="asyncrl-chaos-"))
    runs = []
    for seed in range(seeds):
        for faulty in (False, True):
            one = run_one(shape, seed, faulty, work)
            one.heldout_acc = heldout(one, shape)
            runs.append(one)
    result = summarize(runs, seeds, quick)
    if result.ratios["chaos_completed"] == 1.0 and not result.ratios["chaos_groups_lost"]:
        shutil.rmtree(work, ignore_errors=True)  # kept (logs, journals) when a check failed
        result.details["work_dir"] = None
    else:
        result.details["work_dir"] = str(work)
    print_faults_table(result)
    return result
