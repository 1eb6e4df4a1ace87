"""The start-up and loop of `asyncrl up` that `asyncrl bench e2e` measures: the start-up milestones, Ray started on
a thread beside the buffer, and the next train step started before the driver logs the previous one unless the
boundary needs the learner idle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from asyncrl.driver import _boundary_work
from asyncrl.raycluster import RayStart
from asyncrl.startup import StartupClock, process_start_unix

ROOT = Path(__file__).resolve().parents[3]
MARKS = ("driver_imports", "inputs_checked", "buffer_ready", "ray_ready", "actors_created", "learner_ready",
         "workers_running", "first_step")  # fmt: skip


def test_process_start_is_this_process_start() -> None:
    started = process_start_unix()
    assert started <= time.time()
    code = "from asyncrl.startup import process_start_unix; print(repr(process_start_unix()))"
    before = time.time()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    after = time.time()
    # the child's start, to the kernel's clock tick (10 ms): not before it was spawned (a start read against the whole
    # seconds of /proc/stat's btime was early by the boot's fraction of a second), not the parent's or the machine's
    assert before - 0.02 <= float(done.stdout) <= after


def test_startup_clock_phases_add_up_to_the_marks() -> None:
    clock = StartupClock(origin_unix=time.time() - 2.0)
    first = clock.mark("ray_ready")
    second = clock.mark("first_step")
    assert 2.0 <= first <= second
    phases = clock.phases()
    assert list(phases) == ["ray_ready", "first_step"]
    assert phases["ray_ready"] == first and sum(phases.values()) == pytest.approx(second, abs=2e-3)
    fields = clock.fields()
    assert fields["at_s"] == {"ray_ready": first, "first_step": second} and fields["phase_s"] == phases
    assert clock.summary().startswith("ray_ready +")


def _started(start) -> RayStart:
    ray_start = RayStart()
    ray_start._start(start)
    return ray_start


def test_ray_start_runs_beside_the_caller_and_its_thread_lives_until_close() -> None:
    release = threading.Event()
    ray_start = _started(release.wait)
    assert ray_start._thread is not None and ray_start._thread.is_alive()  # the caller goes on meanwhile
    release.set()
    ray_start.wait()
    assert ray_start._thread.is_alive()  # Ray's processes are tied to the thread that started them: it must live on
    thread = ray_start._thread
    ray_start.close()
    assert not thread.is_alive() and ray_start._thread is None
    ray_start.close()  # twice is harmless


def test_ray_start_raises_the_start_error_in_the_caller() -> None:
    def fail() -> None:
        raise ConnectionError("no GCS")

    ray_start = _started(fail)
    ray_start.settle()  # over, nothing raised
    with pytest.raises(ConnectionError, match="no GCS"):
        ray_start.wait()
    ray_start.wait()  # raised once
    ray_start.close()


def _boundary_args(step: int, steps: int = 10, ckpt: int = 0, eval_every: int = 0, pending=None, stop: str = ""):
    cfg = SimpleNamespace(
        train=SimpleNamespace(steps=steps, eval_every=eval_every), checkpoint=SimpleNamespace(every=ckpt),
        data=SimpleNamespace(eval_size=16),
    )  # fmt: skip
    ops = SimpleNamespace(pending=pending or {}, stop_requested=lambda reason: bool(reason))
    return cfg, ops, SimpleNamespace(requested=stop), step


def test_the_next_step_starts_early_only_when_the_boundary_needs_nothing() -> None:
    assert not _boundary_work(*_boundary_args(3))
    assert _boundary_work(*_boundary_args(10))  # the last step is done
    assert _boundary_work(*_boundary_args(3, stop="SIGINT"))  # a stop was asked for
    assert _boundary_work(*_boundary_args(3, pending={"loss.cap": 3.0}))  # a live change applies from this step
    assert _boundary_work(*_boundary_args(4, ckpt=2)) and not _boundary_work(*_boundary_args(3, ckpt=2))
    assert _boundary_work(*_boundary_args(6, eval_every=3)) and not _boundary_work(*_boundary_args(5, eval_every=3))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_up_logs_its_startup_milestones_in_order(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "up", str(ROOT / "configs" / "dapo_int8.yaml"),
         "model.path=builtin:micro", "train.steps=3", "train.groups_per_step=2", "train.group_size=4",
         "algo.filter_groups=false", "data.eval_size=0", "checkpoint.final=false", f"logging.dir={tmp_path}",
         "logging.name=startup"],
        capture_output=True, text=True, timeout=540, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SIGTERM handler is not set" not in done.stdout + done.stderr  # Ray's note about its thread is dropped
    records = [json.loads(line) for line in (tmp_path / "startup" / "metrics.jsonl").read_text().splitlines()]
    startup = [r for r in records if r.get("event") == "startup"]
    assert len(startup) == 1
    at_s = startup[0]["at_s"]
    assert tuple(at_s) == MARKS
    assert list(at_s.values()) == sorted(at_s.values()) and all(v > 0 for v in at_s.values())
    assert startup[0]["phase_s"]["first_step"] >= 0
    steps = [r["step"] for r in records if "event" not in r]
    assert steps == [0, 1, 2]  # the early start of the next step neither skips nor repeats one
