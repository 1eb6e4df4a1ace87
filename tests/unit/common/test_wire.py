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

from buffer import ingest
from common import wire
from common.wire import (
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
    WorkerLeaving,
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
    WorkerLeaving(worker="worker-1.2"),
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


V = wire.SCHEMA_VERSION


def group_with(**changes: Any) -> bytes:
    """A PushGroup of two trajectories (prompts of 4 tokens, responses of 3) with columns changed or deleted."""
    raw = raw_of(PushGroup("w0", "g7", [make_traj(0, length=3), make_traj(1, length=3)]))
    for key, value in changes.items():
        if value is KeyError:
            del raw["trajectories"][key]
        else:
            raw["trajectories"][key] = value
    return msgpack.packb(raw)


def col(code: str, values: list[Any]) -> bytes:
    return np.asarray(values, dtype="<" + code).tobytes()


COLUMN_MALFORMED: list[tuple[str, bytes, str]] = [
    ("columns as list", msgpack.packb({**raw_of(PushGroup("w", "g", [])), "trajectories": [{}]}), "bad_field"),
    ("missing column", group_with(versions=KeyError), "bad_field"),
    ("extra column", group_with(extra=b""), "bad_field"),
    ("text column of bytes", group_with(uid=[b"g7/0", b"g7/1"]), "bad_field"),
    ("text column not a list", group_with(worker="w0"), "bad_field"),
    ("text columns disagree", group_with(finish=["stop"]), "length_mismatch"),
    ("scalar column as list", group_with(reward=[0.0, 0.5]), "bad_field"),
    ("short scalar column", group_with(reward=col("f8", [0.0])), "length_mismatch"),
    ("lengths disagree with tokens", group_with(response_len=col("i4", [3, 4])), "length_mismatch"),
    ("negative length", group_with(prompt_len=col("i4", [-4, 12])), "bad_field"),
    ("zero length", group_with(response_len=col("i4", [0, 6])), "empty_response"),
    ("huge length", group_with(response_len=col("i4", [wire.MAX_TOKENS + 1, 3])), "oversized"),
    ("negative index", group_with(prompt_index=col("i8", [-1, 7])), "bad_field"),
    ("nan reward", group_with(reward=col("f8", [0.0, math.nan])), "nonfinite_reward"),
    ("inf timestamp", group_with(t_end=col("f8", [math.inf, 1.0])), "bad_field"),
    ("correct 2", group_with(correct=bytes([1, 2])), "bad_field"),
    ("bad finish", group_with(finish=["stop", "eos"]), "bad_finish"),
    ("nan logp", group_with(behav_logp=col("f4", [-1.0] * 5 + [math.nan])), "nonfinite_logp"),
    ("positive logp", group_with(behav_logp=col("f4", [-1.0] * 5 + [0.5])), "positive_logp"),
    ("negative version", group_with(versions=col("i4", [0] * 5 + [-1])), "negative_version"),
    ("negative response token", group_with(response_ids=col("i4", [1] * 5 + [-3])), "negative_token"),
    ("negative prompt token", group_with(prompt_ids=col("i4", [1] * 7 + [-3])), "negative_token"),
    ("long token column", group_with(versions=col("i4", [0] * 7)), "length_mismatch"),
    ("token column as str", group_with(versions="\x00" * 24), "bad_field"),
]

MALFORMED: list[tuple[str, bytes, str]] = [
    *COLUMN_MALFORMED,
    ("empty", b"", "bad_msgpack"),
    ("reserved byte", b"\xc1", "bad_msgpack"),
    ("truncated", encode(make_traj())[:-3], "bad_msgpack"),
    ("trailing bytes", encode(StatsRequest()) + b"\x00", "bad_msgpack"),
    ("not a map", msgpack.packb([1, "StatsRequest"]), "bad_msgpack"),
    ("int map key", msgpack.packb({1: 1}), "bad_msgpack"),
    ("no version", msgpack.packb({"type": "StatsRequest"}), "schema_version"),
    ("future version", msgpack.packb({"v": wire.SCHEMA_VERSION + 1, "type": "StatsRequest"}), "schema_version"),
    ("schema 1", msgpack.packb({"v": 1, "type": "StatsRequest"}), "schema_version"),
    ("bool version", msgpack.packb({"v": True, "type": "StatsRequest"}), "schema_version"),
    ("no type", msgpack.packb({"v": wire.SCHEMA_VERSION}), "unknown_type"),
    ("unknown type", msgpack.packb({"v": wire.SCHEMA_VERSION, "type": "Exec"}), "unknown_type"),
    ("type not str", msgpack.packb({"v": wire.SCHEMA_VERSION, "type": 3}), "unknown_type"),
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
        msgpack.packb({"v": wire.SCHEMA_VERSION, "type": "ErrorReply", "reason": "x" * (wire.MAX_STR_BYTES + 1)}),
        "oversized",
    ),
    ("groups not nested", msgpack.packb({**raw_of(BatchReply(0, [], 0, False)), "groups": [{}]}), "bad_field"),
    ("stats bool value", msgpack.packb({"v": V, "type": "StatsReply", "stats": {"a": True}}), "bad_field"),
    ("stats bytes key", msgpack.packb({"v": V, "type": "StatsReply", "stats": {b"a": 1}}), "bad_field"),
    (
        "negative wait",
        msgpack.packb({"v": wire.SCHEMA_VERSION, "type": "FetchBatch", "step": 0, "num_groups": 1, "wait_s": -1.0}),
        "bad_field",
    ),
    (
        "ext type",
        msgpack.packb({"v": V, "type": "ErrorReply", "reason": msgpack.ExtType(1, b"x"), "detail": ""}),
        "bad_msgpack",
    ),
]


