"""`trim_heap`: the C heap's free pages go back to the kernel, and only when enough of them are free."""

from __future__ import annotations

import torch

from learner.memory import free_heap_bytes, trim_heap

MIB = 2**20


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))


def test_trim_heap_gives_the_free_pages_back_and_skips_a_heap_with_little_free():
    assert not trim_heap(min_free_bytes=2**62)  # never that much free: nothing done
    blocks = [torch.ones(2**14) for _ in range(3000)]  # 64 KiB each: glibc's heap (below its mmap threshold)
    keep = blocks[::100]  # live blocks spread over the heap: it cannot shrink, only give pages back inside
    del blocks
    free = free_heap_bytes()
    assert free is not None and free >= 150 * MIB
    before = _rss_bytes()
    assert trim_heap(min_free_bytes=64 * MIB)
    assert _rss_bytes() < before - 100 * MIB
    assert all(float(block.sum()) == 2**14 for block in keep)  # live tensors untouched
