"""What a person reads on a terminal while `asyncrl up` runs: a progress bar, the few numbers that matter beside it,
and the recent events underneath (rich `Progress` inside a `Live`); a progress bar for long one-time work too
(building a built-in model; compiling our C++ kernels: `KernelBuilds`).

    dapo_int8 ━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━╸━━━━━━━━━━━━━━  step 42/100  0:01:13 elapsed  ETA 0:01:41 at 1.75 s/step
    reward 0.412  acc 0.388  staleness 0.6 (max 2)  mismatch kl 3.1e-04  rollout 2,410 tok/s  workers 3
    11:02:13 scale rollout=3 added=['worker-2'] step=41
    11:02:27 worker_started worker=worker-2 pid=1234

The ETA is the steps left times the mean of the last `STEP_WINDOW` measured step times (wall time between logged
steps). Not on a TTY (pipes, tests, CI), or with `logging.console=false`, none of this shows: `MetricsLogger` prints
plain lines. `dashboard` is a pure function of a `RunView` and the time, so a test renders it from recorded metrics.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

STEP_WINDOW = 20
"""Step times the ETA averages over: recent enough to follow a live change, long enough to be steady."""
EVENT_LINES = 5
"""Recent events shown under the numbers."""

HEADLINE = (
    ("reward/mean", "reward", "{:.3f}"),
    ("acc/mean", "acc", "{:.3f}"),
    ("staleness/mean", "staleness", "{:.1f}"),
    ("mismatch/kl_k3", "mismatch kl", "{:.1e}"),
    ("perf/rollout_tok_s", "rollout", "{:,.0f} tok/s"),
    ("rollout/workers", "workers", "{:.0f}"),
)
"""(metric, label, format) of the numbers beside the bar; `staleness` also shows `staleness/max`."""


@dataclass(slots=True)
class RunView:
    """What the dashboard shows of a run: its size, the latest step's metrics, recent step times and events."""

    name: str
    total_steps: int
    start_step: int = 0
    """Steps done before this process started (a resumed run): the ETA counts only the steps left."""
    started: float = field(default_factory=time.monotonic)
    metrics: dict[str, Any] = field(default_factory=dict)
    step_times_s: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))
    events: deque[str] = field(default_factory=lambda: deque(maxlen=EVENT_LINES))
    last_step_at: float | None = None

    def record_step(self, metrics: dict[str, Any], now: float) -> None:
        """The metrics of a step just logged at `now` (time.monotonic); its time is the wall time since the last."""
        self.step_times_s.append(now - (self.last_step_at if self.last_step_at is not None else self.started))
        self.last_step_at, self.metrics = now, metrics

    def record_event(self, line: str, wall_time: float) -> None:
        self.events.append(f"{time.strftime('%H:%M:%S', time.localtime(wall_time))} {line}")

    def steps_done(self) -> int:
        step = self.metrics.get("step")
        return int(step) + 1 if _number(step) else self.start_step

    def step_s(self) -> float | None:
        """Mean wall time of the recent steps; the learner's `perf/step_s` before any was timed here."""
        times = list(self.step_times_s)  # one atomic copy (another thread may append)
        if times:
            return sum(times) / len(times)
        value = self.metrics.get("perf/step_s")
        return float(value) if _number(value) else None

    def eta_s(self) -> float | None:
        step_s = self.step_s()
        return None if step_s is None else max(self.total_steps - self.steps_done(), 0) * step_s


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def clock(seconds: float | None) -> str:
    """H:MM:SS, or `-:--:--` when not known."""
    if seconds is None or not math.isfinite(seconds):
        return "-:--:--"
    whole = int(seconds)
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def headline(metrics: dict[str, Any]) -> str:
    """The few numbers that matter, as rich markup: label dim, value bold; a metric not (yet) measured is left out."""
    parts = []
    for key, label, fmt in HEADLINE:
        value = metrics.get(key)
        if not _number(value):
            continue
        text = fmt.format(value)
        if key == "staleness/mean" and _number(metrics.get("staleness/max")):
            text += f" (max {metrics['staleness/max']:.0f})"
        parts.append(f"[dim]{label}[/dim] [bold]{text}[/bold]")
    return "  ".join(parts) or "[dim]waiting for the first step[/dim]"


