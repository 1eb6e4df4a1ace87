"""Weight publication over real ZMQ sockets and /dev/shm: latest-version delivery, late subscribers, chunking,
corrupt chunks and files, superseded versions, hostile headers and requests."""

from __future__ import annotations

import glob
import os
import threading
import time

import msgpack
import pytest
import torch
import zmq

from quant_sync.export import export_rollout_tensors
from quant_sync.publisher import MAX_REQUEST_BYTES
from quant_sync.transport import (
    PROTOCOL_VERSION,
    Manifest,
    PayloadError,
    WeightPublisher,
    WeightSubscriber,
    parse_header,
)


def tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    state = {
        "model.layers.0.mlp.up_proj.weight": torch.randn(48, 40, generator=gen),
        "model.norm.weight": torch.randn(40, generator=gen),
        "model.embed_tokens.weight": torch.randn(30, 40, generator=gen),
    }
    return export_rollout_tensors(state, "int8")


def assert_identical(update, expected: dict[str, torch.Tensor]) -> None:
    assert set(update.tensors) == set(expected)
    for name, value in expected.items():
        assert update.tensors[name].dtype == value.dtype and torch.equal(update.tensors[name], value), name


@pytest.mark.parametrize("use_shm", [True, False])
def test_subscribers_receive_latest_and_late_ones_catch_up(use_shm):
    publisher = WeightPublisher(chunk_bytes=256)  # many chunks per tensor
    received: list[int] = []
    try:
        publisher.publish(0, tensors(0), "int8")
        early = WeightSubscriber(publisher.endpoint, lambda u: received.append(u.version), 0.01, use_shm=use_shm)
        assert early.wait_for(0, 10)
        publisher.publish(1, tensors(1), "int8")
        publisher.publish(2, tensors(2), "int8")
        assert early.wait_for(2, 10)
        assert received == sorted(received) and received[-1] == 2
        late_updates = []
        late = WeightSubscriber(publisher.endpoint, late_updates.append, poll_s=0.01, use_shm=use_shm)
        assert late.wait_for(2, 10)
        assert late_updates[0].version == 2  # a late worker gets the latest version first, not version 0
        assert_identical(late_updates[0], tensors(2))  # bit-identical to what was published
        assert (late.via_shm > 0) == use_shm and late.rejected == 0
        assert (publisher.chunks_served > 0) == (not use_shm)
        for stale in (1, 2):  # a new subscriber would have got it while the others stayed on 2: refused
            with pytest.raises(ValueError, match=f"version {stale}: not after the latest published version 2"):
                publisher.publish(stale, tensors(stale), "int8")
        early.close()
        late.close()
    finally:
        publisher.close()


def test_a_new_version_reaches_a_waiting_subscriber_at_once(monkeypatch):
    """Subscribers long-poll: a version published while they wait is answered right away, not when their poll times
    out. Polls here last 60 s and the subscriber polls every 30 s, so an answer within the 10 s wait can only come
    from the publisher waking the parked poll; and close returns without waiting the poll out."""
    from quant_sync import subscriber as subscriber_module

    monkeypatch.setattr(subscriber_module, "LONG_POLL_MS", 60_000)
    publisher = WeightPublisher()
    applied = []
    try:
        publisher.publish(0, tensors(0), "int8")
        subscriber = WeightSubscriber(publisher.endpoint, applied.append, poll_s=30.0)
        assert subscriber.wait_for(0, 10)
        deadline = time.monotonic() + 10
        while not publisher._parked:  # its next `get` is parked at the publisher
            assert time.monotonic() < deadline, "the subscriber never parked a long poll"
            time.sleep(0.01)
        publisher.publish(1, tensors(1), "int8")
        assert subscriber.wait_for(1, 10)  # 10 s against the parked poll's 60 s
        assert_identical(applied[-1], tensors(1))
        deadline = time.monotonic() + 10
        while not publisher._parked:  # parked again, for version 2
            assert time.monotonic() < deadline, "the subscriber never parked its next long poll"
            time.sleep(0.01)
        closer = threading.Thread(target=subscriber.close)
        closer.start()
        closer.join(30)  # against the poll's 60 s
        assert not closer.is_alive(), "close waited out a parked poll"
    finally:
        publisher.close()


