"""`asyncrl up --resume` of a run that finished with `checkpoint.every=0` (no checkpoint): refused, naming what it
would do; it trained the run again from step 0, logged its steps twice and replaced final/ (exit 0, one info line)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.cli import main
from common.config import load_config, to_dict


def _run_dir(tmp_path: Path, summary: dict) -> Path:
    run_dir = tmp_path / "o"
    run_dir.mkdir()
    config = load_config(None, [f"logging.dir={tmp_path}", "logging.name=o", "train.steps=10"])
    (run_dir / "config.json").write_text(json.dumps(to_dict(config)))
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "final").mkdir()
    return run_dir


def test_a_finished_run_without_a_checkpoint_is_not_resumed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir = _run_dir(tmp_path, {"steps": 10, "stopped_early": False, "run_dir": "o"})
    assert main(["up", "--resume", str(run_dir), "train.steps=15"]) == 2
    err = capsys.readouterr().err
    assert f"cannot resume {run_dir}: it finished and holds no checkpoint" in err
    assert f"model.path={run_dir / 'final'}" in err and "checkpoint.every" in err
    assert not (run_dir / "metrics.jsonl").exists()  # nothing trained


def test_a_run_stopped_without_a_checkpoint_still_resumes_from_the_initial_model(tmp_path: Path) -> None:
    """A run abandoned on a second SIGTERM (summary.json written, stopped early, no checkpoint) says "resume ...
    (from the initial model)": that stays allowed (the check reads `stopped_early`)."""
    from asyncrl.checkpoint import finished_steps

    assert finished_steps(_run_dir(tmp_path, {"steps": 3, "stopped_early": True})) is None
    assert finished_steps(tmp_path) is None  # no summary.json: killed
    (tmp_path / "summary.json").write_text("{damaged")
    assert finished_steps(tmp_path) is None
