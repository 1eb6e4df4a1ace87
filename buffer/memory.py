"""The buffer process's malloc settings, so that holding admitted groups does not page-fault on every message.

The buffer keeps each admitted group in the ZMQ frame it arrived in, which ZMQ's I/O thread allocated with malloc.
With glibc's defaults that costs a page fault per 4 KiB, again and again:

- the I/O thread allocates from an arena of its own, which grows into fresh (unfaulted) pages as groups are kept;
- freed memory at the top of an arena is handed back to the kernel (the trim threshold), so the next burst faults
  the same pages in again;
- messages above the dynamic mmap threshold get a fresh mapping each, faulted page by page and unmapped on free.

On these machines (VMs) a fault costs about a microsecond plus the zeroing; a 54 KB group is 13 faults. Measured in
the setting of `asyncrl bench buffer` (groups of 8 x 512 tokens, one producer):

- a ROUTER that only receives, keeps and answers each group: 0.57-0.61 of a raw PUSH/PULL with glibc's defaults,
  1.04 with these settings (its `floor_keep`);
- the buffer itself: 13.3 minor faults per admitted group before, 0.16 after; its ZMQ I/O thread's CPU went from
  50-70 us to 16 us per group, and ingest from about 50k to 65k trajectories/s.

So, in two steps:
1. `configure_malloc`, first thing in `python -m buffer` (buffer/__main__.py, before numpy and ZMQ are imported and
   start threads): every thread allocates from the main arena (`M_ARENA_MAX` 1; an arena some thread created before
   would stay in use), freed memory is never trimmed (`M_TRIM_THRESHOLD` 1 GiB) and allocations up to 32 MiB come
   from the heap (`M_MMAP_THRESHOLD`), so freed frames are reused rather than returned to the kernel;
2. `reserve`, once the config is read: faults in `buffer.reserve_mb` of heap (allocated, written, freed), so the
   first `reserve_mb` of queued groups land in pages that are already there. At most `MAX_RESERVE_MB`: the freed
   reserve must stay below the trim threshold, or glibc hands it straight back.

The cost: the process's resident memory starts at about `reserve_mb` and does not shrink after a peak (the queue is
bounded by `buffer.max_queued_groups`). glibc only; with another C library both steps do nothing and say so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
TRIM_THRESHOLD_BYTES = 1 << 30
MMAP_THRESHOLD_BYTES = 32 << 20
"""glibc's largest allowed mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)."""
MAX_RESERVE_MB = 512
"""Largest `buffer.reserve_mb`: half the trim threshold, so that the freed reserve is kept."""
RESERVE_CHUNK_BYTES = 16 << 20
"""The reserve is faulted in chunks of this size: below the mmap threshold, so they come from the heap."""

_CONFIGURED = "malloc: one arena, no trim"
_configured: str | None = None  # what configure_malloc did (None: not called yet)


def configure_malloc() -> str:
    """Step 1 of the module docstring (call before any thread starts; again is a no-op); returns what was done, for
    the service's log. Never raises."""
    global _configured
    if _configured is None:
        _configured = _mallopt()
    return _configured


def _mallopt() -> str:
    if not sys.platform.startswith("linux"):
        return "malloc left as is (not Linux)"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "malloc left as is (no mallopt in this C library)"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    settings = {"arena_max": (M_ARENA_MAX, 1), "trim_threshold": (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
                "mmap_threshold": (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)}  # fmt: skip
    refused = [name for name, (option, value) in settings.items() if mallopt(option, value) != 1]
    if refused:
        return f"malloc: mallopt refused {', '.join(refused)} (the others are set)"
    return _CONFIGURED


def reserve(reserve_bytes: int) -> str:
    """Step 2 of the module docstring: fault in `reserve_bytes` (rounded up to RESERVE_CHUNK_BYTES, at most
    MAX_RESERVE_MB) of heap and free it; returns what was done. Never raises: without the memory, no reserve."""
    if configure_malloc() != _CONFIGURED:
        return "no reserve (malloc not configured)"
    chunks = -(-min(reserve_bytes, MAX_RESERVE_MB << 20) // RESERVE_CHUNK_BYTES)
    try:
        blocks = [bytearray(RESERVE_CHUNK_BYTES) for _ in range(chunks)]
    except MemoryError:
        return "no reserve (not enough memory for it)"
    del blocks  # freed, not trimmed: the heap keeps the faulted pages for the frames to come
    return f"{chunks * RESERVE_CHUNK_BYTES >> 20} MiB faulted in"
