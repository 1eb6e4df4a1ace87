"""`pid_alive`: a running process is alive; one that exited is not, reaped or still a zombie."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from common.processes import pid_alive


def test_a_running_process_is_alive_and_an_exited_one_is_not_reaped_or_not() -> None:
    assert pid_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while pid_alive(child.pid):  # exited but not reaped: a zombie, which is not alive
        assert time.monotonic() < deadline, "a zombie was taken for a live process"
        time.sleep(0.05)
    assert child.poll() == 0  # reaped now
    assert not pid_alive(child.pid)
