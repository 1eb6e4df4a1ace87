"""A study's results: `results.json` (one row per cell and seed), `table.md` (cells as rows) and PNGs of its curves.

Each row is read from its run directory (metrics.jsonl step records via `asyncrl.plot.read_steps`, so a step logged
twice after a resume counts once, and summary.json):

| row key | what |
|---|---|
| `acc/mean` | final train accuracy: mean of the step metric `acc/mean` (every response generated in the |
| | step, kept by the dynamic-sampling filter or not) over the last `FINAL_STEPS` steps |
| `eval/acc_greedy` | held-out greedy accuracy of the final full-precision weights (summary.json; |
| | null when `data.eval_size=0`); a run with an environment (`env.fn`, multi-turn) has no single-turn |
| | greedy decode: its greedy episodes' accuracy `eval/acc_greedy_rollout` stands in (`eval/key` says which) |
| `mismatch/kl_k3`, `mismatch/w_max`, | {"mean", "max"} over the run's steps |
| `mismatch/acrl_d`, `mismatch/log_ppl_abs_diff` | |
| `skipped_steps` | learner steps skipped for a non-finite loss or gradient (its last step's count) |
| `perf/rollout_tok_s` | tokens generated per second, over every step but the first (which includes start-up) |
| each entry of the study's `metrics` | `KEY[:STAT]` over the run's steps (mean, max, min or last; `A / B`: the |
| | per-step ratio) |

`table.md` gives each column's mean ± std over the cell's finished seeds (a single seed: its value), and n. The PNGs
are `asyncrl plot`'s figures (reward and accuracy, mismatch, ...) of one curve per cell: the per-step mean over its
seeds, written as `curves/<cell>/metrics.jsonl` and drawn by `asyncrl.plot.plot_runs`.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from asyncrl.plot import plot_runs, read_steps
from asyncrl.study_run import read_status, run_state
from asyncrl.study_spec import RunSpec, Study, parse_metric

FINAL_STEPS = 5
"""Steps at the end of a run whose `acc/mean` is averaged into its final train accuracy."""
MISMATCH_KEYS = ("mismatch/kl_k3", "mismatch/w_max", "mismatch/acrl_d", "mismatch/log_ppl_abs_diff")
COLUMNS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("train acc", ("acc/mean",), "{:.3f}"),
    ("held-out acc", ("eval/acc_greedy",), "{:.3f}"),
    *(
        (f"{key.split('/')[1]} {stat}", (key, stat), "{:.5g}" if key == "mismatch/w_max" else "{:.3g}")
        for key in MISMATCH_KEYS
        for stat in ("mean", "max")
    ),  # w_max 1.0017 is not 1
    ("skipped", ("skipped_steps",), "{:.0f}"),
    ("rollout tok/s", ("perf/rollout_tok_s",), "{:.0f}"),
)
"""Table columns: header, path of the value in a results row (key, then "mean" / "max" of a mismatch entry), format."""
HELD_OUT_KEYS = ("eval/acc_greedy", "eval/acc_greedy_rollout")
"""summary.json keys read into a row's held-out accuracy, the first one present: the learner's single-turn greedy
decode, else (multi-turn runs, asyncrl/evaluate.py) the greedy episodes on the rollout engine."""
CURVE_KEYS = ("reward/mean", "acc/mean", "acc/batch", "response_len/mean", "lr", "norm_update", "norm_quant_err")
"""Step metrics averaged over seeds into each cell's curve (besides every `mismatch/*` key)."""


def _finite(values: list[Any]) -> list[float]:
    return [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)]


def _mean(values: list[Any]) -> float | None:
    kept = _finite(values)
    return sum(kept) / len(kept) if kept else None


