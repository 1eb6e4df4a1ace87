"""The wire codec: every message round-trips, every malformed kind is rejected with its reason, fuzzing only ever
raises WireError."""

from __future__ import annotations

import math
import random
from dataclasses import fields, is_dataclass
from typing import Any

import msgpack
import numpy as np
import pytest

from asyncrl import wire
from asyncrl.wire import (
    BatchReply,
    ErrorReply,
    FetchBatch,
    LeaseReply,
    LeaseRequest,
    PromptLease,
    PushGroup,
    PushReply,
    SetMaxLag,
    StatsReply,
    StatsRequest,
    Trajectory,
    WireError,
    decode,
    encode,
)


def make_traj(i: int = 0, length: int = 5, group: str = "g7") -> Trajectory:
    rng = np.random.default_rng(i)
    return Trajectory(
        uid=f"{group}/{i}",
        group=group,
        prompt_index=7,
        prompt_ids=np.arange(4, dtype=np.int32),
        response_ids=rng.integers(0, 1000, length).astype(np.int32),
        behav_logp=-rng.random(length).astype(np.float32),
        versions=np.array([3] * (length - 1) + [4], dtype=np.int32)[:length],
        reward=0.5 * i,
        correct=i % 2 == 0,
        finish="stop",
        worker="w0",
        t_start=1700000000.25,
        t_end=1700000001.5,
    )


ALL_MESSAGES: list[Any] = [
    make_traj(),
    PromptLease(group="g1", index=1, prompt="1+2=", answer="3", deadline=123.5),
    LeaseRequest(worker="w0", max_groups=4),
    LeaseReply(
        leases=[PromptLease("g1", 1, "1+2=", "3", 1.0), PromptLease("g2", 2, "é+∑=", "", 2.0)], retry_after_s=0.0
    ),
    LeaseReply(leases=[], retry_after_s=0.1),
    PushGroup(worker="w0", group="g7", trajectories=[make_traj(0), make_traj(1, length=1)]),
    PushReply(accepted=False, reason="group_size"),
    FetchBatch(step=3, num_groups=2, wait_s=1.5),
    BatchReply(step=3, groups=[[make_traj(0), make_traj(1)], [make_traj(2, group="g8")]], dropped_stale=1, ready=True),
    BatchReply(step=4, groups=[], dropped_stale=0, ready=False),
    StatsRequest(),
    StatsReply(stats={"admitted_groups": 3, "mean": 0.5, "rejected_bad_msgpack": 0}),
    SetMaxLag(max_lag=0),
    ErrorReply(reason="bad_msgpack", detail="truncated"),
]


def assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if is_dataclass(a):
        for f in fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    else:
        assert a == b


@pytest.mark.parametrize("msg", ALL_MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: Any) -> None:
    data = encode(msg)
    assert_same(decode(data), msg)
    raw = msgpack.unpackb(data)
    assert raw["v"] == wire.SCHEMA_VERSION and raw["type"] == type(msg).__name__


def test_every_message_type_is_covered() -> None:
    assert {type(m) for m in ALL_MESSAGES} == set(wire.MESSAGE_TYPES)


def test_arrays_are_raw_little_endian_and_decoded_without_copy() -> None:
    traj = make_traj(length=3)
    raw = msgpack.unpackb(encode(traj))
    assert raw["behav_logp"] == {"dt": "f4", "n": 3, "b": traj.behav_logp.astype("<f4").tobytes()}
    assert raw["versions"]["dt"] == "i4"
    out = decode(encode(traj))
    assert isinstance(out, Trajectory)
    assert not out.behav_logp.flags.owndata and not out.behav_logp.flags.writeable
    assert out.response_ids.dtype == np.dtype("<i4")


def test_encode_converts_compatible_dtypes() -> None:
    traj = make_traj(length=3)
    traj.response_ids = np.array([1, 2, 3], dtype=np.int64)
    traj.behav_logp = np.array([-0.5, -1.0, 0.0], dtype=np.float64)
    traj.versions = np.array([0, 1, 2], dtype=">i4")  # big-endian input travels little-endian
    out = decode(encode(traj))
    assert isinstance(out, Trajectory)
    assert out.response_ids.tolist() == [1, 2, 3] and out.versions.tolist() == [0, 1, 2]
    assert out.behav_logp.dtype == np.float32


