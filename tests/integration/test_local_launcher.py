"""`asyncrl up` with `ray.launcher=local`: the learner, the rollout workers and the evaluator are child processes of
the driver (common/local_actors.py), no Ray process starts, and the driver's restart paths work as under Ray: a
SIGKILLed rollout worker is restarted under a fresh identity, a SIGKILLed learner is restarted from the latest
checkpoint, and every group is trained once; `asyncrl status` and `scale` answer; the evaluator runs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from test_operations import (
    ENV,
    ROOT,
    SMALL,
    assert_trained_once,
    cli,
    down_and_wait,
    kill_if_running,
    records,
    start_up,
    wait_for,
)
from test_security import is_loopback, listening

LOCAL = ("ray.launcher=local",)
RAY_PROCESSES = ("raylet", "gcs_server", "ray::")


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def command_line(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


def process_group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in records(run_dir) if "loss" in r]


def steps_after_restart(run_dir: Path) -> list[dict]:
    rows = records(run_dir)
    at = next((i for i, r in enumerate(rows) if r.get("event") == "learner_restarted"), len(rows))
    return [r for r in rows[at:] if "loss" in r]


@pytest.mark.slow
def test_local_actors_train_evaluate_and_report_start_up_without_ray(tmp_path):
    proc = cli_up(tmp_path, "logging.name=e", "train.steps=3", "data.eval_size=4", "train.eval_every=2",
                  "eval.samples=2", "checkpoint.final=true")  # fmt: skip
    proc.wait(timeout=300)
    left = [command_line(p) for p in psutil.process_iter() if process_group(p.pid) == proc.pid]
    out = proc.stdout.read()
    assert proc.returncode == 0, out[-4000:]
    assert left == [], f"outlived the driver: {left}"  # the zygote did, by a second or two, holding the output pipes
    # the actors fork from a zygote that imported transformers: its progress bars stay off there too
    assert "Writing model shards" not in out and "Loading weights" not in out, out[-4000:]
    rows = records(tmp_path / "e")
    assert steps(tmp_path / "e") == [0, 1, 2]
    assert [r["after_steps"] for r in rows if r.get("event") == "eval"] == [2, 3]
    startup = next(r for r in rows if r.get("event") == "startup")
    assert startup["cpu_s"]["learner"] > 0 and startup["cpu_s"]["rollout_workers"] > 0  # local actors, by kind
    started = [r for r in rows if r.get("event") == "worker_started"]
    assert started and all(r["node"] == "" and r["pid"] > 0 for r in started)
    assert "Started a local Ray instance" not in out


def test_a_run_that_fails_its_input_checks_ends_with_its_reason_and_no_trace_of_the_zygote(tmp_path):
    """The driver starts the zygote, then finds the model directory bad and exits while the zygote still imports
    torch: the zygote, finding the driver gone, exits quietly instead of printing a BrokenPipeError."""
    not_a_model = tmp_path / "not_a_model"
    not_a_model.mkdir()
    done = subprocess.run([sys.executable, "-m", "asyncrl.cli", "up", str(ROOT / "configs/dapo_int8.yaml"),
                           f"logging.dir={tmp_path}", f"model.path={not_a_model}", *LOCAL], capture_output=True,
                          text=True, env=ENV, cwd=tmp_path, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert (
        done.stderr.strip() == f"asyncrl: model.path: {not_a_model}: no config.json (is this a Hugging Face model "
        "directory?)"
    ), done.stderr  # the pipes close only once the zygote has exited: its last words would be here


def test_a_config_error_ends_up_with_its_reason_alone_though_the_fork_server_started_before_the_config(tmp_path):
    """`asyncrl up` starts the fork server before it reads its config (`start_fork_server_early`): a config that does
    not load ends the run with its message alone and leaves no process (the zygote, still importing, goes quietly)."""
    mark = f"config-error-{os.getpid()}-{tmp_path.name}"  # in the environment of every process this run starts
    done = subprocess.run([sys.executable, "-m", "asyncrl.cli", "up", str(ROOT / "configs/dapo_int8.yaml"),
                           f"logging.dir={tmp_path}", "train.stepz=3"], capture_output=True, text=True,
                          env={**ENV, "ASYNCRL_TEST_MARK": mark}, cwd=tmp_path, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("asyncrl: ") and "stepz" in done.stderr and "Traceback" not in done.stderr, (
        done.stderr
    )
    left = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if (
                "common.zygote" in " ".join(proc.info["cmdline"] or [])
                and proc.environ().get("ASYNCRL_TEST_MARK") == mark
            ):
                left.append(proc.pid)
    assert left == [], left


def test_a_ray_run_ends_the_fork_server_started_before_it_knew_its_launcher() -> None:
    """`zygote.discard`: the server exits and this process is no longer a child subreaper (Ray's orphans go to init)."""
    code = (
        "import ctypes, json; from common import zygote; z = zygote.start(); pid = z.process.pid; zygote.discard();"
        "flag = ctypes.c_int(-1); ctypes.CDLL(None).prctl(37, ctypes.byref(flag), 0, 0, 0);"  # PR_GET_CHILD_SUBREAPER
        "print(json.dumps({'pid': pid, 'exit': z.process.poll(), 'subreaper': flag.value, 'again': zygote._zygote}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["exit"] is not None and not psutil.pid_exists(report["pid"]), report
    assert report["subreaper"] == 0 and report["again"] is None, report


def test_a_truncated_weight_file_fails_the_run_before_it_starts_naming_the_file(tmp_path):
    """It failed in the learner's constructor, after start-up, with a safetensors header error naming no file and
    advice to resume (which failed the same way)."""
    import shutil

    from common.builtin_model import resolve_model_path

    model = tmp_path / "model"
    shutil.copytree(resolve_model_path("builtin:micro"), model)
    weights = model / "model.safetensors"
    size = weights.stat().st_size
    with weights.open("r+b") as handle:
        handle.truncate(size // 2)
    done = subprocess.run([sys.executable, "-m", "asyncrl.cli", "up", str(ROOT / "configs/dapo_int8.yaml"),
                           f"logging.dir={tmp_path}", f"model.path={model}", *LOCAL], capture_output=True,
                          text=True, env=ENV, cwd=tmp_path, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().startswith(f"asyncrl: model.path={model}: model.safetensors is truncated: its header "
                                          f"describes {size} bytes, the file has {size // 2}"), done.stderr  # fmt: skip


@pytest.mark.slow
def test_killed_local_worker_and_learner_are_restarted_every_group_trained_once(tmp_path):
    run_dir = tmp_path / "k"
    proc = cli_up(tmp_path, "logging.name=k", "train.steps=100000", "checkpoint.every=3", "buffer.worker_timeout_s=2",
                  "rollout.restart_backoff_s=0.2", "logging.console=false")  # fmt: skip
    try:
        wait_for(lambda: len(steps(run_dir)) >= 1, 120, "the first step", proc)
        tree = [psutil.Process(proc.pid), *descendants(proc.pid)]
        assert not [p for p in tree if any(name in command_line(p) for name in RAY_PROCESSES)]
        assert [p for p in tree if "actor:LearnerActor" in command_line(p)]
        wide = [row for row in listening(tree) if not is_loopback(row[1])]
        assert wide == [], f"listening beyond loopback: {wide}"  # the actors' sockets are ipc:// paths
        status = cli(tmp_path, "status", str(run_dir), "--json")
        assert status.returncode == 0, status.stderr
        assert {w["state"] for w in json.loads(status.stdout)["workers"]} <= {"running", "starting"}
        victim = next(r for r in records(run_dir) if r.get("event") == "worker_started")
        os.kill(victim["pid"], signal.SIGKILL)
        crash = wait_for(lambda: next((r for r in records(run_dir) if r.get("event") == "worker_crashed"), None),
                         120, "the worker crash", proc)  # fmt: skip
        later = crash["time"]
        restarted = lambda: [r for r in records(run_dir) if r.get("event") == "worker_started" and r["time"] > later]  # noqa: E731
        wait_for(restarted, 120, "the worker restart", proc)
        wait_for(lambda: len(steps(run_dir)) >= 5, 120, "five steps", proc)
        learner = next(p for p in descendants(proc.pid) if "actor:LearnerActor" in command_line(p))
        learner.send_signal(signal.SIGKILL)
        event = wait_for(lambda: [r for r in records(run_dir) if r.get("event") == "learner_restarted"], 120,
                         "the learner restart", proc)[0]  # fmt: skip
        wait_for(lambda: len(steps_after_restart(run_dir)) >= event["steps_redone"] + 2, 180,
                 "steps after the restart", proc)  # fmt: skip
        scaled = cli(tmp_path, "scale", "rollout=3", "--run", str(run_dir))
        assert scaled.returncode == 0, scaled.stderr
        down_and_wait(tmp_path, run_dir, proc)
    finally:
        kill_if_running(proc)
    assert crash["worker"] == victim["worker"] and str(victim["pid"]) in crash["error"]
    assert str(learner.pid) in event["error"] and "killed by SIGKILL" in event["error"]
    assert event["from_step"] % 3 == 0 and event["steps_redone"] == event["step"] - event["from_step"]
    after = steps_after_restart(run_dir)
    assert [r["step"] for r in after] == list(range(event["from_step"], event["from_step"] + len(after)))
    assert_trained_once(run_dir, after[-1]["step"] + 1)
    pids = [learner.pid] + [r["pid"] for r in records(run_dir) if r.get("event") == "worker_started"]
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


def cli_up(tmp_path: Path, *overrides: str):
    return start_up(tmp_path, str(ROOT / "configs/dapo_int8.yaml"), f"logging.dir={tmp_path}", *SMALL, *LOCAL,
                    *overrides)  # fmt: skip
