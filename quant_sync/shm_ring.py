"""Small versions in one reused /dev/shm file (LoRA's adapter-only versions): the publisher writes each into the
next free stretch of a ring it allocated once, so a version costs a copy into pages that already exist, where a file
per version costs allocating, zeroing and later freeing its tmpfs pages.

Measured in `asyncrl bench sync`'s LoRA phase (2.35 MB int8 adapter versions, about 40 a second, two workers
decoding on the same 2 cores): writing a version into its own preallocated file took 1.8-2.0 ms of the publishing
thread's CPU (the page-cache path, under the workers' memory traffic), the background allocation of the next file
and the unlinking of old ones about 1 ms more; the same bytes copied into the ring's mapping took 0.12 ms.

The ring holds at least RING_SLOTS versions before it wraps round and overwrites the oldest, so a reader may find
its version's bytes overwritten. A reader therefore never trusts the mapping: it copies the version out first and
verifies every chunk digest on its copy (`read_ring`: a private copy; a subscriber for an int8 engine copies a packed
adapter version straight into a pooled buffer, `ring_bytes` and `verify_copy`); a copy that does not check out
raises RingOverwritten and the subscriber fetches that version over ZMQ. Complete versions (and LoRA's pinned base)
keep a file of their own, which readers map and use in place (`quant_sync.subscriber.read_shm`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np
import torch

from quant_sync.manifest import ALIGN_BYTES, Manifest, ShmUnavailable, chunk_digest

RING_SLOTS = 8
"""Versions of the ring's first version's size it holds before it overwrites the oldest."""
RING_MAX_VERSION_BYTES = 16 << 20
"""Largest adapter version the publisher writes into its ring (a larger one gets a file of its own)."""
RING_ALIGN = 4096
"""Where each version starts in the ring (a page: the copies in and out start on one)."""
MAPPINGS_KEPT = 2
"""Rings a reader process keeps mapped (one per publisher it follows; a new ring replaces its publisher's old)."""


class RingOverwritten(ShmUnavailable):
    """The version's bytes in the ring were overwritten by later versions before this reader copied them out."""


def _round_up(nbytes: int, to: int) -> int:
    return -(-nbytes // to) * to


class ShmRing:
    """The publisher's ring: one /dev/shm file of `nbytes`, mapped shared, written by `write` (one thread)."""

    def __init__(self, path: str, nbytes: int) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # weights: this user only
        try:
            os.posix_fallocate(fd, 0, nbytes)  # every page allocated now, none per version
            self._mapping = mmap.mmap(fd, nbytes)
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        self.path, self.nbytes = path, nbytes
        self._bytes = np.frombuffer(self._mapping, dtype=np.uint8)
        self._next = 0

    @classmethod
    def create(cls, path: str, version_bytes: int) -> ShmRing | None:
        """A ring for versions of about `version_bytes` (RING_SLOTS of them), or None where /dev/shm refuses it."""
        try:
            return cls(path, RING_SLOTS * _round_up(max(version_bytes, 1), RING_ALIGN))
        except OSError:
            return None

    def fits(self, nbytes: int) -> bool:
        """Whether a version of `nbytes` leaves the ring room for RING_SLOTS - 1 more of its size before it."""
        return _round_up(nbytes, RING_ALIGN) * RING_SLOTS <= self.nbytes

    def write(self, views: list[memoryview], offsets: list[int], nbytes: int) -> int:
        """Copy a version (each tensor's bytes at its file offset, `nbytes` in all) into the next free stretch,
        wrapping round to the start when the end has no room; returns where it starts."""
        start = self._next if self._next + nbytes <= self.nbytes else 0
        for data, offset in zip(views, offsets):
            at = start + offset
            self._bytes[at : at + data.nbytes] = np.frombuffer(data, dtype=np.uint8)
        self._next = start + _round_up(nbytes, RING_ALIGN)
        return start

    def close(self) -> None:
        """Unmap and remove the file (readers' own mappings stay valid; their next version comes by ZMQ)."""
        del self._bytes
        self._mapping.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


_MAPPED: OrderedDict[str, tuple[int, int, mmap.mmap]] = OrderedDict()
"""A reader's ring mappings: path -> (inode, size, read-only mapping)."""
_MAPPED_LOCK = threading.Lock()


def _mapping(path: str, version: int) -> mmap.mmap:
    try:
        stat = os.stat(path)
    except OSError as err:
        raise ShmUnavailable(f"version {version}: its ring {path} is gone ({err})") from err
    with _MAPPED_LOCK:
        held = _MAPPED.get(path)
        if held is not None and held[:2] == (stat.st_ino, stat.st_size):
            _MAPPED.move_to_end(path)
            return held[2]
        try:
            with open(path, "rb") as file:
                mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as err:
            raise ShmUnavailable(f"version {version}: cannot map its ring {path}: {err}") from err
        _MAPPED[path] = (stat.st_ino, stat.st_size, mapping)
        while len(_MAPPED) > MAPPINGS_KEPT:
            _MAPPED.popitem(last=False)[1][2].close()  # nothing refers to it: read_ring copies out
        return mapping


@contextlib.contextmanager
def ring_bytes(manifest: Manifest, path: str, offset: int) -> Iterator[list[np.ndarray]]:
    """Each of the version's tensors' bytes in the ring at `offset`, read-only and in place, valid inside the block
    only (the mapping stays open meanwhile). Untrusted: a reader copies what it keeps and verifies the copy
    (`verify_copy`). Raises ShmUnavailable when the ring is unusable."""
    end = max((int(entry["file_offset"]) + int(entry["nbytes"]) for entry in manifest.tensors), default=0)
    mapping = _mapping(path, manifest.version)
    if offset < 0 or offset % ALIGN_BYTES or offset + end > len(mapping):
        raise ShmUnavailable(f"version {manifest.version}: bytes {offset}-{offset + end} lie outside its ring {path}")
    with _MAPPED_LOCK:  # a mapping is closed only under this lock
        if mapping.closed:
            raise ShmUnavailable(f"version {manifest.version}: its ring {path} was unmapped meanwhile")
        whole = np.frombuffer(mapping, dtype=np.uint8, count=end, offset=offset)
        yield [whole[int(entry["file_offset"]) : int(entry["file_offset"]) + int(entry["nbytes"])]
               for entry in manifest.tensors]  # fmt: skip


def verify_copy(manifest: Manifest, index: int, copy: torch.Tensor | np.ndarray) -> None:
    """Check the chunk digests of tensor `index` on `copy` (its bytes as copied out of the ring); RingOverwritten if
    one does not match (later versions overwrote them before the copy)."""
    data = copy.numpy() if isinstance(copy, torch.Tensor) else copy
    data = data.view(np.uint8)
    for tensor, chunk_offset, length, digest in manifest.chunks:
        if tensor == index and chunk_digest(memoryview(data[chunk_offset : chunk_offset + length])) != digest:
            raise RingOverwritten(f"version {manifest.version}: overwritten in the ring before it was read")


def read_ring(manifest: Manifest, path: str, offset: int) -> list[torch.Tensor]:
    """The version's tensors' bytes (uint8, one private copy), copied out of the ring at `offset` and verified there;
    raises RingOverwritten when later versions overwrote them first, ShmUnavailable when the ring is unusable."""
    with ring_bytes(manifest, path, offset) as parts:
        copy = torch.empty(sum(part.size for part in parts), dtype=torch.uint8)
        buffers, at = [], 0
        for part in parts:
            buffers.append(copy[at : at + part.size])
            buffers[-1].numpy()[:] = part
            at += part.size
    for index, buffer in enumerate(buffers):
        verify_copy(manifest, index, buffer)
    return buffers
