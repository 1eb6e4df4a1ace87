"""Operations end to end, with real processes and signals: kill and resume the driver, kill a rollout worker, and
control a live run from another process (`asyncrl status | scale | set | down`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.bench.chaos_faults import records  # metrics.jsonl so far; a line still being written is left out
from buffer.journal import read_records
from common import wire

ROOT = Path(__file__).resolve().parents[2]
SMALL = (
    "model.path=builtin:micro", "train.groups_per_step=2", "train.group_size=4", "algo.filter_groups=false",
    "data.eval_size=0", "checkpoint.final=false",
)  # fmt: skip
ENV = dict(os.environ)


def start_up(tmp_path: Path, *args: str) -> subprocess.Popen:
    """`asyncrl up` in its own process group (so that the test can kill it and everything it started)."""
    return subprocess.Popen(
        [sys.executable, "-m", "asyncrl.cli", "up", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=ENV, cwd=tmp_path, start_new_session=True,
    )  # fmt: skip


def cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", *args], capture_output=True, text=True, env=ENV,
                          cwd=tmp_path, timeout=60)  # fmt: skip


def down_and_wait(tmp_path: Path, run_dir: Path, proc: subprocess.Popen, timeout_s: float = 300) -> str:
    """`asyncrl down` the run, wait for its driver to exit 0 and return its output."""
    down = cli(tmp_path, "down", str(run_dir))
    assert down.returncode == 0, down.stderr
    out, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, out[-4000:]
    return out


def kill_if_running(proc: subprocess.Popen) -> None:
    """SIGKILL a run's process group (`start_up`) if its driver is still there: a test's cleanup."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)


def wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) while waiting for {what}: {proc.stdout.read()}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def net_consumed(run_dir: Path) -> dict[str, int]:
    """group -> train step, from the journal: consumption minus groups returned by a rewind or requeue; asserts that
    no group is consumed twice."""
    consumed: dict[str, int] = {}
    for record in read_records(run_dir / "buffer.journal"):
        if record["k"] == "consume":
            for group in record["g"]:
                assert group not in consumed, f"{group} consumed twice"
                consumed[group] = record["s"]
        elif record["k"] in ("rewind", "requeue"):
            for group in record["g"]:
                del consumed[group]
    return consumed


def assert_trained_once(run_dir: Path, steps: int, groups_per_step: int = 2) -> None:
    consumed = net_consumed(run_dir)
    assert len(consumed) == steps * groups_per_step
    assert sorted(set(consumed.values())) == list(range(steps))
    admitted = [wire.decode(r["m"]) for r in read_records(run_dir / "buffer.journal") if r["k"] == "admit"]
    uids = [t.uid for push in admitted if push.group in consumed for t in push.trajectories]
    assert len(uids) == len(set(uids)) == steps * groups_per_step * 4


