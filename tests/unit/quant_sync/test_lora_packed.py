"""Adapter-only versions packed into one buffer (`pack_adapters`, as learner/lora.py publishes them) decode to the
very tensors the unpacked version decodes to, bit for bit, also through a real publisher and subscriber; a bad
packed index is refused with a message naming it."""

from __future__ import annotations

import json
import time

import pytest
import torch

from quant_sync.export import (
    LORA_A,
    LORA_B,
    LORA_PACKED,
    LORA_PACKED_INDEX,
    LORA_SCALING,
    decode_adapters,
    encode_adapter,
    export_rollout_tensors,
    pack_adapters,
)
from quant_sync.transport import WeightPublisher, WeightSubscriber

LINEARS = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.mlp.down_proj")
SHAPES = {LINEARS[0]: (40, 40), LINEARS[1]: (24, 40), LINEARS[2]: (40, 56)}  # (out, in)


def _adapters(sync_dtype: str, seed: int = 0) -> dict[str, torch.Tensor]:
    gen, tensors = torch.Generator().manual_seed(seed), {}
    for linear, (out, inp) in SHAPES.items():
        matrices = {LORA_A: torch.randn(4, inp, generator=gen), LORA_B: 0.01 * torch.randn(out, 4, generator=gen)}
        for part, matrix in matrices.items():
            for suffix, value in encode_adapter(matrix, part, sync_dtype).items():
                tensors[linear + part + suffix] = value
        tensors[linear + LORA_SCALING] = torch.tensor([2.0])
    return tensors


@pytest.mark.parametrize("sync_dtype", ["fp32", "bf16", "int8"])
def test_packed_adapters_decode_to_the_unpacked_values_bit_for_bit(sync_dtype):
    tensors = _adapters(sync_dtype)
    packed = pack_adapters(tensors)
    assert set(packed) == {LORA_PACKED, LORA_PACKED_INDEX} and packed[LORA_PACKED].dtype == torch.int8
    assert packed[LORA_PACKED].numel() < sum(t.nbytes for t in tensors.values()) + 4 * len(tensors)
    expected, got = decode_adapters(tensors), decode_adapters(packed)
    assert list(got) == list(expected)
    for name, value in expected.items():
        assert got[name].dtype == value.dtype == torch.float32 and torch.equal(got[name], value), name
    base = {"model.norm.weight": torch.ones(40)}  # entries beside the packed ones stay as they are
    assert decode_adapters({**base, **packed})["model.norm.weight"] is base["model.norm.weight"]


def test_a_bad_packed_version_is_refused_naming_what_is_wrong():
    packed = pack_adapters(_adapters("int8"))
    with pytest.raises(ValueError, match="not a LoRA adapter tensor"):
        pack_adapters({"model.norm.weight": torch.ones(4)})
    with pytest.raises(ValueError, match="travel together"):
        decode_adapters({LORA_PACKED: packed[LORA_PACKED]})
    entries = json.loads(packed[LORA_PACKED_INDEX].numpy().tobytes())
    entries[0][3] = packed[LORA_PACKED].numel()  # past the buffer's end
    index = torch.frombuffer(bytearray(json.dumps(entries).encode()), dtype=torch.int8)
    with pytest.raises(ValueError, match="malformed packed adapters.*outside the buffer"):
        decode_adapters({**packed, LORA_PACKED_INDEX: index})
    with pytest.raises(ValueError, match="malformed packed adapters"):
        decode_adapters({**packed, LORA_PACKED_INDEX: torch.tensor([1, 2, 3], dtype=torch.int8)})


def _base_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    state = {linear + ".weight": torch.randn(*shape, generator=gen) for linear, shape in SHAPES.items()}
    return export_rollout_tensors(state, "int8")


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "zmq"])
def test_packed_adapter_versions_reach_the_subscriber_unpacked_and_decoded(use_shm):
    base = _base_tensors()
    publisher, updates = WeightPublisher(chunk_bytes=256), []
    subscriber = None
    try:
        publisher.publish(0, {**base, **_adapters("int8", seed=0)}, "int8", pin=True)
        publisher.publish(1, pack_adapters(_adapters("int8", seed=1)), "int8", base=0)
        subscriber = WeightSubscriber(publisher.endpoint, updates.append, 0.01, use_shm=use_shm)
        assert subscriber.wait_for(1, 10) and subscriber.rejected == 0, subscriber.last_error
        tensors = updates[-1].tensors
        assert LORA_PACKED not in tensors and LORA_PACKED_INDEX not in tensors
        for name, value in decode_adapters(_adapters("int8", seed=1)).items():
            assert torch.equal(tensors[name], value), name
        assert torch.equal(tensors[LINEARS[0] + ".weight"], base[LINEARS[0] + ".weight"])
        bad = pack_adapters(_adapters("int8", seed=2))
        bad[LORA_PACKED_INDEX] = torch.tensor([1, 2, 3], dtype=torch.int8)  # refused, never applied
        publisher.publish(2, bad, "int8", base=0)
        deadline = time.monotonic() + 10
        while subscriber.rejected == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert subscriber.rejected >= 1 and "malformed packed adapters" in subscriber.last_error
        publisher.publish(3, pack_adapters(_adapters("int8", seed=3)), "int8", base=0)
        assert subscriber.wait_for(3, 10) and all(update.version != 2 for update in updates)
    finally:
        if subscriber is not None:
            subscriber.close()
        publisher.close()


