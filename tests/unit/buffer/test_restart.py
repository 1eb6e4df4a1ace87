"""A buffer process SIGKILLed and restarted on its port (as the driver's `BufferSupervisor` does), with real processes
and sockets: clients send their request in flight again, the learner's pending FetchBatch is answered with the batch
the dead service consumed but never delivered, once, and nothing acknowledged is lost or admitted twice."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from typing import Any

import zmq
from test_service import make_group, wait_until, write_config

from buffer.client import BufferClient
from buffer.launcher import start_service, stop_service
from common import wire


def _restart(values: dict[str, Any], run_dir: Path, endpoint: str) -> tuple[Any, str]:
    values = {**values, "buffer": {**values["buffer"], "port": int(endpoint.rsplit(":", 1)[1])}}
    return start_service(values, run_dir, redeliver=True)


def test_a_fetch_pending_across_a_sigkill_gets_the_lost_batch_once(tmp_path: Path) -> None:
    values = json.loads(write_config(tmp_path / "config.json").read_text())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc, endpoint = start_service(values, run_dir)
    worker = BufferClient(endpoint, "w0", timeout_s=10.0)
    learner = BufferClient(endpoint, "learner", timeout_s=30.0)
    try:
        leases, _ = worker.lease(4)
        for lease in leases:
            assert worker.push_group(lease.group, make_group(lease)).reason == ""
        assert [g[0].group for g in learner.fetch_batch(0, 2, wait_s=0.0).groups] == ["g0", "g1"]
        # Step 1's batch is consumed (journaled) and its reply is lost with the service: a peer that never reads it
        lost = zmq.Context.instance().socket(zmq.DEALER)
        lost.setsockopt(zmq.LINGER, 0)
        lost.connect(endpoint)
        lost.send(wire.encode(wire.FetchBatch(step=1, num_groups=2, wait_s=0.0)))
        wait_until(lambda: worker.stats()["consumed_groups"] == 4, "the batch of step 1 consumed")
        lost.close(0)
        (outstanding,), _ = worker.lease(1)  # leased, never pushed: it returns to the pool

        answer: dict[str, Any] = {}
        waiting = threading.Thread(target=lambda: answer.update(reply=learner.fetch_batch(1, 2, wait_s=5.0)))
        waiting.start()  # the learner asks for step 1 (its reply never came) and waits: nothing is queued
        wait_until(lambda: worker.stats()["parked_fetches"] == 1, "the learner's fetch parked")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc, restarted_at = _restart(values, run_dir, endpoint)
        assert restarted_at == endpoint
        waiting.join(timeout=60)
        assert not waiting.is_alive()
        reply = answer["reply"]
        assert reply.ready and reply.step == 1 and [g[0].group for g in reply.groups] == ["g2", "g3"]
        assert learner.resends >= 1  # sent again on a fresh connection, not answered by a timeout

        stats = worker.stats()
        assert stats["redelivered_groups"] == 2 and stats["consumed_groups"] == 4 and stats["replayed_leases"] == 1
        assert not learner.fetch_batch(1, 2, wait_s=0.0).ready  # once: a second ask gets no batch
        assert worker.push_group("g0", make_group(leases[0])).reason == "duplicate"  # admitted once
        again, _ = worker.lease(2)
        assert [x.group for x in again] == [outstanding.group, "g5"]  # the lost lease first, then the cursor
        for lease in again:  # version 1: admissible at step 2 (staleness.max_lag=1)
            assert worker.push_group(lease.group, make_group(lease, version=1)).reason == ""
        assert [g[0].group for g in learner.fetch_batch(2, 2, wait_s=0.0).groups] == [outstanding.group, "g5"]
    finally:
        worker.close()
        learner.close()
        stop_service(proc)


def test_a_restart_forgets_the_lost_batch_once_a_later_step_is_asked(tmp_path: Path) -> None:
    """The learner did receive step 0's batch before the crash: it asks for step 1, which must not get step 0's."""
    values = json.loads(write_config(tmp_path / "config.json").read_text())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc, endpoint = start_service(values, run_dir)
    client = BufferClient(endpoint, "learner", timeout_s=30.0)
    try:
        leases, _ = client.lease(4)
        for lease in leases:
            assert client.push_group(lease.group, make_group(lease)).reason == ""
        assert [g[0].group for g in client.fetch_batch(0, 2, wait_s=0.0).groups] == ["g0", "g1"]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc, _ = _restart(values, run_dir, endpoint)
        assert [g[0].group for g in client.fetch_batch(1, 2, wait_s=0.0).groups] == ["g2", "g3"]
        assert not client.fetch_batch(0, 2, wait_s=0.0).ready
        assert client.stats().get("redelivered_groups", 0) == 0
    finally:
        client.close()
        stop_service(proc)
