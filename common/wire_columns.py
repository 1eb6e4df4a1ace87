"""The column codec of a group of trajectories (part of `common.wire`, which re-exports `GROUP_COLUMNS` and
`check_group`; import them from there).

A group (`PushGroup.trajectories`, each of `BatchReply.groups`) travels as one map of the GROUP_COLUMNS, laid out
as the table in `common.wire`'s docstring says, so that a receiver checks it with a few numpy reductions instead of
building hundreds of small objects. `check_group` is the buffer's ingest hot path (microseconds per group): it
keeps its lookups in module globals and locals, and numpy calls to one reduction per check.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from common.wire_kinds import (
    FINISH_REASONS,
    LOGP_TOLERANCE,
    MAX_GROUP,
    MAX_ID_CHARS,
    MAX_TOKENS,
    Kind,
    WireError,
    wrong_type,
)

if TYPE_CHECKING:
    from common.wire import Trajectory

_I4 = np.dtype("<i4")
_F4 = np.dtype("<f4")
_U1 = np.dtype("u1")
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
    ("mask_len", "i", 4),
)
_TOKEN_COLUMNS = (  # concatenated arrays: (column, dtype, the length column giving each trajectory's share)
    ("prompt_ids", _I4, "prompt_len"),
    ("response_ids", _I4, "response_len"),
    ("behav_logp", _F4, "response_len"),
    ("versions", _I4, "response_len"),
    ("loss_mask", _U1, "mask_len"),
)
GROUP_COLUMNS = (*_TEXT_COLUMNS, *(c for c, _, _ in _SCALAR_COLUMNS), *(c for c, _, _ in _TOKEN_COLUMNS))
"""The keys of a group of trajectories on the wire, in `encode`'s order (see `group_kind`)."""
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
    mask_len: tuple[int, ...]
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    behav_logp: np.ndarray
    versions: np.ndarray
    loss_mask: np.ndarray  # uint8, the masks of the trajectories whose mask_len is not 0, concatenated
    oldest_version: int  # min over all tokens (0 for an empty group)
    newest_version: int  # max over all tokens (0 for an empty group)

    def trajectories(self, trajectory_type: type[Trajectory]) -> list[Trajectory]:
        """The group as `trajectory_type` objects (common.wire.Trajectory) whose arrays are views of the columns."""
        out = []
        prompt_at = response_at = mask_at = 0
        for uid, group, finish, worker, index, reward, correct, t_start, t_end, plen, rlen, mlen in zip(
            self.uid, self.group, self.finish, self.worker, self.prompt_index, self.reward, self.correct,
            self.t_start, self.t_end, self.prompt_len, self.response_len, self.mask_len, strict=True,
        ):  # fmt: skip
            end = response_at + rlen
            out.append(
                trajectory_type(
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
                    self.loss_mask[mask_at : mask_at + mlen] if mlen else None,
                )  # fmt: skip
            )
            prompt_at, response_at, mask_at = prompt_at + plen, end, mask_at + mlen
        return out


def _bytes_column(value: dict[str, Any], column: str, itemsize: int, count: int) -> bytes:
    raw = value[column]
    if type(raw) is not bytes:
        raise wrong_type(column, "bytes", raw)
    if len(raw) != count * itemsize:
        raise WireError("length_mismatch", f"`{column}`: {len(raw)} bytes for {count} values of {itemsize} bytes")
    return raw


