"""The wire schema's bounds, reject reasons and field kinds (part of `common.wire`, which re-exports every public name
here; import them from there).

A field kind is a pair of functions: `encode` turns a Python value into something msgpack carries (converting numpy
scalars and arrays of another dtype where that loses nothing), `decode` checks an unpacked value against the schema
and returns it, raising `WireError` with its reason on anything else. `struct_kind` composes them into a nested
message (a map of exactly its fields), `list_kind` into a bounded list.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

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
    "bad_mask",  # a loss mask not of 0/1 values, of another length than the response, or with no model token
)


class WireError(ValueError):
    """A message that cannot be encoded or does not validate; `reason` is one of WIRE_REASONS."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


# ---------------------------------------------------------------------------------------------------------------
# Field kinds: an encoder (python value -> msgpack-able) and a decoder (unpacked value -> checked python value).


@dataclass(frozen=True, slots=True)
class Kind:
    """How one field travels: `encode(value, field name)` -> msgpack-able, `decode(unpacked, field name)` -> checked."""

    encode: Callable[[Any, str], Any]
    decode: Callable[[Any, str], Any]


def wrong_type(name: str, what: str, value: Any) -> WireError:
    """The `bad_field` error for field `name` holding a value of another type than `what`."""
    return WireError("bad_field", f"`{name}` must be {what}, got {type(value).__name__}")


def _enc_str(value: Any, name: str) -> str:
    if type(value) is not str and not isinstance(value, str):
        raise wrong_type(name, "str", value)
    return value


def _dec_str(value: Any, name: str) -> str:
    if type(value) is not str:
        raise wrong_type(name, "str", value)
    return value


def _dec_id(value: Any, name: str) -> str:
    if type(value) is not str:
        raise wrong_type(name, "str", value)
    if len(value) > MAX_ID_CHARS:
        raise WireError("oversized", f"`{name}` has {len(value)} > {MAX_ID_CHARS} characters")
    return value


def _enc_int(value: Any, name: str) -> int:
    if type(value) is int:
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise wrong_type(name, "int", value)
    return int(value)


def _dec_int(value: Any, name: str) -> int:
    if type(value) is not int:
        raise wrong_type(name, "int", value)
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
        raise wrong_type(name, "float", value)
    return float(value)


def _dec_finite(value: Any, name: str) -> float:
    kind = type(value)
    if kind is int:
        value = float(value)
    elif kind is not float:
        raise wrong_type(name, "float", value)
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
        raise wrong_type(name, "bool", value)
    return bool(value)


def _dec_bool(value: Any, name: str) -> bool:
    if type(value) is not bool:
        raise wrong_type(name, "bool", value)
    return value


def _array_kind(code: str) -> Kind:
    """An array field of fixed little-endian dtype `code` ("i4", "f4" or "u1")."""
    dtype = np.dtype("<" + code)
    itemsize = dtype.itemsize
    is_int = dtype.kind in "iu"
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
            raise wrong_type(name, 'an array map {"dt", "n", "b"}', value)
        dt, n, raw = value.get("dt"), value.get("n"), value.get("b")
        if type(dt) is not str or dt != code:
            raise WireError("bad_dtype", f"`{name}` must have dt={code!r}, got {dt!r}"[:200])
        if type(n) is not int or n < 0:
            raise WireError("bad_field", f"`{name}.n` must be an int >= 0")
        if n > MAX_TOKENS:
            raise WireError("oversized", f"`{name}` has {n} > {MAX_TOKENS} elements")
        if type(raw) is not bytes:
            raise wrong_type(name + ".b", "bytes", raw)
        if len(raw) != n * itemsize:
            raise WireError("length_mismatch", f"`{name}`: {len(raw)} bytes for n={n} of {code}")
        return np.frombuffer(raw, dtype=dtype)

    return Kind(encode, decode)


def list_kind(item: Kind, what: str) -> Kind:
    """A list of at most MAX_GROUP items of kind `item` (`what` names them in errors)."""

    def encode(value: Any, name: str) -> list[Any]:
        if not isinstance(value, (list, tuple)):
            raise wrong_type(name, f"a list of {what}", value)
        if len(value) > MAX_GROUP:
            raise WireError("oversized", f"`{name}` has {len(value)} > {MAX_GROUP} items")
        return [item.encode(x, name) for x in value]

    def decode(value: Any, name: str) -> list[Any]:
        if type(value) is not list:
            raise wrong_type(name, f"a list of {what}", value)
        return [item.decode(x, name) for x in value]

    return Kind(encode, decode)


def _enc_stats(value: Any, name: str) -> dict[str, float | int]:
    if not isinstance(value, dict):
        raise wrong_type(name, "a dict", value)
    if len(value) > MAX_MAP_LEN:
        raise WireError("oversized", f"`{name}` has {len(value)} > {MAX_MAP_LEN} entries")
    out: dict[str, float | int] = {}
    for key, number in value.items():
        if not isinstance(key, str):
            raise wrong_type(name + " key", "str", key)
        if isinstance(number, (bool, np.bool_, int, np.integer)):
            out[key] = int(number)
        else:
            out[key] = _enc_float(number, f"{name}[{key}]")
    return out


def _dec_stats(value: Any, name: str) -> dict[str, float | int]:
    if type(value) is not dict:
        raise wrong_type(name, "a map", value)
    for key, number in value.items():
        if type(key) is not str or type(number) not in (int, float):
            raise WireError("bad_field", f"`{name}` must map str to int or float")
    return value


STR = Kind(_enc_str, _dec_str)
ID = Kind(_enc_str, _dec_id)
STEP = Kind(_enc_int, _dec_step)
WAIT = Kind(_enc_float, _dec_wait)
INT = Kind(_enc_int, _dec_int)
NAT = Kind(_enc_int, _dec_nat)
FINITE = Kind(_enc_float, _dec_finite)
NONNEG = Kind(_enc_float, _dec_nonneg_finite)
BOOL = Kind(_enc_bool, _dec_bool)
I4 = _array_kind("i4")
F4 = _array_kind("f4")
U1 = _array_kind("u1")


def _enc_mask(value: Any, name: str) -> dict[str, Any] | None:
    if value is None:
        return None
    if isinstance(value, np.ndarray) and value.dtype == np.bool_:
        value = value.astype(np.uint8)
    return U1.encode(value, name)


def _dec_mask(value: Any, name: str) -> np.ndarray | None:
    return None if value is None else U1.decode(value, name)


MASK = Kind(_enc_mask, _dec_mask)
"""A per-token loss mask: nil (every token is a model token) or a uint8 array of 0 / 1."""
STATS = Kind(_enc_stats, _dec_stats)


def struct_kind(cls: type, fields_: tuple[tuple[str, Kind], ...], check: Callable[[Any], None] | None) -> Kind:
    """A nested message: a map of exactly its fields."""
    names = frozenset(name for name, _ in fields_)
    encoders = tuple((fname, kind.encode) for fname, kind in fields_)
    decoders = tuple((fname, kind.decode) for fname, kind in fields_)

    def encode(value: Any, name: str) -> dict[str, Any]:
        if type(value) is not cls:
            raise wrong_type(name, cls.__name__, value)
        return {fname: field_encode(getattr(value, fname), fname) for fname, field_encode in encoders}

    def decode(value: Any, name: str) -> Any:
        if type(value) is not dict:
            raise wrong_type(name, f"a {cls.__name__} map", value)
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

    return Kind(encode, decode)
