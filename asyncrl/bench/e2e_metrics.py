"""The figures of `asyncrl bench e2e`, computed from the contenders' `Run`s.

Per run (`run_figures`):

- `launch_s`: from launching the process to the end of the first optimizer step (imports, start-up, first step).
- steady window: the steps after the first `warmup_steps(steps)` (start-up and the run-ahead filling);
  `steady_step_s` is its wall time per step (end of the last step minus end of the last warm-up step, over the steps
  between), and `steady_gen_s`, `steady_train_s`, `steady_wait_s` the mean phases a contender reports within a step
  (see `e2e_runs.StepRow`).
- `steady_samples_s`: trained samples per second over the steady window; `whole_samples_s` over the whole run
  from launch; `gen_tok_s`: tokens generated per second over the steady window; `gen_per_trained`: samples
  generated per sample trained (asyncrl's workers run ahead and, with dynamic sampling, generate groups that are
  dropped; TRL generates exactly what it trains).
- `time_to_acc_s` (`steps_to_acc`): from launch to the end of the first step at which the mean train accuracy
  of the last `ROLLING_STEPS` steps reaches `TARGET_ACC`, fixed before any run; nan when never reached.
  `reached_acc` is 1 where it was reached, else 0 (over seeds: the share of seeds), and `time_to_acc_censored_s` is
  `time_to_acc_s` where reached, else the run's end: a lower bound on the time to the target (`time_to_acc_bound`).

- `heldout_acc`: held-out greedy accuracy of the final model by the workload's reward; on the smol workload also
  `heldout_last_number_acc` (the same answers by a plain last-number check) and `heldout_gaming_gap`, the absolute
  difference of the two (a policy that games the reward opens it).

Over seeds, each figure's mean (`<figure>` or `<figure>_mean`) and, for the accuracy figures, `_std` (the sample
standard deviation; 0 with one seed).

The bound (`decode_bound_step_s`): what asyncrl's step would take if generation and training shared the cores with
no idle time and nothing thrown away, from the synchronous run of the same workload (where the phases run one
after the other, so their times are not inflated by sharing the cores): the generation core-seconds of one step's
trained samples (workers' generation seconds x their threads, per generated sample) plus the learner's core-seconds
per step (train seconds x threads), over the machine's cores. `e2e_fraction_of_bound_decode` is TRL's-time-per-
step-over-ours measured, over the same with the bound: `decode_bound_step_s / decode_async_steady_step_s`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

from asyncrl.bench.e2e_runs import Run

TARGET_ACC = 0.85
"""The time-to-accuracy target on the built-in workload: train accuracy, a mean over `ROLLING_STEPS` steps."""
ROLLING_STEPS = 5
RATIO_NAMES = (
    "e2e_vs_trl_time_to_acc",
    "e2e_vs_trl_steady_samples_s_builtin",
    "e2e_launch_vs_trl",
    "e2e_vs_trl_samples_s_decode",
    "e2e_fraction_of_bound_decode",
    "async_vs_sync_samples_s",
    "int8_vs_fp32_e2e",
    "generated_per_trained",
)
"""The ratios of the default workloads (builtin and decode). `generated_per_trained` is issue 26's: samples the
workers generated per trained sample, on the built-in workload, by asyncrl's own config (the `best` contender:
dynamic sampling and predictive selective rollout on); nan when that contender did not run (`--quick`)."""
SMOL_RATIO_NAMES = ("e2e_vs_trl_samples_s_smol", "e2e_smol_gaming_gap")
"""The smol workload's: steady trained samples/s, asyncrl asynchronous over TRL; the largest held-out gaming gap
(|accuracy by the math reward - by the last number|) over the contenders."""
RATIO_WORKLOADS = {
    **dict.fromkeys(RATIO_NAMES[:3], "builtin"),
    **dict.fromkeys(RATIO_NAMES[3:7], "decode"),
    "generated_per_trained": "builtin",
    **dict.fromkeys(SMOL_RATIO_NAMES, "smol"),
}
"""The workload each ratio is of: a ratio is written when its workload ran."""
ACCURACY_FIGURES = (
    "time_to_acc_s", "steps_to_acc", "final_train_acc", "heldout_acc", "heldout_last_number_acc", "heldout_gaming_gap",
)  # fmt: skip


PIPELINE_FILL_STEPS = 4
"""Steps that asyncrl's run-ahead takes to fill (`staleness.max_lag` + 2 with the configs' `max_lag` 2): while the
learner trains its first steps, the workers lease and generate up to `max_lag` + 1 batches ahead, so on shared cores
those steps wait longer than later ones. Measured (Zen 4, 2 cores, decode workload, 20 steps of each, 2026-12-06):
the fp32-rollout contender waited 11.7, 9.4 and 8.9 s at steps 1-3 and 6.2 s on average from step 4 on (the INT8
one 1.6-2.4 s, then 1.5); `int8_vs_fp32_e2e` over steps 1-7 read 1.451, over steps 4-19 1.313."""


def warmup_steps(steps: int) -> int:
    """Steps left out of the steady window: the first fifth, at least `PIPELINE_FILL_STEPS` (start-up, then the
    run-ahead filling); a run too short for that keeps its last step in the window (`run_figures`)."""
    return max(PIPELINE_FILL_STEPS, steps // 5)


def rolling_accuracy(accuracies: list[float], window: int = ROLLING_STEPS) -> list[float]:
    """Mean of the last `window` steps at each step (nan until `window` steps exist). A step without an accuracy
    (nan: `acc/mean` of a step after which no response was generated) is left out of its windows."""
    rolling = []
    for k in range(len(accuracies)):
        known = [acc for acc in accuracies[max(0, k + 1 - window) : k + 1] if not math.isnan(acc)]
        rolling.append(statistics.fmean(known) if k + 1 >= window and known else math.nan)
    return rolling


def run_figures(run: Run) -> dict[str, float]:
    rows = run.rows
    warm = min(warmup_steps(len(rows)), len(rows) - 1)
    steady = rows[warm:]
    window_s = rows[-1].end_s - rows[warm - 1].end_s if warm > 0 else rows[-1].end_s
    trained = sum(row.trained_samples for row in rows)
    figures = {
        "launch_s": run.launch_s,
        "steady_step_s": window_s / len(steady),
        "steady_samples_s": sum(row.trained_samples for row in steady) / window_s,
        "whole_samples_s": trained / rows[-1].end_s,
        "gen_tok_s": sum(row.generated_tokens for row in steady) / window_s,
        "gen_per_trained": run.total_generated_samples / trained,
        "gen_core_s_per_sample": run.gen_core_s_per_sample,
    }
    for phase in ("gen_s", "train_s", "wait_s"):
        values = [getattr(row, phase) for row in steady if not math.isnan(getattr(row, phase))]
        if values:
            figures[f"steady_{phase}"] = statistics.fmean(values)
    rolling = rolling_accuracy([row.accuracy for row in rows])
    reached = next((k for k, acc in enumerate(rolling) if acc >= TARGET_ACC), None)
    figures["time_to_acc_s"] = rows[reached].end_s if reached is not None else math.nan
    figures["steps_to_acc"] = float(reached + 1) if reached is not None else math.nan
    figures["reached_acc"] = float(reached is not None)
    figures["time_to_acc_censored_s"] = rows[reached if reached is not None else -1].end_s
    figures["final_train_acc"] = (
        rolling[-1]
        if not math.isnan(rolling[-1])
        else _mean(row.accuracy for row in rows if not math.isnan(row.accuracy))
    )
    figures["heldout_acc"] = run.heldout_acc
    figures["heldout_last_number_acc"] = run.heldout_last_number_acc
    figures["heldout_gaming_gap"] = abs(run.heldout_acc - run.heldout_last_number_acc)
    return figures


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return math.nan if not values or any(math.isnan(v) for v in values) else statistics.fmean(values)


def _std(values: list[float]) -> float:
    if any(math.isnan(v) for v in values):
        return math.nan
    return statistics.stdev(values) if len(values) > 1 else 0.0


def contender_figures(runs: list[Run]) -> dict[str, float]:
    """One contender's figures on one workload, over its seeds: means, and spreads of the accuracy figures."""
    per_seed = [run_figures(run) for run in runs]
    out: dict[str, float] = {}
    for key in per_seed[0]:
        values = [figures.get(key, math.nan) for figures in per_seed]
        if key in ACCURACY_FIGURES:
            out[f"{key}_mean"], out[f"{key}_std"] = _mean(values), _std(values)
        else:
            out[key] = _mean(values)
    out["seeds"] = float(len(runs))
    return out


