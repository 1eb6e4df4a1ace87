"""Every message that crosses a process boundary, defined once, and its msgpack codec.

A message on the wire is one msgpack map: `{"v": SCHEMA_VERSION, "type": "<class name>", <field>: <value>, ...}`.
Nested structures (a lease inside a `LeaseReply`) are maps of their fields without `v`/`type`. Numpy arrays travel
as `{"dt": "i4" | "f4", "n": <length>, "b": <raw little-endian bytes>}`; `decode` turns them back with
`np.frombuffer`, without copying, so decoded arrays are READ-ONLY views of the received frame (copy before writing
into them).

A group of trajectories (`PushGroup.trajectories`, each of `BatchReply.groups`) travels as columns, one map of the
15 GROUP_COLUMNS for the whole group, so that a receiver checks a group with a few numpy reductions instead of
hundreds of small objects (schema version 2; version 1 sent a map per trajectory):

| column | msgpack type | content, for n trajectories |
|---|---|---|
| `uid`, `group`, `finish`, `worker` | array of n str | the Trajectory fields |
| `prompt_index` | bin, n x int64 LE | |
| `reward`, `t_start`, `t_end` | bin, n x float64 LE | |
| `correct` | bin, n x uint8 | 0 or 1 |
| `prompt_len`, `response_len` | bin, n x int32 LE | tokens of each trajectory's prompt / response |
| `prompt_ids` | bin, int32 LE | the prompts, concatenated (sum of prompt_len) |
| `response_ids`, `versions` / `behav_logp` | bin, int32 / float32 LE | the responses, concatenated |

Decoded, a group is a list of Trajectory whose arrays are read-only views of those columns. A single `Trajectory`
message keeps the per-field map with array maps.

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
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import msgpack
import numpy as np

SCHEMA_VERSION = 2
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
MAX_ID_CHARS = 256
"""Longest id: a worker, group or trajectory uid (they key the buffer's lease and heartbeat tables)."""
MAX_STEP = 2**31 - 1
"""Largest train step or staleness.max_lag a message may carry (the buffer's throttle arithmetic stays in 64 bits)."""
MAX_WAIT_S = 3600.0
"""Longest FetchBatch.wait_s: how long the buffer may park a fetch."""
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


def _dec_id(value: Any, name: str) -> str:
    if type(value) is not str:
        raise _bad(name, "str", value)
    if len(value) > MAX_ID_CHARS:
        raise WireError("oversized", f"`{name}` has {len(value)} > {MAX_ID_CHARS} characters")
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


def _dec_step(value: Any, name: str) -> int:
    if type(value) is not int or not 0 <= value <= MAX_STEP:
        raise WireError("bad_field", f"`{name}` must be an int in [0, {MAX_STEP}], got {value!r}"[:200])
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


def _dec_wait(value: Any, name: str) -> float:
    value = _dec_nonneg_finite(value, name)
    if value > MAX_WAIT_S:
        raise WireError("bad_field", f"`{name}` must be at most {MAX_WAIT_S} s")
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


def list_kind(item: _Kind, what: str) -> _Kind:
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
ID = _Kind(_enc_str, _dec_id)
STEP = _Kind(_enc_int, _dec_step)
WAIT = _Kind(_enc_float, _dec_wait)
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
    ("uid", ID),
    ("group", ID),
    ("prompt_index", NAT),
    ("prompt_ids", I4),
    ("response_ids", I4),
    ("behav_logp", F4),
    ("versions", I4),
    ("reward", FINITE),
    ("correct", BOOL),
    ("finish", STR),
    ("worker", ID),
    ("t_start", FINITE),
    ("t_end", FINITE),
)
TRAJECTORY = _struct_kind(Trajectory, _TRAJECTORY_FIELDS, _check_trajectory)
_LEASE_FIELDS = (("group", ID), ("index", NAT), ("prompt", STR), ("answer", STR), ("deadline", FINITE))
LEASE = _struct_kind(PromptLease, _LEASE_FIELDS, None)
_I4 = np.dtype("<i4")
_F4 = np.dtype("<f4")
_MIN, _MAX, _OR = np.minimum.reduce, np.maximum.reduce, np.bitwise_or.reduce
_FINISH_SET = frozenset(FINISH_REASONS)
_TEXT_COLUMNS = ("uid", "group", "finish", "worker")
_SCALAR_COLUMNS = (  # one value per trajectory: (column, little-endian struct code, bytes per value)
    ("prompt_index", "q", 8),
    ("reward", "d", 8),
    ("correct", "B", 1),
    ("t_start", "d", 8),
    ("t_end", "d", 8),
    ("prompt_len", "i", 4),
    ("response_len", "i", 4),
)
_TOKEN_COLUMNS = (  # concatenated arrays: (column, dtype, the length column giving each trajectory's share)
    ("prompt_ids", _I4, "prompt_len"),
    ("response_ids", _I4, "response_len"),
    ("behav_logp", _F4, "response_len"),
    ("versions", _I4, "response_len"),
)
GROUP_COLUMNS = (*_TEXT_COLUMNS, *(c for c, _, _ in _SCALAR_COLUMNS), *(c for c, _, _ in _TOKEN_COLUMNS))
"""The keys of a group of trajectories on the wire, in `encode`'s order (see `_encode_group`)."""
_GROUP_KEYS = frozenset(GROUP_COLUMNS)


