"""Worker heartbeats against a real `python -m buffer`: worker processes lease prompts and beat from a thread with
its own socket (`buffer.client.Heartbeat`, as rollout workers do); a SIGKILLed one loses its leases after
`buffer.worker_timeout_s`, a live one that generates slowly (its main thread busy, holding the GIL) keeps them. The
timing rule itself (silent for more than the timeout, not before) is checked on the buffer's state with its clock
passed in."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

from test_service import ROOT, make_group, running_buffer, wait_until

from buffer.client import BufferClient, Heartbeat
from buffer.state import BufferState
from common.config import BufferConfig, DataConfig
from common.tasks import make_source
from common.wire import PromptLease

WORKER_TIMEOUT_S = 1.0
WORKER = """
import json, sys, time
from buffer.client import BufferClient, Heartbeat
endpoint, name, busy_s, timeout_s = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
client = BufferClient(endpoint, name, timeout_s=5.0)
leases, _ = client.lease(2)
Heartbeat(endpoint, name, timeout_s / 6).start()
print(json.dumps([[x.group, x.index] for x in leases]), flush=True)
end = time.monotonic() + busy_s
while time.monotonic() < end:  # "generating": pure Python, so the heartbeat thread competes for the GIL
    sum(i * i for i in range(1000))
print("DONE", flush=True)
time.sleep(60)
"""


def _start_worker(endpoint: str, name: str, busy_s: float) -> tuple[subprocess.Popen[bytes], list[PromptLease]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-c", WORKER, endpoint, name, str(busy_s), str(WORKER_TIMEOUT_S)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 20.0)
    assert ready, f"worker {name} did not lease"
    leases = [PromptLease(group, index, "", "", 0.0) for group, index in json.loads(proc.stdout.readline())]
    assert len(leases) == 2
    return proc, leases


def _wait_line(proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    return proc.stdout.readline().decode().strip() if ready else ""


def test_killed_worker_loses_its_leases_and_a_slow_live_one_keeps_them(tmp_path: Path) -> None:
    config = {"lease_timeout_s": 60.0, "worker_timeout_s": WORKER_TIMEOUT_S}
    with running_buffer(tmp_path, train={"groups_per_step": 4}, buffer=config) as buffer:
        doomed, lost = _start_worker(buffer.endpoint, "w-doomed", busy_s=60.0)
        slow, kept = _start_worker(buffer.endpoint, "w-slow", busy_s=3 * WORKER_TIMEOUT_S)
        try:
            doomed.send_signal(signal.SIGKILL)
            doomed.wait()
            wait_until(lambda: buffer.stats()["dead_worker_leases"] >= 2, "the killed worker's leases to return")
            stats = buffer.stats()
            assert stats["dead_workers"] == 1 and stats["dead_worker_leases"] == 2, stats
            assert stats["leased_groups"] == 2 and stats["returned_groups"] == 2  # the slow worker's are still out
            with BufferClient(buffer.endpoint, "w-new", timeout_s=5.0) as new:  # returned leases go out first
                reissued, _ = new.lease(2)
                assert [x.group for x in reissued] == [x.group for x in lost]
                for lease in reissued:
                    assert new.push_group(lease.group, make_group(lease)).reason == ""
            assert _wait_line(slow, 20.0) == "DONE"  # three timeouts of busy generation later...
            stats = buffer.stats()
            assert stats["dead_worker_leases"] == 2 and stats["leased_groups"] == 2, stats  # ...it still holds both
            with BufferClient(buffer.endpoint, "w-slow", timeout_s=5.0) as late:
                for lease in kept:
                    assert late.push_group(lease.group, make_group(lease)).reason == ""  # admitted, not a duplicate
            assert buffer.stats()["admitted_groups"] == 4
        finally:
            for proc in (doomed, slow):
                proc.kill()
                proc.wait()
                assert proc.stdout is not None
                proc.stdout.close()


def test_heartbeat_stops_when_its_worker_loop_dies(tmp_path: Path) -> None:
    with running_buffer(tmp_path, buffer={"lease_timeout_s": 60.0, "worker_timeout_s": WORKER_TIMEOUT_S}) as buffer:
        loop_alive = True
        with BufferClient(buffer.endpoint, "w-loop", timeout_s=5.0) as client:
            client.lease(1)
        beat = Heartbeat(buffer.endpoint, "w-loop", WORKER_TIMEOUT_S / 6, alive=lambda: loop_alive).start()
        try:  # 12 beats, one every timeout / 6 at most: two timeouts have passed on beats alone
            wait_until(lambda: beat.sent >= 12, "12 heartbeats", timeout_s=30.0)
            assert buffer.stats()["leased_groups"] == 1
            loop_alive = False  # the process lives on, but its loop does not: the lease must come back
            wait_until(lambda: buffer.stats()["dead_worker_leases"] >= 1, "the lease of the dead loop to return")
            assert buffer.stats()["dead_worker_leases"] == 1
        finally:
            beat.stop()


def test_leases_return_once_their_worker_is_silent_for_longer_than_worker_timeout_s() -> None:
    state = BufferState(
        source=make_source(DataConfig(task="arith", digits=2)), group_size=2, groups_per_step=4, max_lag=1,
        filter_groups=False, lease_timeout_s=60.0, max_queued_groups=100, worker_timeout_s=WORKER_TIMEOUT_S,
    )  # fmt: skip
    start = 1000.0  # unix seconds, passed in as `now`
    lost = state.lease("w-silent", 2, now=start).leases
    state.lease("w-beating", 2, now=start)
    state.heartbeat("w-beating", now=start + WORKER_TIMEOUT_S / 2)
    assert state.expire_leases(now=start + WORKER_TIMEOUT_S) == 0  # silent for the timeout itself: not yet past it
    state.heartbeat("w-beating", now=start + WORKER_TIMEOUT_S)
    assert state.expire_leases(now=start + 1.5 * WORKER_TIMEOUT_S) == 2  # the silent one's; the beating one's stay
    assert state.counters["dead_workers"] == 1 and state.counters["dead_worker_leases"] == 2
    assert sorted(state.returned) == sorted(x.group for x in lost)
    assert {lease.worker for lease in state.leased.values()} == {"w-beating"}


def test_heartbeats_are_on_by_default() -> None:
    assert BufferConfig().worker_timeout_s == 30.0
