"""`asyncrl study`: the study file and its validation, run states, the report, and real `--quick` studies."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from asyncrl.study import study_main
from asyncrl.study_report import COLUMNS, extra_metric, write_report
from asyncrl.study_run import run_state, up_command
from asyncrl.study_spec import StudyError, load_study
from common.config import QUANT_SCHEMES, WEIGHTINGS

ROOT = Path(__file__).resolve().parents[3]
STUDIES = sorted((ROOT / "configs" / "studies").glob("*.yaml"))
BASE = ROOT / "configs" / "dapo_int8.yaml"


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _study_file(tmp_path: Path, body: str) -> Path:
    return _write(tmp_path / "s.yaml", f"name: t\nbase: {BASE}\nseeds: [0, 1]\n{body}")


# --- the study file --------------------------------------------------------------------------------------------------


def test_shipped_studies_exist():
    assert {p.stem for p in STUDIES} >= {"quantized_rollout", "uaq", "length_decay", "fp16"}


@pytest.mark.parametrize("path", STUDIES, ids=lambda p: p.stem)
@pytest.mark.parametrize("quick", [False, True])
def test_every_shipped_study_and_cell_validates(path, quick, tmp_path):
    study = load_study(path, root=tmp_path, quick=quick)  # builds and validates every run's config
    assert len(study.runs) == len(study.cells) * len(study.seeds)
    assert {run.run_dir for run in study.runs} == {
        tmp_path / study.name / cell / f"seed{seed}" for cell in study.cells for seed in study.seeds
    }
    if quick:
        assert study.name.endswith("-quick") and len(study.cells) <= 2 and len(study.seeds) <= 2
        assert all(run.steps <= 5 for run in study.runs)


def test_quantized_rollout_is_the_full_grid():
    study = yaml.safe_load((ROOT / "configs" / "studies" / "quantized_rollout.yaml").read_text())  # validated above
    pairs = set()
    for dotlist in study["cells"].values():
        values = dict(item.split("=", 1) for item in dotlist)
        assert values["quant.scheme"] in QUANT_SCHEMES and values["loss.weighting"] in WEIGHTINGS
        pairs.add((values["quant.scheme"], values["loss.weighting"]))
    schemes, weightings = ("none", "int8", "fp8", "w4a16"), ("none", "tis", "mis_token", "acr", "acrl", "tbpo")
    assert pairs == {(s, w) for s in schemes for w in weightings}
    assert "staleness.max_lag=0" in study["overrides"]  # the mismatch is the quantization's alone
    assert "model.path=builtin:tiny-outliers" in study["overrides"]  # where quantization bites (builtin:tiny barely)


def test_base_is_found_relative_to_the_study_file(tmp_path):
    (tmp_path / "sub").mkdir()
    _write(tmp_path / "base.yaml", "train:\n  steps: 7\n")
    path = _write(tmp_path / "sub" / "s.yaml", "name: t\nbase: ../base.yaml\nseeds: [3]\ncells: {a: []}\n")
    study = load_study(path, root=tmp_path / "out")
    assert study.base == (tmp_path / "base.yaml").resolve()
    (run,) = study.runs
    assert run.steps == 7 and run.seed == 3 and "train.seed=3" in run.overrides


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("cells: {a: []}\nsteps: 3\n", "unknown key `steps`"),
        ("seeds2: [1]\ncells: {a: []}\n", "unknown key `seeds2`"),
        ("cells: {}\n", "`cells` must be a non-empty mapping"),
        ("cells: {a: [loss.weighting=tsi]}\n", "cell `a`: invalid value 'tsi' for `loss.weighting`"),
        ("cells: {a: [], b: [loss.wieghting=tis]}\n", "cell `b`: override 'loss.wieghting=tis': unknown config key"),
        ("cells: {a: [train.steps=0]}\n", "cell `a`"),
        ("cells: {a: [quant.scheme]}\n", "must look like key=value"),
        ("cells: {a: [train.seed=4]}\n", "`train.seed` is set by the study"),
        ("overrides: [logging.dir=x]\ncells: {a: []}\n", "`logging.dir` is set by the study"),
        ("cells: {a/b: []}\n", "cell name 'a/b'"),
        ("cells: {a: []}\nmetrics: [lr:median]\n", "'lr:median' must be KEY"),
        ("cells: {a: []}\nquick: {cells: [z]}\n", "`quick.cells` names `z`"),
        ("cells: {a: []}\nquick: {steps: 3}\n", "unknown key `steps`"),
        ("cells: {table.md: []}\n", "cell name 'table.md' is a file the study's report writes"),
        ("cells: {curves: []}\n", "cell name 'curves' is a file the study's report writes"),
        ("cells: {a.png: []}\n", "cell name 'a.png' is a file the study's report writes"),
        ("cells:\n  a: []\n  a: [train.steps=4]\n", "'a' is given twice in one mapping"),  # the last one was kept
        ("overrides: [train.steps=3]\ncells: {a: []}\noverrides: []\n", "'overrides' is given twice"),
    ],
)
def test_bad_study_files_fail_naming_the_fault(tmp_path, body, message):
    for quick in (False, True) if "quick" in body else (False,):  # a bad `quick` block fails without --quick too
        with pytest.raises(StudyError, match=None) as err:
            load_study(_study_file(tmp_path, body), root=tmp_path / "out", quick=quick)
        assert message in str(err.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name: t\nbase: nowhere.yaml\nseeds: [0]\ncells: {{a: []}}\n", "`base` 'nowhere.yaml' is not a file"),
        ("name: t\nbase: {base}\nseeds: [0, 0]\ncells: {{a: []}}\n", "a seed is listed twice"),
        ("name: t\nbase: {base}\nseeds: [-1]\ncells: {{a: []}}\n", "-1 is not a whole number in [0, 4294967295]"),
        ("name: t\nbase: {base}\nseeds: [0, 4294967296]\ncells: {{a: []}}\n", "4294967296 is not a whole number"),
        ("name: t\nbase: {base}\ncells: {{a: []}}\n", "missing key `seeds`"),
        ("name: ../t\nbase: {base}\nseeds: [0]\ncells: {{a: []}}\n", "`name` must be a word"),
        ("- a\n- b\n", "the top level must be a mapping"),
    ],
)
def test_bad_top_level_fails(tmp_path, text, message):
    path = _write(tmp_path / "s.yaml", text.format(base=BASE))
    with pytest.raises(StudyError) as err:
        load_study(path, root=tmp_path / "out")
    assert message in str(err.value)


def test_a_study_file_that_is_a_directory_or_not_utf8_is_named(tmp_path):
    with pytest.raises(StudyError, match="is a directory"):
        load_study(tmp_path, root=tmp_path / "out")
    path = tmp_path / "s.yaml"
    path.write_bytes(b"name: \xff\n")
    with pytest.raises(StudyError, match="s.yaml: not UTF-8 text"):
        load_study(path, root=tmp_path / "out")


def test_plan_with_report_and_a_root_that_is_a_file_are_refused(tmp_path, capsys):
    path = _study_file(tmp_path, "cells: {a: []}\n")
    assert study_main(str(path), root=str(tmp_path / "out"), plan=True, report_only=True) == 2
    assert "--plan and --report do not go together" in capsys.readouterr().err
    (tmp_path / "a_file").write_text("")
    assert study_main(str(path), root=str(tmp_path / "a_file"), plan=True) == 2
    assert f"--root {tmp_path / 'a_file'}: {tmp_path / 'a_file'} is not a directory" in capsys.readouterr().err


def test_a_bad_cell_stops_the_study_before_any_run(tmp_path, capsys):
    path = _study_file(tmp_path, "cells: {good: [quant.scheme=fp8], bad: [quant.scheme=int4]}\n")
    assert study_main(str(path), root=str(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert "cell `bad`" in err and "quant.scheme" in err and "int4" in err
    assert not (tmp_path / "out").exists()  # nothing ran, nothing was written


def test_cli_plan_lists_runs_without_running(tmp_path):
    path = _study_file(tmp_path, "cells: {a: [quant.scheme=fp8]}\n")
    proc = subprocess.run([sys.executable, "-m", "asyncrl.cli", "study", str(path), "--plan", "--root",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count(" new ") == 2 and "logging.name=seed1" in proc.stdout
    assert not (tmp_path / "out").exists()


# --- run states and the report ---------------------------------------------------------------------------------------


def _fake_run(run_dir: Path, rows: list[dict], summary: dict | None = None, checkpoint_step: int | None = None) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text("{}")
    lines = [json.dumps({"event": "startup", "time": 0.0})] + [json.dumps({"time": 1.0, **r}) for r in rows]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))
    if checkpoint_step is not None:
        ckpt = run_dir / "checkpoints" / f"step_{checkpoint_step}"
        ckpt.mkdir(parents=True)
        (ckpt / "meta.json").write_text(json.dumps({"step": checkpoint_step}))


def test_run_states_and_commands(tmp_path):
    path = _study_file(tmp_path, "overrides: [train.steps=4]\ncells: {a: [], b: []}\n")
    study = load_study(path, root=tmp_path / "out")
    new, stopped, partial, done = study.runs
    _fake_run(stopped.run_dir, [{"step": 0}], {"steps": 2, "stopped_early": True}, checkpoint_step=2)
    _fake_run(partial.run_dir, [{"step": 0}])
    _fake_run(done.run_dir, [{"step": s} for s in range(4)], {"steps": 4, "stopped_early": False})
    assert [run_state(r) for r in study.runs] == ["new", "stopped", "partial", "done"]
    assert up_command(stopped, study.base, "stopped")[3:] == ["up", "--resume", str(stopped.run_dir),
                                                              "logging.console=false", "train.steps=4"]  # fmt: skip
    assert up_command(new, study.base, "new")[3:5] == ["up", str(study.base)]
    # A run that stopped early without a checkpoint, or that did fewer steps than asked, is not done.
    (partial.run_dir / "summary.json").write_text(json.dumps({"steps": 3, "stopped_early": False}))
    assert run_state(partial) == "partial"
    for damaged in ({"steps": None, "stopped_early": False}, [1]):  # read as not done (was a TypeError)
        (partial.run_dir / "summary.json").write_text(json.dumps(damaged))
        assert run_state(partial) == "partial"


def test_a_run_held_by_a_driver_or_made_with_other_overrides_is_left_alone(tmp_path, capsys):
    """A study deleted the directory of a run another `asyncrl up` was still training (no checkpoint yet: `partial`),
    and reported runs an older spec made under the cell's new overrides."""
    from asyncrl import run_lock
    from asyncrl.study_run import _status_path, run_study

    path = _study_file(tmp_path, "overrides: [train.steps=4]\ncells: {a: [], b: []}\n")
    study = load_study(path, root=tmp_path / "out")
    held, stale = study.runs[0], study.runs[2]
    _fake_run(held.run_dir, [{"step": 0}])
    _fake_run(stale.run_dir, [{"step": s} for s in range(4)], {"steps": 4, "stopped_early": False})
    _status_path(stale).write_text(json.dumps({"returncode": 0, "wall_s": 1.0, "overrides": ["quant.scheme=fp8"]}))
    lock = run_lock.acquire(held.run_dir)
    try:
        assert run_state(held) == "running" and run_state(stale) == "stale"
        study.runs[:] = [held, stale]  # the two under test only: nothing else is started
        counts = run_study(study)
    finally:
        lock.release()
    assert counts["left"] == 2 and counts["done"] == 0
    assert (held.run_dir / "metrics.jsonl").is_file()  # not deleted
    out = capsys.readouterr().out
    assert "is held by another driver" in out and "was made with other overrides (quant.scheme=fp8)" in out


