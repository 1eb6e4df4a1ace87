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

`tune_allocator` therefore, before the ZMQ context and the journal thread exist:
1. puts every thread on the main arena (`M_ARENA_MAX` 1), so the I/O thread allocates from the memory faulted in
   below, not from an arena of its own;
2. never trims (`M_TRIM_THRESHOLD` 1 GiB) and serves allocations up to 32 MiB from the heap (`M_MMAP_THRESHOLD`),
   so freed frames are reused rather than returned to the kernel;
3. faults in `buffer.reserve_mb` of heap once (allocated, written, freed): the first `reserve_mb` of queued groups
   land in pages that are already there.

The cost: the process's resident memory starts at about `reserve_mb` and does not shrink after a peak (the queue is
bounded by `buffer.max_queued_groups`). glibc only; on another C library it does nothing and says so.
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
RESERVE_CHUNK_BYTES = 16 << 20
"""The reserve is faulted in chunks of this size: below the mmap threshold, so they come from the heap."""


def tune_allocator(reserve_bytes: int) -> str:
    """Apply the settings of the module docstring (call before any thread starts); returns what was done, for the
    service's log. Never raises: a libc without `mallopt` leaves the defaults."""
    if not sys.platform.startswith("linux"):
        return "malloc left as is (not Linux)"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "malloc left as is (no mallopt in this C library)"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    settings = ((M_ARENA_MAX, 1), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES), (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    if not all(mallopt(option, value) == 1 for option, value in settings):
        return "malloc left as is (mallopt refused the settings)"
    chunks = [bytearray(RESERVE_CHUNK_BYTES) for _ in range(-(-reserve_bytes // RESERVE_CHUNK_BYTES))]
    del chunks  # freed, not trimmed: the heap keeps the faulted pages for the frames to come
    return f"malloc: one arena, no trim, {reserve_bytes >> 20} MiB faulted in"
