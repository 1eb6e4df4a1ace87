"""Start-up of `asyncrl up`, measured: seconds from the driver process's start to each milestone.

The driver marks each milestone as it passes it and logs them all as one `startup` event in metrics.jsonl once the
first step is done (`StartupClock.log`), so that a slow start-up says where its time went:

| mark | reached when |
|---|---|
| `driver_imports` | the driver's modules are imported and the config is loaded (`run` begins) |
| `inputs_checked` | dataset rows, model directory, tokenizer and keys checked |
| `buffer_ready` | the buffer service answered READY |
| `ray_ready` | `ray.init` returned (a local cluster started, or a remote one joined) |
| `actors_created` | the learner and the rollout worker actors were asked for (their processes start now) |
| `learner_ready` | the learner has its model and published version 0 |
| `workers_running` | every rollout worker has built its engine, has version 0 and generates |
| `first_step` | the first train step returned to the driver |
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


def process_start_unix() -> float:
    """When this process started (unix seconds), from /proc; now where /proc is not there (not Linux)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat(5), counted after the ")" that ends the command name
        boot_unix = next(
            float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
        )
        return boot_unix + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class StartupClock:
    """Milestones of a start-up, each in seconds since the process started (`process_start_unix`)."""

    def __init__(self, origin_unix: float | None = None) -> None:
        self.origin_unix = process_start_unix() if origin_unix is None else origin_unix
        self.marks: dict[str, float] = {}

    def mark(self, name: str) -> float:
        """Record that `name` is reached now; the seconds since the process started."""
        self.marks[name] = round(time.time() - self.origin_unix, 3)
        return self.marks[name]

    def phases(self) -> dict[str, float]:
        """Seconds spent in each phase: from the previous mark (the process start for the first) to this one."""
        out, previous = {}, 0.0
        for name, at_s in self.marks.items():
            out[name] = round(at_s - previous, 3)
            previous = at_s
        return out

    def summary(self) -> str:
        return ", ".join(f"{name} +{seconds:.1f}" for name, seconds in self.phases().items())

    def fields(self) -> dict[str, Any]:
        """The `startup` event's fields: each mark's seconds since the process started, and the phases."""
        return {"at_s": dict(self.marks), "phase_s": self.phases()}
