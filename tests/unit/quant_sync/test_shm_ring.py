"""The /dev/shm ring of adapter-only versions (quant_sync/shm_ring.py), over real ZMQ sockets and /dev/shm: versions
land in one reused file, readers copy out and verify, an overwritten version is fetched over ZMQ instead, and ring
offsets in headers are checked."""

from __future__ import annotations

import glob
import os

import msgpack
import pytest
import torch

from quant_sync.export import LORA_A, LORA_B, LORA_SCALING, export_rollout_tensors
from quant_sync.shm_ring import RING_ALIGN, RING_SLOTS, RingOverwritten, ShmRing
from quant_sync.transport import (
    PROTOCOL_VERSION,
    PayloadError,
    ShmUnavailable,
    WeightPublisher,
    WeightSubscriber,
    parse_header,
    read_shm,
)

LINEAR = "model.layers.0.mlp.up_proj"


def base_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    state = {LINEAR + ".weight": torch.randn(48, 40, generator=gen), "model.norm.weight": torch.ones(40)}
    return export_rollout_tensors(state, "int8")


def adapters(seed: int, rank: int = 4) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(rank, 40, generator=gen), torch.randn(48, rank, generator=gen)
    return {LINEAR + LORA_A: a, LINEAR + LORA_B: b, LINEAR + LORA_SCALING: torch.tensor([2.0])}


def shm_publisher(**kwargs) -> WeightPublisher:
    publisher = WeightPublisher(**kwargs)
    if publisher.shm_dir is None:
        publisher.close()
        pytest.fail("/dev/shm is not writable on this machine: the ring cannot be tested")
    return publisher