def test_int8_versions_decode_into_reused_buffers_never_one_still_held():
    """The planned decoder (`adapter_buffers.PackedPlan`) writes each version into a pooled float32 buffer that no
    tensor references any more: a version still held keeps its values while later ones decode; once dropped, its
    buffer is written again (no fresh allocation)."""
    import gc

    from quant_sync import adapter_buffers

    gc.collect()  # earlier tests' versions of the same layout: freed now, not midway
    versions = [pack_adapters(_adapters("int8", seed=seed)) for seed in range(4)]
    expected = [decode_adapters(_adapters("int8", seed=seed)) for seed in range(4)]  # the generic decoder
    name_a, name_b = LINEARS[0] + LORA_A, LINEARS[2] + LORA_B
    first = decode_adapters(versions[0])
    assert adapter_buffers.is_plan_buffer(first[name_a]) and not adapter_buffers.is_plan_buffer(expected[0][name_a])
    assert first[name_b].shape == (40, 4) and first[name_b].t().is_contiguous()  # B: a view of its B^T
    for linear in LINEARS:  # B^T in panels of 32 columns beside it (the engine kernel's layout), padding zero
        b_t = expected[0][linear + LORA_B].t()
        padded = torch.nn.functional.pad(b_t, (0, -b_t.shape[1] % 32))
        want = padded.view(b_t.shape[0], -1, 32).transpose(0, 1)
        assert torch.equal(adapter_buffers.panels_of(first[linear + LORA_B]), want), linear
    assert adapter_buffers.panels_of(expected[0][name_b]) is None  # not a decoded buffer's
    held = {name: value.clone() for name, value in first.items()}
    second = decode_adapters(versions[1])  # `first` is still held: another buffer
    assert first[name_a].untyped_storage().data_ptr() != second[name_a].untyped_storage().data_ptr()
    for name, value in held.items():
        assert torch.equal(first[name], value), name  # not overwritten
    for name, value in expected[1].items():
        assert torch.equal(second[name], value), name
    storage = first[name_a].untyped_storage().data_ptr()
    del first
    third = decode_adapters(versions[2])  # `first` dropped: its buffer is taken again
    assert third[name_a].untyped_storage().data_ptr() == storage
    for name, value in expected[2].items():
        assert torch.equal(third[name], value), name


def test_pooled_int8_versions_reuse_a_buffers_views_never_one_still_held():
    """`decode_pooled_adapters`: each version's tensors are views made once per pooled buffer (the same objects for
    every version written there), the published values as `decode_adapters(keep_int8=True)` gives them; a buffer is
    not written again while its `PooledAdapters` lives, whoever holds its tensors, and what a holder derived from it
    (views included) is made once per buffer and key, without keeping the buffer busy."""
    import gc

    from quant_sync import adapter_buffers
    from quant_sync.export import decode_pooled_adapters

    gc.collect()
    versions = [pack_adapters(_adapters("int8", seed=seed)) for seed in range(10, 14)]
    expected = [_adapters("int8", seed=seed) for seed in range(10, 14)]  # as published

    def check(pooled, index):
        assert set(pooled.tensors) == set(expected[index])
        for name, value in expected[index].items():
            assert pooled.tensors[name].dtype == value.dtype and torch.equal(pooled.tensors[name], value), name

    assert decode_pooled_adapters({**versions[0], "x": torch.ones(1)}) is None  # not adapters alone: the dict path
    first = decode_pooled_adapters(versions[0])
    assert first is not None and first.buffer_id is not None and first.others == (2.0, 2.0, 2.0)
    check(first, 0)
    made, tensors = [], first.tensors
    views = first.derived("views", lambda: made.append(1) or [t[:] for t in tensors.values()])
    assert first.derived("views", lambda: made.append(1)) is views and len(made) == 1
    second = decode_pooled_adapters(versions[1])  # `first` held: another buffer
    assert second.buffer_id != first.buffer_id
    check(first, 0)
    check(second, 1)
    buffer_id = first.buffer_id
    del first  # its tensors (`tensors`) and derived views (`views`) are still referenced: they do not hold it
    third = decode_pooled_adapters(versions[2])
    assert third.buffer_id == buffer_id and third.tensors is tensors  # the same views, rewritten
    check(third, 2)
    check(second, 1)
    assert torch.equal(views[0], third.tensors[next(iter(third.tensors))])  # derived views see the new values
    assert third.derived("views", lambda: made.append(1)) is views and len(made) == 1  # made once per buffer
    plan = third.plan
    held = [decode_pooled_adapters(versions[3]) for _ in range(adapter_buffers.BUFFER_SETS)]
    assert len(plan._buffers_int8) == adapter_buffers.BUFFER_SETS  # the pool is full, every buffer held
    beyond = held[-1]
    assert beyond.buffer_id is None  # a buffer of its own: nothing derived from it is kept
    check(beyond, 3)
    assert beyond.derived("views", lambda: made.append(1) or "fresh") == "fresh" and len(made) == 2