@dataclass(slots=True)
class _Group:
    """The checked columns of a group of trajectories: Python values for the per-trajectory columns, read-only numpy
    views of the received bytes for the token columns."""

    uid: list[str]
    group: list[str]
    finish: list[str]
    worker: list[str]
    prompt_index: tuple[int, ...]
    reward: tuple[float, ...]
    correct: bytes
    t_start: tuple[float, ...]
    t_end: tuple[float, ...]
    prompt_len: tuple[int, ...]
    response_len: tuple[int, ...]
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    behav_logp: np.ndarray
    versions: np.ndarray
    oldest_version: int  # min over all tokens (0 for an empty group)
    newest_version: int  # max over all tokens (0 for an empty group)

    def trajectories(self) -> list[Trajectory]:
        out = []
        prompt_at = response_at = 0
        for uid, group, finish, worker, index, reward, correct, t_start, t_end, plen, rlen in zip(
            self.uid, self.group, self.finish, self.worker, self.prompt_index, self.reward, self.correct,
            self.t_start, self.t_end, self.prompt_len, self.response_len, strict=True,
        ):  # fmt: skip
            end = response_at + rlen
            out.append(
                Trajectory(
                    uid,
                    group,
                    index,
                    self.prompt_ids[prompt_at : prompt_at + plen],
                    self.response_ids[response_at:end],
                    self.behav_logp[response_at:end],
                    self.versions[response_at:end],
                    reward,
                    correct == 1,
                    finish,
                    worker,
                    t_start,
                    t_end,
                )  # fmt: skip
            )
            prompt_at, response_at = prompt_at + plen, end
        return out


def _encode_group(value: Any, name: str) -> dict[str, Any]:
    """A list of Trajectory as one map of columns (the layout is in the module docstring)."""
    if not isinstance(value, (list, tuple)):
        raise _bad(name, "a list of Trajectory", value)
    if len(value) > MAX_GROUP:
        raise WireError("oversized", f"`{name}` has {len(value)} > {MAX_GROUP} items")
    rows = [TRAJECTORY.encode(traj, name) for traj in value]  # every field checked and converted as for one
    out: dict[str, Any] = {column: [row[column] for row in rows] for column in _TEXT_COLUMNS}
    lengths = {
        "prompt_len": [row["prompt_ids"]["n"] for row in rows],
        "response_len": [row["response_ids"]["n"] for row in rows],
    }
    for column, code, _ in _SCALAR_COLUMNS:
        values = lengths.get(column) or [row[column] for row in rows]
        try:
            out[column] = struct.pack(f"<{len(values)}{code}", *values)
        except struct.error as err:  # an int beyond the column's width
            raise WireError("bad_field", f"`{column}`: {err}") from None
    for column, _, _ in _TOKEN_COLUMNS:
        out[column] = b"".join(row[column]["b"] for row in rows)
    return out