def test_a_run_the_study_could_not_finish_is_stale_once_its_cell_changes(tmp_path):
    """The study records a run's overrides as it starts it: killed with the study (kill -9) before it could write its
    status, a run was later resumed under the edited cell and reported as that cell (int8 figures in a none row)."""
    from asyncrl.study_run import Progress, _start, read_status

    root = tmp_path / "out"
    run = load_study(_study_file(tmp_path, "overrides: [train.steps=4]\ncells: {a: [quant.scheme=int8]}\n"), root).runs[
        0
    ]
    item = _start(run, BASE, Progress(total=1, parallel=1), 1)
    item.process.kill()
    item.process.wait()
    item.log.close()
    assert read_status(run)["overrides"] == list(run.overrides) and "quant.scheme=int8" in run.overrides
    assert read_status(run)["returncode"] is None
    shutil.rmtree(run.run_dir, ignore_errors=True)
    _fake_run(run.run_dir, [{"step": 0}], {"steps": 2, "stopped_early": True}, checkpoint_step=2)  # what it left
    assert run_state(run) == "stopped"
    edited = load_study(_study_file(tmp_path, "overrides: [train.steps=4]\ncells: {a: [quant.scheme=none]}\n"), root)
    assert run_state(edited.runs[0]) == "stale"