def test_a_corrupt_chunk_is_rejected_and_fetched_again():
    publisher = WeightPublisher(chunk_bytes=128, shm_dir=None)
    original = publisher._answer_chunk
    corrupted = {"n": 0}

    def corrupting(identity, version, index):
        if index == 3 and corrupted["n"] < 2:  # the same chunk arrives damaged twice: flipped, then truncated
            corrupted["n"] += 1
            data = bytearray(publisher._versions[version].chunks[index])
            data = data[:-1] if corrupted["n"] == 2 else bytes([data[0] ^ 0xFF]) + data[1:]
            reply = {"v": PROTOCOL_VERSION, "version": version, "index": index}
            publisher._socket.send_multipart([identity, msgpack.packb(reply), bytes(data)])
            return
        original(identity, version, index)

    publisher._answer_chunk = corrupting
    applied = []
    try:
        publisher.publish(5, tensors(5), "int8")
        subscriber = WeightSubscriber(publisher.endpoint, applied.append, poll_s=0.01)
        assert subscriber.wait_for(5, 10)
        assert subscriber.rejected == 2 and corrupted["n"] == 2
        assert [u.version for u in applied] == [5]
        assert_identical(applied[0], tensors(5))
        subscriber.close()
    finally:
        publisher.close()


def test_a_corrupt_shared_memory_file_falls_back_to_zmq():
    publisher = WeightPublisher()
    if publisher.shm_dir is None:
        publisher.close()
        pytest.fail("/dev/shm is not writable on this machine: the local fast path cannot be tested")
    applied = []
    try:
        publisher.publish(7, tensors(7), "int8")
        path = publisher._latest.shm_path
        with open(path, "r+b") as file:  # flip one byte of the first tensor in place
            first = file.read(1)
            file.seek(0)
            file.write(bytes([first[0] ^ 0x55]))
        subscriber = WeightSubscriber(publisher.endpoint, applied.append, poll_s=0.01)
        assert subscriber.wait_for(7, 10)
        assert subscriber.rejected == 1 and subscriber.via_shm == 0 and publisher.chunks_served > 0
        assert_identical(applied[0], tensors(7))
        subscriber.close()
    finally:
        publisher.close()


def test_shared_memory_files_are_evicted_and_removed():
    publisher = WeightPublisher(keep_versions=2)
    try:
        for version in range(4):
            publisher.publish(version, tensors(version), "int8")
        publisher._housekeeper.join()  # evicted files are unlinked in the background
        files = glob.glob(os.path.join(publisher.shm_dir, publisher._prefix + "-*"))
        assert sorted(os.path.basename(f).rsplit("-", 1)[1] for f in files if not f.endswith("-spare")) == ["v2", "v3"]
    finally:
        publisher.close()
    assert not glob.glob(os.path.join(publisher.shm_dir, publisher._prefix + "*"))


def test_the_next_version_is_written_into_a_preallocated_spare_file():
    publisher = WeightPublisher()
    applied = []
    try:
        publisher.publish(0, tensors(0), "int8")
        spare = publisher._spare_path
        publisher._housekeeper.join(10)  # the spare is allocated in the background (and its lock released)
        allocated = os.stat(spare)
        assert allocated.st_size >= os.stat(publisher._latest.shm_path).st_size > 0
        publisher.publish(1, tensors(1), "int8")
        path = publisher._latest.shm_path
        assert os.stat(path).st_ino == allocated.st_ino  # the spare became version 1's file
        subscriber = WeightSubscriber(publisher.endpoint, applied.append, poll_s=0.01)
        assert subscriber.wait_for(1, 10) and subscriber.via_shm == 1 and subscriber.rejected == 0
        assert_identical(applied[0], tensors(1))  # exactly its bytes: nothing of the spare's zeros or of version 0
        subscriber.close()
    finally:
        publisher.close()
    assert not glob.glob(os.path.join(publisher.shm_dir, publisher._prefix + "*"))


