"""Peak memory of a learner step: hand the C heap's free pages back to the kernel before the publication.

glibc keeps memory that torch frees in its heap for reuse, and a heap does not shrink below a live block: the
activations and gradients a step frees stay resident while the optimizer allocates AdamW's state and temporaries and
the publication quantizes the weights and measures their error, so the peak resident size of the process is their
sum. `trim_heap` (glibc's `malloc_trim(0)`: the top of every arena is released and the free pages inside it are
given back with `madvise`) at the end of the update makes the publication start from the live tensors: on the
SmolLM2-135M shape of `asyncrl bench learner`, with glibc's default settings, its phase's peak falls by 0.4-0.6 GB
(the row's first-step peak from 3.75 to 3.14 GB). It changes no value. But the next step page-faults the memory it
reuses again, and that is not cheap: on the ~100M decode shape of `asyncrl bench e2e` (4,255 tokens a step) the
forward faulted 0.9M pages (3.7 GB) every step, 1.2-3.3 s of system time in a 15 s step. A learner rank now runs
with glibc settings under which a step's allocations come from the heap and stay there (`learner.group`'s
`LEARNER_MALLOC`: mmap threshold 1 GiB, automatic trimming off), so the publication reuses the pages the
activations freed. The update gives pages back (`learner.update.train_on_batch`) only while the machine runs short of
memory (`TRIM_BELOW_AVAILABLE`): later steps reuse what the first left. Until 2026-12-05 it also gave them back after
the first update, the one that allocates AdamW's state on top of the freed activations, because the publication's
quantizer then added four fp32 temporaries of the largest matrix (the SmolLM2 shape's first-step peak 3.02-3.24 GB
without the trim, 2.71-2.84 with it: `learner_peak_rss_gb_smol`, target 3); the second step page-faulted all of it
again, 2.3-2.5 s on top of a 14 s decode-shape step of `asyncrl bench e2e` (Zen 4, 2026-12-05). The quantizer now
works in blocks of rows (`quant_sync.quantizers.WEIGHT_CHUNK_ELEMENTS`), and the first-step peak without the trim is
2.73-2.77 GB. Measured on that row
(`python -m asyncrl.bench.learner_bench --rows smol`, Zen 5, 2026-11-25, two runs each, alternated): step 14.18 and
14.14 -> 13.03 and 12.74 s, forward 5.07 and 4.95 -> 3.69 and 3.67 s, `learner_mfu_smol` 0.64 -> 0.70 and 0.72,
first-step peak 2.73 and 2.77 -> 2.72 and 2.75 GB, steady peak 4.22 -> 4.52-4.64 GB. It runs only when at least
`TRIM_MIN_FREE_BYTES` are free (never on the tiny models, whose steps are short) and once a step: after every
micro-batch it would cost 17% of the forward and backward time.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

TRIM_MIN_FREE_BYTES = 256 * 2**20
"""Free heap bytes below which `trim_heap` does nothing (its page faults would cost more than the memory is worth)."""
TRIM_BELOW_AVAILABLE = 0.25
"""`trim_heap` gives pages back only while the machine's available memory is below this share of its total: with
memory to spare, the pages kept save the next step their page faults."""


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


def _meminfo_kib() -> dict[str, int]:
    """MemTotal and MemAvailable of /proc/meminfo in KiB (those present; none where unreadable)."""
    fields = {}
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                name, _, rest = line.partition(":")
                if name in ("MemTotal", "MemAvailable"):
                    fields[name] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        return {}
    return fields


def available_memory_share() -> float | None:
    """The machine's available memory over its total (`MemAvailable / MemTotal`, /proc/meminfo); None where
    unknown."""
    fields = _meminfo_kib()
    if fields.get("MemTotal", 0) <= 0 or "MemAvailable" not in fields:
        return None
    return fields["MemAvailable"] / fields["MemTotal"]


def available_memory_bytes() -> int | None:
    """The machine's available memory in bytes (`MemAvailable`, /proc/meminfo); None where unknown."""
    kib = _meminfo_kib().get("MemAvailable")
    return None if kib is None else kib * 1024


def trim_heap(min_free_bytes: int = TRIM_MIN_FREE_BYTES, below_available_share: float = TRIM_BELOW_AVAILABLE) -> bool:
    """Give the C heap's free pages back to the kernel when at least `min_free_bytes` are free and the machine is
    short of memory (its available share below `below_available_share`, or unknown); whether it did."""
    libc = _libc()
    if libc is None or libc.mallinfo2().fordblks < min_free_bytes:
        return False
    share = available_memory_share()
    if share is not None and share >= below_available_share:
        return False
    libc.malloc_trim(0)
    return True
