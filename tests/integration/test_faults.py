"""A run that heals itself, with real processes and signals: the buffer process SIGKILLed (once while the learner
waits in FetchBatch, then again right after its restart) is restarted by the driver and training continues with every
group trained once; more buffer deaths than `buffer.max_restarts` fail the run with a one-line reason; a dataset whose
every prompt the workers skip fails with that diagnosis once `train.stall_timeout_s` passes, instead of hanging; a
killed learner is restarted from the latest checkpoint; `--resume auto` starts afresh, then resumes."""

from __future__ import annotations

import json
import os
import shutil
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
    down_and_wait,
    kill_if_running,
    records,
    start_up,
    wait_for,
)

from asyncrl.bench.chaos_faults import buffer_process as find_buffer_process
from asyncrl.bench.chaos_faults import learner_processes
from buffer.client import BufferClient
from common.curve import client_keys


def buffer_process(proc: subprocess.Popen) -> psutil.Process:
    found = find_buffer_process(proc.pid)
    assert found is not None, "no buffer process under the driver"
    return found


def steps_logged(run_dir: Path) -> list[int]:
    return [r["step"] for r in records(run_dir) if "loss" in r]


def restarts(run_dir: Path) -> list[dict]:
    return [r for r in records(run_dir) if r.get("event") == "buffer_restarted"]


def steps_after(run_dir: Path, event: str) -> list[dict]:
    """The step records logged after the first `event` record (none before it)."""
    rows = records(run_dir)
    at = next((i for i, r in enumerate(rows) if r.get("event") == event), len(rows))
    return [r for r in rows[at:] if "loss" in r]


def up_blocking(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", "up", *args], capture_output=True, text=True,
                          env=ENV, cwd=tmp_path, timeout=300)  # fmt: skip


def run_client(run_dir: Path, endpoint: str) -> BufferClient:
    """A client of the run's buffer with the run's own CurveZMQ keys (`buffer.run_keys`), as the run's user has."""
    keys_dir = json.loads((run_dir / "buffer_config.json").read_text())["buffer"]["curve_keys_dir"]
    return BufferClient(endpoint, "test", timeout_s=10, curve=client_keys(keys_dir))


def last_line(out: str) -> str:
    return [line for line in out.splitlines() if line.strip()][-1]


@pytest.mark.slow
def test_buffer_killed_while_the_learner_waits_then_again_training_continues_every_group_once(tmp_path):
    run_dir = tmp_path / "b"
    proc = start_up(tmp_path, str(ROOT / "configs/dapo_int8.yaml"), f"logging.dir={tmp_path}", "logging.name=b",
                    "train.steps=100000", "logging.console=false", *SMALL)  # fmt: skip
    try:
        wait_for(lambda: len(steps_logged(run_dir)) >= 2, 120, "two steps", proc)
        victim = buffer_process(proc)
        endpoint = next(r["endpoint"] for r in records(run_dir) if r.get("event") == "buffer_started")
        with run_client(run_dir, endpoint) as client:  # the learner parked in FetchBatch
            wait_for(lambda: client.stats()["parked_fetches"] >= 1, 60, "the learner waiting in FetchBatch", proc)
            victim.send_signal(signal.SIGKILL)
        first = wait_for(lambda: restarts(run_dir), 60, "the first restart", proc)[0]
        buffer_process(proc).send_signal(signal.SIGKILL)  # again, right after its restart
        second = wait_for(lambda: restarts(run_dir)[1:], 60, "the second restart", proc)[0]
        at = max(steps_logged(run_dir), default=0)
        wait_for(lambda: max(steps_logged(run_dir)) >= at + 3, 120, "steps after the restarts", proc)
        down_and_wait(tmp_path, run_dir, proc)
    finally:
        kill_if_running(proc)
    assert first["exit"] == second["exit"] == "killed by SIGKILL" and [first["restarts"], second["restarts"]] == [1, 2]
    assert first["dead_pid"] == victim.pid and first["downtime_s"] > 0 and "replayed_groups" in first
    steps = steps_logged(run_dir)
    assert steps == list(range(len(steps)))  # training went on at the step it was at
    assert_trained_once(run_dir, len(steps))  # acknowledged groups trained once, none lost or trained twice
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["buffer"]["consumed_groups"] == len(steps) * 2


