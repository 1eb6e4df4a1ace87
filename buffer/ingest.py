"""The buffer's ingest path: a PushGroup validated exactly like `common.wire.decode` does, then kept as its encoded
bytes, so the buffer never builds Trajectory objects, never holds thousands of small Python objects per group, and hands
groups to the learner by copying the msgpack bytes of their trajectory arrays into the BatchReply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from common import wire


@dataclass(slots=True)
class CheckedPush:
    """A PushGroup that passed every check of `decode`, as the buffer keeps it. Producer: `decode_request`.

    `payload` is the validated PushGroup in `encode`'s layout (the bytes received, or their canonical re-encoding if
    they were valid but laid out otherwise); its map of trajectory columns starts at `trajectories_at` and runs to
    the end. The per-trajectory lists are in trajectory order. `oldest_version` / `newest_version`: min / max
    over all tokens (0 for an empty group).
    """

    worker: str
    group: str
    payload: bytes | memoryview
    trajectories_at: int
    uids: list[str]
    trajectory_groups: list[str]
    prompt_indices: tuple[int, ...]
    rewards: tuple[float, ...]
    oldest_version: int
    newest_version: int
    max_token_id: int = -1
    """The largest prompt or response token id of the group (-1: none)."""


_PACK = msgpack.Packer(use_bin_type=True).pack
_TRAJECTORIES_KEY = _PACK("trajectories")
_WORKER_KEY = _PACK("worker")
_GROUP_KEY = _PACK("group")
_PUSH_HEAD = b"".join((b"\x85", _PACK("v"), _PACK(wire.SCHEMA_VERSION), _PACK("type"), _PACK("PushGroup")))
"""How every PushGroup of this schema that `encode` writes begins (a map of 5: v, type, worker, group, trajectories)."""
_COLUMNS_HEAD = msgpack.Packer(use_bin_type=True).pack_map_header(len(wire.GROUP_COLUMNS))
"""The map header of a group's trajectory columns (a map16 since schema 3's 17 columns)."""


def _trajectories_at(data: bytes | memoryview, worker: str, group: str) -> int | None:
    """Where the trajectory columns start in a valid PushGroup laid out as `encode` writes it: a map of 5 entries
    v, type, worker, group and trajectories last, whose value (a map of the wire.GROUP_COLUMNS) then runs to the end
    (msgpack refused trailing bytes). None for any other layout (the caller re-encodes)."""
    prefix = b"".join((_PUSH_HEAD, _WORKER_KEY, _PACK(worker), _GROUP_KEY, _PACK(group), _TRAJECTORIES_KEY))
    view = memoryview(data).cast("B")
    at = len(prefix)
    end = at + len(_COLUMNS_HEAD)
    if end <= view.nbytes and view[:at] == prefix and view[at:end] == _COLUMNS_HEAD:
        return at
    return None


def _checked_push(obj: dict[str, Any], data: bytes | memoryview) -> CheckedPush | None:
    """A CheckedPush of an unpacked PushGroup `obj` received as `data`; wire.WireError if invalid, None if valid but not
    laid out as `encode` writes it."""
    worker, group_id = obj.get("worker"), obj.get("group")
    if len(obj) != 3 or type(worker) is not str or type(group_id) is not str:
        return None  # the generic decoder says what is wrong
    if len(worker) > wire.MAX_ID_CHARS or len(group_id) > wire.MAX_ID_CHARS:
        return None  # the generic decoder raises `oversized`
    group = wire.check_group(obj.get("trajectories"), "trajectories")
    at = _trajectories_at(data, worker, group_id)
    if at is None:
        return None
    top = max((int(ids.max()) for ids in (group.prompt_ids, group.response_ids) if ids.size), default=-1)
    return CheckedPush(
        worker, group_id, data, at, group.uid, group.group, group.prompt_index, group.reward,
        group.oldest_version, group.newest_version, top,
    )  # fmt: skip


def decode_request(data: bytes | bytearray | memoryview) -> wire.Message | CheckedPush:
    """`decode`, except that a valid PushGroup comes back as a CheckedPush (same validation, no Trajectory objects).

    A PushGroup that is valid but not canonically encoded (fields in another order) is accepted too: it is decoded
    generically and its canonical re-encoding becomes the payload.
    """
    name, obj = wire.unpack_message(data)
    if name == "PushGroup":
        try:
            checked = _checked_push(obj, data if isinstance(data, bytes | memoryview) else bytes(data))
        except wire.WireError:
            raise
        except Exception as err:  # a safety net, as in _decode_fields
            raise wire.WireError("bad_field", f"{type(err).__name__}: {err}"[:200]) from None
        if checked is not None:
            return checked
        msg = wire.decode_fields(name, obj)  # raises the precise wire.WireError, or the message was valid after all
        canonical = wire.encode(msg)
        checked = _checked_push(wire.unpack_message(canonical)[1], canonical)
        assert checked is not None, "a decoded PushGroup re-encodes canonically"
        return checked
    return wire.decode_fields(name, obj)


def encode_batch_reply(step: int, groups: list[bytes | memoryview], dropped_stale: int, ready: bool) -> bytes:
    """A BatchReply whose groups are trajectory column maps, already encoded and valid (the
    `CheckedPush.payload[trajectories_at:]` of each group): copied in as they are, never decoded again."""
    if len(groups) > wire.MAX_GROUP:
        raise wire.WireError("oversized", f"`groups` has {len(groups)} > {wire.MAX_GROUP} items")
    pack = msgpack.Packer(use_bin_type=True)
    head = [pack.pack_map_header(6)]
    for key, value in (("v", wire.SCHEMA_VERSION), ("type", "BatchReply"), ("step", wire.STEP.decode(step, "step"))):
        head += (pack.pack(key), pack.pack(value))
    tail = [pack.pack("dropped_stale"), pack.pack(wire.NAT.decode(dropped_stale, "dropped_stale"))]
    tail += (pack.pack("ready"), pack.pack(wire.BOOL.decode(ready, "ready")))
    data = b"".join([*head, pack.pack("groups"), pack.pack_array_header(len(groups)), *groups, *tail])
    if len(data) > wire.MAX_MESSAGE_BYTES:
        raise wire.WireError("oversized", f"{len(data)} bytes > {wire.MAX_MESSAGE_BYTES}")
    return data


def upgrade_push(data: bytes | memoryview) -> bytes | memoryview:
    """A PushGroup in this schema: `data` itself, or an older PushGroup from a journal written before, upgraded and
    re-encoded with every check: schema 1 (a map per trajectory) and schema 2 (columns without the loss mask) carry
    single-turn trajectories only, so they get no mask (every token a model token). wire.WireError if invalid."""
    if bytes(memoryview(data)[: len(_PUSH_HEAD)]) == _PUSH_HEAD:  # this schema, as encode writes it: nothing to do
        return data
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True, **wire.UNPACK_LIMITS)
    except Exception as err:
        raise wire.WireError("bad_msgpack", f"{type(err).__name__}: {err}"[:200]) from None
    if type(obj) is not dict or obj.get("v") not in (1, 2) or obj.get("type") != "PushGroup":
        return data
    worker, group, items = obj.get("worker"), obj.get("group"), obj.get("trajectories")
    if obj["v"] == 1:
        if type(items) is list:
            for item in items:
                if type(item) is dict:
                    item.setdefault("loss_mask", None)
        trajectories = wire.list_kind(wire.TRAJECTORY, "Trajectory").decode(items, "trajectories")
    else:
        if type(items) is dict and "mask_len" not in items and "loss_mask" not in items:
            uids = items.get("uid")
            count = len(uids) if type(uids) is list else 0  # check_group names anything wrong with the columns
            items = {**items, "mask_len": bytes(4 * count), "loss_mask": b""}
        trajectories = wire.TRAJECTORIES.decode(items, "trajectories")
    return wire.encode(wire.PushGroup(wire.STR.decode(worker, "worker"), wire.STR.decode(group, "group"), trajectories))
