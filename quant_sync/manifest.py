"""The weight protocol's format (see `quant_sync.transport` for the protocol): its version and bounds, the version
header a worker checks before fetching anything (`parse_header` -> `Manifest`), chunk digests, the dtypes a tensor
may have on the wire, and the assembly of verified bytes into a `WeightUpdate`. Shared by the publisher and the
subscriber.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import msgpack
import torch
import xxhash

from quant_sync.shm_owner import SHM_DIR  # noqa: F401  (re-exported: where version files go)
from quant_sync.update import WeightUpdate

PROTOCOL_VERSION = 2
CHUNK_BYTES = 4 << 20
MAX_WAIT_MS = 2000
"""Longest long poll the publisher holds a `get` for."""
MAX_TENSORS = 1 << 16
MAX_CHUNKS = 1 << 22
MAX_CHUNK_BYTES = 1 << 30
"""Largest chunk a header may announce (publishers use `chunk_bytes`, 4 MiB by default)."""
MAX_VERSION_BYTES = 1 << 40
"""Largest version a header may announce (1 TiB): a bound on what a hostile header can make a worker allocate."""
ALIGN_BYTES = 64
"""Alignment of each tensor in a version's /dev/shm file (its `file_offset`)."""
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
"""The dtypes a published tensor may have, by their name on the wire."""
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@functools.cache
def boot_id() -> str:
    """This kernel's boot id: equal on both ends only when they share a machine (and its /dev/shm). Read once per
    process (a process outlives no boot; every /dev/shm read checks it: 0.14 ms a file read)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def chunk_digest(data: memoryview | bytes) -> int:
    """The xxh3-64 digest a header gives for each chunk."""
    return xxhash.xxh3_64_intdigest(data)


class PayloadError(ValueError):
    """A weight header or chunk that does not check out (partial, corrupt, inconsistent); never applied."""


class ShmUnavailable(PayloadError):
    """No usable shared-memory copy here (another machine, or the file is gone): not corruption, use ZMQ."""


@dataclass(frozen=True, slots=True)
class Manifest:
    """A validated version header."""

    version: int
    scheme: str
    tensors: list[dict]
    chunks: list[tuple[int, int, int, int]]
    shm: str | None
    boot_id: str
    base: int | None = None
    """An adapter-only version (LoRA): the pinned version whose tensors complete it; None: a complete version."""
    pinned: bool = False
    """A complete version later ones name as their `base` (the publisher holds it until another is pinned)."""
    shm_offset: int | None = None
    """Where the version starts in `shm` when that is the publisher's ring of adapter versions (quant_sync.shm_ring:
    copied out and verified there, since later versions overwrite it); None: `shm` is the version's own file."""

    @property
    def nbytes(self) -> int:
        return sum(int(entry["nbytes"]) for entry in self.tensors)


def _int(value: object) -> int:
    if type(value) is not int:
        raise TypeError(f"{value!r} is not an int")
    return value


def parse_header(frame: bytes) -> Manifest | int:
    """A header frame -> its Manifest, or the publisher's version (int) when it has nothing newer.

    Raises PayloadError unless the header describes its tensors exactly: unique str names, known dtypes, shapes of
    non-negative ints, nbytes = numel x itemsize (at most MAX_VERSION_BYTES in all), file offsets that are
    non-negative multiples of 64 and do not overlap, and chunks of at most MAX_CHUNK_BYTES that cover each tensor's
    bytes in order without gaps or overlaps; an optional `base` is an earlier version, `pinned` a bool (not both).
    """
    try:
        header = msgpack.unpackb(frame, max_bin_len=0, max_array_len=MAX_CHUNKS)
        if isinstance(header, dict) and "error" in header:  # the publisher refused the request, saying why
            raise ValueError(f"the publisher refused the request: {str(header['error'])[:300]}")
        version = _int(header["version"])
        if header.get("v") != PROTOCOL_VERSION:
            raise ValueError(f"protocol {header.get('v')!r}, expected {PROTOCOL_VERSION}")
        if "tensors" not in header:
            return version
        tensors, chunks = header["tensors"], [tuple(map(_int, c)) for c in header["chunks"]]
        if any(len(chunk) != 4 for chunk in chunks):
            raise ValueError("a chunk entry is not [tensor, offset, length, digest]")
        scheme, shm, boot = str(header["scheme"]), header.get("shm"), str(header.get("boot_id", ""))
        base, pinned, shm_offset = header.get("base"), header.get("pinned", False), header.get("shm_offset")
        if shm_offset is not None and not (type(shm_offset) is int and shm_offset >= 0 and isinstance(shm, str)):
            raise ValueError(f"shm_offset {shm_offset!r} is not a byte offset into a named shm file")
        if base is not None and not (type(base) is int and 0 <= base < version):
            raise ValueError(f"base {base!r} is not an earlier version")
        if type(pinned) is not bool or (pinned and base is not None):
            raise ValueError("a pinned version must be complete (bool `pinned`, no `base`)")
    except Exception as err:
        raise PayloadError(f"unreadable weight header: {err}") from err
    if not isinstance(tensors, list) or len(tensors) > MAX_TENSORS:
        raise PayloadError(f"version {version}: bad tensor list")
    covered = [0] * len(tensors)
    for index, offset, length, _ in chunks:
        if not 0 <= index < len(tensors) or offset != covered[index] or not 0 < length <= MAX_CHUNK_BYTES:
            raise PayloadError(f"version {version}: chunk table does not tile tensor {index} in order")
        covered[index] += length
    names, total, file_end = set(), 0, 0
    for index, entry in enumerate(tensors):
        try:
            name, dtype = entry["name"], DTYPES[entry["dtype"]]
            shape = [_int(dim) for dim in entry["shape"]]
            nbytes, file_offset = _int(entry["nbytes"]), _int(entry["file_offset"])
            if type(name) is not str or name in names:
                raise ValueError(f"name {name!r} is not a unique str")
        except (KeyError, TypeError, ValueError) as err:
            raise PayloadError(f"version {version}: tensor entry {index} is malformed ({err})") from err
        names.add(name)
        if min(shape, default=0) < 0 or nbytes != math.prod(shape) * dtype.itemsize or covered[index] != nbytes:
            raise PayloadError(f"version {version}: tensor {name!r} sizes disagree (shape, dtype, chunks)")
        if file_offset % ALIGN_BYTES or file_offset < file_end:
            raise PayloadError(f"version {version}: tensor {name!r} has a misplaced file offset {file_offset}")
        total, file_end = total + nbytes, file_offset + nbytes
        if total > MAX_VERSION_BYTES:
            raise PayloadError(f"version {version}: more than {MAX_VERSION_BYTES} bytes of weights")
    shm = shm if isinstance(shm, str) else None
    return Manifest(version, scheme, tensors, chunks, shm, boot, base, pinned, shm_offset)


def assemble(manifest: Manifest, buffers: list[torch.Tensor]) -> WeightUpdate:
    """Per-tensor byte buffers (uint8, already verified) -> the WeightUpdate the engine stages."""
    tensors = {}
    for entry, raw in zip(manifest.tensors, buffers):
        tensors[entry["name"]] = raw.view(DTYPES[entry["dtype"]]).view(entry["shape"])
    return WeightUpdate(version=manifest.version, tensors=tensors, scheme=manifest.scheme)