def dashboard(view: RunView, now: float) -> Any:
    """The live view at `now` (time.monotonic): bar with step i of N, elapsed and ETA; the numbers; recent events."""
    from rich.console import Group
    from rich.progress import BarColumn, Progress, TextColumn
    from rich.text import Text

    step_s = view.step_s()
    pace = f" at {step_s:.2f} s/step" if step_s is not None else ""
    bar = Progress(
        TextColumn("{task.description}", style="bold", markup=False),
        BarColumn(bar_width=None),
        TextColumn("step {task.completed:.0f}/{task.total:.0f}"),
        TextColumn("{task.fields[elapsed]} elapsed"),
        TextColumn("ETA {task.fields[eta]}{task.fields[pace]}"),
        expand=True,
    )
    bar.add_task(view.name, total=max(view.total_steps, 1), completed=view.steps_done(),
                 elapsed=clock(now - view.started), eta=clock(view.eta_s()), pace=pace)  # fmt: skip
    # list(): one atomic copy, as the driver's thread appends while Live's thread draws; Text: events are not markup
    lines = [Text(line, style="dim", overflow="ellipsis", no_wrap=True) for line in list(view.events)]
    return Group(bar, Text.from_markup(headline(view.metrics)), *lines)


@contextlib.contextmanager
def live_dashboard(view: RunView, console: Any) -> Iterator[None]:
    """While open: `dashboard(view)` redrawn twice a second at the bottom of `console` (lines printed meanwhile
    scroll above it); the last frame stays when it closes."""
    from rich.live import Live

    with Live(console=console, refresh_per_second=2, transient=False,
              get_renderable=lambda: dashboard(view, time.monotonic())):  # fmt: skip
        yield


def is_terminal(enabled: bool) -> bool:
    """Whether to draw live views: `logging.console` on and stdout a terminal (not a pipe, a file or CI)."""
    return enabled and sys.stdout.isatty()


@contextlib.contextmanager
def one_time_work(enabled: bool) -> Iterator[Callable[[str], None]]:
    """A `log` for long work that announces itself with a line starting "building" and ends with one starting "built"
    (`common.builtin_model.resolve_model_path`: "building builtin:tiny into ..."). On a terminal with
    `logging.console` on, a pulsing bar with the elapsed time runs between the two; elsewhere the lines are printed
    as they come. The build reports no progress of its own, so the bar pulses rather than fills."""
    if not is_terminal(enabled):
        yield lambda message: print(message, flush=True)
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(highlight=False, soft_wrap=True)
    progress: Progress | None = None

    def log(message: str) -> None:
        nonlocal progress
        if message.startswith("building") and progress is None:
            progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                                console=console, transient=True)  # fmt: skip
            console.print(message)  # in full, once: the bar names only what is being built
            progress.add_task(" ".join(message.split()[:2]), total=None)
            progress.start()
            return
        if progress is not None:
            progress.stop()
            progress = None
        console.print(message)

    try:
        yield log
    finally:
        if progress is not None:
            progress.stop()


class KernelBuilds:
    """What a person sees while the driver compiles our C++ kernels (`asyncrl/kernels.py`): one line per
    kernel with a spinner and its elapsed time on a terminal, replaced by "compiled NAME in S s" when it is done;
    elsewhere plain lines as each starts and ends. Nothing is shown for a kernel found in the cache. Its methods may
    be called from several threads (one per compile)."""

    def __init__(self, enabled: bool, out: Callable[[str], None] | None = None) -> None:
        self._out = out or (lambda message: print(message, flush=True))
        self._progress: Any = None
        self._tasks: dict[str, Any] = {}
        if is_terminal(enabled) and out is None:
            from rich.console import Console
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            columns = (SpinnerColumn(finished_text="[green]✓[/green]"), TextColumn("{task.description}"))
            self._progress = Progress(*columns, TimeElapsedColumn(), console=Console(highlight=False, soft_wrap=True))

    def start(self, names: list[str], compiler: str) -> None:
        """Announce the builds of `names` (before any starts)."""
        line = f"compiling the C++ kernels with {compiler}, once per machine: {', '.join(names)}"
        if self._progress is None:
            self._out(line)
            return
        self._progress.console.print(line)
        self._progress.start()

    def compiling(self, name: str) -> None:
        if self._progress is None:
            self._out(f"compiling kernel {name} ...")
        else:
            self._tasks[name] = self._progress.add_task(f"compiling {name}", total=None)

    def finished(self, name: str, seconds: float, error: str = "") -> None:
        """`name` compiled in `seconds`, or failed with `error` (the compiler's message, the fallback)."""
        line = f"compiled kernel {name} in {seconds:.1f} s" if not error else f"kernel {name} failed: {error}"
        if self._progress is None:
            self._out(line)
            return
        task = self._tasks.pop(name, None)
        if task is not None:
            self._progress.update(task, total=1, completed=1, description=line if not error else f"{name} failed")
            if error:
                self._progress.console.print(line)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