def check_group(value: Any, name: str) -> _Group:
    """Validate a group of trajectories in its column layout: every check `decode` makes of a single Trajectory
    holds for each. Per-trajectory columns are checked in Python (a handful of values), token columns with one
    numpy reduction per check over the whole group (numpy's per-call cost, not the data, dominates here)."""
    if type(value) is not dict:
        raise wrong_type(name, "a map of trajectory columns", value)
    if value.keys() != _GROUP_KEYS:
        missing = sorted(_GROUP_KEYS - value.keys())
        extra = sorted(repr(k)[:40] for k in value.keys() - _GROUP_KEYS)
        raise WireError("bad_field", f"`{name}`: missing columns {missing}, unknown columns {extra}"[:300])
    texts = []
    for column in _TEXT_COLUMNS:
        items = value[column]
        if type(items) is not list:
            raise wrong_type(column, "a list of str", items)
        try:  # unpacked msgpack holds exact types only, so join succeeds iff every item is a str
            "".join(items)
        except TypeError:
            raise wrong_type(column, "a list of str", items) from None
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
        if min(lens) < 0 or min(scalars["mask_len"]) < 0:
            raise WireError("bad_field", f"`{name}`: a negative prompt_len, response_len or mask_len ({uid0})")
        if max(lens) > MAX_TOKENS:
            raise WireError("oversized", f"`{name}`: a trajectory of more than {MAX_TOKENS} tokens ({uid0})")
        if min(scalars["response_len"]) == 0:
            raise WireError("empty_response", texts[0][scalars["response_len"].index(0)][:100])
    tokens = {
        column: np.frombuffer(_bytes_column(value, column, dtype.itemsize, sum(scalars[length_column])), dtype)
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
        if tokens["loss_mask"].size:  # multi-turn trajectories only: the single-turn path pays one size check
            _check_masks(texts[0], scalars["response_len"], scalars["mask_len"], tokens["loss_mask"])
    return _Group(*texts, **scalars, **tokens, oldest_version=oldest, newest_version=newest)


def _check_masks(uids: list[str], response_len: tuple[int, ...], mask_len: tuple[int, ...], masks: np.ndarray) -> None:
    """Each mask is as long as its response, holds 0 / 1 only, and marks at least one model token (`bad_mask`)."""
    if int(_MAX(masks)) > 1:
        raise WireError("bad_mask", f"a loss_mask value above 1 ({uids[0][:100]})")
    at = 0
    for uid, rlen, mlen in zip(uids, response_len, mask_len, strict=True):
        if mlen and mlen != rlen:
            raise WireError("bad_mask", f"{uid[:100]}: mask_len {mlen} for {rlen} response tokens (0 or equal)")
        if mlen and int(_MAX(masks[at : at + mlen])) == 0:
            raise WireError("bad_mask", f"{uid[:100]}: a loss_mask with no model token")
        at += mlen


def group_kind(trajectory: Kind, trajectory_type: type[Trajectory]) -> Kind:
    """The kind of a group of trajectories in its column layout. `trajectory` is the kind of one Trajectory message
    (its encoder checks and converts each trajectory's fields), `trajectory_type` the class decoded groups are built
    of (`common.wire` passes its own: the message types live there, this module cannot import them)."""
    encode_trajectory = trajectory.encode

    def encode(value: Any, name: str) -> dict[str, Any]:
        """A list of Trajectory as one map of columns (the layout is in `common.wire`'s docstring)."""
        if not isinstance(value, (list, tuple)):
            raise wrong_type(name, "a list of Trajectory", value)
        if len(value) > MAX_GROUP:
            raise WireError("oversized", f"`{name}` has {len(value)} > {MAX_GROUP} items")
        rows = [encode_trajectory(traj, name) for traj in value]  # every field checked and converted as for one
        out: dict[str, Any] = {column: [row[column] for row in rows] for column in _TEXT_COLUMNS}
        lengths = {
            "prompt_len": [row["prompt_ids"]["n"] for row in rows],
            "response_len": [row["response_ids"]["n"] for row in rows],
            "mask_len": [0 if row["loss_mask"] is None else row["loss_mask"]["n"] for row in rows],
        }
        for column, code, _ in _SCALAR_COLUMNS:
            values = lengths.get(column) or [row[column] for row in rows]
            try:
                out[column] = struct.pack(f"<{len(values)}{code}", *values)
            except struct.error as err:  # an int beyond the column's width
                raise WireError("bad_field", f"`{column}`: {err}") from None
        for column, _, _ in _TOKEN_COLUMNS:
            out[column] = b"".join(row[column]["b"] for row in rows if row[column] is not None)
        return out

    def decode(value: Any, name: str) -> list[Trajectory]:
        return check_group(value, name).trajectories(trajectory_type)

    return Kind(encode, decode)