@pytest.mark.parametrize(
    ("attr", "value", "reason"),
    [
        ("response_ids", np.array([2**40], dtype=np.int64), "bad_dtype"),
        ("response_ids", np.array([1.5]), "bad_dtype"),
        ("response_ids", np.zeros((2, 2), dtype=np.int32), "bad_field"),
        ("uid", 5, "bad_field"),
        ("correct", 1, "bad_field"),
        ("reward", "1.0", "bad_field"),
        ("prompt_index", True, "bad_field"),
    ],
)
def test_encode_rejects_what_the_schema_cannot_carry(attr: str, value: Any, reason: str) -> None:
    traj = make_traj()
    setattr(traj, attr, value)
    with pytest.raises(WireError) as err:
        encode(traj)
    assert err.value.reason == reason


def raw_of(msg: Any) -> dict[str, Any]:
    return msgpack.unpackb(encode(msg))


def arr(code: str, values: list[Any]) -> dict[str, Any]:
    data = np.asarray(values, dtype="<" + code).tobytes()
    return {"dt": code, "n": len(values), "b": data}


def traj_with(**changes: Any) -> bytes:
    raw = raw_of(make_traj(length=3))
    for key, value in changes.items():
        if value is KeyError:
            del raw[key]
        else:
            raw[key] = value
    return msgpack.packb(raw)


MALFORMED: list[tuple[str, bytes, str]] = [
    ("empty", b"", "bad_msgpack"),
    ("reserved byte", b"\xc1", "bad_msgpack"),
    ("truncated", encode(make_traj())[:-3], "bad_msgpack"),
    ("trailing bytes", encode(StatsRequest()) + b"\x00", "bad_msgpack"),
    ("not a map", msgpack.packb([1, "StatsRequest"]), "bad_msgpack"),
    ("int map key", msgpack.packb({1: 1}), "bad_msgpack"),
    ("no version", msgpack.packb({"type": "StatsRequest"}), "schema_version"),
    ("future version", msgpack.packb({"v": 2, "type": "StatsRequest"}), "schema_version"),
    ("bool version", msgpack.packb({"v": True, "type": "StatsRequest"}), "schema_version"),
    ("no type", msgpack.packb({"v": 1}), "unknown_type"),
    ("unknown type", msgpack.packb({"v": 1, "type": "Exec"}), "unknown_type"),
    ("type not str", msgpack.packb({"v": 1, "type": 3}), "unknown_type"),
    ("missing field", traj_with(reward=KeyError), "bad_field"),
    ("extra field", traj_with(extra=1), "bad_field"),
    ("int as bool", traj_with(correct=1), "bad_field"),
    ("bool as int", traj_with(prompt_index=True), "bad_field"),
    ("str as int", traj_with(prompt_index="7"), "bad_field"),
    ("negative index", traj_with(prompt_index=-1), "bad_field"),
    ("bytes as str", traj_with(uid=b"g7/0"), "bad_field"),
    ("array as list", traj_with(versions=[0, 0, 0]), "bad_field"),
    ("array map extra key", traj_with(versions={**arr("i4", [0, 0, 0]), "x": 1}), "bad_field"),
    ("array n negative", traj_with(versions={"dt": "i4", "n": -1, "b": b""}), "bad_field"),
    ("array b as str", traj_with(versions={"dt": "i4", "n": 0, "b": ""}), "bad_field"),
    ("nonfinite timestamp", traj_with(t_end=math.inf), "bad_field"),
    ("float64 logp", traj_with(behav_logp=arr("f8", [-1.0, -1.0, -1.0])), "bad_dtype"),
    ("int64 versions", traj_with(versions=arr("i8", [0, 0, 0])), "bad_dtype"),
    ("big-endian", traj_with(versions={"dt": ">i4", "n": 3, "b": bytes(12)}), "bad_dtype"),
    ("bytes != n*itemsize", traj_with(versions={"dt": "i4", "n": 3, "b": bytes(11)}), "length_mismatch"),
    ("short versions", traj_with(versions=arr("i4", [0, 0])), "length_mismatch"),
    ("long logp", traj_with(behav_logp=arr("f4", [-1.0] * 4)), "length_mismatch"),
    (
        "empty response",
        traj_with(response_ids=arr("i4", []), behav_logp=arr("f4", []), versions=arr("i4", [])),
        "empty_response",
    ),
    ("nan logp", traj_with(behav_logp=arr("f4", [-1.0, math.nan, -1.0])), "nonfinite_logp"),
    ("-inf logp", traj_with(behav_logp=arr("f4", [-math.inf, -1.0, -1.0])), "nonfinite_logp"),
    ("+inf logp", traj_with(behav_logp=arr("f4", [math.inf, -1.0, -1.0])), "nonfinite_logp"),
    ("positive logp", traj_with(behav_logp=arr("f4", [-1.0, 0.5, -1.0])), "positive_logp"),
    ("negative version", traj_with(versions=arr("i4", [0, -1, 0])), "negative_version"),
    ("negative token", traj_with(response_ids=arr("i4", [0, -5, 0])), "negative_token"),
    ("negative prompt token", traj_with(prompt_ids=arr("i4", [-1])), "negative_token"),
    ("bad finish", traj_with(finish="eos"), "bad_finish"),
    ("nan reward", traj_with(reward=math.nan), "nonfinite_reward"),
    ("inf reward", traj_with(reward=-math.inf), "nonfinite_reward"),
    (
        "too many tokens",
        traj_with(response_ids={"dt": "i4", "n": wire.MAX_TOKENS + 1, "b": bytes(4 * (wire.MAX_TOKENS + 1))}),
        "oversized",
    ),
    ("n over MAX_TOKENS", traj_with(response_ids={"dt": "i4", "n": wire.MAX_TOKENS + 1, "b": b""}), "oversized"),
    (
        "group too large",
        msgpack.packb({**raw_of(PushGroup("w", "g", [])), "trajectories": [{}] * (wire.MAX_GROUP + 1)}),
        "oversized",
    ),
    (
        "string too long",
        msgpack.packb({"v": 1, "type": "ErrorReply", "reason": "x" * (wire.MAX_STR_BYTES + 1)}),
        "oversized",
    ),
    ("bad trajectory in group", msgpack.packb({**raw_of(PushGroup("w", "g", [])), "trajectories": [{}]}), "bad_field"),
    ("groups not nested", msgpack.packb({**raw_of(BatchReply(0, [], 0, False)), "groups": [{}]}), "bad_field"),
    ("stats bool value", msgpack.packb({"v": 1, "type": "StatsReply", "stats": {"a": True}}), "bad_field"),
    ("stats bytes key", msgpack.packb({"v": 1, "type": "StatsReply", "stats": {b"a": 1}}), "bad_field"),
    (
        "negative wait",
        msgpack.packb({"v": 1, "type": "FetchBatch", "step": 0, "num_groups": 1, "wait_s": -1.0}),
        "bad_field",
    ),
    (
        "ext type",
        msgpack.packb({"v": 1, "type": "ErrorReply", "reason": msgpack.ExtType(1, b"x"), "detail": ""}),
        "bad_msgpack",
    ),
]