def time_to_acc_bound(figures: dict[str, dict[str, float]], workload: str = "builtin") -> dict[str, float]:
    """Where TRL missed the target in some seed and ours reached it in every one (`e2e_vs_trl_time_to_acc` is then
    nan), `<workload>_time_to_acc_vs_trl_at_least`: TRL's mean time with each missing seed counted at its run's end,
    over ours, a lower bound on that ratio (TRL's true times are longer). Empty otherwise."""
    ours, trl = figures.get(f"{workload}_async", {}), figures.get(f"{workload}_trl", {})
    if ours.get("reached_acc") != 1.0 or not 0.0 <= trl.get("reached_acc", 1.0) < 1.0:
        return {}
    return {f"{workload}_time_to_acc_vs_trl_at_least": trl["time_to_acc_censored_s"] / ours["time_to_acc_s_mean"]}


def accuracy_curve(runs: list[Run]) -> list[float]:
    """Train accuracy per step, the mean over seeds."""
    steps = min(len(run.rows) for run in runs)
    return [statistics.fmean(run.rows[k].accuracy for run in runs) for k in range(steps)]


def bound_step_s(sync_run: Run, samples_per_step: int, cores: int) -> float:
    """Seconds per step with generation and training packed on `cores` with no idle time (see the module doc)."""
    train_core_s = run_figures(sync_run)["steady_train_s"] * sync_run.settings["learner_core_s_per_train_s"]
    return (sync_run.gen_core_s_per_sample * samples_per_step + train_core_s) / cores