@pytest.mark.parametrize(("case", "data", "reason"), MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_is_rejected_with_its_reason(case: str, data: bytes, reason: str) -> None:
    with pytest.raises(WireError) as err:
        decode(data)
    assert err.value.reason == reason, err.value
    assert err.value.reason in wire.WIRE_REASONS


def test_a_group_travels_as_columns_decoded_without_copy() -> None:
    group = [make_traj(0, length=3), make_traj(1, length=2)]
    data = encode(PushGroup("w0", "g7", group))
    columns = msgpack.unpackb(data)["trajectories"]
    assert list(columns) == list(wire.GROUP_COLUMNS)
    assert columns["uid"] == ["g7/0", "g7/1"] and columns["response_len"] == col("i4", [3, 2])
    assert columns["behav_logp"] == np.concatenate([t.behav_logp for t in group]).astype("<f4").tobytes()
    out = decode(data)
    assert isinstance(out, PushGroup)
    assert_same(out.trajectories, group)
    views = out.trajectories[1].behav_logp
    assert not views.flags.owndata and not views.flags.writeable
    assert_same(decode(encode(PushGroup("w0", "g7", []))), PushGroup("w0", "g7", []))


def test_encode_rejects_a_group_value_beyond_its_column() -> None:
    traj = make_traj()
    traj.prompt_index = 2**63  # a valid int for one Trajectory map, wider than the int64 column
    encode(traj)
    with pytest.raises(WireError) as err:
        encode(PushGroup("w0", "g7", [traj]))
    assert err.value.reason == "bad_field"


def test_a_schema_1_push_from_an_old_journal_is_upgraded() -> None:
    group = [make_traj(0, length=3), make_traj(1, length=2)]
    maps = [{k: v for k, v in raw_of(t).items() if k not in ("v", "type")} for t in group]
    old = msgpack.packb({"v": 1, "type": "PushGroup", "worker": "w0", "group": "g7", "trajectories": maps})
    with pytest.raises(WireError) as err:
        decode(old)
    assert err.value.reason == "schema_version"
    assert_same(decode(ingest.upgrade_push(old)), PushGroup("w0", "g7", group))
    current = encode(PushGroup("w0", "g7", group))
    assert ingest.upgrade_push(current) is current
    bad = msgpack.unpackb(old)
    bad["trajectories"][1]["behav_logp"] = arr("f4", [math.nan, -1.0])
    with pytest.raises(WireError) as err:
        ingest.upgrade_push(msgpack.packb(bad))
    assert err.value.reason == "nonfinite_logp"


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
            target = raw[key] if isinstance(raw[key], dict) else raw[key][0]  # columns, a lease, a group's columns
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
    """Random bytes inside one array of a valid trajectory or column of a group: NaNs, positive log-probs, negative
    ids and versions, bad lengths and flags."""
    if rng.random() < 0.5:
        raw = raw_of(make_traj(rng.randrange(100), length=rng.randint(1, 8)))
        name = rng.choice(["prompt_ids", "response_ids", "behav_logp", "versions"])
        raw[name]["b"] = rng.randbytes(len(raw[name]["b"]))
        return msgpack.packb(raw)
    raw = raw_of(PushGroup("w", "g7", [make_traj(i, length=rng.randint(1, 8)) for i in range(rng.randint(1, 4))]))
    columns = raw["trajectories"]
    name = rng.choice([c for c in wire.GROUP_COLUMNS if isinstance(columns[c], bytes)])
    columns[name] = rng.randbytes(len(columns[name]))
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


def test_decode_request_agrees_with_decode() -> None:
    """The buffer's ingest decoder (a CheckedPush, no Trajectory objects) accepts exactly what `decode` accepts, with
    the same values, and rejects with the same reason."""
    rng = random.Random(4)
    valid = encode(PushGroup("w", "g7", [make_traj(i) for i in range(4)]))
    reordered = msgpack.unpackb(valid)
    reordered = msgpack.packb({"trajectories": reordered.pop("trajectories"), **reordered})  # valid, not canonical
    outcomes = set()
    for i in range(3000):
        data = (valid, reordered)[i] if i < 2 else (_mutate_structure if i % 2 else _mutate_bytes)(rng, valid)
        try:
            expected: Any = decode(data)
        except WireError as err:
            expected = err.reason
        try:
            checked = ingest.decode_request(data)
        except WireError as err:
            assert err.reason == expected, (i, err, expected)
            outcomes.add(err.reason)
            continue
        if not isinstance(checked, ingest.CheckedPush):
            assert_same(checked, expected)
            continue
        assert isinstance(expected, PushGroup), (i, expected)
        trajectories = expected.trajectories
        assert (checked.worker, checked.group) == (expected.worker, expected.group)
        assert checked.uids == [t.uid for t in trajectories]
        assert checked.rewards == tuple(t.reward for t in trajectories)
        assert checked.prompt_indices == tuple(t.prompt_index for t in trajectories)
        versions = [int(v) for t in trajectories for v in t.versions] or [0]
        assert (checked.oldest_version, checked.newest_version) == (min(versions), max(versions))
        payload = memoryview(checked.payload)
        assert_same(decode(payload), expected)  # the kept payload is canonical and decodes to the same group
        outcomes.add("ok")
    assert "ok" in outcomes and len(outcomes) > 4


def test_ids_steps_and_waits_are_bounded() -> None:
    """Ids key the buffer's tables and steps feed its throttle arithmetic: both are bounded on decode, in the
    single-trajectory, group and buffer (decode_request) forms alike."""
    long_id = "g" * (wire.MAX_ID_CHARS + 1)
    for field_name in ("uid", "group", "worker"):
        traj = make_traj(0)
        setattr(traj, field_name, long_id)
        for data in (encode(traj), encode(PushGroup("w", "g7", [traj]))):
            for decoder in (decode, ingest.decode_request):
                with pytest.raises(WireError) as err:
                    decoder(data)
                assert err.value.reason == "oversized", (field_name, decoder)
    with pytest.raises(WireError, match="oversized"):
        ingest.decode_request(encode(PushGroup(long_id, "g7", [make_traj(0)])))
    ok = make_traj(0)
    ok.uid = ok.group = ok.worker = "g" * wire.MAX_ID_CHARS
    assert decode(encode(ok)).uid == ok.uid
    for msg in (wire.FetchBatch(step=wire.MAX_STEP + 1, num_groups=1, wait_s=0.0), wire.SetMaxLag(wire.MAX_STEP + 1),
                wire.FetchBatch(step=0, num_groups=1, wait_s=wire.MAX_WAIT_S * 2)):  # fmt: skip
        with pytest.raises(WireError, match="bad_field"):
            decode(encode(msg))
    assert decode(encode(wire.SetMaxLag(wire.MAX_STEP))) == wire.SetMaxLag(wire.MAX_STEP)
