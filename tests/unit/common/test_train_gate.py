"""`common.train_gate`: a worker process blocks while the learner's side holds the gate closed, goes on when it
opens, ignores a gate left closed by a dead learner, and the driver names a gate only for its own CPU workers."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from pathlib import Path

from common import train_gate
from common.config import load_config
from common.train_gate import STALE_S, TrainGate

WAITER = """
import sys, time
from common.train_gate import TrainGate
gate = TrainGate(sys.argv[1])
print("ready", flush=True)
waited = gate.wait()
print(f"{waited!r} {time.time()!r}", flush=True)
"""


def test_a_worker_waits_while_the_gate_is_closed_and_goes_on_when_it_opens(tmp_path: Path) -> None:
    learner = TrainGate(tmp_path / "gate")
    learner.close()
    worker = subprocess.Popen([sys.executable, "-c", WAITER, str(tmp_path / "gate")], stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    assert worker.stdout is not None and worker.stdout.readline().strip() == "ready"
    time.sleep(0.4)
    assert worker.poll() is None  # still paused
    opened = time.time()
    learner.open()
    waited, resumed = (float(x) for x in worker.stdout.readline().split())
    assert worker.wait(timeout=30) == 0
    assert waited >= 0.35 and resumed >= opened
    assert TrainGate(tmp_path / "gate").wait() == 0.0  # open: no wait at all


def test_a_gate_left_closed_by_a_dead_learner_is_ignored(tmp_path: Path) -> None:
    gate = TrainGate(tmp_path / "gate")
    (tmp_path / "gate").write_bytes(struct.pack("<d", time.time() - STALE_S - 1))  # closed, and long ago
    start = time.monotonic()
    gate.wait()
    assert time.monotonic() - start < 1.0
    assert gate.closed_since() > 0  # the learner's mark is left as it was


def test_the_driver_names_a_gate_only_for_its_own_embedded_cpu_workers(tmp_path: Path, monkeypatch) -> None:
    from asyncrl.driver import _train_gate

    monkeypatch.setenv(train_gate.ENV_VAR, "")  # recorded, so that the test leaves the environment as it found it
    monkeypatch.delenv(train_gate.ENV_VAR)
    assert TrainGate.from_env() is None
    cfg = load_config(None, [])
    assert _train_gate(cfg, tmp_path, "ray") is None  # a cluster's workers run on other machines
    assert _train_gate(load_config(None, ["rollout.pause_during_training=false"]), tmp_path, "local") is None
    assert _train_gate(load_config(None, ["rollout.device=cuda"]), tmp_path, "local") is None
    path = _train_gate(cfg, tmp_path, "local")
    assert path == tmp_path / ".train_gate"
    assert os.environ[train_gate.ENV_VAR] == str(path)
    gate = TrainGate.from_env()
    assert gate is not None and gate.closed_since() == 0.0


def test_the_gate_file_is_allocated_not_sparse(tmp_path) -> None:
    """A sparse gate file has no block behind it: on a full disk the first write through the mapping killed the
    learner with SIGBUS ("out of memory or a crash"), where an allocation fails with ENOSPC, an OSError."""
    from common.train_gate import TrainGate

    TrainGate(tmp_path / "gate")  # made, not yet written
    assert os.stat(tmp_path / "gate").st_blocks > 0
