"""Weight publication over real ZMQ sockets: latest-version delivery, late subscribers, corrupt payloads."""

from __future__ import annotations

import threading

import msgpack
import pytest
import torch
import zmq

from quant_sync.export import export_rollout_tensors
from quant_sync.transport import PayloadError, WeightPublisher, WeightSubscriber, decode_payload


def tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    state = {
        "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8, generator=gen),
        "model.norm.weight": torch.randn(8, generator=gen),
    }
    return export_rollout_tensors(state, "int8")


def test_subscribers_receive_latest_and_late_ones_catch_up():
    publisher = WeightPublisher()
    received: list[int] = []
    try:
        publisher.publish(0, tensors(0), "int8")
        early = WeightSubscriber(publisher.endpoint, lambda u: received.append(u.version), poll_s=0.01)
        assert early.wait_for(0, 10)
        publisher.publish(1, tensors(1), "int8")
        publisher.publish(2, tensors(2), "int8")
        assert early.wait_for(2, 10)
        assert received == sorted(received) and received[-1] == 2
        late_updates = []
        late = WeightSubscriber(publisher.endpoint, late_updates.append, poll_s=0.01)
        assert late.wait_for(2, 10)
        assert late_updates[0].version == 2  # a late worker gets the latest version first, not version 0
        for name, value in tensors(2).items():
            assert torch.equal(late_updates[0].tensors[name], value)  # bit-identical to what was published
        assert late_updates[0].tensors["model.layers.0.mlp.up_proj.weight"].dtype == torch.int8
        early.close()
        late.close()
    finally:
        publisher.close()


def test_corrupt_frame_is_rejected():
    publisher = WeightPublisher()
    try:
        publisher.publish(3, tensors(3), "int8")
        latest = publisher._latest
        frames = [latest.header] + [bytes(f) for f in latest.frames]
        assert decode_payload(frames).version == 3
        corrupt = list(frames)
        flipped = bytearray(corrupt[1])
        flipped[0] ^= 0xFF
        corrupt[1] = bytes(flipped)
        with pytest.raises(PayloadError, match="corrupt or partial"):
            decode_payload(corrupt)
        with pytest.raises(PayloadError, match="header lists"):
            decode_payload(frames[:-1])
        with pytest.raises(PayloadError, match="unreadable"):
            decode_payload([b"\xc1garbage"])
    finally:
        publisher.close()


def test_subscriber_refetches_after_a_corrupt_payload():
    """A publisher that corrupts its first answer: the subscriber counts it, asks again, applies only the good one."""
    good = WeightPublisher()
    good.publish(5, tensors(5), "int8")
    frames = [good._latest.header] + [bytes(f) for f in good._latest.frames]
    good.close()
    context = zmq.Context.instance()
    router = context.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve():
        answered = 0
        while not stop.is_set():
            if not router.poll(50):
                continue
            identity, request = router.recv_multipart()
            assert msgpack.unpackb(request)["type"] == "get"
            payload = list(frames)
            if answered == 0:
                payload[1] = payload[1][:-1]  # truncated tensor
            router.send_multipart([identity, *payload])
            answered += 1

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    applied = []
    subscriber = WeightSubscriber(f"tcp://127.0.0.1:{port}", applied.append, poll_s=0.01)
    try:
        assert subscriber.wait_for(5, 10)
        assert subscriber.rejected >= 1
        assert [u.version for u in applied] == [5]
    finally:
        subscriber.close()
        stop.set()
        thread.join()
        router.close(0)


def test_publisher_survives_malformed_requests():
    publisher = WeightPublisher()
    publisher.publish(0, tensors(0), "int8")
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(publisher.endpoint)
    try:
        for junk in (b"", b"\xff\xfe", msgpack.packb({"type": "get"}), msgpack.packb([1, 2, 3])):
            dealer.send(junk)
        got = []
        subscriber = WeightSubscriber(publisher.endpoint, got.append, poll_s=0.01)
        assert subscriber.wait_for(0, 10)
        subscriber.close()
        assert publisher.bad_requests >= 3
    finally:
        dealer.close(0)
        publisher.close()
