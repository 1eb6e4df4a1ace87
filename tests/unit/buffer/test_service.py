"""The buffer service as a real subprocess on real ZMQ sockets, with the real `arith` prompt source."""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_for_futures
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from buffer.client import BufferClient, BufferRequestError, BufferUnavailable
from buffer.journal import read_records
from buffer.service import FETCH_REISSUE_GRACE_S
from common import wire
from common.config import Config, DataConfig, to_dict
from common.curve import ClientKeys, client_keys
from common.tasks import make_source
from common.wire import PromptLease, Trajectory

ROOT = Path(__file__).resolve().parents[3]
GROUP_SIZE = 2
BATCH = 2  # groups_per_step


class Buffer:
    """A running `python -m buffer` and a client to it (with the run's CurveZMQ client keys, if any)."""

    def __init__(self, proc: subprocess.Popen[bytes], endpoint: str, curve: ClientKeys | None = None) -> None:
        self.proc = proc
        self.endpoint = endpoint
        self.curve = curve
        self.client = BufferClient(endpoint, "test", timeout_s=5.0, curve=curve)

    def stats(self) -> dict[str, Any]:
        return self.client.stats()


def write_config(path: Path, **sections: dict[str, Any]) -> Path:
    values = to_dict(Config())  # the driver writes the whole tree; the buffer reads its sections
    values["train"].update(groups_per_step=BATCH, group_size=GROUP_SIZE)
    values["staleness"]["max_lag"] = 1
    values["buffer"].update(lease_timeout_s=30.0)
    values["data"].update(task="arith", digits=2)
    for name, fields_ in sections.items():
        values[name].update(fields_)
    path.write_text(json.dumps(values))
    return path


@contextmanager
def running_buffer(
    tmp_path: Path, run_dir: Path | None = None, args: tuple[str, ...] = (), **sections: dict[str, Any]
) -> Iterator[Buffer]:
    config = write_config(tmp_path / "config.json", **sections)
    run_dir = run_dir or tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "buffer", "--config-json", str(config), "--run-dir", str(run_dir), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 20.0)
    line = proc.stdout.readline().decode().strip() if ready else ""
    if not line.startswith("READY tcp://"):
        proc.kill()
        raise AssertionError(f"buffer did not start: {line!r}, rc={proc.poll()}")
    buffer = Buffer(proc, line.split()[1], client_keys(sections.get("buffer", {}).get("curve_keys_dir", "")))
    try:
        yield buffer
    finally:
        buffer.client.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0  # SIGTERM: journal flushed, clean exit
        proc.stdout.close()


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Poll `condition` until it holds; fail naming `what` after `timeout_s` (a bound for a hang, not a speed claim)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what} after {timeout_s} s"
        time.sleep(0.02)


def make_group(lease: PromptLease, version: int = 0, rewards: tuple[float, ...] = (1.0, 0.0)) -> list[Trajectory]:
    rng = np.random.default_rng(lease.index)
    out = []
    for i, reward in enumerate(rewards):
        length = 3 + i
        out.append(
            Trajectory(
                uid=f"{lease.group}/{i}",
                group=lease.group,
                prompt_index=lease.index,
                prompt_ids=np.frombuffer(lease.prompt.encode(), dtype=np.uint8).astype(np.int32),
                response_ids=rng.integers(0, 20, length).astype(np.int32),
                behav_logp=-rng.random(length).astype(np.float32),
                versions=np.full(length, version, dtype=np.int32),
                reward=reward,
                correct=reward > 0,
                finish="stop",
                worker="w0",
                t_start=time.time(),
                t_end=time.time(),
            )
        )
    return out


def lease_and_push(buffer: Buffer, count: int, version: int = 0) -> list[PromptLease]:
    leases, _ = buffer.client.lease(count)
    assert len(leases) == count
    for lease in leases:
        reply = buffer.client.push_group(lease.group, make_group(lease, version))
        assert (reply.accepted, reply.reason) == (True, "")
    return leases


def test_lease_push_fetch(tmp_path: Path) -> None:
    with running_buffer(tmp_path) as buffer:
        asked_at = time.time()
        leases, retry = buffer.client.lease(2)
        answered_at = time.time()
        source = make_source(DataConfig(task="arith", digits=2))
        assert [x.index for x in leases] == [0, 1] and retry == 0.0
        assert [(x.prompt, x.answer) for x in leases] == [
            (source.train(i).prompt, source.train(i).answer) for i in (0, 1)
        ]
        assert all(asked_at + 30.0 <= x.deadline <= answered_at + 30.0 for x in leases)  # buffer.lease_timeout_s
        for lease in reversed(leases):  # admission order, not lease order, is the batch order (FIFO)
            assert buffer.client.push_group(lease.group, make_group(lease)).accepted
        not_yet = buffer.client.fetch_batch(step=0, num_groups=3, wait_s=0.0)
        assert not not_yet.ready and not_yet.groups == []
        batch = buffer.client.fetch_batch(step=0, num_groups=2, wait_s=0.0)
        assert batch.ready and batch.step == 0
        assert [g[0].group for g in batch.groups] == [leases[1].group, leases[0].group]
        sent = make_group(leases[0])
        got = batch.groups[1]
        assert [t.uid for t in got] == [t.uid for t in sent]
        assert all(np.array_equal(a.response_ids, b.response_ids) for a, b in zip(got, sent, strict=True))
        stats = buffer.stats()
        assert (stats["admitted_groups"], stats["consumed_groups"], stats["queued_groups"]) == (2, 2, 0)
        assert stats["leased_groups"] == 0 and stats["current_step"] == 0


