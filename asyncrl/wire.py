"""Every message that crosses a process boundary, defined once, and its msgpack codec.

A message on the wire is one msgpack map: `{"v": SCHEMA_VERSION, "type": "<class name>", <field>: <value>, ...}`.
Nested structures (a trajectory inside a `PushGroup`, a lease inside a `LeaseReply`) are maps of their fields
without `v`/`type`. Numpy arrays travel as `{"dt": "i4" | "f4", "n": <length>, "b": <raw little-endian bytes>}`;
`decode` turns them back with `np.frombuffer`, without copying, so decoded arrays are READ-ONLY views of the
received frame (copy before writing into them).

`decode` trusts nothing: every field must be present with exactly its type (a bool is not an int), arrays must
have the dtype the schema fixes for that field and `len(b) == n * itemsize`, sizes are bounded (`MAX_*`) before and
while unpacking, and trajectories are checked for internal consistency. Anything else raises `WireError` with a
short `reason` code that services count as `rejected_<reason>`; malformed input never raises anything else.
Encoding never uses pickle; neither does anything else in asyncrl.

| message | producer | consumer | reply |
|---|---|---|---|
| `LeaseRequest` | rollout worker | buffer | `LeaseReply` |
| `PushGroup` | rollout worker | buffer | `PushReply` |
| `FetchBatch` | learner | buffer | `BatchReply` |
| `StatsRequest`, `SetMaxLag` | driver / CLI | buffer | `StatsReply` |
| any malformed or unexpected request | anyone | buffer | `ErrorReply` |

Bump `SCHEMA_VERSION` on any change to a field; peers with another version are rejected (`schema_version`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import msgpack
import numpy as np

SCHEMA_VERSION = 1
MAX_TOKENS = 65536
"""Largest length of any token array (prompt_ids, response_ids, behav_logp, versions)."""
MAX_GROUP = 1024
"""Largest list in a message: trajectories of a group, groups of a batch, leases of a reply."""
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
"""Largest encoded message; checked before unpacking."""
MAX_STR_BYTES = 1024 * 1024
"""Largest string (a prompt, an answer, an id)."""
MAX_MAP_LEN = 1024
"""Largest map (the stats counters)."""
LOGP_TOLERANCE = 1e-4
"""A behavior log-prob may exceed 0 by this much (rounding in the engine); more is rejected."""
FINISH_REASONS = ("stop", "length", "abort")

WIRE_REASONS = (
    "bad_msgpack",  # not msgpack, truncated, trailing bytes, too deeply nested, not a map
    "oversized",  # a message, string, list, map or array beyond the MAX_* bounds
    "schema_version",  # missing or different "v"
    "unknown_type",  # missing or unknown "type"
    "bad_field",  # a missing or unknown field, or a field of the wrong type or range
    "bad_dtype",  # an array whose "dt" is not the one the schema fixes for that field
    "length_mismatch",  # len(b) != n * itemsize, or response_ids/behav_logp/versions of different lengths
    "empty_response",  # a trajectory with no response token
    "nonfinite_logp",  # NaN or inf in behav_logp
    "positive_logp",  # behav_logp above LOGP_TOLERANCE
    "negative_version",  # a token version below 0
    "negative_token",  # a token id below 0
    "bad_finish",  # finish not in FINISH_REASONS
    "nonfinite_reward",  # NaN or inf reward
)


class WireError(ValueError):
    """A message that cannot be encoded or does not validate; `reason` is one of WIRE_REASONS."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


# ---------------------------------------------------------------------------------------------------------------
# Message types. Field comments give dtype / shape; producer and consumer are in the class docstrings.


@dataclass(slots=True)
class Trajectory:
    """One sampled response with everything the learner needs. Producer: rollout worker. Consumer: buffer, learner."""

    uid: str  # unique per response: f"{group}/{i}"
    group: str  # group id (the lease id)
    prompt_index: int  # index of the problem in the training stream
    prompt_ids: np.ndarray  # int32 (P,), token ids >= 0
    response_ids: np.ndarray  # int32 (T,), T >= 1, token ids >= 0
    behav_logp: np.ndarray  # float32 (T,), behavior log-prob of each sampled token, finite, <= LOGP_TOLERANCE
    versions: np.ndarray  # int32 (T,), weight version that produced each token, >= 0
    reward: float  # finite
    correct: bool
    finish: str  # "stop" | "length" | "abort"
    worker: str  # id of the rollout worker
    t_start: float  # unix seconds, generation start
    t_end: float  # unix seconds, generation end


