"""Start-up of `asyncrl up`, measured: seconds from the driver process's start to each milestone.

The driver marks each milestone as it passes it and logs them all as one `startup` event in metrics.jsonl once the
first step is done (`StartupClock.log`), so that a slow start-up says where its time went:

| mark | reached when |
|---|---|
| `driver_imports` | the driver's modules are imported and the config is loaded (`run` begins) |
| `inputs_checked` | dataset rows, model directory, tokenizer and keys checked |
| `buffer_ready` | the buffer service answered READY |
| `ray_ready` | `ray.init` returned (a local cluster started, or a remote one joined); at once with `launcher=local` |
| `actors_created` | the learner and the rollout worker actors were asked for (their processes start now) |
| `learner_ready` | the learner has its model and published version 0 |
| `workers_running` | every rollout worker has built its engine, has version 0 and generates |
| `first_step` | the first train step returned to the driver |

With the seconds of each mark the event carries `cpu_s`: CPU-seconds (user + system) spent so far by the driver and
by each kind of process it started, read from /proc when the event is logged (`process_tree_cpu_s`): `learner`,
`rollout_workers` (all of them), `buffer`, `ray` (Ray's own services and idle workers) and `driver` itself. A process
that ended before is not counted; off Linux only `driver` is there. Wall seconds on a shared machine measure the
neighbours as much as the start-up; CPU-seconds say what the start-up itself costs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


def process_start_unix() -> float:
    """When this process started (unix seconds), from /proc: its start in clock ticks since boot, against the boot
    clock now (`CLOCK_BOOTTIME`, the clock those ticks count on). Not /proc/stat's `btime`: whole seconds, so a start
    read against it was early by the boot's fraction of a second (0.94 s on one VM: every start-up read that much
    longer in `driver_imports`). Now where /proc is not there (not Linux)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start_s_since_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat(5), after the ")"
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - start_s_since_boot)
    except (OSError, ValueError, IndexError, AttributeError):  # AttributeError: no CLOCK_BOOTTIME off Linux
        return time.time()


class StartupClock:
    """Milestones of a start-up, each in seconds since the process started (`process_start_unix`)."""

    def __init__(self, origin_unix: float | None = None) -> None:
        self.origin_unix = process_start_unix() if origin_unix is None else origin_unix
        self.marks: dict[str, float] = {}
        self.driver_cpu_s: dict[str, float] = {}
        """This process's CPU-seconds at each mark."""

    def mark(self, name: str) -> float:
        """Record that `name` is reached now; the seconds since the process started."""
        self.marks[name] = round(time.time() - self.origin_unix, 3)
        self.driver_cpu_s[name] = round(time.process_time(), 3)
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
        """The `startup` event's fields: each mark's seconds since the process started, the phases, the driver's
        CPU-seconds at each mark and the CPU-seconds of the process tree now (`process_tree_cpu_s`)."""
        return {"at_s": dict(self.marks), "phase_s": self.phases(), "driver_cpu_s": dict(self.driver_cpu_s),
                "cpu_s": process_tree_cpu_s()}  # fmt: skip


PROCESS_KINDS = (
    ("ray::Learner", "learner"), ("actor:Learner", "learner"), ("ray::RolloutWorker", "rollout_workers"),
    ("actor:RolloutWorker", "rollout_workers"), ("-m buffer", "buffer"), ("-m common.zygote", "zygote"),
)  # fmt: skip
"""(command-line mark, kind) of the processes `process_tree_cpu_s` names: Ray actors (`ray::Class`), local ones
(`common.actor_host actor:Class`) and their fork server (`common.zygote`: the imports they share); other descendants
are Ray's (`ray`)."""


def process_tree_cpu_s(root_pid: int | None = None) -> dict[str, float]:
    """CPU-seconds (user + system) of a process and of its living descendants, summed by kind (`PROCESS_KINDS`;
    the root itself is `driver`). Only `driver` where /proc cannot be read (not Linux)."""
    root_pid = os.getpid() if root_pid is None else root_pid
    totals = {"driver": round(time.process_time(), 3)} if root_pid == os.getpid() else {}
    try:
        pids = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return totals
    table = {pid: stat for pid in pids if (stat := _proc_stat(pid)) is not None}
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    ticks = os.sysconf("SC_CLK_TCK")
    pending, sums = list(children.get(root_pid, [])), {}
    while pending:
        pid = pending.pop()
        pending.extend(children.get(pid, []))
        kind = next((name for mark, name in PROCESS_KINDS if mark in _cmdline(pid)), "ray")
        sums[kind] = sums.get(kind, 0.0) + table[pid][1] / ticks
    if root_pid != os.getpid() and root_pid in table:
        totals["driver"] = round(table[root_pid][1] / ticks, 3)
    return {**totals, **{kind: round(seconds, 3) for kind, seconds in sorted(sums.items())}}


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, user + system clock ticks) of a process; None if it ended or cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[11]) + int(fields[12])  # ppid, utime, stime: fields 4, 14, 15 of stat(5)
    except (OSError, ValueError, IndexError):
        return None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def quiet_libraries() -> None:
    """No progress bars or advisory warnings from transformers / HF hub in this process or the actors it starts."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("PYTHONWARNINGS", "ignore::UserWarning,ignore::FutureWarning")


def start_fork_server_early() -> None:
    """Start the local actors' fork server (`common.zygote`) as `asyncrl up` begins, before its config is read: the
    server's imports of torch and transformers (about 3.5 CPU-seconds, the longest stretch of a local start-up)
    then overlap the driver's reading of the config (about 0.35 s) too. A run whose launcher turns out to be Ray ends
    it (`asyncrl.driver.run` calls `common.zygote.discard`)."""
    from common import zygote

    quiet_libraries()  # first: the fork server imports transformers, which reads it at import
    zygote.start()