def test_a_superseded_version_answers_gone():
    publisher = WeightPublisher(keep_versions=1, shm_dir=None)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(publisher.endpoint)
    try:
        publisher.publish(1, tensors(1), "int8")
        dealer.send(msgpack.packb({"v": PROTOCOL_VERSION, "type": "get", "have": -1}))
        assert dealer.poll(5000)
        manifest = parse_header(dealer.recv())
        assert isinstance(manifest, Manifest) and manifest.version == 1
        publisher.publish(2, tensors(2), "int8")  # keep_versions=1: version 1 is dropped mid-fetch
        dealer.send(msgpack.packb({"v": PROTOCOL_VERSION, "type": "chunk", "version": 1, "index": 0}))
        assert dealer.poll(5000)
        assert msgpack.unpackb(dealer.recv_multipart()[0]).get("gone") is True
    finally:
        dealer.close(0)
        publisher.close()


def entry(**changes) -> dict:
    return {"name": "w", "dtype": "int8", "shape": [2, 4], "nbytes": 8, "file_offset": 0, **changes}


def header(**changes) -> bytes:
    base = {"v": PROTOCOL_VERSION, "version": 3, "scheme": "int8", "shm": None, "boot_id": "",
            "tensors": [{"name": "w", "dtype": "int8", "shape": [2, 4], "nbytes": 8, "file_offset": 0}],
            "chunks": [[0, 0, 4, 1], [0, 4, 4, 2]]}  # fmt: skip
    base.update(changes)
    return msgpack.packb(base)


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (b"\xc1garbage", "unreadable"),
        (msgpack.packb({"v": 1, "version": 3}), "protocol 1"),
        (header(chunks=[[0, 0, 4, 1]]), "sizes disagree"),
        (header(chunks=[[0, 0, 4, 1], [0, 2, 6, 2]]), "does not tile"),
        (header(chunks=[[1, 0, 8, 1]]), "does not tile"),
        (header(tensors=[{"name": "w", "dtype": "int64", "shape": [2, 4], "nbytes": 8}]), "malformed"),
        (header(tensors=[entry(dtype="float32")]), "sizes disagree"),
        (header(tensors=[entry(shape=[-2, -4])]), "sizes disagree"),
        (header(tensors=[entry(shape=[-1, -8])]), "sizes disagree"),  # numel 8, but no dimension may be negative
        (header(tensors=[entry(shape=["2", 4])]), "malformed"),
        (header(tensors=[entry(shape=[2.0, 4])]), "malformed"),
        (header(tensors=[entry(name=None)]), "malformed"),
        (header(tensors=[{k: v for k, v in entry().items() if k != "name"}]), "malformed"),
        (header(tensors=[{k: v for k, v in entry().items() if k != "file_offset"}]), "malformed"),
        (header(tensors=[entry(file_offset=-64)]), "misplaced file offset"),
        (header(tensors=[entry(file_offset=2)]), "misplaced file offset"),
        (header(tensors=[entry(), entry(name="u")], chunks=[[0, 0, 8, 1], [1, 0, 8, 2]]), "misplaced file offset"),
        (header(tensors=[entry(), entry()], chunks=[[0, 0, 8, 1], [1, 0, 8, 2]]), "not a unique str"),
        (header(chunks=[[0, 0, 4, 1], [0, 4, 4]]), "unreadable"),  # a chunk entry of 3 fields
        (header(chunks=[[0, 0, 4, 1], [0, 4, 4, "x"]]), "unreadable"),
        (header(version="3"), "unreadable"),
        (header(tensors=[entry(shape=[1 << 21, 1 << 20], nbytes=1 << 41)], chunks=[[0, 0, 1 << 41, 1]]), "tile"),
        (
            header(
                tensors=[entry(shape=[1 << 20, 1 << 20], nbytes=1 << 40), entry(name="u", file_offset=1 << 40)],
                chunks=[[0, i << 30, 1 << 30, 1] for i in range(1 << 10)] + [[1, 0, 8, 2]],
            ),
            "more than",
        ),
    ],
)
def test_inconsistent_headers_are_rejected_whole(frame, message):
    with pytest.raises(PayloadError, match=message):
        parse_header(frame)