@pytest.mark.slow
def test_more_buffer_deaths_than_max_restarts_fail_the_run_with_a_one_line_reason(tmp_path):
    run_dir = tmp_path / "m"
    proc = start_up(tmp_path, str(ROOT / "configs/dapo_int8.yaml"), f"logging.dir={tmp_path}", "logging.name=m",
                    "train.steps=100000", "buffer.max_restarts=1", "logging.console=false", *SMALL)  # fmt: skip
    try:
        wait_for(lambda: steps_logged(run_dir), 120, "the first step", proc)
        buffer_process(proc).send_signal(signal.SIGKILL)
        wait_for(lambda: restarts(run_dir), 60, "the restart", proc)
        buffer_process(proc).send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, out[-4000:]
    line = last_line(out)
    assert line.startswith("asyncrl: the buffer process (pid ") and "killed by SIGKILL" in line, out[-4000:]
    assert "more than `buffer.max_restarts` (1)" in line and f"asyncrl up --resume {run_dir}" in line
    assert "at step " in line and "Traceback" not in out
    assert any(r.get("event") == "buffer_crashed" for r in records(run_dir))


def unreachable_prompts(tmp_path: Path) -> Path:
    """A dataset whose every prompt the workers can reach is too long for `rollout.max_seq_len=64` (one row fits, so
    the start-up check only warns, but it comes last and the throttle never lets the workers reach it)."""
    from common.config import DataConfig
    from common.tasks import make_source

    rows = [{"prompt": f"{k:03d} " + "1+1=" * 30, "answer": "2"} for k in range(40)]
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    last = make_source(DataConfig(task="jsonl", path=str(data), eval_size=0)).train(39).prompt  # reached last
    rows[int(last[:3])]["prompt"] = "1+1="  # the one that fits
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return data


@pytest.mark.slow
def test_a_dataset_whose_every_prompt_is_skipped_fails_with_that_diagnosis(tmp_path):
    """No group is ever pushed (`unreachable_prompts`). The run fails once `train.stall_timeout_s` has passed,
    naming the skipped prompts, and never hangs."""
    data = unreachable_prompts(tmp_path)
    proc = start_up(tmp_path, str(ROOT / "configs/dapo_int8.yaml"), f"logging.dir={tmp_path}", "logging.name=s",
                    "data.task=jsonl", f"data.path={data}", "rollout.max_seq_len=64", "train.stall_timeout_s=20",
                    "logging.console=true", *SMALL)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, out[-4000:]
    line = last_line(out)
    assert line.startswith("asyncrl: stalled: no step finished for ") and "skipped every prompt" in line, out[-3000:]
    assert "do not fit the engine's max sequence length 64" in line and "at step 0" in line
    assert "asyncrl up --resume" in line and "Traceback" not in out
    stall = next(r for r in records(tmp_path / "s") if r.get("event") == "stall")
    assert stall["diagnosis"] and stall["since_step"]["groups_pushed"] == 0 and stall["since_step"]["prompts_skipped"]
    assert stall["buffer"]["waiting_fetches"] == 1 and stall["learner"] == "waiting in FetchBatch for step 0"


@pytest.mark.slow
def test_resume_auto_starts_fresh_then_resumes_the_newest_run_with_a_checkpoint(tmp_path):
    """`asyncrl up --resume auto CONFIG`, re-run as a scheduler would: a fresh run first, then that run continued."""
    args = (str(ROOT / "configs/dapo_int8.yaml"), f"logging.dir={tmp_path}", "logging.name=a", "checkpoint.every=2",
            "logging.console=false", *SMALL)  # fmt: skip
    first = up_blocking(tmp_path, "--resume", "auto", *args, "train.steps=2")
    assert first.returncode == 0, first.stderr[-4000:]
    assert "starting a new run" in first.stderr and (tmp_path / "a/checkpoints/step_2").is_dir()
    second = up_blocking(tmp_path, "--resume", "auto", *args, "train.steps=4")
    assert second.returncode == 0, second.stderr[-4000:]
    assert f"resuming {tmp_path / 'a'} from step_2" in second.stderr and not (tmp_path / "a-2").exists()
    rows = records(tmp_path / "a")
    resume_at = next(i for i, r in enumerate(rows) if r.get("event") == "resume")
    assert rows[resume_at]["step"] == 2 and [r["step"] for r in rows[resume_at:] if "loss" in r] == [2, 3]
    assert_trained_once(tmp_path / "a", 4)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "rank"), [(1, 0), (2, 1)])