@dataclass(slots=True)
class PromptLease:
    """One problem leased to a worker as one group. Producer: buffer. Consumer: rollout worker."""

    group: str  # group id; the trajectories of this group carry it
    index: int  # index of the problem in the training stream (-> Trajectory.prompt_index)
    prompt: str
    answer: str  # reference answer for the reward function
    deadline: float  # unix seconds after which the lease may be given to another worker


@dataclass(slots=True)
class LeaseRequest:
    """Ask for up to `max_groups` prompts. Producer: rollout worker. Consumer: buffer."""

    worker: str
    max_groups: int  # >= 0


@dataclass(slots=True)
class LeaseReply:
    """Leases granted; empty with `retry_after_s > 0` when throttled (staleness, backpressure) or the pool is empty.

    Producer: buffer. Consumer: rollout worker.
    """

    leases: list[PromptLease]
    retry_after_s: float  # >= 0, seconds to wait before asking again


@dataclass(slots=True)
class PushGroup:
    """A finished group: all `group_size` responses of one leased prompt. Producer: rollout worker. Consumer: buffer."""

    worker: str
    group: str
    trajectories: list[Trajectory]


@dataclass(slots=True)
class PushReply:
    """Whether a group was taken. Producer: buffer. Consumer: rollout worker.

    `accepted=True` means the lease is done (reason "" when queued for training, or "duplicate", "filtered",
    "stale": already admitted, dropped by dynamic sampling, too old). `accepted=False` gives the counted reject
    reason; on "backpressure" the worker keeps the group and pushes it again later.
    """

    accepted: bool
    reason: str


@dataclass(slots=True)
class FetchBatch:
    """The learner asks for `num_groups` admissible groups for train step `step`. Producer: learner. Consumer: buffer.

    The buffer waits up to `wait_s` seconds for enough groups before answering `ready=False`.
    """

    step: int  # >= 0
    num_groups: int  # >= 1
    wait_s: float  # >= 0


@dataclass(slots=True)
class BatchReply:
    """Complete groups for a train step, oldest first. Producer: buffer. Consumer: learner.

    `ready=False` (and no groups) if not enough admissible groups arrived within `wait_s`.
    """

    step: int
    groups: list[list[Trajectory]]
    dropped_stale: int  # groups dropped as too stale while serving this request
    ready: bool


@dataclass(slots=True)
class StatsRequest:
    """Ask for the buffer's counters. Producer: driver / CLI. Consumer: buffer."""


@dataclass(slots=True)
class StatsReply:
    """Counters by name (admitted_groups, queued_groups, rejected_<reason>, ...). Producer: buffer. Consumer: driver."""

    stats: dict[str, float | int] = field(default_factory=dict)


@dataclass(slots=True)
class SetMaxLag:
    """Change staleness.max_lag of a live buffer; answered with StatsReply. Producer: driver / CLI. Consumer: buffer."""

    max_lag: int  # >= 0


@dataclass(slots=True)
class ErrorReply:
    """A request that was malformed or unexpected; `reason` is counted as `rejected_<reason>`. Producer: buffer."""

    reason: str
    detail: str = ""


Message: TypeAlias = (
    Trajectory
    | PromptLease
    | LeaseRequest
    | LeaseReply
    | PushGroup
    | PushReply
    | FetchBatch
    | BatchReply
    | StatsRequest
    | StatsReply
    | SetMaxLag
    | ErrorReply
)

# ---------------------------------------------------------------------------------------------------------------
# Field kinds: an encoder (python value -> msgpack-able) and a decoder (unpacked value -> checked python value).


@dataclass(frozen=True, slots=True)
class _Kind:
    encode: Callable[[Any, str], Any]
    decode: Callable[[Any, str], Any]


def _bad(name: str, what: str, value: Any) -> WireError:
    return WireError("bad_field", f"`{name}` must be {what}, got {type(value).__name__}")


def _enc_str(value: Any, name: str) -> str:
    if type(value) is not str and not isinstance(value, str):
        raise _bad(name, "str", value)
    return value