def _bytes_column(value: dict[str, Any], column: str, itemsize: int, count: int) -> bytes:
    raw = value[column]
    if type(raw) is not bytes:
        raise _bad(column, "bytes", raw)
    if len(raw) != count * itemsize:
        raise WireError("length_mismatch", f"`{column}`: {len(raw)} bytes for {count} values of {itemsize} bytes")
    return raw


def check_group(value: Any, name: str) -> _Group:
    """Validate a group of trajectories in its column layout: every check `decode` makes of a single Trajectory
    holds for each. Per-trajectory columns are checked in Python (a handful of values), token columns with one
    numpy reduction per check over the whole group (numpy's per-call cost, not the data, dominates here)."""
    if type(value) is not dict:
        raise _bad(name, "a map of trajectory columns", value)
    if value.keys() != _GROUP_KEYS:
        missing = sorted(_GROUP_KEYS - value.keys())
        extra = sorted(repr(k)[:40] for k in value.keys() - _GROUP_KEYS)
        raise WireError("bad_field", f"`{name}`: missing columns {missing}, unknown columns {extra}"[:300])
    texts = []
    for column in _TEXT_COLUMNS:
        items = value[column]
        if type(items) is not list:
            raise _bad(column, "a list of str", items)
        try:  # unpacked msgpack holds exact types only, so join succeeds iff every item is a str
            "".join(items)
        except TypeError:
            raise _bad(column, "a list of str", items) from None
        if column != "finish" and items and max(map(len, items)) > MAX_ID_CHARS:
            raise WireError("oversized", f"`{column}`: an id of more than {MAX_ID_CHARS} characters")
        texts.append(items)
    count = len(texts[0])
    if any(len(items) != count for items in texts):
        raise WireError("length_mismatch", f"`{name}`: text columns of {[len(t) for t in texts]} items")
    uid0 = texts[0][0][:100] if count else ""
    scalars: dict[str, Any] = {}
    for column, code, itemsize in _SCALAR_COLUMNS:
        raw = _bytes_column(value, column, itemsize, count)
        scalars[column] = raw if code == "B" else struct.unpack(f"<{count}{code}", raw)
    if count:
        if min(scalars["prompt_index"]) < 0:
            raise WireError("bad_field", f"`prompt_index` must be an int >= 0 ({uid0})")
        if not all(map(math.isfinite, scalars["reward"])):
            raise WireError("nonfinite_reward", uid0)
        if not (all(map(math.isfinite, scalars["t_start"])) and all(map(math.isfinite, scalars["t_end"]))):
            raise WireError("bad_field", f"`t_start` and `t_end` must be finite ({uid0})")
        if max(scalars["correct"]) > 1:
            raise WireError("bad_field", f"`correct` must be 0 or 1 ({uid0})")
        if not _FINISH_SET.issuperset(texts[2]):
            bad = next(f for f in texts[2] if f not in _FINISH_SET)
            raise WireError("bad_finish", f"{bad[:40]!r} not in {FINISH_REASONS}")
        lens = scalars["prompt_len"] + scalars["response_len"]
        if min(lens) < 0:
            raise WireError("bad_field", f"`{name}`: a negative prompt_len or response_len ({uid0})")
        if max(lens) > MAX_TOKENS:
            raise WireError("oversized", f"`{name}`: a trajectory of more than {MAX_TOKENS} tokens ({uid0})")
        if min(scalars["response_len"]) == 0:
            raise WireError("empty_response", texts[0][scalars["response_len"].index(0)][:100])
    tokens = {
        column: np.frombuffer(_bytes_column(value, column, 4, sum(scalars[length_column])), dtype)
        for column, dtype, length_column in _TOKEN_COLUMNS
    }
    oldest = newest = 0
    if count:
        logp = tokens["behav_logp"]
        low, high = float(_MIN(logp)), float(_MAX(logp))  # NaN propagates: two comparisons check finite and sign
        if not (low > -math.inf and high <= LOGP_TOLERANCE):
            if not np.isfinite(logp).all():
                raise WireError("nonfinite_logp", uid0)
            raise WireError("positive_logp", f"{uid0}: max {high}")
        versions = tokens["versions"]
        oldest, newest = int(_MIN(versions)), int(_MAX(versions))
        if oldest < 0:
            raise WireError("negative_version", uid0)
        prompts = tokens["prompt_ids"]
        if int(_OR(tokens["response_ids"])) < 0 or (prompts.size and int(_OR(prompts)) < 0):
            raise WireError("negative_token", uid0)  # a negative int32 has the sign bit, so their OR is negative
    return _Group(*texts, **scalars, **tokens, oldest_version=oldest, newest_version=newest)


