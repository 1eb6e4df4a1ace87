"""Peak memory of a learner step: hand the C heap's free pages back to the kernel before the publication.

glibc keeps memory that torch frees in its heap for reuse, and a heap does not shrink below a live block: the
activations and gradients a step frees stay resident while the optimizer allocates AdamW's state and temporaries and
the publication quantizes the weights and measures their error, so the peak resident size of the process is their
sum. `trim_heap` (glibc's `malloc_trim(0)`: the top of every arena is released and the free pages inside it are
given back with `madvise`) at the end of the update makes the publication start from the live tensors: on the
SmolLM2-135M shape of `asyncrl bench learner` its phase's peak falls by 0.4-0.6 GB (the row's first-step peak from
3.75 to 3.14 GB). It changes no value. The next step page-faults the memory it reuses again (about 1 s per GB on
these VMs, 1-2% of that step), so it runs only when at least `TRIM_MIN_FREE_BYTES` are free (never on the tiny
models, whose steps are short) and once a step: after every micro-batch it would cost 17% of the forward and
backward time, and before the optimizer or after the first micro-batch it saved less than the run-to-run spread
of the peak (0.1-0.2 GB).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

TRIM_MIN_FREE_BYTES = 256 * 2**20
"""Free heap bytes below which `trim_heap` does nothing (its page faults would cost more than the memory is worth)."""


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]  # fmt: skip


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    if libc is None or not hasattr(libc, "malloc_trim") or not hasattr(libc, "mallinfo2"):
        return None  # not glibc >= 2.33 (musl, macOS): nothing to trim
    libc.mallinfo2.restype = _MallInfo2
    return libc


def free_heap_bytes() -> int | None:
    """Bytes free inside the C heap's arenas (glibc `mallinfo2().fordblks`); None where unknown."""
    libc = _libc()
    return None if libc is None else int(libc.mallinfo2().fordblks)


def trim_heap(min_free_bytes: int = TRIM_MIN_FREE_BYTES) -> bool:
    """Give the C heap's free pages back to the kernel when at least `min_free_bytes` are free; whether it did."""
    libc = _libc()
    if libc is None or libc.mallinfo2().fordblks < min_free_bytes:
        return False
    libc.malloc_trim(0)
    return True