def test_runs_the_studys_ctrl_c_stopped_are_reported_stopped_and_unlogged_metrics_named(tmp_path):
    """Two Ctrl-C to a study exit its runs with 130: they were reported `failed` though resumable; a misspelled
    `metrics` key gave a column of `-` and no word."""
    body = "overrides: [train.steps=2]\ncells: {a: []}\nmetrics: [norm_updat, lr:last]\n"
    study = load_study(_study_file(tmp_path, body), root=tmp_path / "out")
    stopped, done = study.runs
    _fake_run(stopped.run_dir, [{"step": 0}], {"steps": 1, "stopped_early": True}, checkpoint_step=1)
    stopped.run_dir.with_name("seed0.status.json").write_text(
        json.dumps({"returncode": 130, "wall_s": 1.0, "overrides": list(stopped.overrides), "interrupted": True})
    )
    rows = [{**_step(s, kl=0.0, w=1.0, acc=0.5), "lr": 1e-4} for s in range(2)]
    _fake_run(done.run_dir, rows, {"steps": 2, "stopped_early": False})
    results = write_report(study)
    assert [r["status"] for r in results["rows"]] == ["stopped", "done"]
    assert results["warnings"] == [
        "metric 'norm_updat': no finished run logged a value for it (logged keys close to it: norm_update, "
        "norm_quant_err)"
    ]