def run_row(run: RunSpec, metrics: tuple[str, ...] = ()) -> dict[str, Any]:
    """The results row of one run (status `done`, `failed`, `stopped`, `partial` or `new`; metrics only when done)."""
    state = run_state(run)
    status = read_status(run)
    if state != "done" and status.get("returncode") not in (None, 0) and not status.get("interrupted"):
        state = "failed"  # an attempt the study's Ctrl-C stopped (exit code 130 on a second one) stays `stopped`
    row: dict[str, Any] = {"cell": run.cell, "seed": run.seed, "run_dir": str(run.run_dir), "status": state,
                           "steps": run.steps, "wall_s": status.get("wall_s"), "log": str(run.log_path)}  # fmt: skip
    if state != "done":
        return row
    try:
        steps = read_steps(run.run_dir)
        summary = json.loads((run.run_dir / "summary.json").read_text())
        if not isinstance(summary, dict):
            raise ValueError("summary.json is not a JSON object")
    except (OSError, ValueError) as err:  # a file damaged since the run: the row says so, the report goes on
        return {**row, "status": "damaged", "error": f"{type(err).__name__}: {err}"[:300]}
    row["acc/mean"] = _mean([s.get("acc/mean") for s in steps[-FINAL_STEPS:]])
    row["eval/key"] = next((key for key in HELD_OUT_KEYS if summary.get(key) is not None), HELD_OUT_KEYS[0])
    row["eval/acc_greedy"] = summary.get(row["eval/key"])
    for key in MISMATCH_KEYS:
        values = _finite([s.get(key) for s in steps])
        row[key] = {"mean": sum(values) / len(values), "max": max(values)} if values else {"mean": None, "max": None}
    skipped = _finite([s.get("skipped_steps") for s in steps])
    row["skipped_steps"] = skipped[-1] if skipped else None
    timed = steps[1:] or steps
    seconds = sum(_finite([s.get("perf/step_s") for s in timed]))
    tokens = sum(_finite([(s.get("perf/rollout_tok_s") or 0.0) * (s.get("perf/step_s") or 0.0) for s in timed]))
    row["perf/rollout_tok_s"] = tokens / seconds if seconds > 0 else None
    for spec in metrics:
        row[spec] = extra_metric(steps, spec)
    return row


def extra_metric(steps: list[dict[str, Any]], spec: str) -> float | None:
    """A `metrics` entry of the study file (`KEY[:STAT]`, KEY possibly `A / B`) over a run's step records."""
    parts, stat = parse_metric(spec)
    values = []
    for step in steps:
        found = _finite([step.get(part) for part in parts])
        if len(found) == len(parts) and (len(parts) == 1 or found[1] != 0):
            values.append(found[0] if len(parts) == 1 else found[0] / found[1])
    if not values:
        return None
    reduce = {"mean": statistics.fmean, "max": max, "min": min, "last": lambda v: v[-1]}[stat]
    return float(reduce(values))