@pytest.mark.slow
def test_driver_killed_then_resumed_continues_steps_and_trains_every_group_once(tmp_path):
    run_dir = tmp_path / "r"
    proc = start_up(tmp_path, str(ROOT / "configs/dapo_int8.yaml"), f"logging.dir={tmp_path}", "logging.name=r",
                    "train.steps=200", "checkpoint.every=2", "checkpoint.keep_last=2", *SMALL)  # fmt: skip
    try:
        wait_for(lambda: (run_dir / "checkpoints/step_4").is_dir(), 120, "checkpoint step_4", proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver, its buffer process and its Ray cluster
        proc.wait()
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"), key=lambda p: int(p.name[5:]))
    # keep_last, or one more: checkpoint.save writes the new one before it deletes the oldest, and SIGKILL may land
    # between the two (a built-in step takes ~60 ms, so step_6 can be written before the kill)
    assert 1 <= len(checkpoints) <= 3
    resumed_at = json.loads((checkpoints[-1] / "meta.json").read_text())["step"]
    steps = resumed_at + 4
    resumed = cli(tmp_path, "up", "--resume", str(run_dir), f"train.steps={steps}")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    rows = records(run_dir)
    resume_at = next(i for i, r in enumerate(rows) if r.get("event") == "resume")
    assert rows[resume_at]["step"] == resumed_at
    after = [r for r in rows[resume_at:] if "loss" in r]
    assert [r["step"] for r in after] == list(range(resumed_at, steps))  # step and version continue
    assert all(r["version"] == r["step"] + 1 for r in after)
    assert all(r["staleness/max"] <= 2 for r in rows if "loss" in r)  # staleness.max_lag holds across the resume
    assert any(r["k"] == "rewind" and r["s"] == resumed_at for r in read_records(run_dir / "buffer.journal"))
    counts = json.loads((run_dir / "summary.json").read_text())["buffer"]  # the run's, not the resumed part's alone
    assert counts["completed_groups"] >= counts["admitted_groups"] + counts["filtered_groups"] > 0, counts
    shares = [r["rollout/filtered_share"] for r in after if r["rollout/filtered_share"] is not None]  # NaN: none
    assert all(0.0 <= share <= 1.0 for share in shares), shares  # the first resumed interval starts from the counts
    assert_trained_once(run_dir, steps)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run_dir / f"checkpoints/step_{steps}/model")
    assert len(list((run_dir / "checkpoints").glob("step_*"))) == 2  # the resumed run pruned to keep_last


@pytest.mark.slow
def test_killed_rollout_worker_is_restarted_and_every_group_is_trained_once(tmp_path):
    """SIGKILL a worker's process: it is restarted under a fresh identity while training goes on; the run then
    stops with `asyncrl down` (not at a fixed step count, which the surviving worker could reach before the
    restart on a loaded machine), and every consumed group was trained exactly once. No console lines: a long run
    must not fill the stdout pipe."""
    run_dir = tmp_path / "w"
    proc = start_up(tmp_path, str(ROOT / "configs/dapo_int8.yaml"), f"logging.dir={tmp_path}", "logging.name=w",
                    "train.steps=100000", "buffer.worker_timeout_s=2", "rollout.restart_backoff_s=0.2",
                    "logging.console=false", *SMALL)  # fmt: skip
    try:
        wait_for(lambda: any("loss" in r for r in records(run_dir)), 120, "the first step", proc)
        victim = next(r for r in records(run_dir) if r.get("event") == "worker_started")
        os.kill(victim["pid"], signal.SIGKILL)
        crash = wait_for(lambda: next((r for r in records(run_dir) if r.get("event") == "worker_crashed"), None),
                         120, "the crash event", proc)  # fmt: skip
        restarted = wait_for(
            lambda: [r for r in records(run_dir) if r.get("event") == "worker_started" and r["time"] > crash["time"]],
            120, "the restart", proc,
        )  # fmt: skip
        restart_step = max(r["step"] for r in records(run_dir) if "loss" in r)
        wait_for(lambda: max(r["step"] for r in records(run_dir) if "loss" in r) >= restart_step + 3, 120,
                 "steps after the restart", proc)  # fmt: skip
        down_and_wait(tmp_path, run_dir, proc)
    finally:
        kill_if_running(proc)
    assert crash["worker"] == victim["worker"] and str(victim["pid"]) in crash["error"]
    assert restarted[0]["worker"] == victim["worker"] + ".1"  # a fresh identity for the buffer
    steps = len([r for r in records(run_dir) if "loss" in r])
    assert [r["step"] for r in records(run_dir) if "loss" in r] == list(range(steps))
    assert_trained_once(run_dir, steps)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["buffer"]["consumed_groups"] == steps * 2