def _step(step: int, kl: float, w: float, acc: float, tok_s: float = 100.0, skipped: float = 0.0) -> dict:
    return {"step": step, "acc/mean": acc, "reward/mean": acc, "mismatch/kl_k3": kl, "mismatch/w_max": w,
            "mismatch/acrl_d": kl * 10, "mismatch/log_ppl_abs_diff": kl * 100, "skipped_steps": skipped,
            "perf/rollout_tok_s": tok_s, "perf/step_s": 1.0, "norm_update": 2.0 * (step + 1),
            "norm_quant_err": 1.0}  # fmt: skip


def test_report_rows_table_and_pngs(tmp_path):
    body = "overrides: [train.steps=3]\ncells: {fp32: [quant.scheme=none], int8: []}\nmetrics: [norm_update / norm_quant_err, norm_update:last]\n"  # noqa: E501
    study = load_study(_study_file(tmp_path, body), root=tmp_path / "out")
    for run in study.runs:
        scale = 0.0 if run.cell == "fp32" else 0.01 * (run.seed + 1)
        acc = 0.4 + 0.1 * run.seed
        rows = [_step(s, kl=scale * (s + 1), w=1 + scale * 10 * s, acc=acc + 0.1 * s) for s in range(3)]
        _fake_run(run.run_dir, rows, {"steps": 3, "stopped_early": False, "eval/acc_greedy": 0.5 + 0.25 * run.seed})
    results = write_report(study)
    out = study.out_dir
    saved = json.loads((out / "results.json").read_text())
    assert [(r["cell"], r["seed"], r["status"]) for r in saved["rows"]] == [
        ("fp32", 0, "done"), ("fp32", 1, "done"), ("int8", 0, "done"), ("int8", 1, "done")]  # fmt: skip
    int8_s1 = saved["rows"][3]
    assert int8_s1["mismatch/kl_k3"] == pytest.approx({"mean": 0.04, "max": 0.06})
    assert int8_s1["mismatch/w_max"] == pytest.approx({"mean": 1.2, "max": 1.4})
    assert int8_s1["acc/mean"] == pytest.approx(0.6)  # mean over the last FINAL_STEPS (here all 3) steps
    assert int8_s1["eval/acc_greedy"] == 0.75 and int8_s1["skipped_steps"] == 0.0
    assert int8_s1["perf/rollout_tok_s"] == pytest.approx(100.0)
    assert int8_s1["norm_update / norm_quant_err"] == pytest.approx(4.0) and int8_s1["norm_update:last"] == 6.0
    assert saved["rows"][0]["mismatch/kl_k3"] == {"mean": 0.0, "max": 0.0}
    table = (out / "table.md").read_text().splitlines()
    header = next(line for line in table if line.startswith("| cell"))
    for title, _, _ in COLUMNS:
        assert f"| {title} |" in header
    assert "| norm_update / norm_quant_err |" in header and header.endswith("| n |")
    int8_line = next(line for line in table if line.startswith("| int8 |"))
    assert "| 0.03 ± 0.0141 | 0.045 ± 0.0212 |" in int8_line  # kl_k3 mean, max: over seeds (0.02, 0.04), ± std
    assert int8_line.endswith("| 4 ± 0 | 6 ± 0 | 2 |")  # the study's metrics, then n
    assert {Path(p).name for p in results["pngs"]} >= {"reward_accuracy.png", "mismatch.png"}
    for png in results["pngs"]:
        assert Path(png).read_bytes()[:4] == b"\x89PNG"
    curve = [json.loads(line) for line in (out / "curves" / "int8" / "metrics.jsonl").read_text().splitlines()]
    assert curve[2]["mismatch/kl_k3"] == pytest.approx((0.03 + 0.06) / 2)  # per-step mean over the two seeds


