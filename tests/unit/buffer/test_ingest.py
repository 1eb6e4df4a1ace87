"""The buffer's ingest path without copies: a validated PushGroup is kept as its bytes, its trajectory array is spliced
into the learner's BatchReply, and the journal writes the same bytes behind the service thread."""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from test_service import make_group, running_buffer

from asyncrl.bench.buffer_bench import _payloads
from buffer import ingest
from buffer import journal as journal_module
from buffer.journal import MAGIC, WRITE_CHUNK_BYTES, Journal, read_records
from buffer.state import Queued, batch_reply
from common import wire
from common.wire import PromptLease


def _push_bytes(group: str = "g3", index: int = 3) -> bytes:
    lease = PromptLease(group, index, "1+2=", "3", 0.0)
    return wire.encode(wire.PushGroup("w0", group, make_group(lease, version=2, rewards=(1.0, 0.0, 0.5))))


def _same_trajectories(a: list[wire.Trajectory], b: list[wire.Trajectory]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for name in wire.Trajectory.__dataclass_fields__:
            u, v = getattr(x, name), getattr(y, name)
            assert np.array_equal(u, v) if isinstance(u, np.ndarray) else u == v, name


def _variants(rng: random.Random, data: bytes) -> list[bytes]:
    """A valid PushGroup laid out otherwise than `encode` does, and mutated ones (mostly invalid)."""
    raw = msgpack.unpackb(data)
    reordered = {"trajectories": raw["trajectories"], **{k: v for k, v in raw.items() if k != "trajectories"}}
    out = [msgpack.packb(reordered)]
    values: list[Any] = [None, 1, -1, 1.5, "x", b"", [], {}, "trajectories", 2**40, bytes(24), ["g3/0"] * 3]
    for _ in range(400):
        mutated = msgpack.unpackb(data)
        target = mutated if rng.random() < 0.3 else mutated["trajectories"]
        key = rng.choice([*target, "extra"])
        target[key] = rng.choice(values)
        out.append(msgpack.packb(mutated))
    return out


def test_spliced_batch_decodes_to_exactly_what_was_validated() -> None:
    rng = random.Random(7)
    valid = _push_bytes()
    accepted = 0
    for data in [valid, *_variants(rng, valid)]:
        try:
            checked = ingest.decode_request(memoryview(data))
        except wire.WireError:
            continue
        assert isinstance(checked, ingest.CheckedPush)
        accepted += 1
        expected = wire.decode(data)  # the generic decoder's reading of the same message
        assert isinstance(expected, wire.PushGroup)
        payload = memoryview(checked.payload)
        assert msgpack.unpackb(payload[checked.trajectories_at :]) == msgpack.unpackb(payload)["trajectories"]
        reply = wire.decode(batch_reply(5, [Queued.of(checked), Queued.of(checked)], 1))
        assert isinstance(reply, wire.BatchReply) and (reply.step, reply.dropped_stale, reply.ready) == (5, 1, True)
        for group in reply.groups:
            _same_trajectories(group, expected.trajectories)
    assert accepted >= 2  # the canonical message, the reordered one (and any mutation that stayed valid)
    empty = wire.decode(batch_reply(2, None, 0))
    assert isinstance(empty, wire.BatchReply) and (empty.groups, empty.ready) == ([], False)


def test_journal_writes_behind_and_reads_back_byte_for_byte(tmp_path: Path) -> None:
    path = tmp_path / "buffer.journal"
    payloads = _payloads(40, None, 0)  # 40 groups of 8 x 512 tokens, 2 MB: the writer thread takes them in chunks
    assert sum(map(len, payloads)) > 2 * WRITE_CHUNK_BYTES
    journal = Journal(path, "batch")
    journal.append_admit(memoryview(payloads[0]))
    assert path.read_bytes() == MAGIC and journal.size_bytes() > len(MAGIC)  # in memory until a chunk or a commit
    for i, payload in enumerate(payloads[1:], start=1):
        journal.append({"k": "consume", "g": [f"g{i - 1}"], "s": i - 1})
        journal.append_admit(memoryview(payload))
    journal.commit()
    assert journal.size_bytes() == path.stat().st_size
    records = read_records(path)
    assert [r["m"] for r in records if r["k"] == "admit"] == payloads
    assert [r["s"] for r in records if r["k"] == "consume"] == list(range(39))
    journal.close()
    packed = Journal(tmp_path / "packed.journal", "never")  # append_admit writes exactly what append would
    zero_copy = Journal(tmp_path / "zero_copy.journal", "never")
    for payload in payloads[:3]:
        packed.append({"k": "admit", "m": payload})
        zero_copy.append_admit(payload)
    packed.close()
    zero_copy.close()
    assert (tmp_path / "packed.journal").read_bytes() == (tmp_path / "zero_copy.journal").read_bytes()


def test_a_version_1_journal_is_read_and_converted_when_opened(tmp_path: Path) -> None:
    """Journals written before the xxh3 layout (`<u32 length><u32 crc32>` records, no magic) lose nothing."""
    import struct
    import zlib

    path = tmp_path / "buffer.journal"
    records = [{"k": "lease", "i": [0, 1]}, {"k": "admit", "m": _push_bytes()}, {"k": "max_lag", "v": 3}]
    with open(path, "wb") as handle:
        for record in records:
            payload = msgpack.packb(record, use_bin_type=True)
            handle.write(struct.pack("<II", len(payload), zlib.crc32(payload)) + payload)
        handle.write(b"\x40\x00\x00\x00torn")  # and a torn tail, cut off as in version 2
    assert read_records(path) == records
    journal = Journal(path, "batch")
    assert path.read_bytes().startswith(MAGIC)
    journal.append({"k": "consume", "g": ["g0"], "s": 0})
    journal.close()
    assert read_records(path) == [*records, {"k": "consume", "g": ["g0"], "s": 0}]
    path.write_bytes(MAGIC[:5])  # a crash while the magic of a new journal was written: an empty journal
    assert read_records(path) == [] and path.stat().st_size == 0


def test_commit_returns_only_once_the_writer_thread_wrote_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_write = journal_module._write_all

    def slow(fd: int, parts: list[bytes | memoryview]) -> None:  # a disk that takes its time
        time.sleep(0.2)
        slow_write(fd, parts)

    monkeypatch.setattr(journal_module, "_write_all", slow)
    path = tmp_path / "buffer.journal"
    journal = Journal(path, "never")
    for payload in _payloads(30, None, 0):  # 1.6 MB: one chunk goes to the writer before the commit
        journal.append_admit(payload)
    journal.commit()
    assert path.stat().st_size == journal.size_bytes() and len(read_records(path)) == 30
    journal.close()


def test_commit_async_reports_durability_through_its_fd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipelined commit: `commit_async` returns at once; the records are durable (written and fsynced) when
    `durable()` reaches its number, which the writer thread announces on `ready_fd`."""
    import select

    synced: list[int] = []
    disk_done = threading.Event()  # the disk finishes an fsync only once the test says so
    real_fsync = os.fsync

    def held_fsync(fd: int) -> None:  # a disk that takes its time
        assert disk_done.wait(10), "the test never released the fsync"
        real_fsync(fd)
        synced.append(fd)

    path = tmp_path / "buffer.journal"
    journal = Journal(path, "batch")  # created (and its directory entry synced) before the disk slows down
    monkeypatch.setattr(journal_module.os, "fsync", held_fsync)
    assert journal.commit_async() == 0  # nothing appended: nothing to wait for
    journal.append_admit(_push_bytes())
    seq = journal.commit_async()  # returns while its fsync is held: it did not wait for the disk
    assert seq == 1 and journal.durable() == 0 and not synced
    assert select.select([journal.ready_fd], [], [], 0.0)[0] == []  # nothing announced yet
    disk_done.set()
    readable, _, _ = select.select([journal.ready_fd], [], [], 5.0)
    assert readable and journal.durable() == 1 and len(synced) == 1
    assert [r["k"] for r in read_records(path)] == ["admit"]
    journal.append({"k": "max_lag", "v": 2})
    assert journal.commit_async() == 2
    journal.commit()  # a synchronous commit waits for the one in flight
    assert journal.durable() == 2 and len(synced) == 2
    journal.close()


def test_journal_write_error_surfaces_at_commit(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "buffer.journal", "batch")
    read_only = os.open(tmp_path / "buffer.journal", os.O_RDONLY)
    os.close(journal._fd)
    journal._fd = read_only  # every write now fails with EBADF, in the writer thread
    journal.append({"k": "max_lag", "v": 3})
    with pytest.raises(OSError, match="journal write failed"):
        journal.commit()
    with pytest.raises(OSError):
        journal.close()


def test_sigkill_mid_stream_keeps_every_acknowledged_group_exactly_once(tmp_path: Path) -> None:
    """Pipelined 55 KB pushes, SIGKILL while they stream in: after a restart the queue holds every group whose
    PushReply arrived, once, byte for byte (the writer thread never lets a reply overtake its journal record)."""
    run_dir = tmp_path / "run"
    count = 600
    sections: dict[str, dict[str, Any]] = {"train": {"group_size": 8, "groups_per_step": 400}}
    with running_buffer(tmp_path, run_dir=run_dir, **sections) as buffer:
        leases: list[PromptLease] = []
        while len(leases) < count:
            leases += buffer.client.lease(count - len(leases))[0]
        payloads = dict(zip([x.group for x in leases], _payloads(count, leases, 0), strict=True))
        producer = zmq.Context.instance().socket(zmq.DEALER)
        producer.setsockopt(zmq.LINGER, 0)
        producer.setsockopt(zmq.SNDHWM, 0)
        producer.connect(buffer.endpoint)
        sends = list(payloads.values())
        for payload in sends[:100]:
            producer.send(payload, copy=False)
        acked = 0
        while acked < 100 and producer.poll(10_000):
            reply = wire.decode(producer.recv())
            assert isinstance(reply, wire.PushReply) and reply.reason == "", reply
            acked += 1
        for payload in sends[100:]:  # 500 more streamed in, then the kill lands while they are being admitted
            producer.send(payload, copy=False)
        buffer.proc.kill()  # mid-stream: more pushes are in flight, in the socket and in the service
        buffer.proc.wait()
        while producer.poll(200):  # replies already on their way were acknowledged too
            acked += 1
            producer.recv()
        producer.close()
    assert 100 <= acked <= count, acked
    with running_buffer(tmp_path, run_dir=run_dir, **sections) as buffer:
        queued = buffer.stats()["queued_groups"]
        assert acked <= queued <= count
        batch = buffer.client.fetch_batch(step=0, num_groups=queued, wait_s=0.0)
        groups = [g[0].group for g in batch.groups]
        assert len(set(groups)) == len(groups)  # once each
        assert groups[:acked] == [x.group for x in leases[:acked]]  # the acknowledged ones, in admission order
        for group in batch.groups[:: max(1, queued // 20)]:
            sent = wire.decode(payloads[group[0].group])
            assert isinstance(sent, wire.PushGroup)
            _same_trajectories(group, sent.trajectories)


def _minor_faults(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[7])  # field 10, minflt


def _faults_per_kept_group(tmp_path: Path, reserve_mb: int, count: int = 200) -> float:
    sections: dict[str, Any] = {
        "train": {"group_size": 8, "groups_per_step": count},
        "staleness": {"max_lag": 10},
        "buffer": {"reserve_mb": reserve_mb, "max_queued_groups": count},
    }
    with running_buffer(tmp_path, run_dir=tmp_path / f"run-{reserve_mb}", **sections) as buffer:
        leases, _ = buffer.client.lease(count)
        assert len(leases) == count
        payloads = _payloads(count, leases, 0)  # 8 x 512 tokens: 54 KB, 13 pages each
        context = zmq.Context()
        socket = context.socket(zmq.DEALER)
        socket.connect(buffer.endpoint)
        before = _minor_faults(buffer.proc.pid)
        for payload in payloads:
            socket.send(payload)
        replies = [wire.decode(socket.recv()) for _ in payloads]
        faults = _minor_faults(buffer.proc.pid) - before
        socket.close(0)
        context.term()
        assert all(isinstance(r, wire.PushReply) and (r.accepted, r.reason) == (True, "") for r in replies)
        assert buffer.stats()["queued_groups"] == count  # every frame is still held
    return faults / count


def test_kept_groups_land_in_memory_faulted_in_at_start(tmp_path: Path) -> None:
    """The buffer keeps each admitted group in the ZMQ frame it arrived in. With `buffer.reserve_mb` those frames come
    from memory faulted in at start-up (buffer/memory.py), so admitting a group costs no page fault; without the
    reserve the heap grows into fresh pages, about one fault per 4 KiB kept."""
    reserved = _faults_per_kept_group(tmp_path, reserve_mb=64)
    unreserved = _faults_per_kept_group(tmp_path, reserve_mb=0)
    assert reserved < 1.0, (reserved, unreserved)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    thp_always = "[always]" in (thp.read_text() if thp.exists() else "")
    huge_heap = thp_always or "hugetlb" in os.environ.get("GLIBC_TUNABLES", "")
    if not huge_heap:  # with 2 MiB pages under the heap the unreserved buffer barely faults either
        assert unreserved > 8.0, (reserved, unreserved)  # the measurement sees the faults when they happen