def _lookup(row: dict[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = row
    for part in path:
        value = value.get(part) if isinstance(value, dict) else None
    return value


def table_markdown(study: Study, rows: list[dict[str, Any]]) -> str:
    """Cells as rows; each column the mean ± std over the cell's finished seeds, then n and failures."""
    columns = [*COLUMNS, *((spec, (spec,), "{:.3g}") for spec in study.metrics)]
    header = ["cell", *(title for title, _, _ in columns), "n"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for cell in study.cells:
        cell_rows = [row for row in rows if row["cell"] == cell]
        done = [row for row in cell_rows if row["status"] == "done"]
        cells = [cell]
        for _, key, fmt in columns:
            values = _finite([_lookup(row, key) for row in done])
            fewer = f" (n={len(values)})" if values and len(values) < len(done) else ""  # not every seed has it
            cells.append(_spread(values, fmt) + fewer)
        missing = len(cell_rows) - len(done)
        failed = sum(row["status"] == "failed" for row in cell_rows)
        damaged = sum(row["status"] == "damaged" for row in cell_rows)
        note = f" ({failed} failed)" if failed else (f" ({missing} unfinished)" if missing else "")
        note += f" ({damaged} damaged)" if damaged else ""
        cells.append(f"{len(done)}{note}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _spread(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.fmean(values))} ± {fmt.format(statistics.stdev(values))}"


def cell_curves(study: Study, out_dir: Path) -> list[Path]:
    """Per cell, the per-step mean over its finished seeds as `out_dir/<cell>/metrics.jsonl`; returns the dirs."""
    written = []
    for cell in study.cells:
        runs = [run for run in study.runs if run.cell == cell and run_state(run) == "done"]
        by_step: dict[int, list[dict[str, Any]]] = {}
        for run in runs:
            try:
                records = read_steps(run.run_dir)
            except (OSError, ValueError):  # damaged: its row says so (run_row)
                continue
            for record in records:
                by_step.setdefault(int(record["step"]), []).append(record)
        if not by_step:
            continue
        target = out_dir / cell
        target.mkdir(parents=True, exist_ok=True)
        with (target / "metrics.jsonl").open("w") as handle:
            for step, records in sorted(by_step.items()):
                keys = {k for r in records for k in r if k in CURVE_KEYS or k.startswith("mismatch/")}
                mean = {key: _mean([r.get(key) for r in records]) for key in sorted(keys)}
                handle.write(json.dumps({"step": step, **{k: v for k, v in mean.items() if v is not None}}) + "\n")
        written.append(target)
    return written


def write_report(study: Study) -> dict[str, Any]:
    """Write results.json, table.md and the PNGs into runs/studies/<name>/; returns the results document."""
    rows = [run_row(run, study.metrics) for run in study.runs]
    out = study.out_dir
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "study": study.name,
        "base": str(study.base),
        "overrides": list(study.overrides),
        "cells": {cell: list(dotlist) for cell, dotlist in study.cells.items()},
        "seeds": list(study.seeds),
        "written": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": f"{platform.node()} ({platform.machine()}, {_cpus()} CPUs)",
        "rows": rows,
    }
    results["warnings"] = unlogged_metrics(study, rows)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    table = table_markdown(study, rows)
    heading = (f"# study `{study.name}`\n\n{results['written']}, {results['machine']}; base `{study.base.name}`, "
               f"seeds {list(study.seeds)}; mean ± std over seeds; mismatch columns: mean / max over a run's "
               f"steps, then over seeds; train acc: `acc/mean` of the last {FINAL_STEPS} steps.\n\n")  # fmt: skip
    (out / "table.md").write_text(heading + table)
    _remove_previous_figures(out)
    curve_dirs = cell_curves(study, out / "curves")
    results["pngs"] = [str(p) for p in plot_runs([str(d) for d in curve_dirs], str(out))] if curve_dirs else []
    return results


def unlogged_metrics(study: Study, rows: list[dict[str, Any]]) -> list[str]:
    """A line for each `metrics` entry of the study file that no finished run logged (a misspelled key gave a column
    of `-` and no word), with the logged keys closest to it."""
    import difflib

    done = [row for row in rows if row["status"] == "done"]
    missing = [spec for spec in study.metrics if done and all(row.get(spec) is None for row in done)]
    if not missing:
        return []
    logged = sorted({key for step in read_steps(Path(done[0]["run_dir"])) for key in step})
    lines = []
    for spec in missing:
        parts, _ = parse_metric(spec)
        close = [match for part in parts for match in difflib.get_close_matches(part, logged, n=3)]
        hint = f" (logged keys close to it: {', '.join(close)})" if close else ""
        lines.append(f"metric {spec!r}: no finished run logged a value for it{hint}")
    return lines


def _remove_previous_figures(out: Path) -> None:
    """The curves and PNGs an earlier report wrote: a cell without finished runs now must not keep its old ones."""
    import shutil

    shutil.rmtree(out / "curves", ignore_errors=True)
    for png in out.glob("*.png"):
        png.unlink(missing_ok=True)


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0
