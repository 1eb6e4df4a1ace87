"""The train gate: rollout workers on the learner's machine pause between decode steps while it trains on every core.

On one machine the workers run under SCHED_IDLE (`rollout_workers.cpu_priority`) and fill the learner's gaps. When
the learner's step splits over every core (a large model: `learner.threads`' measured policy), those gaps are short:
a worker runs a sliver of a decode step, the learner's next GEMM finds its caches full of the worker's weights, and
the step slows by more than the generation gains. On the 100M decode workload of `asyncrl bench e2e` (2 Zen 4
cores, 2026-12-06) the learner trained 13.7-15.6 s a step beside generating workers (14.5-15.6 in three of four
runs) and 13.1-13.9 s behind the gate (13.0-13.4 with the workers stopped outright), while its wait for the next
batch stayed 1.4-1.9 s: 15.5-15.9 s a step against 16.1-17.1.

The gate is an 8-byte file both sides map: 0.0 when open, the wall time the learner closed it otherwise. The
learner closes it around a train step that runs on every core (`Learner.train_step`) and opens it after; a worker
checks it before each decode step and sleeps while it is closed. A gate closed longer than `STALE_S` (a learner that
died in its step) is ignored. The driver names the file in `ENV_VAR` for the processes it starts on this machine
(`ray.launcher=local`), and only when `rollout.pause_during_training` is on: workers started elsewhere (a Ray
cluster) never see it and never pause.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path

ENV_VAR = "ASYNCRL_TRAIN_GATE"
"""The gate file's path, for the learner and the workers the driver starts on its machine."""
STALE_S = 600.0
"""A gate closed for longer than this is treated as open (its learner died or hung mid-step)."""
POLL_S = 0.002
"""How often a paused worker looks at the gate again."""
_FORMAT = "<d"


class TrainGate:
    """One side's view of the gate file at `path` (created, open, when missing)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < struct.calcsize(_FORMAT):  # allocated, not sparse: on a full disk a sparse
                os.posix_fallocate(fd, 0, struct.calcsize(_FORMAT))  # page faults (SIGBUS) at its first write
            self._map = mmap.mmap(fd, struct.calcsize(_FORMAT))
        finally:
            os.close(fd)

    @classmethod
    def from_env(cls) -> TrainGate | None:
        """The gate the driver named in `ENV_VAR`, or None (no gate: never pause)."""
        path = os.environ.get(ENV_VAR, "")
        return cls(path) if path else None

    def close(self) -> None:
        """The learner's train step starts: workers pause at their next decode step."""
        self._map[:] = struct.pack(_FORMAT, time.time())

    def open(self) -> None:
        """The learner's train step ended: workers go on."""
        self._map[:] = struct.pack(_FORMAT, 0.0)

    def closed_since(self) -> float:
        """The wall time the gate was closed, or 0.0 when open."""
        return struct.unpack(_FORMAT, self._map[:])[0]

    def wait(self) -> float:
        """Block while the gate is closed (and not stale); the seconds waited."""
        closed = self.closed_since()
        if not closed:
            return 0.0
        start = time.monotonic()
        while closed and time.time() - closed < STALE_S:
            time.sleep(POLL_S)
            closed = self.closed_since()
        return time.monotonic() - start
