"""The run logger: wandb is the optional extra `asyncrl[wandb]`; without it `logging.wandb=true` fails clearly and
`logging.wandb=false` never imports it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from asyncrl.cli import main as cli_main
from asyncrl.metrics import MetricsLogger
from common.config import ConfigError, LoggingConfig

ROOT = Path(__file__).resolve().parents[3]


def test_wandb_on_without_the_package_names_the_key_and_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now fails as if it were not installed
    monkeypatch.setenv("WANDB_MODE", "disabled")  # the logger sets it by default: keep other tests' environment
    with pytest.raises(ConfigError, match=r"logging\.wandb=true .*pip install 'asyncrl\[wandb\]'"):
        MetricsLogger(LoggingConfig(name="run", console=False, wandb=True), tmp_path)
    assert list(tmp_path.iterdir()) == []  # it failed before opening metrics.jsonl


def test_asyncrl_up_says_what_to_install_before_starting_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setattr("asyncrl.driver.quiet_libraries", lambda: None)  # it sets this process's environment
    config = str(ROOT / "configs" / "dapo_int8.yaml")
    overrides = ["logging.wandb=true", "model.path=builtin:micro", f"logging.dir={tmp_path}", "logging.name=run"]
    assert cli_main(["up", config, *overrides]) == 2
    message = "asyncrl: logging.wandb=true needs the wandb package: pip install 'asyncrl[wandb]'"
    assert message in capsys.readouterr().err  # a message and exit code 2, not a traceback
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # it failed before the buffer and Ray were started


def test_wandb_off_logs_steps_without_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    logger = MetricsLogger(LoggingConfig(name="run", console=False), tmp_path)
    logger.log_step({"step": 0, "reward/mean": 0.5, "acc/mean": float("nan")})
    logger.close()
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert (record["step"], record["reward/mean"], record["acc/mean"]) == (0, 0.5, None)


def test_a_torn_last_record_is_cut_before_a_resumed_run_appends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A run killed while writing a record left half a line; the resumed run's records were glued to it, and the file
    was no longer readable past it (`asyncrl plot`: "line 28: not a JSON record")."""
    from asyncrl.plot import read_steps

    monkeypatch.setitem(sys.modules, "wandb", None)
    whole = '{"step": 0, "loss": 1.0}\n{"step": 1, "loss": 2.0}\n'
    (tmp_path / "metrics.jsonl").write_text(whole + '{"step": 2, "lo')
    logger = MetricsLogger(LoggingConfig(name="run", console=False), tmp_path)
    assert (tmp_path / "metrics.jsonl").read_text() == whole
    logger.event("resume", from_step=2)
    logger.log_step({"step": 2, "loss": 3.0})
    logger.close()
    assert [(r["step"], r["loss"]) for r in read_steps(tmp_path)] == [(0, 1.0), (1, 2.0), (2, 3.0)]
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "lo')  # one torn line and nothing else
    MetricsLogger(LoggingConfig(name="run", console=False), tmp_path).close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_the_console_line_leaves_out_what_was_not_measured():
    """A step whose interval saw no new sample printed `reward nan  acc nan`."""
    from asyncrl.metrics import step_line

    line = step_line({"step": 9, "reward/mean": float("nan"), "acc/mean": float("nan"), "perf/step_s": 0.5})
    assert line == "step 9  step_s 0.50"