@pytest.mark.slow
def test_live_control_scale_set_status_and_down(tmp_path):
    run_dir = tmp_path / "runs" / "c"  # `asyncrl status` without RUN finds the newest running job under ./runs
    proc = start_up(tmp_path, str(ROOT / "configs/dapo_int8.yaml"), "logging.dir=runs", "logging.name=c",
                    "train.steps=100000", "rollout.num_workers=1", "ray.worker_cpus=0.3", *SMALL)  # fmt: skip
    try:
        wait_for(lambda: any("loss" in r for r in records(run_dir)), 120, "the first step", proc)

        def running_workers() -> int:
            status = cli(tmp_path, "status", "--json")
            assert status.returncode == 0, status.stderr
            return sum(w["state"] == "running" for w in json.loads(status.stdout)["workers"])

        assert running_workers() == 1
        scaled = cli(tmp_path, "scale", "rollout=3")
        assert scaled.returncode == 0, scaled.stderr
        wait_for(lambda: running_workers() == 3, 120, "3 running workers", proc)
        assert cli(tmp_path, "scale", "rollout=1", "--run", str(run_dir)).returncode == 0
        wait_for(lambda: running_workers() == 1, 120, "1 running worker", proc)
        too_many = cli(tmp_path, "scale", "rollout=30", "--run", str(run_dir))  # 1 + 30 x 0.3 CPUs > 2 x 4 logical
        assert too_many.returncode == 2 and "at most 23 workers" in too_many.stderr, too_many.stderr
        assert "ray.local_oversubscribe" in too_many.stderr

        for item, expected in [("loss.cpa=3", "did you mean `loss.cap`"), ("rollout.temperature=0.5", "live keys"),
                               ("staleness.max_lag=-1", "out of range"), ("loss.cap=high", "loss.cap")]:  # fmt: skip
            rejected = cli(tmp_path, "set", item, "--run", str(run_dir))
            assert rejected.returncode == 2 and expected in rejected.stderr, (item, rejected.stderr)
        accepted = cli(tmp_path, "set", "staleness.max_lag=0", "loss.cap=3", "--run", str(run_dir))
        assert accepted.returncode == 0, accepted.stderr
        event = wait_for(lambda: next((r for r in records(run_dir) if r.get("key") == "staleness.max_lag"), None),
                         60, "the set event", proc)  # fmt: skip
        later = wait_for(lambda: [r for r in records(run_dir) if "loss" in r and r["step"] >= event["step"]][3:] and
                         [r for r in records(run_dir) if "loss" in r and r["step"] >= event["step"]], 120,
                         "steps after the change", proc)  # fmt: skip
        assert all(r["staleness/max"] == 0 for r in later), [r["staleness/max"] for r in later]

        down_and_wait(tmp_path, run_dir, proc, timeout_s=120)
    finally:
        kill_if_running(proc)
    assert not (run_dir / "control.json").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_early"]
    meta = json.loads((tmp_path / summary["checkpoint"] / "meta.json").read_text())
    assert meta["step"] == summary["steps"] and meta["live"]["staleness.max_lag"] == 0 and meta["live"]["loss.cap"] == 3
    events = [r.get("event") for r in records(run_dir)]
    assert events.count("worker_stopped") == 2 and "down" in events and "checkpoint" in events
    retired = [w["worker"] for w in summary["workers"] if w.get("retired")]  # the two scaled away are counted too
    assert sorted(retired) == ["worker-1", "worker-2"] and len(summary["workers"]) == 3, summary["workers"]
    assert summary["buffer"]["left_workers"] == 3 and summary["buffer"]["dead_workers"] == 0, summary["buffer"]
    gone = cli(tmp_path, "status", str(run_dir))
    assert gone.returncode == 2 and "not running" in gone.stderr