def test_a_killed_learner_is_restarted_from_the_latest_checkpoint_every_group_trained_once(tmp_path, world, rank):
    """SIGKILL the learner's process (mostly it waits in FetchBatch, or trains): the driver restarts the learner and
    the workers from the latest checkpoint, the buffer rewound to it as `--resume` does; the steps after it are
    trained again, and the journal shows every group trained once. With two ranks, the killed one's peer fails at
    once in its collective (gloo: connection reset): that error ended the run, naming the survivor."""
    run_dir = tmp_path / "l"
    proc = start_up(tmp_path, str(ROOT / "configs/dapo_int8.yaml"), f"logging.dir={tmp_path}", "logging.name=l",
                    "train.steps=100000", "checkpoint.every=3", "logging.console=false", *SMALL,
                    f"learner.world_size={world}")  # fmt: skip
    try:
        wait_for(lambda: len(steps_logged(run_dir)) >= 5, 120, "five steps", proc)
        learner = sorted(learner_processes(proc.pid), key=lambda p: p.create_time())[rank]
        learner.send_signal(signal.SIGKILL)
        event = wait_for(lambda: [r for r in records(run_dir) if r.get("event") == "learner_restarted"], 120,
                         "the learner restart", proc)[0]  # fmt: skip
        wait_for(lambda: len(steps_after(run_dir, "learner_restarted")) >= event["steps_redone"] + 3, 180,
                 "steps after the restart", proc)  # fmt: skip
        down_and_wait(tmp_path, run_dir, proc)
    finally:
        kill_if_running(proc)
    assert event["from_step"] % 3 == 0 and event["step"] >= event["from_step"] >= 3
    assert event["steps_redone"] == event["step"] - event["from_step"] and str(learner.pid) in event["error"]
    after = steps_after(run_dir, "learner_restarted")
    assert [r["step"] for r in after] == list(range(event["from_step"], event["from_step"] + len(after)))
    assert all(r["version"] == r["step"] + 1 for r in after)  # the versions start again from the checkpoint
    assert_trained_once(run_dir, after[-1]["step"] + 1)


def _model_missing_a_tensor(tmp_path: Path) -> str:
    from safetensors.torch import load_file, save_file

    from common.builtin_model import resolve_model_path

    target = tmp_path / "missing"
    shutil.copytree(resolve_model_path("builtin:tiny", log=lambda *a: None), target)
    tensors = load_file(target / "model.safetensors")
    del tensors["model.layers.3.mlp.down_proj.weight"]
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return str(target)