def _dec_str(value: Any, name: str) -> str:
    if type(value) is not str:
        raise _bad(name, "str", value)
    return value


def _enc_int(value: Any, name: str) -> int:
    if type(value) is int:
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise _bad(name, "int", value)
    return int(value)


def _dec_int(value: Any, name: str) -> int:
    if type(value) is not int:
        raise _bad(name, "int", value)
    return value


def _dec_nat(value: Any, name: str) -> int:
    if type(value) is not int or value < 0:
        raise WireError("bad_field", f"`{name}` must be an int >= 0, got {value!r}"[:200])
    return value


def _enc_float(value: Any, name: str) -> float:
    if type(value) is float:
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise _bad(name, "float", value)
    return float(value)


def _dec_finite(value: Any, name: str) -> float:
    kind = type(value)
    if kind is int:
        value = float(value)
    elif kind is not float:
        raise _bad(name, "float", value)
    if not math.isfinite(value):
        raise WireError("nonfinite_reward" if name == "reward" else "bad_field", f"`{name}` must be finite")
    return value


def _dec_nonneg_finite(value: Any, name: str) -> float:
    value = _dec_finite(value, name)
    if value < 0:
        raise WireError("bad_field", f"`{name}` must be >= 0")
    return value


def _enc_bool(value: Any, name: str) -> bool:
    if type(value) is bool:
        return value
    if not isinstance(value, (bool, np.bool_)):
        raise _bad(name, "bool", value)
    return bool(value)


def _dec_bool(value: Any, name: str) -> bool:
    if type(value) is not bool:
        raise _bad(name, "bool", value)
    return value


def _array_kind(code: str) -> _Kind:
    """An array field of fixed little-endian dtype `code` ("i4" or "f4")."""
    dtype = np.dtype("<" + code)
    itemsize = dtype.itemsize
    is_int = dtype.kind == "i"
    info = np.iinfo(dtype) if is_int else None

    def encode(value: Any, name: str) -> dict[str, Any]:
        if type(value) is np.ndarray and value.dtype is dtype and value.ndim == 1:
            return {"dt": code, "n": value.shape[0], "b": value.tobytes()}  # the common case: one copy, C order
        arr = np.asarray(value)
        if arr.ndim != 1:
            raise WireError("bad_field", f"`{name}` must be 1-D, got shape {arr.shape}")
        if arr.dtype != dtype:
            if arr.size == 0:
                arr = arr.astype(dtype)
            elif is_int and arr.dtype.kind in "iu":
                assert info is not None
                if arr.min() < info.min or arr.max() > info.max:
                    raise WireError("bad_dtype", f"`{name}` does not fit in {code}")
                arr = arr.astype(dtype)
            elif not is_int and arr.dtype.kind in "fiu":
                arr = arr.astype(dtype)
            else:
                raise WireError("bad_dtype", f"`{name}` must be {code}, got {arr.dtype}")
        return {"dt": code, "n": int(arr.shape[0]), "b": arr.tobytes()}

    def decode(value: Any, name: str) -> np.ndarray:
        if type(value) is not dict or len(value) != 3:
            raise _bad(name, 'an array map {"dt", "n", "b"}', value)
        dt, n, raw = value.get("dt"), value.get("n"), value.get("b")
        if type(dt) is not str or dt != code:
            raise WireError("bad_dtype", f"`{name}` must have dt={code!r}, got {dt!r}"[:200])
        if type(n) is not int or n < 0:
            raise WireError("bad_field", f"`{name}.n` must be an int >= 0")
        if n > MAX_TOKENS:
            raise WireError("oversized", f"`{name}` has {n} > {MAX_TOKENS} elements")
        if type(raw) is not bytes:
            raise _bad(name + ".b", "bytes", raw)
        if len(raw) != n * itemsize:
            raise WireError("length_mismatch", f"`{name}`: {len(raw)} bytes for n={n} of {code}")
        return np.frombuffer(raw, dtype=dtype)

    return _Kind(encode, decode)


