"""The /dev/shm files of a publisher whose process died (SIGKILL, real subprocesses) are swept by the next publisher;
a live publisher's files, other users' and files without a lock stay."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from quant_sync.export import export_rollout_tensors
from quant_sync.shm_owner import LOCK_SUFFIX, ShmOwner, sweep_stale
from quant_sync.transport import WeightPublisher

PUBLISHER = textwrap.dedent("""
    import sys, time, torch
    from quant_sync.export import export_rollout_tensors
    from quant_sync.transport import WeightPublisher
    publisher = WeightPublisher(shm_dir=sys.argv[1])
    publisher.publish(0, export_rollout_tensors({"model.norm.weight": torch.ones(64)}, "int8"), "int8")
    print(publisher._prefix, flush=True)
    time.sleep(120)
""")


def start_publisher(shm_dir: Path) -> tuple[subprocess.Popen, str]:
    root = Path(__file__).resolve().parents[3]
    process = subprocess.Popen([sys.executable, "-c", PUBLISHER, str(shm_dir)], stdout=subprocess.PIPE, text=True,
                               cwd=root, env={**os.environ, "PYTHONPATH": str(root)})  # fmt: skip
    prefix = process.stdout.readline().strip()
    assert prefix.startswith("asyncrl-weights-"), f"publisher did not start: {prefix!r}"
    return process, prefix


def files_of(shm_dir: Path, prefix: str) -> list[str]:
    return sorted(name for name in os.listdir(shm_dir) if name.startswith(prefix))


def test_a_killed_publishers_files_are_swept_and_a_live_ones_stay(tmp_path):
    dead, dead_prefix = start_publisher(tmp_path)
    live, live_prefix = start_publisher(tmp_path)
    try:
        assert dead_prefix + "-v0" in files_of(tmp_path, dead_prefix)
        assert dead_prefix + LOCK_SUFFIX in files_of(tmp_path, dead_prefix)
        legacy = tmp_path / "asyncrl-weights-1-0000abcd-v3"  # from before the locks: no owner to ask
        legacy.write_bytes(b"x")
        dead.send_signal(signal.SIGKILL)
        dead.wait(timeout=30)
        assert files_of(tmp_path, dead_prefix), "SIGKILL left the files (what the sweep is for)"

        publisher = WeightPublisher(shm_dir=str(tmp_path))
        try:
            assert files_of(tmp_path, dead_prefix) == []
            assert live_prefix + "-v0" in files_of(tmp_path, live_prefix)
            assert live_prefix + LOCK_SUFFIX in files_of(tmp_path, live_prefix)
            assert legacy.exists()
            assert sweep_stale(str(tmp_path), keep_prefix=publisher._prefix) == []  # nothing dead is left
        finally:
            publisher.close()
        assert files_of(tmp_path, publisher._prefix) == [], "close removes the lock file with the versions"
    finally:
        live.kill()
        live.wait(timeout=30)
    assert sweep_stale(str(tmp_path)) == [live_prefix]
    assert sorted(os.listdir(tmp_path)) == [legacy.name]


def test_a_closed_publisher_leaves_nothing_and_its_lock_is_held_while_open(tmp_path):
    publisher = WeightPublisher(shm_dir=str(tmp_path))
    publisher.publish(0, export_rollout_tensors({"model.norm.weight": torch.ones(8)}, "int8"), "int8")
    assert sweep_stale(str(tmp_path)) == [], "an open publisher is alive to the sweep, even from its own process"
    assert files_of(tmp_path, publisher._prefix)
    publisher.close()
    assert os.listdir(tmp_path) == []


def test_an_owner_cannot_claim_a_prefix_twice_and_release_is_idempotent(tmp_path):
    owner = ShmOwner(str(tmp_path), "asyncrl-weights-7-00000000")
    with pytest.raises(FileExistsError):
        ShmOwner(str(tmp_path), "asyncrl-weights-7-00000000")
    assert os.listdir(tmp_path) == ["asyncrl-weights-7-00000000" + LOCK_SUFFIX]
    owner.release()
    owner.release()
    assert os.listdir(tmp_path) == []


ORPHAN = textwrap.dedent("""
    import os, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[1], str(os.getpid())])
    print(child.pid, flush=True)
    child.wait()
""")
ORPHANED_PUBLISHER = textwrap.dedent("""
    import sys, threading, time, torch
    from common.actor_host import _watch_parent
    from quant_sync.export import export_rollout_tensors
    from quant_sync.transport import WeightPublisher
    threading.Thread(target=_watch_parent, args=(int(sys.argv[2]),), daemon=True).start()  # as a local actor does
    publisher = WeightPublisher(shm_dir=sys.argv[1])
    publisher.publish(0, export_rollout_tensors({"model.norm.weight": torch.ones(64)}, "int8"), "int8")
    print(publisher._prefix, flush=True)
    time.sleep(120)
""")


def test_a_local_actor_whose_driver_was_killed_removes_its_publisher_s_files(tmp_path):
    """A local actor exits when its driver is gone (common/actor_host.py `_watch_parent`); its weight files stayed
    in /dev/shm until another publisher started (none may, on a machine that runs no other job)."""
    import time

    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root)}
    driver = subprocess.Popen([sys.executable, "-c", ORPHAN, str(tmp_path), ORPHANED_PUBLISHER], cwd=root, env=env,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    actor_pid = int(driver.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        while not any(name.endswith("-v0") for name in os.listdir(tmp_path)):
            assert time.monotonic() < deadline and driver.poll() is None, "the publisher did not publish"
            time.sleep(0.05)
        driver.kill()  # SIGKILL: the driver stops nothing
        driver.wait(timeout=30)
        deadline = time.monotonic() + 30
        while os.listdir(tmp_path):
            assert time.monotonic() < deadline, f"left behind: {os.listdir(tmp_path)}"
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(actor_pid, signal.SIGKILL)
