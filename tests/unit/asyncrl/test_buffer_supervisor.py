"""`BufferSupervisor` with a real buffer process: a SIGKILLed buffer is restarted on its run directory and port (a
`buffer_restarted` event says how it died and what was replayed); past `buffer.max_restarts` the run fails with a
one-line reason."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from asyncrl.supervise import BufferSupervisor, SupervisionError
from buffer.client import BufferClient
from common.config import Config, to_dict


def _values(max_restarts: int) -> dict[str, Any]:
    values = to_dict(Config())
    values["train"].update(groups_per_step=2, group_size=2)
    values["data"].update(task="arith", digits=2)
    values["buffer"].update(max_restarts=max_restarts, reserve_mb=0)
    return values


def test_a_killed_buffer_is_restarted_on_its_endpoint_until_max_restarts(tmp_path: Path) -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    lines: list[str] = []
    supervisor = BufferSupervisor(_values(1), tmp_path, lambda kind, **f: events.append((kind, f)), lines.append)
    endpoint = supervisor.start()
    try:
        with BufferClient(endpoint, "w0", timeout_s=10.0) as client:
            assert len(client.lease(2)[0]) == 2
            first = supervisor.pid
            supervisor.proc.send_signal(signal.SIGKILL)
            supervisor.proc.wait()
            supervisor.poll()
            assert supervisor.pid != first and supervisor.endpoint == endpoint
            kind, fields = events[-1]
            assert kind == "buffer_restarted" and fields["exit"] == "killed by SIGKILL" and fields["restarts"] == 1
            assert fields["replayed_leases"] == 2 and fields["downtime_s"] >= 0
            assert client.stats()["returned_groups"] == 2  # the same client, on the same endpoint

            supervisor.proc.send_signal(signal.SIGKILL)
            supervisor.proc.wait()
            with pytest.raises(SupervisionError) as failed:
                supervisor.poll()
        message = str(failed.value)
        assert "\n" not in message and "killed by SIGKILL" in message and "`buffer.max_restarts` (1)" in message
        assert events[-1][0] == "buffer_crashed"
    finally:
        supervisor.stop()


def test_a_buffer_whose_journal_cannot_be_written_is_not_restarted(tmp_path: Path) -> None:
    """It was restarted `buffer.max_restarts` times within a second, each failing the same way on the full disk."""
    import subprocess
    import sys

    from buffer.launcher import EXIT_JOURNAL_UNWRITABLE, stop_service

    events: list[tuple[str, dict[str, Any]]] = []
    supervisor = BufferSupervisor(_values(3), tmp_path, lambda kind, **f: events.append((kind, f)), lambda line: None)
    supervisor.start()
    try:
        stop_service(supervisor.proc)
        supervisor.proc = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({EXIT_JOURNAL_UNWRITABLE})"])
        supervisor.proc.wait()
        with pytest.raises(SupervisionError, match="its journal in .* cannot be written"):
            supervisor.poll()
        assert events[-1][0] == "buffer_crashed" and events[-1][1]["restart"] is False
        assert not [kind for kind, _ in events if kind == "buffer_restarted"]
    finally:
        supervisor.stop()


def test_a_worker_scaled_away_and_back_gets_a_fresh_identity_and_the_stopping_one_is_kept(tmp_path: Path) -> None:
    """Scaling 3 -> 1 -> 3 before the removed workers had stopped gave the new ones their ids: the stopping entries
    (their stop calls, their counters) were overwritten, and their processes idled to the end of the run."""
    from types import SimpleNamespace

    from asyncrl.supervise import WorkerPool
    from common.config import load_config
    from rollout_workers.sections import WorkerSections

    class Handle:  # what the pool calls on a worker actor; nothing here returns until the test says
        def __init__(self, *args: Any) -> None:
            self.start = self.stop = SimpleNamespace(remote=lambda *a: object())

    events: list[tuple[str, dict[str, Any]]] = []
    cfg = load_config(None, [])
    pool = WorkerPool(WorkerSections.pick(cfg), cfg.ray, "model", "tcp://127.0.0.1:9", "tcp://127.0.0.1:9",
                      lambda kind, **f: events.append((kind, f)))  # fmt: skip
    pool.actor_cls = SimpleNamespace(remote=Handle)
    assert pool.scale(3) == (["worker-0", "worker-1", "worker-2"], [])
    assert pool.scale(1) == ([], ["worker-2", "worker-1"])
    added, removed = pool.scale(3)
    assert removed == [] and len(set(added)) == 2 and not set(added) & {"worker-1", "worker-2"}
    assert sorted(w.worker_id for w in pool.workers.values() if w.state == "stopping") == ["worker-1", "worker-2"]
    assert len(pool.workers) == 5 and len(pool.active()) == 3
