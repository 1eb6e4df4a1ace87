"""Running a study's cells x seeds, each as its own `asyncrl up` process, resumably, with a progress line.

A run's state is read from its directory (runs/studies/<name>/<cell>/seed<k>):

| state | seen as | what `run_study` does |
|---|---|---|
| done | summary.json with `stopped_early: false` and `steps` >= the run's train.steps | skips it |
| stopped | a checkpoint in checkpoints/ (a graceful stop writes one), `buffer.journal` on | `asyncrl up --resume DIR` |
| partial | anything else in the directory (a crash, a hard kill) | removes the directory, starts over |
| new | no directory | `asyncrl up BASE <overrides>` |

A run that exits non-zero is recorded (`seed<k>.status.json`: its exit code and log) and the study goes on with the
next one; the study's exit code says that some failed, and the next `asyncrl study` tries them again.

Ctrl-C / SIGTERM to the study: the first is passed on to the running `asyncrl up` processes as SIGTERM (each finishes
its step, writes a checkpoint and stops; the next `asyncrl study` resumes them); a second one is passed on as SIGINT
(they stop at once, without a checkpoint: those runs start over). On Linux a run also gets SIGTERM if the study
process dies without passing anything on (prctl PDEATHSIG), so no run outlives its study.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl import checkpoint, run_lock
from asyncrl.study_spec import RunSpec, Study

LOCK_FILE = "study.lock"
"""runs/studies/<name>/study.lock: held (flock) by the `asyncrl study` running the study; a second one is refused."""
POLL_S = 0.5
"""How often the study polls its running processes and their metrics."""
PLAIN_PROGRESS_EVERY_S = 15.0
"""Off a terminal, a progress line at most this often (and at every start and end of a run)."""
_PR_SET_PDEATHSIG = 1


def run_state(run: RunSpec) -> str:
    """`done`, `stopped` (resumable), `partial` (start over) or `new`, read from the run's directory; `running` when
    a driver holds it (another `asyncrl up` or study: never touched), `stale` when the study made it with other
    overrides than the cell has now (its figures are not the cell's: never reported or resumed as it)."""
    if not run.run_dir.exists():
        return "new"
    if run_lock.holder(run.run_dir) is not None:
        return "running"
    made_with = read_status(run).get("overrides")
    if isinstance(made_with, list) and tuple(made_with) != run.overrides:
        return "stale"
    steps = checkpoint.finished_steps(run.run_dir)
    if steps is not None and steps >= run.steps:
        return "done"
    if run.journal and (run.run_dir / "config.json").is_file() and checkpoint.latest(run.run_dir) is not None:
        return "stopped"
    return "partial"


def up_command(run: RunSpec, base: Path, state: str) -> list[str]:
    """The `asyncrl up` command of a run in `state` (`stopped`: resume it; otherwise a fresh run)."""
    cli = [sys.executable, "-m", "asyncrl.cli", "up"]
    if state == "stopped":  # train.steps: the cell's now (the run's config.json may hold fewer)
        return [*cli, "--resume", str(run.run_dir), "logging.console=false", f"train.steps={run.steps}"]
    return [*cli, str(base), *run.overrides]


def last_step(run_dir: Path) -> int:
    """Steps a run has logged so far (the last step record of metrics.jsonl + 1; 0 before the first)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    with path.open("rb") as handle:
        handle.seek(max(0, path.stat().st_size - 16384))
        tail = handle.read().decode(errors="replace").splitlines()
    for line in reversed(tail):
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and "event" not in record and "step" in record:
                return int(record["step"]) + 1
    return 0


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(slots=True)
class _Running:
    run: RunSpec
    process: subprocess.Popen[bytes]
    started: float
    log: Any
    resumed: bool
    number: int
    """Its position in the study (1-based), for the progress line."""


@dataclass(slots=True)
class Progress:
    """What the progress line shows: run i of n, its step, and the time left estimated from finished runs."""

    total: int
    parallel: int
    done_before: int = 0
    """Runs already done when this invocation started (skipped)."""
    finished: int = 0
    seconds_per_step: list[float] = field(default_factory=list)
    """Wall seconds per step of each run finished by this invocation (launch overhead included)."""
    remaining_steps: int = 0
    """Steps of the runs not yet started."""
    stream: Any = None
    _last_plain: float = 0.0

    def line(self, running: list[_Running]) -> str:
        parts = [f"run {item.number}/{self.total} {item.run.cell} seed {item.run.seed} "
                 f"step {last_step(item.run.run_dir)}/{item.run.steps}" for item in running]  # fmt: skip
        left = self.seconds_left(running)
        eta = "time left: unknown until a run finishes" if left is None else f"time left ~{_duration(left)}"
        done = self.done_before + self.finished
        return "study: " + "; ".join(parts or [f"{done}/{self.total} runs done"]) + f"; {eta}"

    def seconds_left(self, running: list[_Running]) -> float | None:
        if not self.seconds_per_step:
            return None
        per_step = sum(self.seconds_per_step) / len(self.seconds_per_step)  # start-up included, spread over steps
        in_flight = sum(item.run.steps - last_step(item.run.run_dir) for item in running)
        return (in_flight + self.remaining_steps) * per_step / max(1, self.parallel)

    def show(self, running: list[_Running], force: bool = False) -> None:
        stream = self.stream or sys.stdout
        text = self.line(running)
        if stream.isatty():
            stream.write("\r\x1b[2K" + text[: shutil.get_terminal_size().columns - 1])
            stream.flush()
        elif force or time.monotonic() - self._last_plain >= PLAIN_PROGRESS_EVERY_S:
            self._last_plain = time.monotonic()
            print(text, file=stream, flush=True)

    def say(self, message: str) -> None:
        stream = self.stream or sys.stdout
        prefix = "\r\x1b[2K" if stream.isatty() else ""
        print(prefix + message, file=stream, flush=True)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


class _Signals:
    """First Ctrl-C / SIGTERM: stop starting runs, pass SIGTERM on; second: pass SIGINT on (stop at once)."""

    def __init__(self) -> None:
        self.count = 0
        self._previous: dict[int, Any] = {}

    @contextlib.contextmanager
    def installed(self, running: list[_Running], say: Callable[[str], None]) -> Iterator[None]:
        def handle(signum: int, frame: object) -> None:
            self.count += 1
            forward = signal.SIGTERM if self.count == 1 else signal.SIGINT
            say(f"study: {signal.Signals(signum).name}: stopping the running runs "
                f"({'checkpoint, resumable' if self.count == 1 else 'at once'}); again: stop at once")  # fmt: skip
            for item in running:
                with contextlib.suppress(ProcessLookupError):
                    item.process.send_signal(forward)

        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, handle)
        try:
            yield
        finally:
            for sig, previous in self._previous.items():
                signal.signal(sig, previous)


def _start(run: RunSpec, base: Path, progress: Progress, number: int) -> _Running:
    state = run_state(run)
    if state == "partial":
        progress.say(f"study: {run.label}: an unfinished run without a checkpoint in {run.run_dir}: starting over")
        shutil.rmtree(run.run_dir)
    elif state == "stopped":
        progress.say(f"study: {run.label}: resuming {run.run_dir} from its latest checkpoint")
    run.run_dir.parent.mkdir(parents=True, exist_ok=True)
    argv = up_command(run, base, state)
    # the overrides are recorded before the run starts, so that one the study cannot finish (killed with it) is
    # `stale`, not resumed as another cell's, when the study file changes before the next attempt
    status = {**read_status(run), "returncode": None, "log": str(run.log_path), "overrides": list(run.overrides)}
    _status_path(run).write_text(json.dumps(status))
    log = run.log_path.open("a")
    log.write(f"$ {' '.join(argv)}\n")
    log.flush()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                               preexec_fn=_die_with_parent)  # fmt: skip
    resumed = state == "stopped"
    return _Running(run=run, process=process, started=time.monotonic(), log=log, resumed=resumed, number=number)


def _status_path(run: RunSpec) -> Path:
    return run.run_dir.with_name(run.run_dir.name + ".status.json")


def read_status(run: RunSpec) -> dict[str, Any]:
    """The study's record of a run's last attempt: {"returncode" (null while it runs), "wall_s", "log", "overrides",
    "interrupted" (stopped by the study's Ctrl-C / SIGTERM)} ({} before any)."""
    path = _status_path(run)
    try:
        status = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}


class StudyBusyError(RuntimeError):
    """Another `asyncrl study` process is running the same study (it holds runs/studies/<name>/study.lock)."""


@contextlib.contextmanager
def study_lock(out_dir: Path) -> Iterator[None]:
    """Hold runs/studies/<name>/study.lock for the duration; StudyBusyError if another process holds it."""
    import fcntl

    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / LOCK_FILE).open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StudyBusyError(f"{out_dir}: another `asyncrl study` is running this study") from None
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield


def run_study(study: Study, parallel: int = 1, stream: Any = None) -> dict[str, int]:
    """Run every run of `study` not yet done, up to `parallel` at a time; returns counts by outcome
    {"skipped", "done", "failed", "interrupted"}. StudyBusyError if another process is running the same study."""
    if parallel < 1:
        raise ValueError(f"--parallel must be at least 1, got {parallel}")
    with study_lock(study.out_dir):
        return _run_all(study, parallel, stream)


def _run_all(study: Study, parallel: int, stream: Any) -> dict[str, int]:
    states = {run: run_state(run) for run in study.runs}
    left_alone = [run for run in study.runs if states[run] in ("running", "stale")]
    pending = [run for run in study.runs if states[run] != "done" and run not in left_alone]
    progress = Progress(total=len(study.runs), parallel=parallel, done_before=len(study.runs) - len(pending),
                        remaining_steps=sum(run.steps for run in pending), stream=stream)  # fmt: skip
    for run in study.runs:  # the time-left estimate starts from the runs an earlier invocation finished
        earlier = read_status(run)
        if states[run] == "done" and earlier.get("returncode") == 0 and earlier.get("fresh"):
            progress.seconds_per_step.append(float(earlier["wall_s"]) / max(1, run.steps))
    progress.done_before -= len(left_alone)
    counts = {"skipped": progress.done_before, "done": 0, "failed": 0, "interrupted": 0, "left": len(left_alone)}
    for run in left_alone:
        progress.say(f"study: {run.label}: {_left_alone_reason(run, states[run])}")
    if progress.done_before:
        progress.say(f"study {study.name}: {progress.done_before} of {len(study.runs)} runs already done (skipped)")
    running: list[_Running] = []
    signals = _Signals()
    with signals.installed(running, progress.say):
        while pending or running:
            while pending and len(running) < parallel and not signals.count and _started_up(running):
                run = pending.pop(0)
                progress.remaining_steps -= run.steps
                number = len(study.runs) - len(pending)
                running.append(_start(run, study.base, progress, number))
                progress.show(running, force=True)
            if not running:
                break  # stopped by a signal before the remaining runs started
            time.sleep(POLL_S)
            for item in [item for item in running if item.process.poll() is not None]:
                running.remove(item)
                outcome = _finish(item, progress, interrupted=bool(signals.count))
                counts[outcome] += 1
                progress.show(running, force=True)
            progress.show(running)
    if (stream or sys.stdout).isatty():
        print(file=stream or sys.stdout)
    return counts


def _left_alone_reason(run: RunSpec, state: str) -> str:
    if state == "running":
        return (f"{run.run_dir} is held by another driver (pid {run_lock.holder(run.run_dir) or '?'}: an `asyncrl up` "
                "or a study still stopping): left alone; run the study again once it has ended")  # fmt: skip
    made_with = " ".join(read_status(run).get("overrides", []))
    return (
        f"{run.run_dir} was made with other overrides ({made_with}) than the cell has now: its figures are not "
        "this cell's; move it aside (or delete it) and run the study again to run the cell as it is"
    )


def _started_up(running: list[_Running]) -> bool:
    """True once every running run has logged a step: `--parallel` starts the next run only then, so two local Ray
    clusters never start at the same moment (on a loaded 2-core machine, two at once have failed to reach their GCS
    within Ray's 60 s), while one run's start-up still overlaps the other's steps."""
    return all(last_step(item.run.run_dir) > 0 for item in running)


def _finish(item: _Running, progress: Progress, interrupted: bool) -> str:
    item.log.close()
    wall_s = time.monotonic() - item.started
    code = item.process.returncode
    before = read_status(item.run).get("wall_s") if item.resumed else None  # the attempts before it count too
    total_s = wall_s + (float(before) if isinstance(before, int | float) else 0.0)
    status = {"returncode": code, "wall_s": total_s, "log": str(item.run.log_path), "fresh": not item.resumed,
              "overrides": list(item.run.overrides), "interrupted": interrupted}  # fmt: skip
    _status_path(item.run).write_text(json.dumps(status))
    state = run_state(item.run)
    if state == "done":
        progress.finished += 1
        if not item.resumed:  # a resumed run ran only part of its steps
            progress.seconds_per_step.append(wall_s / max(1, item.run.steps))
        progress.say(f"study: {item.run.label} done in {_duration(wall_s)}")
        return "done"
    if interrupted:
        progress.say(f"study: {item.run.label} stopped ({state}); the next `asyncrl study` continues it")
        return "interrupted"
    tail = item.run.log_path.read_text(errors="replace").splitlines()[-15:]
    progress.say(f"study: {item.run.label} FAILED (exit code {code}); log {item.run.log_path}:\n  "
                 + "\n  ".join(tail))  # fmt: skip
    return "failed"