def test_report_marks_failed_and_unfinished_runs(tmp_path):
    study = load_study(_study_file(tmp_path, "cells: {a: []}\n"), root=tmp_path / "out")
    first, second = study.runs
    first.run_dir.parent.mkdir(parents=True)
    first.run_dir.with_name("seed0.status.json").write_text(json.dumps({"returncode": 1, "wall_s": 3.0}))
    results = write_report(study)
    assert [r["status"] for r in results["rows"]] == ["failed", "new"]
    assert (
        "| a | - |" in (study.out_dir / "table.md").read_text()
        and "0 (1 failed) |" in (study.out_dir / "table.md").read_text()
    )
    assert results["pngs"] == []


def test_report_held_out_falls_back_to_the_greedy_episodes_of_multi_turn_runs(tmp_path):
    # A run with an environment (env.fn) has no single-turn greedy decode: its summary has eval/acc_greedy_rollout.
    study = load_study(_study_file(tmp_path, "overrides: [train.steps=2]\ncells: {a: []}\n"), root=tmp_path / "out")
    single, multi = study.runs
    rows = [_step(s, kl=0.0, w=1.0, acc=0.5) for s in range(2)]
    _fake_run(single.run_dir, rows, {"steps": 2, "stopped_early": False, "eval/acc_greedy": 0.25,
                                     "eval/acc_greedy_rollout": 0.75})  # fmt: skip
    _fake_run(multi.run_dir, rows, {"steps": 2, "stopped_early": False, "eval/acc_greedy_rollout": 0.75})
    results = write_report(study)
    assert [(r["eval/key"], r["eval/acc_greedy"]) for r in results["rows"]] == [
        ("eval/acc_greedy", 0.25), ("eval/acc_greedy_rollout", 0.75)]  # fmt: skip
    assert "| a | 0.500 ± 0.000 | 0.500 ± 0.354 |" in (study.out_dir / "table.md").read_text()


