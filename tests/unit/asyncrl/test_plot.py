"""`asyncrl plot` writes non-empty PNGs comparing runs, and rejects a directory that is not a run."""

from __future__ import annotations

import json
import subprocess
import sys


def write_run(path, offset: float) -> None:
    path.mkdir()
    rows = [{"event": "eval", "acc_greedy": 0.5}]
    for step in range(5):
        rows.append({"step": step, "acc/mean": 0.4 + offset + 0.1 * step, "reward/mean": 0.4 + 0.1 * step,
                     "mismatch/acrl_d": 0.01 / (step + 1), "mismatch/kl_k3": 0.001, "staleness/max": 1,
                     "lr": 1e-4, "perf/rollout_tok_s": 500.0, "loss": None})  # fmt: skip
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_plot_writes_pngs(tmp_path):
    write_run(tmp_path / "a", 0.0)
    write_run(tmp_path / "b", 0.05)
    out = tmp_path / "plots"
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "plot", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    names = {p.name for p in out.glob("*.png")}
    assert {"reward_accuracy.png", "mismatch.png", "staleness.png", "lr.png", "throughput.png"} <= names
    for png in out.glob("*.png"):
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_plot_rejects_non_run_dirs(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "asyncrl.cli", "plot", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2 and "no metrics.jsonl" in proc.stderr


def test_a_resumed_run_draws_each_step_once_from_its_last_record(tmp_path):
    from asyncrl.plot import read_steps

    rows = [{"step": 0, "loss": 1.0}, {"step": 1, "loss": 2.0}, {"step": 2, "loss": 3.0},
            {"event": "resume", "from_step": 1}, {"step": 1, "loss": 5.0}, {"step": 2, "loss": 6.0}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [(r["step"], r["loss"]) for r in read_steps(tmp_path)] == [(0, 1.0), (1, 5.0), (2, 6.0)]


def test_a_torn_last_line_is_ignored_and_a_bad_line_named(tmp_path):
    import pytest

    from asyncrl.plot import read_steps

    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert [row["step"] for row in read_steps(tmp_path)] == [0, 1]  # killed while writing step 2
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\nnot json\n{"step": 2, "loss": 3.0}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: not a JSON record"):
        read_steps(tmp_path)


def test_an_out_path_that_is_a_file_is_a_clear_error(tmp_path):
    write_run(tmp_path / "a", 0.0)
    (tmp_path / "taken").write_text("")
    args = [sys.executable, "-m", "asyncrl.cli", "plot", str(tmp_path / "a"), "--out", str(tmp_path / "taken")]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"--out {tmp_path / 'taken'} is a file" in proc.stderr


def test_bad_step_values_non_utf8_and_empty_runs_are_named(tmp_path):
    import pytest

    from asyncrl.plot import plot_runs, read_steps

    metrics = tmp_path / "metrics.jsonl"
    for step in ("null", "[1]", "1e400", '"abc"', "-1", "true", "1.5"):
        metrics.write_text(f'{{"step": 0, "loss": 1.0}}\n{{"step": {step}, "loss": 2.0}}\n{{"step": 2}}\n')
        with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: step is .*, not a whole number"):
            read_steps(tmp_path)
    metrics.write_bytes(b'{"step": 0, "loss": 1.0}\n{"step": 1, "note": "\xff"}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: not UTF-8 text"):
        read_steps(tmp_path)
    metrics.write_text('{"event": "start"}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl has no step records yet"):
        plot_runs([str(tmp_path)], str(tmp_path / "plots"))
    assert not (tmp_path / "plots").exists()


def test_a_run_given_twice_is_refused(tmp_path):
    import pytest

    from asyncrl.plot import plot_runs

    write_run(tmp_path / "a", 0.0)
    with pytest.raises(ValueError, match="is given twice"):
        plot_runs([str(tmp_path / "a"), str(tmp_path / "a") + "/"], str(tmp_path / "plots"))