def test_parked_fetch_is_answered_when_groups_arrive(tmp_path: Path) -> None:
    with (
        running_buffer(tmp_path) as buffer,
        BufferClient(buffer.endpoint, "worker") as worker,
        ThreadPoolExecutor(1) as learner,
    ):
        leases, _ = worker.lease(2)
        fetch = learner.submit(buffer.client.fetch_batch, step=0, num_groups=2, wait_s=30.0)
        wait_until(lambda: worker.stats()["parked_fetches"] == 1, "the fetch to park")
        for lease in leases:
            assert worker.push_group(lease.group, make_group(lease)).accepted
        answered, _ = wait_for_futures([fetch], timeout=20.0)
        assert answered, "the parked fetch was not answered when its groups arrived (it waits up to 30 s)"
        batch = fetch.result()
        assert batch.ready and len(batch.groups) == 2
        start = time.monotonic()
        empty = buffer.client.fetch_batch(step=1, num_groups=2, wait_s=0.3)  # the client gives up 5 s past wait_s
        assert not empty.ready and time.monotonic() - start > 0.25  # answered once its wait was over, not before


def test_a_fetch_answered_empty_counts_as_waiting_until_its_peer_asks_again(tmp_path: Path) -> None:
    """The watchdog tells a waiting learner from a busy one by `waiting_fetches`: a fetch answered empty at its
    deadline still counts for FETCH_REISSUE_GRACE_S (the learner asks again at once), then no longer."""
    with running_buffer(tmp_path) as buffer, BufferClient(buffer.endpoint, "worker") as worker:
        empty = buffer.client.fetch_batch(step=0, num_groups=2, wait_s=0.2)
        answered_at = time.monotonic()
        stats = worker.stats()
        assert not empty.ready and stats["parked_fetches"] == 0
        if time.monotonic() - answered_at < FETCH_REISSUE_GRACE_S:  # the stats round trip took less than the grace
            assert stats["waiting_fetches"] == 1
        wait_until(
            lambda: worker.stats()["waiting_fetches"] == 0, "the grace to pass", timeout_s=10 * FETCH_REISSUE_GRACE_S
        )
        assert time.monotonic() - answered_at >= FETCH_REISSUE_GRACE_S * 0.9
        with ThreadPoolExecutor(1) as learner:
            fetch = learner.submit(buffer.client.fetch_batch, step=0, num_groups=2, wait_s=30.0)
            wait_until(lambda: worker.stats()["parked_fetches"] == 1, "the fetch to park")
            assert worker.stats()["waiting_fetches"] == 1
            leases, _ = worker.lease(2)
            for lease in leases:
                assert worker.push_group(lease.group, make_group(lease)).accepted
            assert fetch.result(timeout=20).ready
        assert worker.stats()["waiting_fetches"] == 0