def test_a_consistent_header_parses():
    manifest = parse_header(header())
    assert isinstance(manifest, Manifest) and manifest.version == 3 and len(manifest.chunks) == 2
    assert parse_header(msgpack.packb({"v": PROTOCOL_VERSION, "version": 9})) == 9  # nothing newer


def test_publisher_survives_malformed_requests():
    publisher = WeightPublisher()
    publisher.publish(0, tensors(0), "int8")
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(publisher.endpoint)
    try:
        junk = [b"", b"\xff\xfe", msgpack.packb({"type": "get"}), msgpack.packb([1, 2, 3]),
                msgpack.packb({"v": PROTOCOL_VERSION, "type": "chunk", "version": "x", "index": 0})]  # fmt: skip
        errors = []
        for frame in junk:  # each answered with why (a worker of another asyncrl version only timed out, unsaid)
            dealer.send(frame)
            assert dealer.poll(5000), frame
            errors.append(msgpack.unpackb(dealer.recv_multipart()[0])["error"])
        assert "protocol None: this publisher speaks" in errors[2] and "a request is a map" in errors[3], errors
        with pytest.raises(PayloadError, match="the publisher refused the request: .*protocol"):
            parse_header(msgpack.packb({"v": PROTOCOL_VERSION, "version": -1, "error": errors[2]}))
        dealer.send(msgpack.packb({"v": PROTOCOL_VERSION, "type": "chunk", "version": 0, "index": 10**6}))
        assert dealer.poll(5000) and msgpack.unpackb(dealer.recv_multipart()[0]).get("gone") is True
        flood = zmq.Context.instance().socket(zmq.DEALER)
        flood.connect(publisher.endpoint)
        flood.send(b"\0" * (MAX_REQUEST_BYTES + 1))  # past the limit: its sender is disconnected, nothing is read
        flood.send(msgpack.packb({"v": PROTOCOL_VERSION, "type": "chunk", "version": 0, "index": 10**6}))
        assert flood.poll(5000) and msgpack.unpackb(flood.recv_multipart()[0]).get("gone") is True  # reconnected
        flood.close(0)
        got = []
        subscriber = WeightSubscriber(publisher.endpoint, got.append, poll_s=0.01)
        assert subscriber.wait_for(0, 10)
        subscriber.close()
        assert publisher.bad_requests == len(junk)  # the oversized frame was never read (read, it is one more)
    finally:
        dealer.close(0)
        publisher.close()


def test_with_curve_keys_only_allow_listed_subscribers_get_weights(tmp_path):
    """Bound beyond loopback with the buffer's keys: an allow-listed subscriber is served over CurveZMQ; one without
    keys or with a stranger's keys never receives a version, and the publisher keeps serving the good one."""
    import zmq.auth

    from common.curve import ClientKeys, client_keys, create_keys, server_keys

    create_keys(tmp_path / "keys")
    publisher = WeightPublisher(host="0.0.0.0", shm_dir=None, curve=server_keys(str(tmp_path / "keys")))
    assert not publisher.endpoint.startswith("tcp://0.0.0.0")  # advertised as a routable address
    publisher.publish(4, tensors(4), "int8")
    good_keys = client_keys(str(tmp_path / "keys"))
    (tmp_path / "other").mkdir()
    _, stranger_file = zmq.auth.create_certificates(tmp_path / "other", "stranger")
    public, secret = zmq.auth.load_certificate(stranger_file)
    stranger = ClientKeys(public, secret, good_keys.server_public)  # knows the server, is not allow-listed
    got_plain, got_stranger, got_good = [], [], []
    plain = WeightSubscriber(publisher.endpoint, got_plain.append, 0.01, timeout_s=1.0)
    strange = WeightSubscriber(publisher.endpoint, got_stranger.append, 0.01, timeout_s=1.0, curve=stranger)
    good = WeightSubscriber(publisher.endpoint, got_good.append, 0.01, curve=good_keys)
    try:
        assert good.wait_for(4, 10)
        assert_identical(got_good[0], tensors(4))
        assert not plain.wait_for(4, 2) and not strange.wait_for(4, 0.1)
        assert got_plain == [] and got_stranger == []
    finally:
        for subscriber in (plain, strange, good):
            subscriber.close()
        publisher.close()


