"""The CPU-seconds of the `startup` event: the driver's at each mark and its process tree's, summed by kind."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from asyncrl.startup import StartupClock, process_tree_cpu_s

BURN = """
import sys, time
while time.process_time() < 0.3:
    pass
print(time.process_time(), flush=True)
sys.stdin.read()
"""


def _burner(*argv: str) -> tuple[subprocess.Popen, float]:
    """A child that spends 0.3 CPU-seconds, says how many exactly, then waits for its stdin to close."""
    proc = subprocess.Popen([sys.executable, "-c", BURN, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    assert proc.stdout is not None
    return proc, float(proc.stdout.readline())


def test_the_process_tree_is_summed_by_kind() -> None:
    buffer, buffer_cpu_s = _burner("-m", "buffer")  # the buffer service's command line
    other, other_cpu_s = _burner()
    try:
        tree = process_tree_cpu_s()
        tick_s = 1 / os.sysconf("SC_CLK_TCK")
        assert tree["buffer"] >= buffer_cpu_s - 2 * tick_s
        assert tree["ray"] >= other_cpu_s - 2 * tick_s  # any other descendant counts as Ray's
        assert "learner" not in tree and "rollout_workers" not in tree
        assert tree["driver"] <= time.process_time()
        outside = process_tree_cpu_s(buffer.pid)  # another root: its own CPU, no children
        assert outside["driver"] >= buffer_cpu_s - 2 * tick_s and set(outside) == {"driver"}
    finally:
        for proc in (buffer, other):
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(timeout=30)


def test_the_startup_event_carries_the_driver_cpu_at_each_mark() -> None:
    clock = StartupClock(origin_unix=time.time() - 1.0)
    clock.mark("ray_ready")
    while time.process_time() < clock.driver_cpu_s["ray_ready"] + 0.06:
        pass
    clock.mark("first_step")
    fields = clock.fields()
    assert list(fields["driver_cpu_s"]) == ["ray_ready", "first_step"]
    assert fields["driver_cpu_s"]["first_step"] >= fields["driver_cpu_s"]["ray_ready"] + 0.05  # rounded to 1 ms
    assert fields["cpu_s"]["driver"] >= fields["driver_cpu_s"]["first_step"]