def test_a_packed_index_out_of_the_engines_order_still_decodes_exactly():
    """An index whose matrices do not lie back to back (another packer's placement) takes the generic decoder."""
    tensors = _adapters("int8", seed=5)
    packed = pack_adapters(tensors)
    entries = [entry[:4] for entry in json.loads(packed[LORA_PACKED_INDEX].numpy().tobytes())]  # B as (out, r)
    buffer = torch.zeros(packed[LORA_PACKED].numel() + 4 * len(entries), dtype=torch.int8)
    offset = 0
    for entry in reversed(entries):  # the same tensors, each 4 bytes after the previous one's end, in reverse order
        value = tensors[entry[0]].reshape(-1).view(torch.int8)
        buffer[offset : offset + value.numel()] = value
        entry[3] = offset
        offset += -(-(value.numel() + 4) // 4) * 4
    index = torch.frombuffer(bytearray(json.dumps(entries).encode()), dtype=torch.int8)
    got = decode_adapters({LORA_PACKED: buffer, LORA_PACKED_INDEX: index})
    for name, value in decode_adapters(tensors).items():
        assert torch.equal(got[name], value), name


def _panels_of(b: torch.Tensor) -> torch.Tensor:
    """B^T (r, out) in zero-padded panels of 32 columns (ceil(out / 32), r, 32)."""
    b_t = b.t()
    return torch.nn.functional.pad(b_t, (0, -b_t.shape[1] % 32)).view(b_t.shape[0], -1, 32).transpose(0, 1)


def test_a_packed_index_with_b_untransposed_decodes_exactly_through_the_plan():
    """pack_adapters' placement, but each B's bytes as (out, r) (no fifth index field): the plan reads B strided."""
    from quant_sync import adapter_buffers

    tensors = _adapters("int8", seed=6)
    packed = pack_adapters(tensors)
    entries = [entry[:4] for entry in json.loads(packed[LORA_PACKED_INDEX].numpy().tobytes())]
    buffer = packed[LORA_PACKED].clone()
    for name, _, _, start in entries:
        if name.endswith(LORA_B):
            value = tensors[name].reshape(-1).view(torch.int8)
            buffer[start : start + value.numel()] = value
    index = torch.frombuffer(bytearray(json.dumps(entries).encode()), dtype=torch.int8)
    got = decode_adapters({LORA_PACKED: buffer, LORA_PACKED_INDEX: index})
    assert adapter_buffers.is_plan_buffer(got[LINEARS[0] + LORA_B])
    for name, value in decode_adapters(tensors).items():
        assert torch.equal(got[name], value), name
    b_t = got[LINEARS[1] + LORA_B].t()
    want = torch.nn.functional.pad(b_t, (0, -b_t.shape[1] % 32)).view(b_t.shape[0], -1, 32).transpose(0, 1)
    assert torch.equal(adapter_buffers.panels_of(got[LINEARS[1] + LORA_B]), want)
    from quant_sync.export import decode_pooled_adapters

    version = {LORA_PACKED: buffer, LORA_PACKED_INDEX: index}  # int8 as published: B^T made in a buffer of its own
    for kept in (decode_adapters(version, keep_int8=True), decode_pooled_adapters(version).tensors):
        assert not adapter_buffers.plan_for(index, buffer.numel(), list).verbatim
        for name, value in tensors.items():
            assert kept[name].dtype == value.dtype and torch.equal(kept[name], value), name
        b = kept[LINEARS[1] + LORA_B]
        assert torch.equal(adapter_buffers.panels_of(b), _panels_of(b))


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "zmq"])
def test_a_subscriber_for_an_int8_engine_hands_packed_versions_over_as_published(use_shm):
    """`keep_int8_adapters`: a packed int8 version arrives as its int8 matrices and float32 scales (views of a pooled
    buffer), exactly the published values, completed with the pinned base's tensors."""
    base = _base_tensors()
    publisher, updates = WeightPublisher(chunk_bytes=256), []
    subscriber = None
    try:
        publisher.publish(0, base, "int8", pin=True)
        publisher.publish(1, pack_adapters(_adapters("int8", seed=1)), "int8", base=0)
        subscriber = WeightSubscriber(publisher.endpoint, updates.append, 0.01, use_shm=use_shm,
                                      keep_int8_adapters=True)  # fmt: skip
        assert subscriber.wait_for(1, 10) and subscriber.rejected == 0, subscriber.last_error
        tensors = updates[-1].tensors
        for name, value in _adapters("int8", seed=1).items():
            assert tensors[name].dtype == value.dtype and torch.equal(tensors[name], value), name
        assert torch.equal(tensors[LINEARS[0] + ".weight"], base[LINEARS[0] + ".weight"])
        assert updates[-1].pooled is not None and updates[-1].base is subscriber.base  # held while staged, run
    finally:
        if subscriber is not None:
            subscriber.close()
        publisher.close()