def _group_kind() -> _Kind:
    def decode(value: Any, name: str) -> list[Trajectory]:
        return check_group(value, name).trajectories()

    return _Kind(_encode_group, decode)


TRAJECTORIES = _group_kind()

_SCHEMAS: dict[type, tuple[tuple[str, _Kind], ...]] = {
    Trajectory: _TRAJECTORY_FIELDS,
    PromptLease: _LEASE_FIELDS,
    LeaseRequest: (("worker", ID), ("max_groups", NAT)),
    LeaseReply: (("leases", list_kind(LEASE, "PromptLease")), ("retry_after_s", NONNEG)),
    PushGroup: (("worker", ID), ("group", ID), ("trajectories", TRAJECTORIES)),
    PushReply: (("accepted", BOOL), ("reason", STR)),
    FetchBatch: (("step", STEP), ("num_groups", NAT), ("wait_s", WAIT)),
    BatchReply: (
        ("step", STEP),
        ("groups", list_kind(TRAJECTORIES, "groups")),
        ("dropped_stale", NAT),
        ("ready", BOOL),
    ),
    StatsRequest: (),
    StatsReply: (("stats", STATS),),
    SetMaxLag: (("max_lag", STEP),),
    ErrorReply: (("reason", STR), ("detail", STR)),
}
_CHECKS: dict[type, Callable[[Any], None]] = {Trajectory: _check_trajectory}
_BY_NAME: dict[str, tuple[type, _Kind]] = {
    cls.__name__: (cls, _struct_kind(cls, fields_, _CHECKS.get(cls))) for cls, fields_ in _SCHEMAS.items()
}
MESSAGE_TYPES: tuple[type, ...] = tuple(_SCHEMAS)

UNPACK_LIMITS = {
    "max_str_len": MAX_STR_BYTES,
    "max_bin_len": MAX_MESSAGE_BYTES,  # a group's token columns; each array's own bound is checked on decode
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


def unpack_message(data: bytes | bytearray | memoryview) -> tuple[str, dict[str, Any]]:
    """msgpack-unpack one message within the MAX_* bounds; (type name, fields without "v" and "type")."""
    try:
        size = memoryview(data).nbytes
    except TypeError:
        raise WireError("bad_msgpack", f"expected bytes, got {type(data).__name__}") from None
    if size > MAX_MESSAGE_BYTES:
        raise WireError("oversized", f"{size} bytes > {MAX_MESSAGE_BYTES}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True, **UNPACK_LIMITS)
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


def decode_fields(name: str, obj: dict[str, Any]) -> Message:
    try:
        return _BY_NAME[name][1].decode(obj, name)
    except WireError:
        raise
    except Exception as err:  # a safety net: validation above should make this unreachable
        raise WireError("bad_field", f"{type(err).__name__}: {err}"[:200]) from None


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Parse and validate one message; raises WireError (and nothing else) on any malformed input."""
    name, obj = unpack_message(data)
    return decode_fields(name, obj)