@pytest.mark.slow
def test_scale_past_the_cores_on_the_default_config(tmp_path):
    """The README's `asyncrl scale rollout=3`, then 4, on the default config (2 workers of `ray.worker_cpus`=0.5 and
    a learner of 1 CPU on 2 cores): accepted, and `asyncrl status` shows every worker running and generating."""
    run_dir = tmp_path / "runs" / "d"
    proc = start_up(tmp_path, str(ROOT / "configs/dapo_int8.yaml"), "logging.dir=runs", "logging.name=d",
                    "train.steps=100000", "logging.console=false", *SMALL)  # fmt: skip
    try:
        wait_for(lambda: any("loss" in r for r in records(run_dir)), 120, "the first step", proc)

        def workers() -> list[dict]:
            status = cli(tmp_path, "status", "--json")
            assert status.returncode == 0, status.stderr
            return json.loads(status.stdout)["workers"]

        for count in (3, 4):
            scaled = cli(tmp_path, "scale", f"rollout={count}")
            assert scaled.returncode == 0, scaled.stderr
            wait_for(lambda n=count: [w["state"] for w in workers()] == ["running"] * n, 120, f"{count} running", proc)
        wait_for(lambda: all(w["samples"] > 0 for w in workers()), 120, "samples from all 4 workers", proc)
        shown = cli(tmp_path, "status")
        assert shown.returncode == 0 and "workers (4):" in shown.stdout and shown.stdout.count(" running ") == 4
        down_and_wait(tmp_path, run_dir, proc, timeout_s=180)
    finally:
        kill_if_running(proc)
    scales = [r for r in records(run_dir) if r.get("event") == "scale"]
    assert [(r["rollout"], r["added"]) for r in scales] == [(3, ["worker-2"]), (4, ["worker-3"])]


@pytest.mark.slow
def test_fsdp2_learner_checkpoints_and_resumes(tmp_path):
    """Two FSDP2 ranks: the checkpoint holds the gathered model and optimizer state, and a resume continues."""
    import torch

    run_dir = tmp_path / "f"
    args = (f"logging.dir={tmp_path}", "logging.name=f", "checkpoint.every=2", "learner.world_size=2",
            "rollout.num_workers=1", "ray.worker_cpus=0.5", *SMALL)  # fmt: skip
    first = subprocess.run([sys.executable, "-m", "asyncrl.cli", "up", str(ROOT / "configs/dapo_int8.yaml"),
                            "train.steps=3", *args], capture_output=True, text=True, env=ENV, cwd=tmp_path,
                           timeout=300)  # fmt: skip
    assert first.returncode == 0, first.stderr[-4000:]
    state = torch.load(run_dir / "checkpoints/step_3/training_state.pt", weights_only=True)
    optimizer = state["optimizer"]["state"]
    assert "model.layers.0.self_attn.q_proj.weight" in optimizer  # unsharded, keyed by parameter name
    assert all(int(s["step"]) == 3 for s in optimizer.values())  # AdamW moments of every parameter, 3 updates
    resumed = subprocess.run([sys.executable, "-m", "asyncrl.cli", "up", "--resume", str(run_dir),
                              "train.steps=5"], capture_output=True, text=True, env=ENV, cwd=tmp_path,
                             timeout=300)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    rows = records(run_dir)
    resume_at = next(i for i, r in enumerate(rows) if r.get("event") == "resume")
    after = [r for r in rows[resume_at:] if "loss" in r]
    assert [r["step"] for r in after] == [3, 4] and all(r["version"] == r["step"] + 1 for r in after)
    assert_trained_once(run_dir, 5)


def test_a_sigterm_during_start_up_ends_up_with_a_line_and_leaves_no_process(tmp_path):
    """A SIGTERM before the driver chose its run directory (and set its own handlers) killed `asyncrl up` outright:
    no line, exit -15, its fork server left to notice alone. It now says what happened and exits 130 as a Ctrl-C."""
    import psutil

    proc = start_up(tmp_path, str(ROOT / "configs/dapo_int8.yaml"), f"logging.dir={tmp_path}", "logging.name=e",
                    "train.steps=3", *SMALL)  # fmt: skip
    try:
        children = wait_for(lambda: psutil.Process(proc.pid).children(), 30, "the fork server", proc)  # started early
        os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        kill_if_running(proc)
    assert proc.returncode == 130, out[-3000:]
    assert "asyncrl: SIGTERM during start-up: stopped before the run began" in out, out[-3000:]
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, [child.cmdline() for child in alive]