def test_a_version_the_worker_refuses_is_skipped_and_the_next_one_applied():
    publisher = WeightPublisher()
    applied = []

    def on_update(update):
        if update.version == 1:
            raise KeyError("version 1 lacks weights: model.norm.weight")
        applied.append(update.version)

    try:
        publisher.publish(0, tensors(0), "int8")
        subscriber = WeightSubscriber(publisher.endpoint, on_update, poll_s=0.01)
        assert subscriber.wait_for(0, 10)
        publisher.publish(1, tensors(1), "int8")
        deadline = time.monotonic() + 10
        while subscriber.refused != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # the refused version is not fetched again
        assert subscriber.refused == 1 and subscriber.rejected == 1 and subscriber.have == 0 and subscriber.alive
        assert "version 1: KeyError" in subscriber.last_error
        publisher.publish(2, tensors(2), "int8")
        assert subscriber.wait_for(2, 10) and applied == [0, 2] and subscriber.rejected == 1
        subscriber.close()
    finally:
        publisher.close()


def test_hostile_headers_over_zmq_are_rejected_and_the_subscriber_stays_up():
    """A fake publisher answers with headers that no check may let through; then with a real version."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    hostile = [
        header(tensors=[entry(shape=[-1, -8])]),
        header(chunks=[[0, 0, 4, 1], [0, 4, 4]]),
        header(tensors=[entry(shape=[1 << 20, 1 << 20], nbytes=1 << 40)], chunks=[[0, 0, 1 << 30, 1]]),
        header(
            tensors=[entry(shape=[1 << 19, 1 << 20], nbytes=1 << 39)],  # parses; too large to allocate here
            chunks=[[0, i << 30, 1 << 30, 1] for i in range(1 << 9)],
        ),  # fmt: skip
    ]
    applied = []
    subscriber = WeightSubscriber(endpoint, applied.append, poll_s=0.01, use_shm=False)
    try:
        for frame in hostile:
            assert router.poll(5000)
            identity, request = router.recv_multipart()
            assert msgpack.unpackb(request)["type"] == "get"
            router.send_multipart([identity, frame])
        publisher = WeightPublisher(shm_dir=None)
        try:
            publisher.publish(4, tensors(4), "int8")
            assert router.poll(5000)
            identity, request = router.recv_multipart()  # answered with a pointer to a real version's header
            router.send_multipart([identity, publisher._latest.header])
            while not applied and router.poll(5000):  # serve its chunk requests from the real publisher's
                identity, request = router.recv_multipart()
                if msgpack.unpackb(request)["type"] == "chunk":
                    index = msgpack.unpackb(request)["index"]
                    reply = {"v": PROTOCOL_VERSION, "version": 4, "index": index}
                    router.send_multipart([identity, msgpack.packb(reply), publisher._latest.chunks[index]])
            assert subscriber.wait_for(4, 10) and subscriber.alive
        finally:
            publisher.close()
        assert subscriber.rejected == len(hostile) and [u.version for u in applied] == [4]
        assert_identical(applied[0], tensors(4))
    finally:
        subscriber.close()
        router.close(0)


def test_a_shared_memory_path_outside_dev_shm_is_not_mapped():
    from quant_sync.transport import ShmUnavailable, boot_id, read_shm

    manifest = parse_header(header(shm="/dev/shm/../etc/passwd", boot_id=boot_id()))
    with pytest.raises(ShmUnavailable):
        read_shm(manifest)