def test_a_commit_without_replies_does_not_wake_the_poll_forever(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A parked fetch that drops a stale group journals a record and sends no reply. When that record's commit turns
    durable (in the writer thread, after a slow fsync), the service must read the signal and block in its poll
    again, not spin until the fetch's deadline. The service runs in this process, on a real socket."""
    from buffer import journal as journal_module
    from buffer.journal import Journal
    from buffer.service import BufferService, make_socket
    from buffer.state import BufferState

    real_fsync = os.fsync
    synced: list[int] = []

    def slow_fsync(fd: int) -> None:
        time.sleep(0.2)
        real_fsync(fd)
        synced.append(fd)

    monkeypatch.setattr(journal_module.os, "fsync", slow_fsync)
    state = BufferState(
        source=make_source(DataConfig(task="arith", digits=2)), group_size=GROUP_SIZE, groups_per_step=BATCH, max_lag=1,
        filter_groups=False, lease_timeout_s=60.0, max_queued_groups=100,
    )  # fmt: skip
    journal = state.journal = Journal(tmp_path / "buffer.journal", "batch")
    context = zmq.Context()
    socket = make_socket(context)
    endpoint = f"tcp://127.0.0.1:{socket.bind_to_random_port('tcp://127.0.0.1')}"
    service = BufferService(state, socket, journal)
    serving = threading.Thread(target=service.run)
    serving.start()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        with BufferClient(endpoint, "w0") as client:
            (lease,), _ = client.lease(1)
        dealer.send(wire.encode(wire.PushGroup("w0", lease.group, make_group(lease, version=0))))
        assert dealer.poll(5000) and wire.decode(dealer.recv()).reason == ""
        synced_before = len(synced)  # the push's commit is durable: it was answered
        dealer.send(wire.encode(wire.FetchBatch(step=5, num_groups=BATCH, wait_s=4.0)))  # drops it: max_lag 1
        wait_until(lambda: len(synced) > synced_before, "the drop's commit to turn durable")  # the fetch stays parked
        before = time.process_time()
        time.sleep(1.5)
        assert time.process_time() - before < 0.5  # this process idles (CPU time): the service's poll blocks
        assert dealer.poll(10_000)
        reply = wire.decode(dealer.recv())
        assert isinstance(reply, wire.BatchReply) and not reply.ready and reply.dropped_stale == 1
    finally:
        service.stopping = True
        serving.join()
        dealer.close()
        socket.close(0)
        journal.close()
        context.term()


def test_duplicate_and_invalid_pushes(tmp_path: Path) -> None:
    with running_buffer(tmp_path) as buffer:
        client = buffer.client
        (lease,) = client.lease(1)[0]
        group = make_group(lease)
        cases = {
            "group_size": group[:1],
            "group_mismatch": [group[0], make_group(PromptLease("g9", lease.index, "", "", 0.0))[1]],
            "duplicate_uid": [group[0], group[0]],
            "prompt_index": make_group(PromptLease(lease.group, lease.index + 5, lease.prompt, "", 0.0)),
            "future_version": make_group(lease, version=2),  # the learner is at step 0: versions 0 and 1 exist
        }
        for reason, trajectories in cases.items():
            reply = client.push_group(lease.group, trajectories)
            assert (reply.accepted, reply.reason) == (False, reason)
        unknown = client.push_group("g999", make_group(PromptLease("g999", 999, "", "", 0.0)))
        assert (unknown.accepted, unknown.reason) == (False, "unknown_group")
        assert client.push_group(lease.group, group).reason == ""  # the lease survived the rejects
        again = client.push_group(lease.group, group)
        assert (again.accepted, again.reason) == (True, "duplicate")
        stats = buffer.stats()
        assert stats["admitted_groups"] == 1 and stats["queued_groups"] == 1 and stats["duplicate_groups"] == 1
        for reason in [*cases, "unknown_group"]:
            assert stats[f"rejected_{reason}"] == 1
        assert len(client.fetch_batch(0, 1, 0.0).groups) == 1
        assert not client.fetch_batch(0, 1, 0.0).ready


def test_a_token_id_past_the_models_vocabulary_is_refused(tmp_path: Path) -> None:
    """Accepted, such a group made the learner's embedding raise and ended the run (`--vocab-size`: the driver's)."""
    with running_buffer(tmp_path, args=("--vocab-size", "128")) as buffer:  # make_group: ASCII prompts, ids < 20
        client = buffer.client
        (lease,) = client.lease(1)[0]
        for column in ("response_ids", "prompt_ids"):
            group = make_group(lease)
            getattr(group[1], column)[0] = 128
            reply = client.push_group(lease.group, group)
            assert (reply.accepted, reply.reason) == (False, "token_range")
        assert buffer.stats()["rejected_token_range"] == 2
        group = make_group(lease)
        group[1].response_ids[0] = 127
        assert client.push_group(lease.group, group).reason == ""  # the largest id there is


def test_stale_groups_are_dropped_and_counted(tmp_path: Path) -> None:
    with running_buffer(tmp_path) as buffer:  # max_lag = 1
        client = buffer.client
        lease_and_push(buffer, 2, version=0)
        assert client.fetch_batch(step=1, num_groups=1, wait_s=0.0).ready  # 1 - 0 <= 1: fine
        reply = client.fetch_batch(step=2, num_groups=1, wait_s=0.0)  # 2 - 0 > 1: dropped
        assert not reply.ready and reply.dropped_stale == 1
        leases, _ = client.lease(1)
        late = client.push_group(leases[0].group, make_group(leases[0], version=0))  # already too old on arrival
        assert (late.accepted, late.reason) == (True, "stale")
        stats = buffer.stats()
        assert stats["dropped_stale"] == 2 and stats["queued_groups"] == 0 and stats["consumed_groups"] == 1
        # the per-step metric counts both, the one refused at its push too (the learner's figure saw only the fetch's)
        from buffer.selective import rollout_metrics

        assert rollout_metrics(stats, {})["staleness/dropped"] == 2


def test_throttle_and_resume(tmp_path: Path) -> None:
    with running_buffer(tmp_path) as buffer:  # B = 2, max_lag = 1: (k + 2) * 2 groups by step k
        client = buffer.client
        leases, _ = client.lease(10)
        assert len(leases) == 4
        empty, retry = client.lease(1)
        assert empty == [] and retry > 0
        for lease in leases:
            assert client.push_group(lease.group, make_group(lease)).accepted
        assert client.lease(1)[0] == []
        assert client.fetch_batch(step=0, num_groups=2, wait_s=0.0).ready
        assert client.lease(1)[0] == []  # consumed groups still count
        assert client.fetch_batch(step=1, num_groups=2, wait_s=0.0).ready
        more, _ = client.lease(10)
        assert [x.index for x in more] == [4, 5]  # (1 + 2) * 2 = 6 groups by step 1
        client.set_max_lag(3)  # live change: (1 + 4) * 2 = 10
        assert len(client.lease(10)[0]) == 4
        stats = client.set_max_lag(0)
        assert stats["max_lag"] == 0 and stats["may_lease"] == 0


def test_lease_expiry_returns_the_prompt(tmp_path: Path) -> None:
    with running_buffer(tmp_path, buffer={"lease_timeout_s": 0.3}) as buffer:
        first, _ = buffer.client.lease(1)
        wait_until(lambda: buffer.stats()["expired_leases"] == 1, "the 0.3 s lease to expire")
        with BufferClient(buffer.endpoint, "w1") as other:
            again, _ = other.lease(2)
            assert [x.group for x in again] == [first[0].group, "g1"]  # the expired prompt first, same group id
            late = buffer.client.push_group(first[0].group, make_group(first[0]))  # the first worker was just slow
            assert (late.accepted, late.reason) == (True, "")
            dup = other.push_group(again[0].group, make_group(again[0]))
            assert (dup.accepted, dup.reason) == (True, "duplicate")
        stats = buffer.stats()
        assert stats["admitted_groups"] == 1 and stats["reissued_leases"] == 1 and stats["queued_groups"] == 1


def test_filter_groups_drops_uniform_rewards(tmp_path: Path) -> None:
    with running_buffer(tmp_path, algo={"filter_groups": True}) as buffer:
        client = buffer.client
        leases, _ = client.lease(4)
        uniform = client.push_group(leases[0].group, make_group(leases[0], rewards=(1.0, 1.0)))
        assert (uniform.accepted, uniform.reason) == (True, "filtered")
        assert client.push_group(leases[1].group, make_group(leases[1], rewards=(0.0, 0.0))).reason == "filtered"
        assert client.push_group(leases[2].group, make_group(leases[2], rewards=(0.0, 1.0))).reason == ""
        stats = buffer.stats()
        assert stats["filtered_groups"] == 2 and stats["queued_groups"] == 1
        assert len(client.lease(4)[0]) == 2  # filtered groups do not count toward the throttle


def test_backpressure(tmp_path: Path) -> None:
    with running_buffer(tmp_path, buffer={"max_queued_groups": 1}) as buffer:
        client = buffer.client
        leases, _ = client.lease(2)
        assert client.push_group(leases[0].group, make_group(leases[0])).reason == ""
        full = client.push_group(leases[1].group, make_group(leases[1]))
        assert (full.accepted, full.reason) == (False, "backpressure")
        assert client.lease(1)[0] == []  # leasing pauses while the queue is full
        assert client.fetch_batch(0, 1, 0.0).ready
        assert client.push_group(leases[1].group, make_group(leases[1])).reason == ""
        assert buffer.stats()["rejected_backpressure"] == 1


def test_restart_replays_the_journal(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with running_buffer(tmp_path, run_dir=run_dir) as buffer:
        leases = lease_and_push(buffer, 4)
        consumed = buffer.client.fetch_batch(step=1, num_groups=2, wait_s=0.0)
        assert [g[0].group for g in consumed.groups] == ["g0", "g1"]
        (outstanding,) = buffer.client.lease(1)[0]  # in flight when the buffer dies
        buffer.proc.kill()  # SIGKILL: no chance to flush anything
        buffer.proc.wait()
    with (run_dir / "buffer.journal").open("ab") as journal:
        journal.write(b"\x40\x00\x00\x00torn")  # a record cut short by the crash

    with running_buffer(tmp_path, run_dir=run_dir) as buffer:
        stats = buffer.stats()
        assert stats["queued_groups"] == 2 and stats["current_step"] == 1 and stats["consumed_groups"] == 2
        batch = buffer.client.fetch_batch(step=1, num_groups=2, wait_s=0.0)
        assert [g[0].group for g in batch.groups] == ["g2", "g3"]
        assert not buffer.client.fetch_batch(step=1, num_groups=1, wait_s=0.0).ready
        assert buffer.client.push_group("g0", make_group(leases[0])).reason == "duplicate"
        assert buffer.client.push_group("g2", make_group(leases[2])).reason == "duplicate"
        again, _ = buffer.client.lease(2)
        assert [x.group for x in again] == [outstanding.group, "g5"]  # the lost lease first, then the cursor
        assert buffer.client.push_group(outstanding.group, make_group(outstanding)).reason == ""

    with running_buffer(tmp_path, run_dir=run_dir) as buffer:  # a clean restart after the torn tail was cut
        stats = buffer.stats()
        assert stats["queued_groups"] == 1 and stats["consumed_groups"] == 4 and stats["cursor"] == 6


def test_resume_rewinds_the_journal_to_the_checkpoint_step(tmp_path: Path) -> None:
    """Resuming a learner checkpoint whose next step is 1: what step 1 consumed returns, in order, for step 1 again;
    groups with versions the lost learner published (2) are dropped; the rewind is journaled and survives restarts."""
    run_dir = tmp_path / "run"
    with running_buffer(tmp_path, run_dir=run_dir) as buffer:
        lease_and_push(buffer, 4)
        assert buffer.client.fetch_batch(step=0, num_groups=2, wait_s=0.0).ready
        assert [g[0].group for g in buffer.client.fetch_batch(step=1, num_groups=2, wait_s=0.0).groups] == ["g2", "g3"]
        lease_and_push(buffer, 2, version=2)  # g4, g5 on version 2, published by step 1 of the lost learner
        buffer.proc.kill()
        buffer.proc.wait()
    with running_buffer(tmp_path, run_dir=run_dir, args=("--resume-step", "1")) as buffer:
        stats = buffer.stats()
        assert stats["consumed_groups"] == 2 and stats["queued_groups"] == 2
        assert stats["rewound_groups"] == 2 and stats["rewind_dropped_groups"] == 2
        assert [g[0].group for g in buffer.client.fetch_batch(step=1, num_groups=2, wait_s=0.0).groups] == ["g2", "g3"]
        assert buffer.client.push_group("g4", make_group(_lease(4))).reason == "duplicate"
    rewinds = [r for r in read_records(run_dir / "buffer.journal") if r["k"] == "rewind"]
    assert rewinds == [{"k": "rewind", "s": 1, "g": ["g2", "g3"], "d": ["g4", "g5"], "c": 2}]
    with running_buffer(tmp_path, run_dir=run_dir) as buffer:  # a plain restart replays the rewind
        stats = buffer.stats()
        assert stats["consumed_groups"] == 4 and stats["queued_groups"] == 0 and stats["cursor"] == 6


def _lease(index: int) -> PromptLease:
    return PromptLease(f"g{index}", index, "1+1=", "2", 0.0)


def test_malformed_messages_are_counted_and_survived(tmp_path: Path) -> None:
    with running_buffer(tmp_path) as buffer:
        context = zmq.Context.instance()
        raw = context.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(buffer.endpoint)
        bad = {
            "bad_msgpack": b"\xc1garbage",
            "unknown_type": msgpack.packb({"v": wire.SCHEMA_VERSION, "type": "Shutdown"}),
            "schema_version": msgpack.packb({"v": 99, "type": "StatsRequest"}),
            "nonfinite_logp": None,
            "unexpected_type": wire.encode(wire.PushReply(True, "")),
        }
        leases, _ = buffer.client.lease(1)
        group = make_group(leases[0])
        group[1].behav_logp = np.array([-1.0, np.nan, -1.0, -1.0], dtype=np.float32)
        bad["nonfinite_logp"] = wire.encode(wire.PushGroup("w0", leases[0].group, group))
        for reason, payload in bad.items():
            raw.send(payload)
            assert raw.poll(5000)
            reply = wire.decode(raw.recv())
            assert isinstance(reply, wire.ErrorReply) and reply.reason == reason
        raw.send_multipart([b"", b"\x00\x01"])  # a REQ-style envelope is answered the same way
        assert raw.poll(5000)
        frames = raw.recv_multipart()
        assert frames[0] == b"" and wire.decode(frames[-1]).reason == "bad_msgpack"
        raw.close()
        stats = buffer.stats()
        assert stats["rejected_bad_msgpack"] == 2 and stats["rejected_nonfinite_logp"] == 1
        assert all(stats[f"rejected_{r}"] >= 1 for r in bad)
        assert buffer.client.push_group(leases[0].group, make_group(leases[0])).reason == ""


def test_client_times_out_clearly_and_recovers(tmp_path: Path) -> None:
    context = zmq.Context.instance()
    silent = context.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    client = BufferClient(f"tcp://127.0.0.1:{port}", "w", timeout_s=0.2)
    with pytest.raises(BufferUnavailable, match="did not answer"):
        client.stats()
    identity, payload = silent.recv_multipart()
    assert isinstance(wire.decode(payload), wire.StatsRequest)
    silent.send_multipart([identity, wire.encode(wire.StatsReply({"late": 1}))])  # a late reply is never mistaken
    client.timeout_s = 5.0

    def answer_next() -> None:
        identity, _ = silent.recv_multipart()
        silent.send_multipart([identity, wire.encode(wire.StatsReply({"n": 2}))])

    thread = threading.Thread(target=answer_next)
    thread.start()
    assert client.stats() == {"n": 2}
    thread.join()
    client.close()
    silent.close()


@pytest.mark.parametrize(
    ("section", "key"),
    [({"buffer": {"max_queued_groups": 0}}, "buffer.max_queued_groups"), ({"staleness": {"max_lgs": 1}}, "max_lgs")],
)
def test_bad_config_exits_naming_the_key(tmp_path: Path, section: dict[str, Any], key: str) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(section))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "buffer", "--config-json", str(config), "--run-dir", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and key in done.stderr and "READY" not in done.stdout


# ---- issue 4: fuzzing over the socket, dead workers, live max_lag across restarts, compaction ------------------


def _malformed_pool(rng: np.random.Generator, valid: bytes, size: int) -> list[bytes]:
    """`size` distinct messages that `wire.decode` rejects: random bytes, truncations, wrong types, NaN, mismatched
    lengths, oversized arrays."""
    columns = list(msgpack.unpackb(valid)["trajectories"])
    wrong = [None, True, -1, 2**63, 1.5, math.nan, math.inf, "x", b"", [], {}, [{}], bytes(8), ["x"]]
    pool: list[bytes] = []
    while len(pool) < size:
        kind = len(pool) % 6
        if kind == 0:
            data = rng.bytes(int(rng.integers(1, 300)))
        elif kind == 1:
            data = valid[: int(rng.integers(0, len(valid)))]
        else:
            mutated = msgpack.unpackb(valid)
            target = mutated["trajectories"]
            if kind == 2:
                target[columns[int(rng.integers(0, len(columns)))]] = wrong[int(rng.integers(0, len(wrong)))]
            elif kind == 3:
                values = np.frombuffer(target["behav_logp"], np.float32).copy()
                values[int(rng.integers(0, len(values)))] = [np.nan, np.inf, -np.inf, 3.0][len(pool) % 4]
                target["behav_logp"] = values.tobytes()
            elif kind == 4:
                name = ["versions", "behav_logp", "response_ids", "response_len"][len(pool) % 4]
                target[name] += bytes(4 * int(rng.integers(1, 5)))
            else:
                lengths = np.frombuffer(target["response_len"], np.int32).copy()
                lengths[0] = wire.MAX_TOKENS + 1
                target["response_len"] = lengths.tobytes()
            data = msgpack.packb(mutated)
        try:
            wire.decode(data)
        except wire.WireError:
            pool.append(data)
    return pool


def test_fuzz_over_the_socket_while_valid_traffic_flows(tmp_path: Path) -> None:
    total_malformed = 100_000
    with running_buffer(tmp_path, train={"groups_per_step": 40}) as buffer:
        leases, _ = buffer.client.lease(1)
        rng = np.random.default_rng(4)
        pool = _malformed_pool(rng, wire.encode(wire.PushGroup("w0", "g0", make_group(leases[0]))), 3000)
        context = zmq.Context.instance()
        attacker = context.socket(zmq.DEALER)
        attacker.setsockopt(zmq.LINGER, 0)
        attacker.setsockopt(zmq.SNDHWM, 0)
        attacker.setsockopt(zmq.RCVHWM, 0)
        attacker.connect(buffer.endpoint)
        replies = 0

        def attack() -> None:  # pipelined: no waiting for replies
            for i in range(total_malformed):
                attacker.send(pool[i % len(pool)], copy=False)

        sender = threading.Thread(target=attack)
        started = time.monotonic()
        sender.start()
        with BufferClient(buffer.endpoint, "w-valid", timeout_s=30.0) as worker:
            assert worker.push_group(leases[0].group, make_group(leases[0])).reason == ""
            pushed = [leases[0]]
            while len(pushed) < 40:  # (0 + max_lag + 1) * 40 groups may be leased at step 0
                more, _ = worker.lease(4)
                for lease in more:
                    assert worker.push_group(lease.group, make_group(lease)).reason == ""
                    pushed.append(lease)
        sender.join()
        while replies < total_malformed and time.monotonic() - started < 120:
            if attacker.poll(5000):
                reply = wire.decode(attacker.recv())
                assert isinstance(reply, wire.ErrorReply)
                replies += 1
        attacker.close()
        stats = buffer.stats()
        rejected = sum(v for k, v in stats.items() if k.startswith("rejected_"))
        assert replies == total_malformed and rejected == total_malformed, (replies, rejected)
        assert stats["admitted_groups"] == len(pushed)
        batch = buffer.client.fetch_batch(step=0, num_groups=len(pushed), wait_s=0.0)
        assert sorted(g[0].group for g in batch.groups) == sorted(x.group for x in pushed)


@contextlib.contextmanager
def _two_workers(tmp_path: Path, first: str) -> Iterator[tuple[Any, BufferClient, BufferClient]]:
    """A buffer that declares a worker dead after 1 s of silence (leases last 60 s), a worker `first`, and `alive`."""
    with (
        running_buffer(tmp_path, buffer={"lease_timeout_s": 60.0, "worker_timeout_s": 1.0}) as buffer,
        BufferClient(buffer.endpoint, first) as one,
        BufferClient(buffer.endpoint, "alive") as alive,
    ):
        yield buffer, one, alive


def test_dead_worker_leases_return_before_their_deadline(tmp_path: Path) -> None:
    with _two_workers(tmp_path, "doomed") as (buffer, doomed, alive):
        lost, _ = doomed.lease(2)
        kept, _ = alive.lease(1)

        def doomed_is_declared_dead() -> bool:  # `alive` heartbeats (a LeaseRequest of 0 groups); `doomed` is silent
            assert alive.lease(0)[0] == []
            return buffer.stats()["dead_workers"] > 0

        wait_until(doomed_is_declared_dead, "the silent worker to be declared dead")
        stats = buffer.stats()
        assert stats["dead_workers"] == 1 and stats["dead_worker_leases"] == 2 and stats["leased_groups"] == 1
        again, _ = alive.lease(3)
        assert [x.group for x in again] == [x.group for x in lost] + ["g3"]
        assert alive.push_group(kept[0].group, make_group(kept[0])).reason == ""


def test_a_leaving_worker_returns_its_leases_at_once_and_is_not_declared_dead(tmp_path: Path) -> None:
    with _two_workers(tmp_path, "scaled-away") as (buffer, leaving, alive):
        unfinished, _ = leaving.lease(3)
        leaving.push_group(unfinished[0].group, make_group(unfinished[0]))
        leaving.leave()
        stats = buffer.stats()  # the two it did not push are back in the pool at once, reissued first
        assert stats["left_workers"] == 1 and stats["left_worker_leases"] == 2 and stats["leased_groups"] == 0
        again, _ = alive.lease(3)
        assert [x.group for x in again] == [x.group for x in unfinished[1:]] + ["g3"]
        end = time.monotonic() + 1.5  # past worker_timeout_s (`alive` beating): one that left is never declared dead
        while time.monotonic() < end:
            assert alive.lease(0)[0] == []
            time.sleep(0.1)
        assert buffer.stats()["dead_workers"] == 0
        assert alive.push_group(again[0].group, make_group(again[0])).reason == ""


def test_max_lag_set_live_survives_a_restart(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with running_buffer(tmp_path, run_dir=run_dir) as buffer:
        assert buffer.client.set_max_lag(5)["max_lag"] == 5
        buffer.proc.kill()
        buffer.proc.wait()
    with running_buffer(tmp_path, run_dir=run_dir) as buffer:
        stats = buffer.stats()
        assert stats["max_lag"] == 5 and stats["may_lease"] == (0 + 5 + 1) * BATCH


def test_a_journal_that_is_mostly_queue_is_not_compacted(tmp_path: Path) -> None:
    """Compaction rewrites the queued groups: while they are most of the journal it would only copy it. Once the
    learner has consumed them, the next growth compacts."""
    run_dir = tmp_path / "run"
    with running_buffer(tmp_path, run_dir=run_dir, buffer={"compact_bytes": 4096}, staleness={"max_lag": 8}) as buffer:
        for _ in range(8):
            lease_and_push(buffer, BATCH)
        assert (run_dir / "buffer.journal").stat().st_size > 6000  # past compact_bytes, yet no compaction
        assert buffer.stats().get("journal_compactions", 0) == 0
        for step in range(8):
            assert buffer.client.fetch_batch(step=step, num_groups=BATCH, wait_s=0.0).ready
        lease_and_push(buffer, BATCH, version=8)
        assert buffer.stats()["journal_compactions"] == 1


def test_compaction_bounds_the_journal_and_keeps_exactly_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    sizes = []
    consumed: list[str] = []
    with running_buffer(tmp_path, run_dir=run_dir, buffer={"compact_bytes": 4096}) as buffer:
        for step in range(12):
            lease_and_push(buffer, BATCH, version=step)
            batch = buffer.client.fetch_batch(step=step, num_groups=BATCH, wait_s=0.0)
            consumed += [g[0].group for g in batch.groups]
            sizes.append((run_dir / "buffer.journal").stat().st_size)
        leftover = lease_and_push(buffer, 1, version=12)  # admitted, not consumed when the buffer dies
        stats = buffer.stats()
        assert stats["journal_compactions"] >= 2 and max(sizes[4:]) < 3 * 4096
        buffer.proc.kill()
        buffer.proc.wait()
    with running_buffer(tmp_path, run_dir=run_dir) as buffer:
        stats = buffer.stats()
        assert stats["queued_groups"] == 1 and stats["current_step"] == 11 and stats["cursor"] == 25
        assert stats["admitted_groups"] == 25 and stats["consumed_groups"] == 24  # compacted admits still counted
        batch = buffer.client.fetch_batch(step=12, num_groups=1, wait_s=0.0)
        assert [g[0].group for g in batch.groups] == [leftover[0].group]
        assert len(set(consumed)) == 24
        for group in consumed[:3] + consumed[-2:]:  # consumed before the compaction or after: still duplicates
            lease = PromptLease(group, int(group[1:]), "", "", 0.0)
            assert buffer.client.push_group(group, make_group(lease, version=12)).reason == "duplicate"


def test_a_resume_from_the_oldest_checkpoint_after_a_compaction_trains_the_same_groups_again(tmp_path: Path) -> None:
    """Checkpoints every 3 steps, the last 2 kept, as a run writes them; the journal compacts several times. A resume
    from the oldest checkpoint on disk, from before the last compaction, gets back every group consumed since, in the
    same batches: none is lost (the compaction kept them as `kept` records)."""
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    batches: list[list[str]] = []
    sections: dict[str, Any] = {"buffer": {"compact_bytes": 4096}, "staleness": {"max_lag": 100}}
    with running_buffer(tmp_path, run_dir=run_dir, checkpoint={"every": 3}, **sections) as buffer:
        for step in range(14):
            lease_and_push(buffer, BATCH)  # version 0: no group is dropped by the rewind for its versions
            batch = buffer.client.fetch_batch(step=step, num_groups=BATCH, wait_s=0.0)
            batches.append([g[0].group for g in batch.groups])
            if (step + 1) % 3 == 0:  # step_<k>: k steps trained; the oldest beyond 2 deleted
                (checkpoints / f"step_{step + 1}").mkdir(parents=True)
                for old in sorted(checkpoints.iterdir(), key=lambda p: int(p.name[5:]))[:-2]:
                    old.rmdir()
        assert buffer.stats()["journal_compactions"] >= 2
        buffer.proc.kill()
        buffer.proc.wait()
    head = read_records(run_dir / "buffer.journal")[0]
    assert head["k"] == "state" and head["step"] >= 9  # the last compaction came after the checkpoint resumed from
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_12", "step_9"]
    with running_buffer(tmp_path, run_dir=run_dir, args=("--resume-step", "9"), **sections) as buffer:
        stats = buffer.stats()
        assert stats.get("rewind_lost_groups", 0) == 0 and stats["rewound_groups"] == 5 * BATCH
        for step in range(9, 14):
            batch = buffer.client.fetch_batch(step=step, num_groups=BATCH, wait_s=0.0)
            assert [g[0].group for g in batch.groups] == batches[step]


def test_a_fetch_of_more_than_a_reply_can_hold_is_refused_and_consumes_nothing(tmp_path: Path) -> None:
    with running_buffer(tmp_path) as buffer:
        lease_and_push(buffer, 3)
        with pytest.raises(BufferRequestError, match=r"bad_field.*num_groups must be in \[1, 1024\]"):
            buffer.client.fetch_batch(0, wire.MAX_GROUP + 1, wait_s=0.0)
        assert buffer.stats()["queued_groups"] == 3 and buffer.stats()["consumed_groups"] == 0


def test_a_batch_too_large_to_encode_goes_back_to_the_queue(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The service in this process (so that the reply size limit can be lowered): the learner is told, the groups
    stay queued (in the journal too), and a smaller fetch gets them."""
    from buffer import recovery
    from buffer.journal import Journal
    from buffer.service import BufferService, make_socket
    from buffer.state import BufferState
    from common.netaddr import bind

    def start(run: Path) -> tuple[BufferService, threading.Thread, str, zmq.Context]:
        state = BufferState(source=make_source(DataConfig(task="arith", digits=2)), group_size=GROUP_SIZE,
                            groups_per_step=BATCH, max_lag=5, filter_groups=False, lease_timeout_s=30.0,
                            max_queued_groups=100)  # fmt: skip
        recovery.replay(state, read_records(run / "buffer.journal"))
        journal = state.journal = Journal(run / "buffer.journal", "batch")
        context = zmq.Context()
        socket = make_socket(context)
        endpoint = bind(socket, "127.0.0.1", 0)
        service = BufferService(state, socket, journal)
        thread = threading.Thread(target=service.run, daemon=True)
        thread.start()
        return service, thread, endpoint, context

    def stop(service: BufferService, thread: threading.Thread, context: zmq.Context) -> None:
        service.stopping = True
        thread.join(10)
        assert service.journal is not None
        service.journal.close()
        service.socket.close(0)
        context.term()

    run = tmp_path / "run"
    run.mkdir()
    service, thread, endpoint, context = start(run)
    client = BufferClient(endpoint, "learner", timeout_s=5.0)
    try:
        leases, _ = client.lease(3)
        for lease in leases:
            assert client.push_group(lease.group, make_group(lease)).accepted
        one_group = len(service.state.queue[0].payload)
        monkeypatch.setattr(wire, "MAX_MESSAGE_BYTES", 2 * one_group + 200)  # two groups fit in a reply, not three
        with pytest.raises(BufferRequestError, match=r"oversized.*BatchReply of 3 groups.*fetch fewer"):
            client.fetch_batch(0, 3, wait_s=0.0)
        stats = client.stats()
        assert stats["queued_groups"] == 3 and stats["consumed_groups"] == 0 and stats["rejected_oversized"] == 1
        reply = client.fetch_batch(0, 2, wait_s=0.0)
        assert reply.ready and [g[0].group for g in reply.groups] == [lease.group for lease in leases[:2]]
    finally:
        client.close()
        stop(service, thread, context)
    service, thread, endpoint, context = start(run)  # the journal replays to the same queue: the third group
    try:
        assert [q.group for q in service.state.queue] == [leases[2].group]
        assert service.state.counters["admitted_groups"] == 3 and service.state.consumed_groups == 2
    finally:
        stop(service, thread, context)


def test_a_journal_that_cannot_be_written_stops_the_buffer_clearly_and_keeps_what_was_acknowledged(
    tmp_path: Path,
) -> None:
    """The journal's file size is capped (RLIMIT_FSIZE): a write fails with EFBIG as on a full disk."""
    import resource

    config = write_config(tmp_path / "config.json", staleness={"max_lag": 500})  # leasing never throttles here
    run_dir = tmp_path / "run"
    limit = 20_000

    def cap_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    args = [sys.executable, "-m", "buffer", "--config-json", str(config), "--run-dir", str(run_dir)]
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=cap_file_size)  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    acknowledged = []
    try:
        endpoint = proc.stdout.readline().decode().split()[1]
        client = BufferClient(endpoint, "w0", timeout_s=3.0)
        try:
            for _ in range(200):
                leases, _ = client.lease(1)
                reply = client.push_group(leases[0].group, make_group(leases[0]))
                assert (reply.accepted, reply.reason) == (True, "")
                acknowledged.append(leases[0].group)
        except BufferUnavailable:
            pass
        finally:
            client.close()
        assert proc.wait(timeout=20) == 3
        stderr = proc.stderr.read().decode()
        assert "cannot be written" in stderr and "File too large" in stderr and "Traceback" not in stderr, stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    assert 5 < len(acknowledged) < 200
    with running_buffer(tmp_path, run_dir=run_dir, staleness={"max_lag": 500}) as buffer:  # no cap: all are there
        queued = buffer.stats()["queued_groups"]
        assert queued >= len(acknowledged)
        batch = buffer.client.fetch_batch(0, queued, wait_s=0.0)
        assert [g[0].group for g in batch.groups][: len(acknowledged)] == acknowledged


def test_a_request_interrupted_while_waiting_never_takes_its_late_reply_for_the_next_answer(tmp_path: Path) -> None:
    with running_buffer(tmp_path) as buffer:
        client = buffer.client
        client.stats()  # connected
        socket = client._socket
        real_poll = socket.poll

        def interrupted(*args, **kwargs):  # Ctrl-C while the request is out: its reply is left unread
            socket.poll = real_poll
            assert real_poll(5000)  # the reply is there, unread, when the interrupt lands
            raise KeyboardInterrupt

        socket.poll = interrupted
        with pytest.raises(KeyboardInterrupt):
            client.stats()
        assert client.set_max_lag(7)["max_lag"] == 7  # the answer to this request, not the stats sent before
        assert client.stats()["max_lag"] == 7


def test_hostile_requests_are_refused_and_bounded_while_the_learner_is_served(tmp_path: Path) -> None:
    """Values past the wire's bounds, an oversized routing envelope, a parked fetch that cannot be filled and more
    parked fetches than MAX_PARKED: each is refused, counted or waits alone; the service stays up and the learner's
    own parked fetch is answered as soon as a group arrives."""
    from buffer.service import MAX_PARKED

    context = zmq.Context()
    sockets: list[zmq.Socket] = []

    def send(data: bytes, *envelope: bytes) -> zmq.Socket:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(buffer.endpoint)
        sock.send_multipart([*envelope, data])
        sockets.append(sock)
        return sock

    def reply(sock: zmq.Socket, timeout_ms: int = 5000) -> wire.Message | None:
        return wire.decode(sock.recv()) if sock.poll(timeout_ms) else None

    with running_buffer(tmp_path, buffer={"worker_timeout_s": 30.0}) as buffer:
        try:
            for msg, reason in [
                (wire.SetMaxLag(max_lag=2**64 - 1), "bad_field"),  # once crashed the service (stats overflowed)
                (wire.FetchBatch(step=2**40, num_groups=1, wait_s=0.0), "bad_field"),
                (wire.FetchBatch(step=0, num_groups=1, wait_s=1e9), "bad_field"),
                (wire.LeaseRequest(worker="w" * (wire.MAX_ID_CHARS + 1), max_groups=0), "oversized"),
            ]:
                answer = reply(send(wire.encode(msg)))
                assert isinstance(answer, wire.ErrorReply) and answer.reason == reason, (msg, answer)
            big_envelope = send(wire.encode(wire.StatsRequest()), b"x" * 8192)
            assert reply(big_envelope, timeout_ms=500) is None  # dropped: nothing to answer it with

            unfillable = send(wire.encode(wire.FetchBatch(step=0, num_groups=wire.MAX_GROUP, wait_s=60.0)))
            learner = send(wire.encode(wire.FetchBatch(step=0, num_groups=1, wait_s=60.0)))
            lease_and_push(buffer, 1)
            batch = reply(learner)  # served at once, not after the unfillable fetch parked before it
            assert isinstance(batch, wire.BatchReply) and batch.ready and len(batch.groups) == 1
            assert reply(unfillable, timeout_ms=0) is None

            for _ in range(MAX_PARKED - 1):
                send(wire.encode(wire.FetchBatch(step=0, num_groups=wire.MAX_GROUP, wait_s=60.0)))
            deadline = time.monotonic() + 10
            while buffer.stats()["parked_fetches"] < MAX_PARKED:  # each socket connects on its own: wait for all
                assert time.monotonic() < deadline, buffer.stats()["parked_fetches"]
                time.sleep(0.05)
            refused = reply(send(wire.encode(wire.FetchBatch(step=0, num_groups=wire.MAX_GROUP, wait_s=60.0))))
            assert isinstance(refused, wire.ErrorReply) and refused.reason == "oversized"

            stats = buffer.stats()
            assert stats["parked_fetches"] == MAX_PARKED
            assert stats["rejected_bad_field"] == 3 and stats["rejected_oversized"] == 2
            assert stats["rejected_bad_envelope"] == 1
            for wait_s in (math.nan, -1.0, math.inf):
                with pytest.raises(ValueError, match="wait_s"):
                    buffer.client.fetch_batch(step=0, num_groups=1, wait_s=wait_s)
        finally:
            for sock in sockets:
                sock.close(0)
            context.term()


def test_without_a_journal_the_consumed_groups_are_forgotten_as_they_are_trained() -> None:
    """`buffer.journal=false`: the record of consumed groups (what a compaction would keep for a resume) grew by a
    batch every step for the whole run (about 2 KB a step, 3.5 GB a day at the built-in model's pace)."""
    from buffer.service import BufferService
    from buffer.state import BufferState, Queued

    state = BufferState(source=None, group_size=8, groups_per_step=16, max_lag=2, filter_groups=True,
                        lease_timeout_s=60, max_queued_groups=1024, journal=None)  # fmt: skip
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    try:
        service = BufferService(state, socket, None)
        for step in range(1, 201):
            for g in range(16):
                state.queue.append(Queued(f"g{step}-{g}", "w", b"x" * 64, 0, step, step))
            taken, _ = state.take_batch(step, 16)
            service._maybe_compact()  # what the poll loop runs after every drain
            assert taken is not None and len(state.consumed_log) <= 16, (step, len(state.consumed_log))
        state.requeue(taken)  # the batch in flight can still go back
        assert len(state.queue) == 16 and not state.consumed_log
    finally:
        socket.close()
        context.term()
