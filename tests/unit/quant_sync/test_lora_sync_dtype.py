"""`model.lora.sync_dtype`: adapters encoded for the wire (fp32, bf16, int8 with per-rank-component scales) decode
to exactly `round_adapter`'s values (the learner's forward runs those), also through a real publisher and subscriber."""

from __future__ import annotations

import time

import pytest
import torch

from quant_sync.export import (
    LORA_A,
    LORA_B,
    LORA_SCALE,
    LORA_SCALING,
    decode_adapters,
    encode_adapter,
    export_rollout_tensors,
    round_adapter,
)
from quant_sync.transport import WeightPublisher, WeightSubscriber

LINEAR = "model.layers.0.mlp.up_proj"


def _matrices(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(4, 40, generator=gen), 0.01 * torch.randn(48, 4, generator=gen)
    b[:, 2] = 0.0  # a rank component that is all zero (peft's B at the start): scale 1, values 0
    a[1] *= 1e3  # rows of very different size: each rank component gets its own scale
    return {LORA_A: a, LORA_B: b}


def _encoded(sync_dtype: str, seed: int = 0) -> dict[str, torch.Tensor]:
    tensors = {LINEAR + LORA_SCALING: torch.tensor([2.0])}
    for part, matrix in _matrices(seed).items():
        for suffix, value in encode_adapter(matrix, part, sync_dtype).items():
            tensors[LINEAR + part + suffix] = value
    return tensors


@pytest.mark.parametrize("sync_dtype", ["fp32", "bf16", "int8"])
def test_decoded_adapters_are_the_rounded_values_bit_for_bit(sync_dtype):
    encoded = _encoded(sync_dtype)
    wire = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}[sync_dtype]
    assert encoded[LINEAR + LORA_A].dtype == encoded[LINEAR + LORA_B].dtype == wire
    assert (LINEAR + LORA_A + LORA_SCALE in encoded) == (sync_dtype == "int8")
    decoded = decode_adapters(encoded)
    assert set(decoded) == {LINEAR + LORA_A, LINEAR + LORA_B, LINEAR + LORA_SCALING}  # the scales are dropped
    for part, matrix in _matrices().items():
        rounded = round_adapter(matrix, part, sync_dtype)
        assert decoded[LINEAR + part].dtype == torch.float32 and torch.equal(decoded[LINEAR + part], rounded)
        if sync_dtype == "fp32":
            assert torch.equal(rounded, matrix)
        else:  # rounding to the nearest step: half a step (int8: amax / 254 per rank component; bf16: 2^-8 relative)
            rank_dim = 0 if part == LORA_A else 1
            amax = matrix.abs().amax(dim=1 - rank_dim, keepdim=True)
            step = amax / 127 if sync_dtype == "int8" else matrix.abs() * 2.0**-7
            assert bool(((rounded - matrix).abs() <= step / 2 + 1e-12).all()) and not torch.equal(rounded, matrix)
    assert torch.equal(decoded[LINEAR + LORA_B][:, 2], torch.zeros(48))


def test_int8_adapter_bytes_and_bad_encodings():
    fp32 = sum(t.nbytes for t in _encoded("fp32").values())
    int8 = sum(t.nbytes for t in _encoded("int8").values())
    assert int8 == (4 * 40 + 48 * 4) + 2 * 4 * 4 + 4 and int8 < 0.3 * fp32  # values, 2 x rank scales, scaling
    encoded = _encoded("int8")
    with pytest.raises(ValueError, match="needs float32 scales"):
        decode_adapters({k: v for k, v in encoded.items() if k != LINEAR + LORA_B + LORA_SCALE})
    with pytest.raises(ValueError, match="needs float32 scales"):
        decode_adapters({**encoded, LINEAR + LORA_A + LORA_SCALE: torch.ones(5)})
    with pytest.raises(ValueError, match="without their matrix"):
        decode_adapters({k: v for k, v in encoded.items() if k != LINEAR + LORA_A})
    with pytest.raises(ValueError, match="sync_dtype"):
        encode_adapter(torch.ones(2, 3), LORA_A, "fp8")
    with pytest.raises(ValueError, match="part"):
        round_adapter(torch.ones(2, 3), ".lora_C", "int8")
    plain = {"model.norm.weight": torch.ones(3)}
    assert decode_adapters(plain) is plain  # no adapters: untouched


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "zmq"])
def test_int8_adapter_versions_reach_the_subscriber_as_the_rounded_fp32_values(use_shm):
    gen = torch.Generator().manual_seed(1)
    state = {LINEAR + ".weight": torch.randn(48, 40, generator=gen), "model.norm.weight": torch.ones(40)}
    base = export_rollout_tensors(state, "int8")
    publisher, updates = WeightPublisher(chunk_bytes=128), []
    subscriber = None
    try:
        publisher.publish(0, {**base, **_encoded("int8", seed=0)}, "int8", pin=True)
        publisher.publish(1, _encoded("int8", seed=1), "int8", base=0)
        subscriber = WeightSubscriber(publisher.endpoint, updates.append, 0.01, use_shm=use_shm)
        assert subscriber.wait_for(1, 10) and subscriber.rejected == 0, subscriber.last_error
        tensors = updates[-1].tensors
        assert not any(name.endswith((LORA_A + LORA_SCALE, LORA_B + LORA_SCALE)) for name in tensors)
        assert torch.equal(tensors[LINEAR + ".weight"], base[LINEAR + ".weight"])
        for part, matrix in _matrices(seed=1).items():
            assert torch.equal(tensors[LINEAR + part], round_adapter(matrix, part, "int8"))
        bad = _encoded("int8", seed=2)
        bad[LINEAR + LORA_A + LORA_SCALE] = torch.ones(3)  # misshapen scales: rejected, never applied
        publisher.publish(2, bad, "int8", base=0)
        deadline = time.monotonic() + 10
        while subscriber.rejected == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert subscriber.rejected >= 1 and "needs float32 scales" in subscriber.last_error, subscriber.last_error
        publisher.publish(3, _encoded("int8", seed=3), "int8", base=0)
        assert subscriber.wait_for(3, 10) and all(update.version != 2 for update in updates)
    finally:
        if subscriber is not None:
            subscriber.close()
        publisher.close()