def ratios(figures: dict[str, dict[str, float]], bound_s: float) -> dict[str, float]:
    """The issues' ratios from `figures[<workload>_<contender>]`, those of the workloads that ran
    (`RATIO_WORKLOADS`); nan where a figure is missing (never reached, a contender not run)."""

    def fig(key: str, name: str) -> float:
        return figures.get(key, {}).get(name, math.nan)

    decode_async_step_s = fig("decode_async", "steady_step_s")
    gaps = [values["heldout_gaming_gap_mean"] for key, values in figures.items() if key.startswith("smol_")]
    every = {
        "e2e_vs_trl_time_to_acc": fig("builtin_trl", "time_to_acc_s_mean") / fig("builtin_async", "time_to_acc_s_mean"),
        "e2e_vs_trl_steady_samples_s_builtin": fig("builtin_async", "steady_samples_s")
        / fig("builtin_trl", "steady_samples_s"),
        "e2e_launch_vs_trl": fig("builtin_async", "launch_s") / fig("builtin_trl", "launch_s"),
        "e2e_vs_trl_samples_s_decode": fig("decode_async", "steady_samples_s") / fig("decode_trl", "steady_samples_s"),
        "e2e_fraction_of_bound_decode": bound_s / decode_async_step_s,
        "async_vs_sync_samples_s": fig("decode_async", "steady_samples_s") / fig("decode_sync", "steady_samples_s"),
        "int8_vs_fp32_e2e": fig("decode_async", "steady_samples_s") / fig("decode_fp32", "steady_samples_s"),
        "generated_per_trained": fig("builtin_best", "gen_per_trained"),
        "e2e_vs_trl_samples_s_smol": fig("smol_async", "steady_samples_s") / fig("smol_trl", "steady_samples_s"),
        "e2e_smol_gaming_gap": math.nan if not gaps or any(math.isnan(g) for g in gaps) else max(gaps),
    }
    ran = {key.split("_", 1)[0] for key in figures}
    return {name: value for name, value in every.items() if RATIO_WORKLOADS[name] in ran}