@pytest.mark.parametrize(("case", "data", "reason"), MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_is_rejected_with_its_reason(case: str, data: bytes, reason: str) -> None:
    with pytest.raises(WireError) as err:
        decode(data)
    assert err.value.reason == reason, err.value
    assert err.value.reason in wire.WIRE_REASONS


def test_small_positive_logp_rounding_is_allowed() -> None:
    out = decode(traj_with(behav_logp=arr("f4", [-1.0, 5e-5, 0.0])))
    assert isinstance(out, Trajectory)


def test_oversized_message_rejected_before_unpacking(monkeypatch: pytest.MonkeyPatch) -> None:
    data = encode(make_traj(length=100))
    monkeypatch.setattr(wire, "MAX_MESSAGE_BYTES", len(data) - 1)
    with pytest.raises(WireError) as err:
        decode(data)
    assert err.value.reason == "oversized"


def test_decode_rejects_non_bytes() -> None:
    with pytest.raises(WireError) as err:
        decode("StatsRequest")  # type: ignore[arg-type]
    assert err.value.reason == "bad_msgpack"


# ---- fuzzing ----------------------------------------------------------------------------------------------------

_VALID = [encode(m) for m in ALL_MESSAGES]
_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    2**63,
    -(2**63),
    1.5,
    math.nan,
    math.inf,
    "",
    "x",
    "stop",
    b"",
    b"\x00" * 7,
    [],
    [{}],
    {},
    {"dt": "i4", "n": 1, "b": b"\x00\x00\x00\x00"},
    {"dt": "f4", "n": 2, "b": b"\x00" * 4},
    {"dt": "i4", "n": 2**40, "b": b""},
    [[]],
    [[{}]],
    {"a": {"b": {"c": []}}},
    "v",
    "type",
]


