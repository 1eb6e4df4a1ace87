"""`asyncrl plot RUN_DIR [RUN_DIR ...] [--out DIR]`: PNGs comparing runs, one figure per metric family.

Reads each run's metrics.jsonl (step records only; events are skipped; after `asyncrl up --resume` a step logged
twice, once by the killed run and once after the resume, is drawn from its last record) and draws every run on the
same axes:
reward and accuracy, response length, every `mismatch/*` metric, staleness, learning rate, throughput, losses
and norms, and the held-out evaluations (`eval` events, asyncrl/evaluate.py: every `eval/*` metric at the step
record of the last step before it ran). A metric a run never logged is simply absent from its figure.
"""

from __future__ import annotations

import json
from pathlib import Path

FAMILIES: dict[str, tuple[str, ...]] = {
    "reward_accuracy": ("reward/mean", "acc/mean", "acc/batch"),
    "response_length": ("response_len/mean", "response_len/max"),
    "mismatch": ("mismatch/",),
    "staleness": ("staleness/",),
    "lr": ("lr",),
    "throughput": ("perf/rollout_tok_s", "perf/step_s", "perf/train_s"),
    "optimization": ("loss", "grad_norm", "entropy", "norm_update", "norm_quant_err"),
    "eval": ("eval/",),
}


def read_evals(run_dir: Path) -> list[dict[str, float]]:
    """The `eval` events of a run as rows {step: the step record it followed, eval/*: value}; the last one per step.
    A step record's `step` counts from 0 and an eval's `after_steps` counts steps done: the eval after 10 steps sits
    at step 9, beside the training figures of the weights it scored (it was drawn one step to the right)."""
    by_step = {int(r["after_steps"]): {"step": r["after_steps"] - 1, **r} for r in _records(run_dir)
               if r.get("event") == "eval" and isinstance(r.get("after_steps"), int)}  # fmt: skip
    return [by_step[step] for step in sorted(by_step)]


def read_steps(run_dir: Path) -> list[dict[str, float]]:
    by_step: dict[int, dict[str, float]] = {}
    for record in _records(run_dir):
        if "event" not in record and "step" in record:
            by_step[record["step"]] = record  # the last record of a step wins (resumed runs)
    return [by_step[step] for step in sorted(by_step)]


def _records(run_dir: Path) -> list[dict]:
    """The JSON objects of run_dir/metrics.jsonl; a step record's `step` is checked to be a whole number."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (is this a run directory?)")
    records = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text ({err})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):  # torn by a run killed while writing it: the steps before it stand
                break
            raise ValueError(f"{path}, line {number}: not a JSON record ({err})") from None
        if not isinstance(record, dict):
            continue
        step = record.get("step")
        if "event" not in record and "step" in record and (type(step) is not int or step < 0):
            raise ValueError(f"{path}, line {number}: step is {step!r}, not a whole number")
        records.append(record)
    return records


def _keys(prefixes: tuple[str, ...], runs: dict[str, list[dict[str, float]]]) -> list[str]:
    seen: list[str] = []
    for rows in runs.values():
        for row in rows:
            for key, value in row.items():
                matches = any(key == p or (p.endswith("/") and key.startswith(p)) for p in prefixes)
                if matches and isinstance(value, int | float) and key not in seen:
                    seen.append(key)
    return seen


def plot_runs(run_dirs: list[str], out_dir: str) -> list[Path]:
    """Write one PNG per metric family into out_dir; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    resolved = [Path(d).resolve() for d in run_dirs]
    twice = next((d for d, r in zip(run_dirs, resolved) if resolved.count(r) > 1), None)
    if twice is not None:
        raise ValueError(f"{twice} is given twice: each run is drawn once")
    names = [Path(d).name for d in run_dirs]
    labels = [n if names.count(n) == 1 else str(d) for n, d in zip(names, run_dirs)]  # same name: full path
    runs = {label: read_steps(Path(d)) for label, d in zip(labels, run_dirs)}
    evals = {label: read_evals(Path(d)) for label, d in zip(labels, run_dirs)}
    for label, d in zip(labels, run_dirs):
        if not runs[label] and not evals[label]:
            raise ValueError(f"{d}/metrics.jsonl has no step records yet (has the run trained a step?)")
    target = Path(out_dir)
    if target.exists() and not target.is_dir():
        raise ValueError(f"--out {out_dir} is a file; it names the directory for the PNGs")
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for family, prefixes in FAMILIES.items():
        family_runs = evals if family == "eval" else runs
        keys = _keys(prefixes, family_runs)
        if not keys:
            continue
        fig, axes = plt.subplots(len(keys), 1, figsize=(8, 2.6 * len(keys)), squeeze=False)
        for ax, key in zip(axes[:, 0], keys):
            for name, rows in family_runs.items():
                points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
                if points:  # markers where the points are few: one point as a bare line is not drawn at all
                    ax.plot(*zip(*points), label=name, marker="o" if len(points) <= 30 else None, markersize=4)
            ax.set_title(key)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = target / f"{family}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written
