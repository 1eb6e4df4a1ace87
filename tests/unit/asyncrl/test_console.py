"""The terminal dashboard (asyncrl/console.py) rendered from a step's recorded metrics, and the plain lines the run
logger prints when stdout is not a terminal."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from asyncrl import console as console_module
from asyncrl.console import RunView, clock, dashboard, headline, one_time_work
from asyncrl.metrics import MetricsLogger
from common.config import LoggingConfig

RECORDED = {  # step 40 of a dapo_int8 run on builtin:tiny (metrics.jsonl, a few learner keys left out)
    "time": 1795518642.6466541, "loss": 0.024346770718693733, "grad_norm": 5.151883602142334,
    "mismatch/acrl_d": 0.002129806438460946, "mismatch/kl_k1": 0.002201622584834695,
    "mismatch/kl_k3": 0.0005045765428803861, "mismatch/w_max": 1.1215711832046509, "step": 40, "version": 41,
    "reward/batch": 0.8203125, "acc/batch": 0.8203125, "response_len/mean": 2.6796875, "staleness/mean": 0.4375,
    "staleness/max": 1.0, "staleness/dropped": 0.0, "entropy": 0.18196919560432434, "lr": 0.0001,
    "acc/mean": 0.90625, "reward/mean": 0.90625, "rollout/samples": 288.0, "perf/rollout_tok_s": 2282.926324721289,
    "perf/step_s": 0.35831204500209424, "rollout/workers": 2.0, "rollout/restarts": 0.0, "reward/errors": 0.0,
}  # fmt: skip


def render(renderable: object, width: int = 100) -> str:
    console = Console(record=True, force_terminal=True, width=width, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_dashboard_shows_progress_eta_the_numbers_and_recent_events():
    view = RunView(name="dapo_int8", total_steps=100, started=1000.0)
    for i, now in enumerate((1001.0, 1003.0, 1005.0)):  # step times 1, 2, 2 s: mean 5/3 s
        view.record_step({**RECORDED, "step": 38 + i}, now)
    view.record_event("scale rollout=3 added=['worker-2'] step=40", 0.0)
    view.record_event("worker_started worker=worker-2 pid=1234", 0.0)
    text = render(dashboard(view, now=1073.0))
    lines = text.splitlines()
    assert lines[0].startswith("dapo_int8 ") and "━" in lines[0]
    assert "step 41/100" in lines[0] and "0:01:13 elapsed" in lines[0]
    assert "ETA 0:01:38 at 1.67 s/step" in lines[0]  # 59 steps left x 5/3 s = 98.3 s
    assert lines[1] == (
        "reward 0.906  acc 0.906  staleness 0.4 (max 1)  mismatch kl 5.0e-04  rollout 2,283 tok/s  workers 2"
    )
    assert lines[2].endswith("scale rollout=3 added=['worker-2'] step=40")
    assert lines[3].endswith("worker_started worker=worker-2 pid=1234")
    assert len(lines) == 4


def test_before_the_first_step_the_bar_is_empty_and_the_eta_unknown():
    view = RunView(name="r", total_steps=10, start_step=4, started=0.0)  # a run resumed at step 4
    lines = render(dashboard(view, now=5.0)).splitlines()
    assert "step 4/10" in lines[0] and "0:00:05 elapsed" in lines[0] and "ETA -:--:--" in lines[0]
    assert lines[1] == "waiting for the first step"


def test_the_eta_counts_only_the_steps_left_and_follows_recent_steps():
    view = RunView(name="r", total_steps=50, start_step=20, started=0.0)
    for step in range(20, 50):
        view.record_step({"step": step}, now=float(step - 19) * (1.0 if step < 40 else 3.0))
    assert view.steps_done() == 50 and view.eta_s() == 0.0
    assert len(view.step_times_s) == console_module.STEP_WINDOW
    view.record_step({"step": 30}, now=view.last_step_at + 3.0)
    assert view.eta_s() == pytest.approx(19 * sum(view.step_times_s) / len(view.step_times_s))


def test_headline_leaves_out_what_was_not_measured():
    assert headline({"reward/mean": 0.5, "acc/mean": float("nan"), "staleness/mean": 1.0}) == (
        "[dim]reward[/dim] [bold]0.500[/bold]  [dim]staleness[/dim] [bold]1.0[/bold]"
    )
    assert clock(3725.9) == "1:02:05" and clock(None) == "-:--:--" and clock(float("nan")) == "-:--:--"


def test_not_on_a_terminal_the_logger_prints_plain_step_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    logger = MetricsLogger(LoggingConfig(name="run"), tmp_path)
    with logger.live_view(total_steps=100):  # stdout is captured, not a TTY: no dashboard
        logger.log_step(RECORDED)
        logger.event("scale", rollout=3)
    logger.close()
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "step 40  reward 0.906  acc 0.906  len 2.7  stale 1  acrl_d 0.0021  tok/s 2283  step_s 0.36"
    ]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 40 and rows[1]["event"] == "scale"


def test_on_a_terminal_the_logger_draws_the_dashboard_instead_of_step_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr("asyncrl.metrics.is_terminal", lambda enabled: enabled)  # as if stdout were a TTY
    logger = MetricsLogger(LoggingConfig(name="tty-run"), tmp_path)
    logger.console = Console(record=True, force_terminal=True, width=100, color_system=None, file=io.StringIO())
    with logger.live_view(total_steps=100, start_step=0):
        logger.event("startup", at_s={"ray_ready": 1.5}, total_s=9.5)
        logger.log_step(RECORDED)
        logger.event("scale", rollout=3, added=["worker-2"], removed=[])
    logger.close()
    shown = logger.console.export_text()
    assert "tty-run" in shown and "step 41/100" in shown and "rollout 2,283 tok/s  workers 2" in shown
    assert "startup total_s=9.5" in shown and "ray_ready" not in shown  # nested fields stay in metrics.jsonl
    assert "scale rollout=3 added=['worker-2'] removed=[]" in shown
    assert "acrl_d" not in shown  # no plain step line beside the dashboard


def test_one_time_work_prints_its_lines_when_not_on_a_terminal(capsys: pytest.CaptureFixture[str]):
    with one_time_work(True) as log:
        log("building builtin:tiny into /cache (once; later runs reuse it)")
        log("built builtin:tiny in 180 s")
    assert capsys.readouterr().out.splitlines() == [
        "building builtin:tiny into /cache (once; later runs reuse it)",
        "built builtin:tiny in 180 s",
    ]