@pytest.mark.slow
def test_sigterm_stops_the_run_like_down_and_takes_the_buffer_with_it(tmp_path):
    """SIGTERM (or Ctrl-C) to `asyncrl up`: the step finishes, workers stop, a checkpoint is written, exit 0; the
    buffer, in its own session (a terminal's Ctrl-C does not reach it), is stopped by the driver."""
    import psutil

    run_dir = tmp_path / "t"
    proc = start_up(tmp_path, str(ROOT / "configs/dapo_int8.yaml"), f"logging.dir={tmp_path}", "logging.name=t",
                    "train.steps=100000", "logging.console=false", *SMALL)  # fmt: skip
    try:
        wait_for(lambda: sum("loss" in r for r in records(run_dir)) >= 2, 120, "two steps", proc)
        buffer = next(p for p in psutil.Process(proc.pid).children() if "buffer" in p.cmdline())
        os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-4000:]
    steps = [r["step"] for r in records(run_dir) if "loss" in r]
    assert any(r.get("event") == "down" and r.get("reason") == "SIGTERM" for r in records(run_dir))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_early"] and summary["steps"] == steps[-1] + 1
    saved = json.loads((run_dir / f"checkpoints/step_{summary['steps']}/meta.json").read_text())
    assert saved["step"] == summary["steps"]
    assert not buffer.is_running() or buffer.status() == psutil.STATUS_ZOMBIE


@pytest.mark.slow
def test_a_hangup_and_timeout_s_two_sigterms_stop_the_run_gracefully(tmp_path):
    """SIGHUP (the terminal closed, an ssh session dropped) stops the run as SIGTERM does, with a checkpoint; it
    used to kill the driver (exit 129, no checkpoint, a stale control.json). timeout(1) sends SIGTERM to the driver
    and then to its process group: the second, 10 ms later, is the same stop, not "SIGTERM again: now"."""
    run_dir = tmp_path / "h"
    for stop in ("hangup", "timeout"):
        resume = ("--resume", str(run_dir)) if stop == "timeout" else (str(ROOT / "configs/dapo_int8.yaml"),)
        proc = start_up(tmp_path, *resume, f"logging.dir={tmp_path}", "logging.name=h", "train.steps=100000",
                        "logging.console=false", *SMALL)  # fmt: skip
        try:
            before = sum("loss" in r for r in records(run_dir))
            wait_for(lambda: sum("loss" in r for r in records(run_dir)) >= before + 2, 120, "two steps", proc)  # noqa: B023
            if stop == "hangup":
                os.kill(proc.pid, signal.SIGHUP)
            else:
                os.kill(proc.pid, signal.SIGTERM)
                time.sleep(0.01)
                os.killpg(proc.pid, signal.SIGTERM)
            out, _ = proc.communicate(timeout=180)
        finally:
            kill_if_running(proc)
        assert proc.returncode == 0, (stop, out[-4000:])
        assert "again" not in out, (stop, out[-4000:])
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["stopped_early"], stop
        meta = json.loads((run_dir / f"checkpoints/step_{summary['steps']}/meta.json").read_text())
        assert meta["step"] == summary["steps"], stop
        reason = "SIGHUP" if stop == "hangup" else "SIGTERM"
        assert any(r.get("event") == "down" and r.get("reason") == reason for r in records(run_dir)), stop
        assert not (run_dir / "control.json").exists(), stop
    trained = json.loads((run_dir / "summary.json").read_text())["steps"]
    config_before = (run_dir / "config.json").read_text()
    refused = cli(tmp_path, "up", "--resume", str(run_dir), f"train.steps={trained - 1}")  # fewer than trained
    assert refused.returncode == 2 and f"has {trained} steps trained already" in refused.stderr, refused.stderr
    assert (run_dir / "config.json").read_text() == config_before  # it used to rewrite it and save again