def _list_kind(item: _Kind, what: str) -> _Kind:
    def encode(value: Any, name: str) -> list[Any]:
        if not isinstance(value, (list, tuple)):
            raise _bad(name, f"a list of {what}", value)
        if len(value) > MAX_GROUP:
            raise WireError("oversized", f"`{name}` has {len(value)} > {MAX_GROUP} items")
        return [item.encode(x, name) for x in value]

    def decode(value: Any, name: str) -> list[Any]:
        if type(value) is not list:
            raise _bad(name, f"a list of {what}", value)
        return [item.decode(x, name) for x in value]

    return _Kind(encode, decode)


def _enc_stats(value: Any, name: str) -> dict[str, float | int]:
    if not isinstance(value, dict):
        raise _bad(name, "a dict", value)
    if len(value) > MAX_MAP_LEN:
        raise WireError("oversized", f"`{name}` has {len(value)} > {MAX_MAP_LEN} entries")
    out: dict[str, float | int] = {}
    for key, number in value.items():
        if not isinstance(key, str):
            raise _bad(name + " key", "str", key)
        if isinstance(number, (bool, np.bool_, int, np.integer)):
            out[key] = int(number)
        else:
            out[key] = _enc_float(number, f"{name}[{key}]")
    return out


def _dec_stats(value: Any, name: str) -> dict[str, float | int]:
    if type(value) is not dict:
        raise _bad(name, "a map", value)
    for key, number in value.items():
        if type(key) is not str or type(number) not in (int, float):
            raise WireError("bad_field", f"`{name}` must map str to int or float")
    return value


STR = _Kind(_enc_str, _dec_str)
INT = _Kind(_enc_int, _dec_int)
NAT = _Kind(_enc_int, _dec_nat)
FINITE = _Kind(_enc_float, _dec_finite)
NONNEG = _Kind(_enc_float, _dec_nonneg_finite)
BOOL = _Kind(_enc_bool, _dec_bool)
I4 = _array_kind("i4")
F4 = _array_kind("f4")
STATS = _Kind(_enc_stats, _dec_stats)


def _struct_kind(cls: type, fields_: tuple[tuple[str, _Kind], ...], check: Callable[[Any], None] | None) -> _Kind:
    """A nested message: a map of exactly its fields."""
    names = frozenset(name for name, _ in fields_)
    encoders = tuple((fname, kind.encode) for fname, kind in fields_)
    decoders = tuple((fname, kind.decode) for fname, kind in fields_)

    def encode(value: Any, name: str) -> dict[str, Any]:
        if type(value) is not cls:
            raise _bad(name, cls.__name__, value)
        return {fname: field_encode(getattr(value, fname), fname) for fname, field_encode in encoders}

    def decode(value: Any, name: str) -> Any:
        if type(value) is not dict:
            raise _bad(name, f"a {cls.__name__} map", value)
        try:
            args = [field_decode(value[fname], fname) for fname, field_decode in decoders]
        except KeyError as err:
            raise WireError("bad_field", f"{cls.__name__}: missing field {err.args[0]!r}") from None
        if len(value) != len(fields_):
            extra = sorted(repr(k)[:40] for k in value if k not in names)
            raise WireError("bad_field", f"{cls.__name__}: unknown fields {', '.join(extra)}")
        obj = cls(*args)
        if check is not None:
            check(obj)
        return obj

    return _Kind(encode, decode)


def _check_trajectory(traj: Trajectory) -> None:
    """Cross-field checks of a decoded trajectory (dtypes and sizes are already checked)."""
    length = traj.response_ids.shape[0]
    if length == 0:
        raise WireError("empty_response", traj.uid[:100])
    if traj.behav_logp.shape[0] != length or traj.versions.shape[0] != length:
        raise WireError(
            "length_mismatch",
            f"{traj.uid[:100]}: response_ids {length}, behav_logp {traj.behav_logp.shape[0]}, "
            f"versions {traj.versions.shape[0]}",
        )
    logp = traj.behav_logp
    low, high = logp.min(), logp.max()  # NaN propagates, so one comparison pair checks finiteness and sign
    if not (low > -np.inf and high <= LOGP_TOLERANCE):
        if not np.isfinite(logp).all():
            raise WireError("nonfinite_logp", traj.uid[:100])
        raise WireError("positive_logp", f"{traj.uid[:100]}: max {float(high)}")
    # One reduction over the three int32 arrays (numpy's per-call overhead dominates at these sizes).
    ints = np.frombuffer(b"".join((traj.versions.data, traj.response_ids.data, traj.prompt_ids.data)), "<i4")
    if ints.min() < 0:
        if traj.versions.min() < 0:
            raise WireError("negative_version", traj.uid[:100])
        raise WireError("negative_token", traj.uid[:100])
    if traj.finish not in FINISH_REASONS:
        raise WireError("bad_finish", f"{traj.finish[:40]!r} not in {FINISH_REASONS}")