@pytest.mark.parametrize("fault", ["gpu", "weights"])
def test_a_learner_whose_first_start_raises_in_its_constructor_fails_the_run_at_once(tmp_path, fault):
    """A constructor error on the first start (a GPU device on a process that sees none; weight files without a
    tensor config.json's model has, which transformers filled with random values: the run trained them) raises again
    on every restart, so the run ends with it at once instead of restarting the learner `learner.max_restarts` times,
    and its last line says to fix it, not to resume."""
    env = {**ENV, "CUDA_VISIBLE_DEVICES": ""}  # no GPU for the learner on any machine
    setting = "learner.device=cuda" if fault == "gpu" else f"model.path={_model_missing_a_tensor(tmp_path)}"
    done = subprocess.run([sys.executable, "-m", "asyncrl.cli", "up", str(ROOT / "configs/dapo_int8.yaml"),
                           f"logging.dir={tmp_path}", "logging.name=g", "learner.max_restarts=2",
                           "logging.console=false", *SMALL, setting],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-4000:]
    line = last_line(out)
    assert line.startswith("asyncrl: the learner (pid ") and "died (its constructor raised " in line
    if fault == "gpu":
        assert "RuntimeError: `learner.device=cuda` but this learner process sees no GPU" in line
    else:
        assert (
            "WeightsMismatch: model.path=" in line
            and "the weights do not fit config.json: 1 tensor(s) missing " in line
            and "model.layers.3.mlp.down_proj.weight" in line
        )
    assert line.endswith("fix what it names, then run the command again") and "--resume" not in line
    assert "Traceback" not in out and "restarting the learner" not in out, out[-4000:]
    assert not [r for r in records(tmp_path / "g") if r.get("event") == "learner_restarted"]
    assert not (tmp_path / "g" / "control.json").exists()  # `asyncrl status` waited 10 s on it before calling it stale


def test_a_diverged_model_fails_the_run_after_max_nonfinite_steps_and_leaves_no_weight_files(tmp_path):
    """optim.lr=1e9: the first update blows the weights up, every later step has a non-finite loss and is skipped;
    the run fails after `train.max_nonfinite_steps` of them instead of skipping to the end, and the learner's
    /dev/shm versions go with the run."""
    run_dir = tmp_path / "dv"
    proc = start_up(tmp_path, str(ROOT / "configs/dapo_int8.yaml"), f"logging.dir={tmp_path}", "logging.name=dv",
                    "optim.lr=1e9", "train.max_nonfinite_steps=3", "train.steps=1000", "checkpoint.every=1",
                    "logging.console=false", *SMALL)  # fmt: skip
    try:
        learners = wait_for(lambda: learner_processes(proc.pid), 120, "the learner", proc)
        out, _ = proc.communicate(timeout=300)
    finally:
        kill_if_running(proc)
    assert proc.returncode == 1, out[-4000:]
    line = last_line(out)
    steps = [r for r in records(run_dir) if "loss" in r]
    first = next(r["step"] for r in steps if r.get("skipped_nonfinite"))
    assert line.startswith(f"asyncrl: the model diverged: 3 train steps in a row (from step {first}) had a non-finite")
    assert f"checkpoint step_{first} and later ones hold the weights that diverged" in line and "Traceback" not in out
    assert (
        [r["step"] for r in steps if r.get("skipped_nonfinite")]
        == [first, first + 1, first + 2]
        == [r["step"] for r in steps[-3:]]
    )
    assert [r for r in records(run_dir) if r.get("event") == "diverged"][0]["first_step"] == first
    pids = {learner.pid for learner in learners}
    assert not [name for name in os.listdir("/dev/shm") if any(f"-{pid}-" in name for pid in pids)]


@pytest.mark.slow
def test_the_first_sigint_stops_a_run_whose_step_never_comes_at_once_without_a_traceback(tmp_path):
    run_dir = tmp_path / "c"
    proc = start_up(tmp_path, str(ROOT / "configs/dapo_int8.yaml"), f"logging.dir={tmp_path}", "logging.name=c",
                    "data.task=jsonl", f"data.path={unreachable_prompts(tmp_path)}", "rollout.max_seq_len=64",
                    "logging.console=false", *SMALL)  # fmt: skip
    try:
        endpoint = wait_for(lambda: next((r["endpoint"] for r in records(run_dir) if r.get("event") ==
                                          "buffer_started"), None), 120, "the buffer", proc)  # fmt: skip
        with run_client(run_dir, endpoint) as client:
            wait_for(lambda: client.stats()["parked_fetches"] >= 1, 120, "the learner waiting for step 0", proc)
        os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=180)  # the default stall timeout (300 s) has not passed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out[-4000:]
    line = last_line(out)
    assert line.startswith("asyncrl: stopped on SIGINT without waiting for the step in flight"), out[-3000:]
    assert "at step 0; resume with `asyncrl up --resume" in line and "Traceback" not in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 0 and summary["stopped_early"] and "checkpoint" not in summary