@pytest.mark.slow
def test_sigterm_to_the_whole_process_group_stops_the_run_gracefully(tmp_path):
    """`kill -TERM -PGID` (timeout, Slurm's scancel, systemd's stop) reaches the actors too: they leave it to the
    driver, whose graceful stop needs them; it used to kill the learner, and the run failed without a checkpoint."""
    run_dir = tmp_path / "g"
    proc = start_up(tmp_path, str(ROOT / "configs/dapo_int8.yaml"), f"logging.dir={tmp_path}", "logging.name=g",
                    "train.steps=100000", *SMALL)  # fmt: skip
    try:
        wait_for(lambda: sum("loss" in r for r in records(run_dir)) >= 2, 120, "two steps", proc)
        os.killpg(proc.pid, signal.SIGTERM)  # start_up's process group: the driver and its local actors
        out, _ = proc.communicate(timeout=180)
    finally:
        kill_if_running(proc)
    assert proc.returncode == 0, out[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_early"] and "died" not in out, out[-4000:]
    assert f"stopped after {summary['steps']} of 100000 steps (SIGTERM)" in out
    assert f"resume with `asyncrl up --resume {run_dir}`" in out
    meta = json.loads((run_dir / f"checkpoints/step_{summary['steps']}/meta.json").read_text())
    assert meta["step"] == summary["steps"]


@pytest.mark.slow
def test_a_ctrl_c_while_a_stopped_run_cleans_up_is_ignored_and_the_clean_up_ends(tmp_path):
    """A second Ctrl-C right after "stopped after ..." landed in the clean-up, with Python's handler back: it
    stopped there (exit 130, a bare "asyncrl: " line) and left the run's keys directory and gate file behind."""
    import contextlib
    import tempfile

    from common.curve import RUN_KEYS_PREFIX

    run_dir = tmp_path / "c"
    proc = start_up(tmp_path, str(ROOT / "configs/dapo_int8.yaml"), f"logging.dir={tmp_path}", "logging.name=c",
                    "train.steps=100000", *SMALL)  # fmt: skip
    try:
        wait_for(lambda: sum("loss" in r for r in records(run_dir)) >= 2, 120, "two steps", proc)
        os.kill(proc.pid, signal.SIGINT)
        lines = []
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "stopped after" in line:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGINT)
                break
        out, _ = proc.communicate(timeout=180)
        out = "".join(lines) + out
    finally:
        kill_if_running(proc)
    assert proc.returncode == 0, out[-4000:]
    assert not out.rstrip().endswith("asyncrl:"), out[-2000:]
    assert not list(Path(tempfile.gettempdir()).glob(f"{RUN_KEYS_PREFIX}{proc.pid}-*"))
    assert not (run_dir / ".train_gate").exists()


@pytest.mark.slow
def test_the_first_ctrl_c_on_a_stalled_run_stops_it_without_waiting_for_its_workers(tmp_path):
    """README: "The first Ctrl-C on a stalled run stops it at once". The step was abandoned at once, but the driver
    then waited up to 120 s for each worker to finish its batch (here, a reward call of 100 s): 62 s with a reward
    of 8 s. The run now ends without those batches."""
    (tmp_path / "slow.py").write_text("import time\n\ndef reward(response, answer, row):\n    time.sleep(100)\n"
                                      "    return 0.0\n")  # fmt: skip
    run_dir = tmp_path / "s"
    proc = start_up(tmp_path, str(ROOT / "configs/dapo_int8.yaml"), f"logging.dir={tmp_path}", "logging.name=s",
                    "train.steps=5", "logging.console=false", *SMALL, f"reward.fn={tmp_path / 'slow.py'}:reward",
                    "reward.timeout_s=200", "train.stall_timeout_s=5")  # fmt: skip
    try:
        wait_for(lambda: any(r.get("event") == "stall" for r in records(run_dir)), 180, "the stall report", proc)
        os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=45)  # a hang bound: it waited for the 100 s reward calls
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "asyncrl: stopped on SIGINT without waiting for the step in flight" in out, out[-3000:]
