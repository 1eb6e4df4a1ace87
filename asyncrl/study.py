"""`asyncrl study STUDY.yaml`: run a grid of `asyncrl up` runs (cells x seeds) and compare them in one table.

    asyncrl study configs/studies/quantized_rollout.yaml              # every cell x seed, one after another
    asyncrl study configs/studies/quantized_rollout.yaml --quick      # two cells, one seed, 3 steps (CI)
    asyncrl study STUDY.yaml --parallel 2                              # two runs side by side
    asyncrl study STUDY.yaml --plan                                    # validate, list the runs and their state
    asyncrl study STUDY.yaml --report                                  # only rewrite results.json / table.md / PNGs

The study file and its validation: `asyncrl/study_spec.py`. Running, resuming and the progress line:
`asyncrl/study_run.py`. results.json, table.md and the PNGs: `asyncrl/study_report.py`. Everything lands in
runs/studies/<name>/ (`--root` changes runs/studies): <cell>/seed<k>/ (the run), <cell>/seed<k>.log (its output),
results.json, table.md, *.png and curves/<cell>/metrics.jsonl (the per-step mean over seeds drawn in the PNGs).

Runs side by side are `--parallel N` local processes, not Ray tasks: each `asyncrl up` starts its own local Ray
cluster, and N processes share the machine's cores. A run starts once the running ones have logged their first step
(start-ups are staggered: two local Ray clusters starting at once on a loaded machine have timed out).
"""

from __future__ import annotations

import sys
from pathlib import Path

from asyncrl.study_spec import Study, StudyError, load_study


def study_main(path: str, *, quick: bool = False, parallel: int = 1, root: str = "runs/studies", plan: bool = False,
               report_only: bool = False) -> int:  # fmt: skip
    """The `asyncrl study` command; returns its exit code (2: a bad study file, 1: some runs failed or the study
    was stopped before the end)."""
    try:
        study = load_study(path, root=root, quick=quick)
    except StudyError as err:
        print(f"asyncrl: study error: {err}", file=sys.stderr)
        return 2
    if parallel < 1:
        print(f"asyncrl: --parallel must be at least 1, got {parallel}", file=sys.stderr)
        return 2
    if plan and report_only:
        print("asyncrl: --plan and --report do not go together (--plan runs and writes nothing)", file=sys.stderr)
        return 2
    existing = next((p for p in (study.out_dir, *study.out_dir.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        print(f"asyncrl: --root {root}: {existing} is not a directory", file=sys.stderr)
        return 2
    if plan:
        _print_plan(study)
        return 0
    from asyncrl.study_report import write_report

    unfinished = 0
    if not report_only:
        from asyncrl.study_run import StudyBusyError, run_study

        total_steps = sum(run.steps for run in study.runs)
        print(f"study {study.name}: {len(study.cells)} cells x {len(study.seeds)} seeds = {len(study.runs)} runs, "
              f"{total_steps} steps, in {study.out_dir}")  # fmt: skip
        try:
            counts = run_study(study, parallel=parallel)
        except StudyBusyError as err:
            print(f"asyncrl: {err}", file=sys.stderr)
            return 2
        unfinished = counts["failed"] + counts["interrupted"] + counts["left"]
        print(f"study {study.name}: {counts['done']} runs done, {counts['skipped']} skipped (done before), "
              f"{counts['failed']} failed, {counts['interrupted']} interrupted, {counts['left']} left alone (said "
              "above)")  # fmt: skip
        if counts["interrupted"]:
            print(f"study {study.name}: stopped; run the same command again to continue")
    results = write_report(study)
    out = study.out_dir
    for line in results["warnings"]:
        print(f"study {study.name}: {line}", file=sys.stderr)
    print((out / "table.md").read_text(), end="")
    print(f"wrote {out / 'results.json'}, {out / 'table.md'} and {len(results['pngs'])} PNGs in {out}")
    return 1 if unfinished else 0


def _print_plan(study: Study) -> None:
    from asyncrl.study_run import run_state, up_command

    print(f"study {study.name}: base {study.base}; {len(study.runs)} runs in {study.out_dir}")
    for run in study.runs:
        state = run_state(run)
        print(f"  {run.cell:<24} seed {run.seed:<4} {run.steps:>5} steps  {state:<8} "
              f"{' '.join(up_command(run, Path(study.base), state)[3:])}")  # fmt: skip