def assert_equal_tensors(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name


def test_adapter_versions_share_one_ring_file_and_arrive_exact():
    publisher = shm_publisher(keep_versions=2)
    updates = []
    try:
        publisher.publish(0, base_tensors(), "int8", pin=True)
        subscriber = WeightSubscriber(publisher.endpoint, updates.append, 0.01)
        for version in range(1, 2 * RING_SLOTS + 3):  # wraps round the ring twice
            publisher.publish(version, adapters(version), "int8", base=0)
            assert subscriber.wait_for(version, 10)
            assert_equal_tensors({k: updates[-1].tensors[k] for k in adapters(0)}, adapters(version))
        header = parse_header(publisher._latest.header)
        assert header.shm is not None and header.shm.endswith("-ring1") and header.shm_offset % RING_ALIGN == 0
        files = sorted(os.path.basename(path).rsplit("-", 1)[1]
                       for path in glob.glob(os.path.join(publisher.shm_dir, publisher._prefix + "-*")))  # fmt: skip
        assert files == ["ring1", "spare", "v0"]  # no file per adapter version
        assert subscriber.via_shm == 2 * RING_SLOTS + 3 and subscriber.rejected == subscriber.ring_overwritten == 0
        subscriber.close()
    finally:
        publisher.close()
    assert not glob.glob(os.path.join(publisher.shm_dir, publisher._prefix + "*"))


def test_a_version_overwritten_in_the_ring_is_refused_there_and_fetched_over_zmq():
    publisher = shm_publisher(keep_versions=RING_SLOTS + 2)
    updates = []
    try:
        publisher.publish(0, base_tensors(), "int8", pin=True)
        publisher.publish(1, adapters(1), "int8", base=0)
        first = parse_header(publisher._latest.header)
        assert_equal_tensors(read_shm(first).tensors, adapters(1))
        for version in range(2, RING_SLOTS + 2):  # the ring wraps: version RING_SLOTS + 1 lands where 1 was
            publisher.publish(version, adapters(version), "int8", base=0)
        assert parse_header(publisher._latest.header).shm_offset == first.shm_offset
        with pytest.raises(RingOverwritten, match="version 1: overwritten"):
            read_shm(first)
        ring = publisher._ring.path
        with open(ring, "r+b") as file:  # the latest version's first byte flipped: its copy does not check out
            latest = parse_header(publisher._latest.header)
            file.seek(latest.shm_offset)
            byte = file.read(1)
            file.seek(latest.shm_offset)
            file.write(bytes([byte[0] ^ 0x55]))
        subscriber = WeightSubscriber(publisher.endpoint, updates.append, 0.01)
        assert subscriber.wait_for(RING_SLOTS + 1, 10)
        assert subscriber.ring_overwritten == 1 and subscriber.rejected == 0 and publisher.chunks_served > 0
        assert_equal_tensors({k: updates[-1].tensors[k] for k in adapters(0)}, adapters(RING_SLOTS + 1))
        subscriber.close()
    finally:
        publisher.close()


def test_a_version_larger_than_the_ring_allows_gets_a_new_ring():
    publisher = shm_publisher()
    try:
        publisher.publish(0, base_tensors(), "int8", pin=True)
        publisher.publish(1, adapters(1, rank=1), "int8", base=0)
        small = publisher._ring
        publisher.publish(2, adapters(2, rank=40), "int8", base=0)  # 10x the bytes: no room for RING_SLOTS of them
        assert publisher._ring is not small and publisher._ring.path.endswith("-ring2")
        assert not os.path.exists(small.path)
        assert_equal_tensors(read_shm(parse_header(publisher._latest.header)).tensors, adapters(2, rank=40))
    finally:
        publisher.close()


def test_ring_offsets_outside_the_ring_or_malformed_are_refused():
    publisher = shm_publisher()
    try:
        publisher.publish(0, base_tensors(), "int8", pin=True)
        publisher.publish(1, adapters(1), "int8", base=0)
        fields = msgpack.unpackb(publisher._latest.header)
        size = os.path.getsize(publisher._ring.path)
        cases = [(size, ShmUnavailable, "outside its ring"), (8, ShmUnavailable, "outside"),
                 (-64, PayloadError, "shm_offset"), ("0", PayloadError, "shm_offset")]  # fmt: skip
        for offset, error, message in cases:
            with pytest.raises(error, match=message):
                read_shm(parse_header(msgpack.packb({**fields, "shm_offset": offset})))
        with pytest.raises(PayloadError, match="shm_offset"):  # an offset with no file to read it in
            parse_header(msgpack.packb({**fields, "shm": None}))
        gone = {**fields, "shm": publisher._ring.path + "-gone"}
        with pytest.raises(ShmUnavailable, match="gone"):
            read_shm(parse_header(msgpack.packb(gone)))
        assert parse_header(msgpack.packb({**fields, "v": PROTOCOL_VERSION})).shm_offset == fields["shm_offset"]
    finally:
        publisher.close()


def test_the_ring_wraps_to_its_start_when_the_end_has_no_room():
    path = f"/dev/shm/asyncrl-test-ring-{os.getpid()}"
    ring = ShmRing(path, 3 * RING_ALIGN)
    try:
        data = [memoryview(bytes([i]) * 100) for i in range(4)]
        assert [ring.write([d], [0], 100) for d in data] == [0, RING_ALIGN, 2 * RING_ALIGN, 0]
        with open(path, "rb") as file:
            content = file.read()
        assert content[:100] == bytes([3]) * 100 and content[RING_ALIGN : RING_ALIGN + 100] == bytes([1]) * 100
        assert not ring.fits(1)  # a page a version: 3 pages hold fewer than RING_SLOTS
    finally:
        ring.close()
    assert not os.path.exists(path)
    sized = ShmRing.create(path, 100)  # RING_SLOTS pages: versions of up to a page fit
    try:
        assert sized is not None and sized.nbytes == RING_SLOTS * RING_ALIGN
        assert sized.fits(RING_ALIGN) and not sized.fits(RING_ALIGN + 1)
    finally:
        sized.close()


def int8_adapters(seed: int) -> dict[str, torch.Tensor]:
    from quant_sync.export import LORA_SCALE, encode_adapter

    tensors = {LINEAR + LORA_SCALING: torch.tensor([2.0])}
    for part, matrix in adapters(seed).items():
        if part.endswith((LORA_A, LORA_B)):
            for suffix, value in encode_adapter(matrix, part.removeprefix(LINEAR), "int8").items():
                tensors[part + suffix] = value
    assert LINEAR + LORA_A + LORA_SCALE in tensors
    return tensors


def test_a_packed_int8_version_is_copied_from_the_ring_into_a_pooled_buffer_once_and_verified_there(monkeypatch):
    """An engine running int8 adapters gets a packed ring version copied straight into a pooled buffer (no private
    copy first: `read_shm` is not called for it) and verified there; one that does not check out leaves the buffer
    free and is fetched over ZMQ."""
    import gc

    from quant_sync import subscriber as subscriber_module
    from quant_sync.export import pack_adapters

    gc.collect()
    copied_out = []
    monkeypatch.setattr(subscriber_module, "read_shm", lambda m: copied_out.append(m.version) or read_shm(m))
    publisher = shm_publisher(keep_versions=4)
    updates, subscribers = [], []
    try:
        publisher.publish(0, base_tensors(), "int8", pin=True)
        publisher.publish(1, pack_adapters(int8_adapters(1)), "int8", base=0)
        subscribers.append(WeightSubscriber(publisher.endpoint, updates.append, 0.01, keep_int8_adapters=True))
        assert subscribers[0].wait_for(1, 10) and subscribers[0].rejected == 0, subscribers[0].last_error
        assert copied_out == [0] and subscribers[0].via_shm == 2 and updates[-1].pooled is not None
        assert_equal_tensors({k: updates[-1].tensors[k] for k in int8_adapters(0)}, int8_adapters(1))
        subscribers[0].close()
        publisher.publish(2, pack_adapters(int8_adapters(2)), "int8", base=0)
        latest = parse_header(publisher._latest.header)
        packed_at = next(entry["file_offset"] for entry in latest.tensors if entry["name"].endswith("packed"))
        with open(publisher._ring.path, "r+b") as file:  # a byte of the packed adapters flipped in the ring
            file.seek(latest.shm_offset + packed_at + 5)
            byte = file.read(1)
            file.seek(latest.shm_offset + packed_at + 5)
            file.write(bytes([byte[0] ^ 0x55]))
        subscribers.append(WeightSubscriber(publisher.endpoint, updates.append, 0.01, keep_int8_adapters=True))
        assert subscribers[1].wait_for(2, 10), subscribers[1].last_error
        assert subscribers[1].ring_overwritten == 1 and subscribers[1].rejected == 0 and publisher.chunks_served > 0
        assert_equal_tensors({k: updates[-1].tensors[k] for k in int8_adapters(0)}, int8_adapters(2))
        plan = updates[-1].pooled.plan
        assert plan.verbatim and len(plan._buffers_int8) == 2  # version 1's (held) and the one tried, then used
    finally:
        for subscriber in subscribers:
            subscriber.close()
        publisher.close()