def _mutate_structure(rng: random.Random, data: bytes) -> bytes:
    """Replace, delete or add one field (possibly nested one level) with a random value."""
    raw = msgpack.unpackb(data)
    target = raw
    for key in ("trajectories", "leases", "groups"):
        if key in raw and raw[key] and rng.random() < 0.7:
            target = raw[key][0]
            if isinstance(target, list):
                target = target[0] if target else raw
            break
    keys = list(target)
    choice = rng.random()
    if choice < 0.6 and keys:
        target[rng.choice(keys)] = rng.choice(_VALUES)
    elif choice < 0.8 and keys:
        del target[rng.choice(keys)]
    else:
        target[rng.choice(["v", "type", "extra", "uid", "n"])] = rng.choice(_VALUES)
    return msgpack.packb(raw)


def _mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.random()
        pos = rng.randrange(len(buf) + 1)
        if op < 0.5 and buf:
            buf[min(pos, len(buf) - 1)] = rng.randrange(256)
        elif op < 0.7:
            del buf[pos:]
        elif op < 0.85:
            buf[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif buf:
            del buf[pos : pos + rng.randint(1, 8)]
    return bytes(buf)


def _mutate_array(rng: random.Random) -> bytes:
    """Random bytes inside one array of a valid trajectory: NaNs, positive log-probs, negative ids and versions."""
    raw = raw_of(make_traj(rng.randrange(100), length=rng.randint(1, 8)))
    name = rng.choice(["prompt_ids", "response_ids", "behav_logp", "versions"])
    size = len(raw[name]["b"])
    raw[name]["b"] = rng.randbytes(size)
    return msgpack.packb(raw)


def test_fuzz_only_wire_error() -> None:
    rng = random.Random(20240611)
    cases = 0
    reasons: dict[str, int] = {}
    for i in range(12000):
        kind = i % 4
        if kind == 0:
            data = rng.randbytes(rng.choice([1, 2, 5, 20, 200]))
            if rng.random() < 0.5:
                data = bytes([0x80 | rng.randrange(16)]) + data  # start like a small map
        elif kind == 1:
            data = _mutate_bytes(rng, rng.choice(_VALID))
        elif kind == 2:
            data = _mutate_structure(rng, rng.choice(_VALID))
        else:
            data = _mutate_array(rng)
        try:
            decode(data)
        except WireError as err:
            assert err.reason in wire.WIRE_REASONS
            reasons[err.reason] = reasons.get(err.reason, 0) + 1
        cases += 1
    assert cases >= 10000
    assert len(reasons) >= 12, reasons  # the fuzzer reaches most rejection paths


def test_fast_path_agrees_with_the_generic_decoder() -> None:
    """The trajectory fast path may only be faster: on valid and mutated groups it accepts exactly what the generic
    decoder accepts, with the same values, and `decode_request` rejects with the generic reason."""
    rng = random.Random(4)
    generic = wire._list_kind(wire.TRAJECTORY, "Trajectory")
    valid = encode(PushGroup("w", "g7", [make_traj(i) for i in range(4)]))
    outcomes = set()
    for i in range(3000):
        data = valid if i == 0 else (_mutate_structure if i % 2 else _mutate_bytes)(rng, valid)
        try:
            expected: Any = generic.decode(msgpack.unpackb(data)["trajectories"], "trajectories")
        except Exception as err:
            expected = getattr(err, "reason", "error")
        try:
            items = msgpack.unpackb(data)["trajectories"]
        except Exception:
            items = None
        fast = wire._scan(items, build=True)
        if fast is not None:
            assert not isinstance(expected, str), (i, expected)
            assert_same(fast.trajectories, expected)
        try:
            checked = wire.decode_request(data)
            outcome = "ok" if isinstance(checked, wire.CheckedPush) else type(checked).__name__
        except WireError as err:
            outcome = err.reason
            try:
                decode(data)
                raise AssertionError("decode_request rejected what decode accepts")
            except WireError as again:
                assert again.reason == err.reason
        outcomes.add(outcome)
    assert "ok" in outcomes and len(outcomes) > 4
