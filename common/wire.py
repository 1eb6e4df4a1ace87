"""Every message that crosses a process boundary, defined once, and its msgpack codec.

A message on the wire is one msgpack map: `{"v": SCHEMA_VERSION, "type": "<class name>", <field>: <value>, ...}`.
Nested structures (a lease inside a `LeaseReply`) are maps of their fields without `v`/`type`. Numpy arrays travel
as `{"dt": "i4" | "f4", "n": <length>, "b": <raw little-endian bytes>}`; `decode` turns them back with
`np.frombuffer`, without copying, so decoded arrays are READ-ONLY views of the received frame (copy before writing
into them).

A group of trajectories (`PushGroup.trajectories`, each of `BatchReply.groups`) travels as columns, one map of the
17 GROUP_COLUMNS for the whole group, so that a receiver checks a group with a few numpy reductions instead of
hundreds of small objects (schema version 3; version 2 had no loss mask, version 1 sent a map per trajectory):

| column | msgpack type | content, for n trajectories |
|---|---|---|
| `uid`, `group`, `finish`, `worker` | array of n str | the Trajectory fields |
| `prompt_index` | bin, n x int64 LE | |
| `reward`, `t_start`, `t_end` | bin, n x float64 LE | |
| `correct` | bin, n x uint8 | 0 or 1 |
| `prompt_len`, `response_len` | bin, n x int32 LE | tokens of each trajectory's prompt / response |
| `prompt_ids` | bin, int32 LE | the prompts, concatenated (sum of prompt_len) |
| `response_ids`, `versions` / `behav_logp` | bin, int32 / float32 LE | the responses, concatenated |
| `mask_len` | bin, n x int32 LE | 0 (no mask: every response token is a model token) or response_len |
| `loss_mask` | bin, uint8 | the masks of the trajectories that have one, concatenated (sum of mask_len) |

The loss mask (schema 3) marks which response tokens the model sampled (1: trained) and which an environment
appended (0: observations and chat-template tokens of a multi-turn episode, context only). A masked token's
`behav_logp` carries no behaviour log-prob (the worker writes 0.0) and its `versions` entry is the weight version
current when it was appended, never older than the model tokens before it, so `min(versions)` (staleness) is the
oldest model token's version. A single-turn trajectory has no mask (`loss_mask=None`, `mask_len` 0): its wire
is 4 bytes per trajectory larger than schema 2's, and the single-turn path is unchanged.

Decoded, a group is a list of Trajectory whose arrays are read-only views of those columns. A single `Trajectory`
message keeps the per-field map with array maps.

`decode` trusts nothing: every field must be present with exactly its type (a bool is not an int), arrays must
have the dtype the schema fixes for that field and `len(b) == n * itemsize`, sizes are bounded (`MAX_*`) before and
while unpacking, and trajectories are checked for internal consistency. Anything else raises `WireError` with a
short `reason` code that services count as `rejected_<reason>`; malformed input never raises anything else.
Encoding never uses pickle; neither does any other message between a run's services (actor calls of the same run
do: docs/security.md).

| message | producer | consumer | reply |
|---|---|---|---|
| `LeaseRequest` | rollout worker | buffer | `LeaseReply` |
| `PushGroup` | rollout worker | buffer | `PushReply` |
| `WorkerLeaving` | rollout worker (stopping) | buffer | `LeaseReply` (empty) |
| `FetchBatch` | learner | buffer | `BatchReply` |
| `StatsRequest`, `SetMaxLag` | driver / CLI | buffer | `StatsReply` |
| any malformed or unexpected request | anyone | buffer | `ErrorReply` |

Bump `SCHEMA_VERSION` on any change to a field; peers with another version are rejected (`schema_version`). A new
message type leaves the version as it is: a peer without it answers `unknown_type` (a stopping worker whose
`WorkerLeaving` is refused so leaves its leases to `buffer.worker_timeout_s`, as before the type existed).

Layout: this module holds the message types, their schemas and `encode` / `decode`; the bounds, reject reasons and
field kinds are in `common.wire_kinds`, the group column codec in `common.wire_columns`. Every public name of those
two is re-exported here: import from `common.wire`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import msgpack
import numpy as np

from common.wire_columns import GROUP_COLUMNS, check_group, group_kind
from common.wire_kinds import (
    BOOL,
    F4,
    FINISH_REASONS,
    FINITE,
    I4,
    ID,
    INT,
    LOGP_TOLERANCE,
    MASK,
    MAX_GROUP,
    MAX_ID_CHARS,
    MAX_MAP_LEN,
    MAX_MESSAGE_BYTES,
    MAX_STEP,
    MAX_STR_BYTES,
    MAX_TOKENS,
    MAX_WAIT_S,
    NAT,
    NONNEG,
    STATS,
    STEP,
    STR,
    U1,
    WAIT,
    WIRE_REASONS,
    Kind,
    WireError,
    list_kind,
    struct_kind,
)

__all__ = [
    "BOOL",
    "F4",
    "FINISH_REASONS",
    "FINITE",
    "GROUP_COLUMNS",
    "I4",
    "ID",
    "INT",
    "LEASE",
    "LOGP_TOLERANCE",
    "MAX_GROUP",
    "MAX_ID_CHARS",
    "MAX_MAP_LEN",
    "MAX_MESSAGE_BYTES",
    "MAX_STEP",
    "MAX_STR_BYTES",
    "MAX_TOKENS",
    "MAX_WAIT_S",
    "MESSAGE_TYPES",
    "NAT",
    "NONNEG",
    "SCHEMA_VERSION",
    "STATS",
    "STEP",
    "STR",
    "TRAJECTORIES",
    "TRAJECTORY",
    "U1",
    "UNPACK_LIMITS",
    "WAIT",
    "WIRE_REASONS",
    "BatchReply",
    "ErrorReply",
    "FetchBatch",
    "LeaseReply",
    "LeaseRequest",
    "Message",
    "PromptLease",
    "PushGroup",
    "PushReply",
    "SetMaxLag",
    "StatsReply",
    "StatsRequest",
    "Trajectory",
    "WireError",
    "WorkerLeaving",
    "check_group",
    "decode",
    "decode_fields",
    "encode",
    "list_kind",
    "model_token_mask",
    "unpack_message",
]

SCHEMA_VERSION = 3
_SCHEMA_HISTORY = {1: "a map per trajectory", 2: "no per-token loss mask"}
"""What each older schema lacked, for the refusal message (journals of both are upgraded: buffer.ingest)."""

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
    loss_mask: np.ndarray | None = None  # uint8 (T,) 1 on model tokens, 0 on observation tokens; None: all model


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
class WorkerLeaving:
    """A worker stops (scaled away, or the run ends): the buffer returns its unfinished leases to the pool now and
    stops tracking its heartbeats, so it is not declared dead later; answered with an empty LeaseReply.
    Producer: rollout worker. Consumer: buffer."""

    worker: str


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
    | WorkerLeaving
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
# Schemas: the fields of each message, in encode's order, with their kinds (common.wire_kinds).


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
    if traj.loss_mask is not None:
        check_mask(traj.loss_mask, length, traj.uid)


def check_mask(mask: np.ndarray, length: int, uid: str) -> None:
    """A loss mask of `length` response tokens: 0 / 1 values with at least one model token, else `bad_mask`."""
    if mask.shape[0] != length:
        raise WireError("bad_mask", f"{uid[:100]}: loss_mask of {mask.shape[0]} tokens for {length} response tokens")
    if int(mask.max()) > 1 or int(mask.max()) == 0:
        raise WireError("bad_mask", f"{uid[:100]}: loss_mask must hold 0 / 1 with at least one 1")


def model_token_mask(traj: Trajectory) -> np.ndarray:
    """The trajectory's loss mask as a bool array (all True when it has none)."""
    if traj.loss_mask is None:
        return np.ones(traj.response_ids.shape[0], dtype=bool)
    return traj.loss_mask.astype(bool)


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
    ("loss_mask", MASK),
)
TRAJECTORY = struct_kind(Trajectory, _TRAJECTORY_FIELDS, _check_trajectory)
_LEASE_FIELDS = (("group", ID), ("index", NAT), ("prompt", STR), ("answer", STR), ("deadline", FINITE))
LEASE = struct_kind(PromptLease, _LEASE_FIELDS, None)

TRAJECTORIES = group_kind(TRAJECTORY, Trajectory)

_SCHEMAS: dict[type, tuple[tuple[str, Kind], ...]] = {
    Trajectory: _TRAJECTORY_FIELDS,
    PromptLease: _LEASE_FIELDS,
    LeaseRequest: (("worker", ID), ("max_groups", NAT)),
    LeaseReply: (("leases", list_kind(LEASE, "PromptLease")), ("retry_after_s", NONNEG)),
    WorkerLeaving: (("worker", ID),),
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
_BY_NAME: dict[str, tuple[type, Kind]] = {
    cls.__name__: (cls, struct_kind(cls, fields_, _CHECKS.get(cls))) for cls, fields_ in _SCHEMAS.items()
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
        old = _SCHEMA_HISTORY.get(version) if type(version) is int else None
        lacks = f" (schema {version} has {old}; upgrade the peer)" if old else ""
        raise WireError("schema_version", f"got {version!r}, expected {SCHEMA_VERSION}{lacks}"[:200])
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
