"""Fault injection for `asyncrl bench chaos`: finding a live run's processes and killing them on a seeded schedule.

The processes of a run started by `asyncrl up` (the driver, in a session of its own):

| kind | what it is | how it is found |
|---|---|---|
| `buffer` | a subprocess of the driver (`python -m buffer ...`) | a direct child running `python -m buffer` |
| `learner` | a Ray actor per rank (`ray::Learner`) | a descendant of the driver named after `Learner` |
| `worker` | a Ray actor per rollout worker (`ray::RolloutWorker`) | a descendant named after `RolloutWorker` |

`plan_faults` draws a schedule from a seed: each kind `per_kind` times, signals alternating SIGKILL and SIGTERM in a
shuffled order, each fault after a random number of logged steps (counted over the whole run, redone steps
included) plus a random delay under a second. `inject` runs the schedule against a live run: it waits for each
fault's step, kills a process of that kind, then waits until the run recovered (the restart event of that kind,
then a step logged after it) before the next fault, so that every fault is measured on its own.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

KINDS = ("worker", "buffer", "learner")
RESTART_EVENT = {"worker": "worker_started", "buffer": "buffer_restarted", "learner": "learner_restarted"}
"""The metrics.jsonl event that says a process of each kind was started again."""
POLL_S = 0.1


@dataclass(slots=True)
class Fault:
    kind: str
    signal: str
    """`SIGKILL` or `SIGTERM`."""
    after_steps: int
    """Injected once the run has logged this many step records (redone steps included)."""
    delay_s: float
    """Then after this many seconds (a random point inside a step)."""
    pid: int = 0
    at_unix: float = 0.0
    """When the signal was sent (0: never injected)."""
    recovered_unix: float = 0.0
    """The first step logged after the restart event of its kind (0: never recovered)."""
    event: dict[str, Any] | None = None
    """The restart event (`buffer_restarted`, `learner_restarted`, `worker_started`)."""

    @property
    def recovery_s(self) -> float:
        """From the signal to the first step after the restart (nan when not recovered)."""
        return self.recovered_unix - self.at_unix if self.recovered_unix and self.at_unix else float("nan")

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "recovery_s": self.recovery_s}


def plan_faults(seed: int, per_kind: int, first_step: int, last_step: int) -> list[Fault]:
    """`per_kind` faults of each kind at random step counts in [first_step, last_step), in step order."""
    if per_kind < 1 or last_step - first_step < per_kind * len(KINDS):
        raise ValueError(f"cannot place {per_kind} faults of each kind between steps {first_step} and {last_step}")
    rng = random.Random(seed)
    faults = []
    for kind in KINDS:
        signals = [("SIGKILL", "SIGTERM")[i % 2] for i in range(per_kind)]
        rng.shuffle(signals)
        faults += [Fault(kind, sig, 0, round(rng.uniform(0.0, 1.0), 3)) for sig in signals]
    rng.shuffle(faults)
    steps = sorted(rng.sample(range(first_step, last_step), len(faults)))
    for fault, step in zip(faults, steps):
        fault.after_steps = step
    return faults


def records(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics.jsonl records (a torn last line is left out)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def step_records(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if "loss" in r and "event" not in r]


def _descendants(driver_pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(driver_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _named(process: psutil.Process, name: str) -> bool:
    try:
        # a Ray actor, or a local one (common/local_actors.py; a forked one's command line is one string, setproctitle)
        return f"ray::{name}" in process.name() or f"actor:{name}" in " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def buffer_process(driver_pid: int) -> psutil.Process | None:
    """The run's buffer process: the driver's child running `python -m buffer` (None when there is none)."""
    try:
        children = psutil.Process(driver_pid).children()
    except psutil.NoSuchProcess:
        return None
    for child in children:
        try:
            if child.cmdline()[1:3] == ["-m", "buffer"] and child.status() != psutil.STATUS_ZOMBIE:
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return None


def learner_processes(driver_pid: int) -> list[psutil.Process]:
    """The learner's ranks (Ray actors `ray::Learner`)."""
    return [p for p in _descendants(driver_pid) if _named(p, "Learner")]


def worker_processes(driver_pid: int) -> list[psutil.Process]:
    """The rollout workers (Ray actors `ray::RolloutWorker`)."""
    return [p for p in _descendants(driver_pid) if _named(p, "RolloutWorker")]


def find_victim(kind: str, driver_pid: int, rng: random.Random) -> psutil.Process | None:
    """A live process of `kind` in the run of `driver_pid` (a random one among several), or None."""
    if kind == "buffer":
        return buffer_process(driver_pid)
    found = learner_processes(driver_pid) if kind == "learner" else worker_processes(driver_pid)
    return rng.choice(found) if found else None


def _recovered(fault: Fault, rows: list[dict[str, Any]]) -> tuple[dict[str, Any], float] | None:
    """(the restart event, the time of the first step after it) once both are logged."""
    name = RESTART_EVENT[fault.kind]
    event = next((r for r in rows if r.get("event") == name and r["time"] > fault.at_unix
                  and (fault.kind != "buffer" or r.get("dead_pid") == fault.pid)), None)  # fmt: skip
    if event is None:
        return None
    step = next((r for r in step_records(rows) if r["time"] > event["time"]), None)
    return (event, step["time"]) if step is not None else None


def inject(proc: subprocess.Popen, run_dir: Path, faults: list[Fault], seed: int, timeout_s: float) -> None:
    """Run `faults` against the live run of `proc` (in order; each waits for the previous one's recovery). Stops
    early when the run exits; a fault not injected keeps `at_unix == 0`, one not recovered `recovered_unix == 0`."""
    rng = random.Random(seed + 1)
    for fault in faults:
        deadline = time.monotonic() + timeout_s
        while len(step_records(records(run_dir))) < fault.after_steps:
            if proc.poll() is not None or time.monotonic() > deadline:
                return
            time.sleep(POLL_S)
        time.sleep(fault.delay_s)
        victim = None
        while victim is None:  # a process being restarted (after the previous fault) is not there yet
            if proc.poll() is not None or time.monotonic() > deadline:
                return
            victim = find_victim(fault.kind, proc.pid, rng)
            if victim is None:
                time.sleep(POLL_S)
        fault.pid, fault.at_unix = victim.pid, time.time()
        try:
            victim.send_signal(getattr(signal, fault.signal))
        except psutil.NoSuchProcess:
            fault.at_unix = 0.0  # it ended on its own just now: try the next fault
            continue
        while (done := _recovered(fault, records(run_dir))) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                return
            time.sleep(POLL_S)
        fault.event, fault.recovered_unix = done


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the run's whole session (the driver, its buffer and its Ray cluster) if it still runs."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
