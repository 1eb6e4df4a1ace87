"""LoRA publication over real ZMQ sockets and /dev/shm: a pinned base, adapter-only versions that name it, late
subscribers that fetch the base first, and headers that misuse `base` / `pinned`."""

from __future__ import annotations

import msgpack
import pytest
import torch

from quant_sync.export import LORA_A, LORA_B, LORA_SCALING, base_weight_name, export_rollout_tensors
from quant_sync.transport import PROTOCOL_VERSION, PayloadError, WeightPublisher, WeightSubscriber, parse_header

LINEAR = "model.layers.0.mlp.up_proj"


def base_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    state = {
        LINEAR + ".weight": torch.randn(48, 40, generator=gen),
        "model.norm.weight": torch.randn(40, generator=gen),
        "model.embed_tokens.weight": torch.randn(30, 40, generator=gen),
    }
    return export_rollout_tensors(state, "int8")


def adapters(seed: int, rank: int = 4) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        LINEAR + LORA_A: torch.randn(rank, 40, generator=gen),
        LINEAR + LORA_B: torch.randn(48, rank, generator=gen),
        LINEAR + LORA_SCALING: torch.tensor([2.0]),
    }


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "zmq"])
def test_adapter_versions_complete_the_pinned_base_for_early_and_late_subscribers(use_shm):
    publisher = WeightPublisher(chunk_bytes=256, keep_versions=1)
    early_updates, late_updates = [], []
    subscribers = []
    try:
        publisher.publish(0, {**base_tensors(), **adapters(0)}, "int8", pin=True)
        subscribers.append(WeightSubscriber(publisher.endpoint, early_updates.append, 0.01, use_shm=use_shm))
        assert subscribers[0].wait_for(0, 10)
        for version in (1, 2, 3):  # keep_versions=1: versions 1 and 2 are evicted, the pinned base is not
            publisher.publish(version, adapters(version), "int8", base=0)
        assert subscribers[0].wait_for(3, 10)
        subscribers.append(WeightSubscriber(publisher.endpoint, late_updates.append, 0.01, use_shm=use_shm))
        assert subscribers[1].wait_for(3, 10)
        assert late_updates[0].version == 3  # the latest first, completed with the base it fetched
        for update in (early_updates[-1], late_updates[0]):
            expected = {**base_tensors(), **adapters(3)}
            assert set(update.tensors) == set(expected) and update.scheme == "int8"
            for name, value in expected.items():
                assert torch.equal(update.tensors[name], value), name
        for subscriber in subscribers:
            assert subscriber.base is not None and subscriber.base.version == 0 and subscriber.rejected == 0
    finally:
        for subscriber in subscribers:
            subscriber.close()
        publisher.close()


def test_a_new_pinned_base_releases_the_old_one():
    publisher = WeightPublisher(shm_dir=None, keep_versions=1)
    try:
        publisher.publish(0, base_tensors(), "int8", pin=True)
        publisher.publish(1, adapters(1), "int8", base=0)
        publisher.publish(2, base_tensors(), "int8", pin=True)
        publisher.publish(3, adapters(3), "int8", base=2)
        assert sorted(publisher._versions) == [2, 3]
        with pytest.raises(ValueError, match="pinned"):
            publisher.publish(4, adapters(4), "int8", base=0)  # not the pinned version
        with pytest.raises(ValueError, match="complete"):
            publisher.publish(5, adapters(5), "int8", base=2, pin=True)
    finally:
        publisher.close()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"base": 5}, "earlier version"),
        ({"base": -1}, "earlier version"),
        ({"base": "0"}, "earlier version"),
        ({"pinned": 1}, "pinned"),
        ({"pinned": True, "base": 1}, "pinned"),
    ],
)
def test_headers_with_a_bad_base_or_pin_are_rejected(fields, message):
    header = {"v": PROTOCOL_VERSION, "version": 5, "scheme": "int8", "tensors": [], "chunks": [], "shm": None}
    with pytest.raises(PayloadError, match=message):
        parse_header(msgpack.packb({**header, **fields}))
    assert parse_header(msgpack.packb({**header, "base": 2})).base == 2


def test_peft_names_map_to_the_base_models():
    assert base_weight_name("base_model.model.model.layers.0.mlp.up_proj.base_layer.weight") == LINEAR + ".weight"
    assert base_weight_name("base_model.model.model.layers.0.mlp.up_proj.base_layer") == LINEAR
    assert base_weight_name("base_model.model.lm_head.weight") == "lm_head.weight"
    assert base_weight_name("model.norm.weight") == "model.norm.weight"
