"""`trim_heap`: the C heap's free pages go back to the kernel, and only when enough of them are free and the machine
is short of memory."""

from __future__ import annotations

import torch

from learner.memory import available_memory_bytes, available_memory_share, free_heap_bytes, trim_heap

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
    assert not trim_heap(min_free_bytes=64 * MIB, below_available_share=0.0)  # memory to spare: the pages stay
    assert _rss_bytes() > before - 50 * MIB
    assert trim_heap(min_free_bytes=64 * MIB, below_available_share=1.01)  # short of memory (every share is below)
    assert _rss_bytes() < before - 100 * MIB
    assert all(float(block.sum()) == 2**14 for block in keep)  # live tensors untouched


def test_the_available_share_is_read_from_the_kernel():
    share = available_memory_share()
    assert share is not None and 0.0 < share <= 1.0


def test_the_available_bytes_are_read_from_the_kernel_and_unknown_without_meminfo(monkeypatch):
    import builtins

    share, available = available_memory_share(), available_memory_bytes()
    assert share is not None and available is not None
    with open("/proc/meminfo") as meminfo:
        total_kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemTotal:"))
    assert 0 < available <= total_kib * 1024
    assert abs(available / (total_kib * 1024) - share) < 0.05  # both MemAvailable, read moments apart
    real_open = builtins.open

    def no_meminfo(path, *args, **kwargs):
        if str(path) == "/proc/meminfo":
            raise PermissionError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_meminfo)
    assert available_memory_bytes() is None and available_memory_share() is None