_TRAJECTORY_FIELDS = (
    ("uid", STR),
    ("group", STR),
    ("prompt_index", NAT),
    ("prompt_ids", I4),
    ("response_ids", I4),
    ("behav_logp", F4),
    ("versions", I4),
    ("reward", FINITE),
    ("correct", BOOL),
    ("finish", STR),
    ("worker", STR),
    ("t_start", FINITE),
    ("t_end", FINITE),
)
TRAJECTORY = _struct_kind(Trajectory, _TRAJECTORY_FIELDS, _check_trajectory)
_LEASE_FIELDS = (("group", STR), ("index", NAT), ("prompt", STR), ("answer", STR), ("deadline", FINITE))
LEASE = _struct_kind(PromptLease, _LEASE_FIELDS, None)
_I4 = np.dtype("<i4")
_F4 = np.dtype("<f4")


@dataclass(slots=True)
class _Scan:
    """What one pass of the fast path learns about a list of trajectory maps."""

    trajectories: list[Trajectory]  # empty unless asked for
    uids: list[str]
    groups: list[str]
    prompt_indices: list[int]
    rewards: list[float]
    versions: list[bytes]  # raw versions arrays, for the group's oldest / newest version


def _scan(items: Any, build: bool) -> _Scan | None:
    """Check a list of canonically encoded, valid trajectory maps with the fewest Python operations, or None.

    The fast path of the codec (a PushGroup or a BatchReply is mostly trajectories). It accepts exactly the maps that
    `encode` produces and that pass every check of the generic decoder (TRAJECTORY above): the same 13 fields with
    the same types, arrays of the fixed dtypes with `len(b) == n * itemsize` and `n <= MAX_TOKENS`, finite floats, a
    known finish, equal response lengths, and the value checks (finite log-probs <= LOGP_TOLERANCE, versions and
    token ids >= 0) done once per list on the concatenated raw bytes, so numpy's per-call overhead (microseconds) is
    paid once per group instead of once per array. Anything else, valid or not (an int reward, a NaN, a bad dtype),
    returns None and the caller runs the generic decoder, which accepts it or raises the precise WireError. The fast
    path can therefore only be faster, never more permissive; a differential fuzz test (tests/unit/asyncrl/
    test_wire.py) holds it to that. `build`: also make the Trajectory objects (zero-copy arrays).
    """
    if type(items) is not list or len(items) > MAX_GROUP:
        return None
    out = _Scan([], [], [], [], [], [])
    logps: list[bytes] = []
    ints: list[bytes] = []
    frombuffer = np.frombuffer
    for m in items:
        if type(m) is not dict or len(m) != 13:
            return None
        try:
            uid, group, index, finish, worker = m["uid"], m["group"], m["prompt_index"], m["finish"], m["worker"]
            reward, t_start, t_end, correct = m["reward"], m["t_start"], m["t_end"], m["correct"]
            pa, ra, la, va = m["prompt_ids"], m["response_ids"], m["behav_logp"], m["versions"]
            if not (type(pa) is type(ra) is type(la) is type(va) is dict):
                return None
            pb, rb, lb, vb = pa["b"], ra["b"], la["b"], va["b"]
            pn, rn, ln, vn = pa["n"], ra["n"], la["n"], va["n"]
            pd, rd, ld, vd = pa["dt"], ra["dt"], la["dt"], va["dt"]
        except KeyError:
            return None
        if not (
            type(uid) is type(group) is type(finish) is type(worker) is str
            and type(index) is int
            and index >= 0
            and type(reward) is type(t_start) is type(t_end) is float
            and reward - reward == 0.0  # finite: inf - inf and nan - nan are nan
            and t_start - t_start == 0.0
            and t_end - t_end == 0.0
            and type(correct) is bool
            and finish in FINISH_REASONS
            and len(pa) == len(ra) == len(la) == len(va) == 3
            and type(pb) is type(rb) is type(lb) is type(vb) is bytes
            and type(pn) is type(rn) is type(ln) is type(vn) is int
            and pd == rd == vd == "i4"
            and ld == "f4"
            and 0 < rn == ln == vn <= MAX_TOKENS
            and pn <= MAX_TOKENS
            and len(pb) == 4 * pn
            and len(rb) == len(lb) == len(vb) == 4 * rn
        ):
            return None
        logps.append(lb)
        ints += (pb, rb, vb)
        out.versions.append(vb)
        out.uids.append(uid)
        out.groups.append(group)
        out.prompt_indices.append(index)
        out.rewards.append(reward)
        if build:
            out.trajectories.append(
                Trajectory(
                    uid,
                    group,
                    index,
                    frombuffer(pb, _I4),
                    frombuffer(rb, _I4),
                    frombuffer(lb, _F4),
                    frombuffer(vb, _I4),
                    reward,
                    correct,
                    finish,
                    worker,
                    t_start,
                    t_end,
                )  # fmt: skip
            )
    if logps:
        logp = frombuffer(b"".join(logps), _F4)
        if not (logp.min() > -np.inf and logp.max() <= LOGP_TOLERANCE):  # NaN fails both comparisons
            return None
        if frombuffer(b"".join(ints), _I4).min() < 0:
            return None
    return out