def test_extra_metric_stats():
    steps = [{"a": 1.0, "b": 2.0}, {"a": 3.0, "b": 0.0}, {"a": None, "b": 1.0}, {"a": 5.0, "b": 5.0}]
    assert extra_metric(steps, "a") == 3.0
    assert extra_metric(steps, "a:last") == 5.0 and extra_metric(steps, "a:max") == 5.0
    assert extra_metric(steps, "a / b") == pytest.approx((0.5 + 1.0) / 2)  # b == 0 and a missing are skipped
    assert extra_metric(steps, "c") is None


# --- real studies ----------------------------------------------------------------------------------------------------


def _study_cli(*args: str, cwd: Path, timeout: int = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", "study", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)  # fmt: skip


@pytest.mark.slow
def test_quick_quantized_rollout_study_runs_reports_and_skips_done_runs(tmp_path):
    study_file = str(ROOT / "configs" / "studies" / "quantized_rollout.yaml")
    out = tmp_path / "studies" / "quantized_rollout-quick"
    junk = out / "fp32_none" / "seed0"  # a run killed before its first checkpoint: started over
    junk.mkdir(parents=True)
    (junk / "metrics.jsonl").write_text('{"step": 0, "acc/mean": 0.0}\n{"step": 1, "acc/me')
    # --parallel 2: both runs side by side (their start-ups overlap: the test takes less time)
    proc = _study_cli(study_file, "--quick", "--parallel", "2", "--root", str(tmp_path / "studies"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "starting over" in proc.stdout and "run 2/2 int8_none seed 0 step" in proc.stdout
    results = json.loads((out / "results.json").read_text())
    rows = {row["cell"]: row for row in results["rows"]}
    assert list(rows) == ["fp32_none", "int8_none"] and all(r["status"] == "done" for r in rows.values())
    for row in rows.values():
        assert row["steps"] == 3 and 0.0 <= row["acc/mean"] <= 1.0 and 0.0 <= row["eval/acc_greedy"] <= 1.0
        assert row["perf/rollout_tok_s"] > 0 and row["skipped_steps"] == 0
    # fp32 rollout against the fp32 learner: no mismatch beyond rounding; INT8 rollout: a measurable one.
    assert rows["fp32_none"]["mismatch/kl_k3"]["max"] < 1e-6 and rows["fp32_none"]["mismatch/w_max"]["max"] < 1.001
    assert rows["int8_none"]["mismatch/kl_k3"]["mean"] > 10 * rows["fp32_none"]["mismatch/kl_k3"]["mean"]
    table = (out / "table.md").read_text()
    assert "| fp32_none |" in table and "| int8_none |" in table and "| kl_k3 mean | kl_k3 max |" in table
    assert (out / "reward_accuracy.png").is_file() and (out / "mismatch.png").is_file()
    metrics_mtime = (out / "int8_none" / "seed0" / "metrics.jsonl").stat().st_mtime_ns
    again = _study_cli(study_file, "--quick", "--root", str(tmp_path / "studies"), cwd=tmp_path, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "2 of 2 runs already done (skipped)" in again.stdout
    assert (out / "int8_none" / "seed0" / "metrics.jsonl").stat().st_mtime_ns == metrics_mtime
    assert json.loads((out / "results.json").read_text())["rows"] == results["rows"]


@pytest.mark.slow
def test_a_stopped_study_resumes_its_run_from_the_checkpoint(tmp_path):
    path = _write(
        tmp_path / "s.yaml",
        f"""name: stop
base: {BASE}
seeds: [0]
overrides: [train.steps=12, train.groups_per_step=4, data.eval_size=8, checkpoint.final=false, staleness.max_lag=0]
cells: {{a: []}}
""",
    )
    run_dir = tmp_path / "studies" / "stop" / "a" / "seed0"
    argv = [sys.executable, "-m", "asyncrl.cli", "study", str(path), "--root", str(tmp_path / "studies")]
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file() and metrics.read_text().count('"step": 2,') >= 1:
            break
        time.sleep(0.3)
    os.kill(proc.pid, signal.SIGTERM)  # like Ctrl-C: the run finishes its step, checkpoints and stops
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 1, output[-3000:]
    assert "the next `asyncrl study` continues it" in output
    assert run_state(load_study(path, root=tmp_path / "studies").runs[0]) == "stopped"
    stopped_at = json.loads((run_dir / "summary.json").read_text())["steps"]
    assert 3 <= stopped_at < 12
    again = _study_cli(str(path), "--root", str(tmp_path / "studies"), cwd=tmp_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resuming" in again.stdout
    commands = [line for line in run_dir.with_name("seed0.log").read_text().splitlines() if line.startswith("$ ")]
    assert len(commands) == 2 and "--resume" not in commands[0] and f"--resume {run_dir}" in commands[1]
    rows = json.loads((tmp_path / "studies" / "stop" / "results.json").read_text())["rows"]
    assert rows[0]["status"] == "done"
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"event"' not in line]  # fmt: skip
    assert steps == list(range(12))  # every step once: the resumed run went on from the checkpoint


def test_a_second_study_process_on_the_same_study_is_refused(tmp_path, capsys):
    from asyncrl.study_run import study_lock

    path = _study_file(tmp_path, "cells: {a: []}\n")
    study = load_study(path, root=tmp_path / "out")
    with study_lock(study.out_dir):
        assert study_main(str(path), root=str(tmp_path / "out")) == 2
    assert "another `asyncrl study` is running this study" in capsys.readouterr().err
    assert not study.runs[0].run_dir.exists()


def test_a_report_over_a_damaged_run_a_partial_column_and_old_figures(tmp_path):
    """A garbled metrics.jsonl made `--report` a traceback; a column only one of two seeds has showed its one value
    as the cell's with n = 2; a cell whose runs are gone kept its old curves and PNGs."""
    study = load_study(_study_file(tmp_path, "overrides: [train.steps=3]\ncells: {a: [], b: []}\n"),
                       root=tmp_path / "out")  # fmt: skip
    for run in study.runs:
        summary = {"steps": 3, "stopped_early": False, **({"eval/acc_greedy": 0.5} if run.seed == 0 else {})}
        _fake_run(run.run_dir, [_step(s, kl=0.01, w=1.0017, acc=0.5) for s in range(3)], summary)
    write_report(study)
    out = study.out_dir
    assert (out / "curves" / "b").is_dir() and any(out.glob("*.png"))
    a_line = next(line for line in (out / "table.md").read_text().splitlines() if line.startswith("| a |"))
    assert "| 0.500 (n=1) |" in a_line and "1.0017" in a_line  # held-out of one seed of two; w_max not "1"
    for run in study.runs:
        if run.cell == "b":
            (run.run_dir / "summary.json").unlink()  # no finished run left in b
    bad = study.runs[1].run_dir / "metrics.jsonl"
    bad.write_text(bad.read_text() + "{not json\n" + json.dumps({"step": 3}) + "\n")
    write_report(study)  # no traceback
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert rows[1]["status"] == "damaged" and rows[1]["error"].startswith("ValueError")
    assert not (out / "curves" / "b").exists()
    a_line = next(line for line in (out / "table.md").read_text().splitlines() if line.startswith("| a |"))
    assert a_line.endswith("| 1 (1 unfinished) (1 damaged) |")