def _trajectories_kind() -> _Kind:
    generic = _list_kind(TRAJECTORY, "Trajectory")

    def decode(value: Any, name: str) -> list[Trajectory]:
        fast = _scan(value, build=True)
        return fast.trajectories if fast is not None else generic.decode(value, name)

    return _Kind(generic.encode, decode)


TRAJECTORIES = _trajectories_kind()

_SCHEMAS: dict[type, tuple[tuple[str, _Kind], ...]] = {
    Trajectory: _TRAJECTORY_FIELDS,
    PromptLease: _LEASE_FIELDS,
    LeaseRequest: (("worker", STR), ("max_groups", NAT)),
    LeaseReply: (("leases", _list_kind(LEASE, "PromptLease")), ("retry_after_s", NONNEG)),
    PushGroup: (("worker", STR), ("group", STR), ("trajectories", TRAJECTORIES)),
    PushReply: (("accepted", BOOL), ("reason", STR)),
    FetchBatch: (("step", NAT), ("num_groups", NAT), ("wait_s", NONNEG)),
    BatchReply: (
        ("step", NAT),
        ("groups", _list_kind(TRAJECTORIES, "groups")),
        ("dropped_stale", NAT),
        ("ready", BOOL),
    ),
    StatsRequest: (),
    StatsReply: (("stats", STATS),),
    SetMaxLag: (("max_lag", NAT),),
    ErrorReply: (("reason", STR), ("detail", STR)),
}
_CHECKS: dict[type, Callable[[Any], None]] = {Trajectory: _check_trajectory}
_BY_NAME: dict[str, tuple[type, _Kind]] = {
    cls.__name__: (cls, _struct_kind(cls, fields_, _CHECKS.get(cls))) for cls, fields_ in _SCHEMAS.items()
}
MESSAGE_TYPES: tuple[type, ...] = tuple(_SCHEMAS)

_UNPACK_LIMITS = {
    "max_str_len": MAX_STR_BYTES,
    "max_bin_len": MAX_TOKENS * 4,
    "max_array_len": MAX_GROUP,
    "max_map_len": MAX_MAP_LEN,
    "max_ext_len": 0,
}


def encode(msg: Message) -> bytes:
    """Serialize one message to msgpack bytes; raises WireError if a field has a type the schema cannot carry.

    Arrays of another integer / float dtype are converted to the schema's dtype (integers only if they fit).
    Semantic checks (finite log-probs, lengths, ...) happen in `decode`, on the receiving side.
    """
    entry = _BY_NAME.get(type(msg).__name__)
    if entry is None or entry[0] is not type(msg):
        raise WireError("unknown_type", f"cannot encode {type(msg).__name__}")
    payload: dict[str, Any] = {"v": SCHEMA_VERSION, "type": type(msg).__name__}
    payload.update(entry[1].encode(msg, type(msg).__name__))
    data = msgpack.packb(payload, use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError("oversized", f"{len(data)} bytes > {MAX_MESSAGE_BYTES}")
    return data


def _unpack(data: bytes | bytearray | memoryview) -> tuple[str, dict[str, Any]]:
    """msgpack-unpack one message within the MAX_* bounds; (type name, fields without "v" and "type")."""
    try:
        size = memoryview(data).nbytes
    except TypeError:
        raise WireError("bad_msgpack", f"expected bytes, got {type(data).__name__}") from None
    if size > MAX_MESSAGE_BYTES:
        raise WireError("oversized", f"{size} bytes > {MAX_MESSAGE_BYTES}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True, **_UNPACK_LIMITS)
    except ValueError as err:
        text = str(err)  # msgpack says "<n> exceeds max_<kind>_len(<limit>)"; ext types are not in our format at all
        reason = "oversized" if "exceeds max" in text and "max_ext_len" not in text else "bad_msgpack"
        raise WireError(reason, text[:200]) from None
    except Exception as err:  # msgpack raises a few non-ValueError types on garbage
        raise WireError("bad_msgpack", f"{type(err).__name__}: {err}"[:200]) from None
    if type(obj) is not dict:
        raise WireError("bad_msgpack", f"top level must be a map, got {type(obj).__name__}")
    version = obj.pop("v", None)
    if type(version) is not int or version != SCHEMA_VERSION:
        raise WireError("schema_version", f"got {version!r}, expected {SCHEMA_VERSION}"[:200])
    name = obj.pop("type", None)
    if type(name) is not str or name not in _BY_NAME:
        raise WireError("unknown_type", repr(name)[:100])
    return name, obj


def _decode_fields(name: str, obj: dict[str, Any]) -> Message:
    try:
        if name == "Trajectory":
            fast = _scan([obj], build=True)
            if fast is not None:
                return fast.trajectories[0]
        return _BY_NAME[name][1].decode(obj, name)
    except WireError:
        raise
    except Exception as err:  # a safety net: validation above should make this unreachable
        raise WireError("bad_field", f"{type(err).__name__}: {err}"[:200]) from None


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Parse and validate one message; raises WireError (and nothing else) on any malformed input."""
    name, obj = _unpack(data)
    return _decode_fields(name, obj)


# ---------------------------------------------------------------------------------------------------------------
# The buffer's ingest path: a PushGroup validated exactly like `decode` does, then kept as its encoded bytes, so the
# buffer never builds Trajectory objects, never holds thousands of small Python objects per group, and hands groups
# to the learner by copying the msgpack bytes of their trajectory arrays into the BatchReply.


@dataclass(slots=True)
class CheckedPush:
    """A PushGroup that passed every check of `decode`, as the buffer keeps it. Producer: `decode_request`.

    `payload` is the validated PushGroup in `encode`'s layout (the bytes received, or their canonical re-encoding if
    they were valid but laid out otherwise); its msgpack array of trajectories starts at `trajectories_at` and runs
    to the end. The per-trajectory lists are in trajectory order. `oldest_version` / `newest_version`: min / max
    over all tokens (0 for an empty group).
    """

    worker: str
    group: str
    payload: bytes | memoryview
    trajectories_at: int
    uids: list[str]
    trajectory_groups: list[str]
    prompt_indices: list[int]
    rewards: list[float]
    oldest_version: int
    newest_version: int


_TRAJECTORIES_KEY = b"\xactrajectories"  # msgpack fixstr "trajectories"
_FIXED_SIZES = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}
_FIXED_SIZES.update({0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8})  # nil, false, true, floats, uints, ints: payload bytes
_STR_WIDTHS = {0xD9: 1, 0xDA: 2, 0xDB: 4}  # str8/16/32: bytes of the length


def _skip_scalar(view: memoryview, at: int) -> int | None:
    """The offset after the msgpack int, float, bool, nil or str at `at`; None for any other type."""
    if at >= len(view):
        return None
    head = view[at]
    if head <= 0x7F or head >= 0xE0:  # positive / negative fixint
        return at + 1
    if 0xA0 <= head <= 0xBF:  # fixstr
        return at + 1 + (head & 0x1F)
    if head in _FIXED_SIZES:
        return at + 1 + _FIXED_SIZES[head]
    width = _STR_WIDTHS.get(head)
    if width is None:
        return None
    return at + 1 + width + int.from_bytes(view[at + 1 : at + 1 + width], "big")


def _trajectories_at(data: bytes | memoryview, count: int) -> int | None:
    """Where the array of `count` trajectories starts in a valid PushGroup laid out as `encode` writes it: a map of
    5 entries whose last key is "trajectories" (its value then runs to the end: msgpack refused trailing bytes). None
    for any other layout (the caller re-encodes)."""
    view = memoryview(data).cast("B")
    if not view.nbytes or view[0] != 0x85:
        return None
    at: int | None = 1
    for _ in range(8):  # the 4 other keys and their values: v, type, worker, group (str and int only)
        at = _skip_scalar(view, at)
        if at is None:
            return None
    if view[at : at + len(_TRAJECTORIES_KEY)] != _TRAJECTORIES_KEY:
        return None
    at += len(_TRAJECTORIES_KEY)
    if at >= view.nbytes:
        return None
    head = view[at]
    if head & 0xF0 == 0x90:  # fixarray
        found = head & 0x0F
    elif head in (0xDC, 0xDD):  # array16 / array32
        found = int.from_bytes(view[at + 1 : at + (3 if head == 0xDC else 5)], "big")
    else:
        return None
    return at if found == count else None


def _checked_push(obj: dict[str, Any], data: bytes | memoryview) -> CheckedPush | None:
    if len(obj) != 3:
        return None
    worker, group, maps = obj.get("worker"), obj.get("group"), obj.get("trajectories")
    if type(worker) is not str or type(group) is not str:
        return None
    scan = _scan(maps, build=False)
    if scan is None:
        return None
    assert type(maps) is list
    at = _trajectories_at(data, len(maps))
    if at is None:
        return None
    oldest = newest = 0
    if scan.versions:
        versions = np.frombuffer(b"".join(scan.versions), _I4)
        oldest, newest = int(versions.min()), int(versions.max())
    return CheckedPush(
        worker, group, data, at, scan.uids, scan.groups, scan.prompt_indices, scan.rewards, oldest, newest
    )  # fmt: skip


def decode_request(data: bytes | bytearray | memoryview) -> Message | CheckedPush:
    """`decode`, except that a valid PushGroup comes back as a CheckedPush (same validation, no Trajectory objects).

    A PushGroup that is valid but not canonically encoded (an int where `encode` writes a float, fields in another
    order) is accepted too: it is decoded generically and its canonical re-encoding becomes the payload.
    """
    name, obj = _unpack(data)
    if name == "PushGroup":
        checked = _checked_push(obj, data if isinstance(data, bytes | memoryview) else bytes(data))
        if checked is not None:
            return checked
        msg = _decode_fields(name, obj)  # raises the precise WireError, or the message was valid after all
        canonical = encode(msg)
        checked = _checked_push(_unpack(canonical)[1], canonical)
        assert checked is not None, "a decoded PushGroup re-encodes canonically"
        return checked
    return _decode_fields(name, obj)


def encode_batch_reply(step: int, groups: list[bytes | memoryview], dropped_stale: int, ready: bool) -> bytes:
    """A BatchReply whose groups are msgpack arrays of trajectories, already encoded and valid (the
    `CheckedPush.payload[trajectories_at:]` of each group): copied in as they are, never decoded again."""
    if len(groups) > MAX_GROUP:
        raise WireError("oversized", f"`groups` has {len(groups)} > {MAX_GROUP} items")
    pack = msgpack.Packer(use_bin_type=True)
    head = [pack.pack_map_header(6)]
    for key, value in (("v", SCHEMA_VERSION), ("type", "BatchReply"), ("step", _dec_nat(step, "step"))):
        head += (pack.pack(key), pack.pack(value))
    tail = [pack.pack("dropped_stale"), pack.pack(_dec_nat(dropped_stale, "dropped_stale"))]
    tail += (pack.pack("ready"), pack.pack(_dec_bool(ready, "ready")))
    data = b"".join([*head, pack.pack("groups"), pack.pack_array_header(len(groups)), *groups, *tail])
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError("oversized", f"{len(data)} bytes > {MAX_MESSAGE_BYTES}")
    return data
