"""Run logging: one JSON object per step in runs/<name>/metrics.jsonl, a console line per step, optional wandb.

On a terminal (stdout is a TTY) the console shows a live table of the latest step instead (rich.live, see
`live_view`), with the step lines scrolling above it; elsewhere (pipes, tests, CI) it prints the plain lines.

wandb runs offline unless `logging.wandb_mode=online` (with an API key and no network, online `init` hangs). It is an
optional extra: `pip install 'asyncrl[wandb]'`; `logging.wandb=true` without it raises a ConfigError that says so.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common.config import ConfigError, LoggingConfig

CONSOLE_FIELDS = (
    ("step", "step", "{:.0f}"),
    ("reward/mean", "reward", "{:.3f}"),
    ("acc/mean", "acc", "{:.3f}"),
    ("response_len/mean", "len", "{:.1f}"),
    ("staleness/max", "stale", "{:.0f}"),
    ("mismatch/acrl_d", "acrl_d", "{:.4f}"),
    ("perf/rollout_tok_s", "tok/s", "{:.0f}"),
    ("perf/step_s", "step_s", "{:.2f}"),
)

LIVE_FIELDS = (
    "step", "version", "reward/mean", "acc/mean", "loss", "response_len/mean", "staleness/mean", "staleness/max",
    "mismatch/acrl_d", "lr", "perf/rollout_tok_s", "perf/step_s", "perf/fetch_wait_s", "rollout/workers",
    "rollout/restarts",
)  # fmt: skip
"""Rows of the live console table."""


def _jsonable(value: Any) -> Any:
    """`value` with every non-finite float (nested in dicts and lists too) as None: JSON has no NaN or inf, and
    null marks "not measured"."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    return value


WANDB_MISSING = "logging.wandb=true needs the wandb package: pip install 'asyncrl[wandb]' (or set logging.wandb=false)"
"""What `MetricsLogger` raises (as a ConfigError) when `logging.wandb` is on and wandb is not installed."""


def _import_wandb() -> Any:
    """The wandb module; a ConfigError naming `logging.wandb` and the extra to install when it is missing (wandb is
    the optional extra `asyncrl[wandb]`, not a dependency)."""
    try:
        import wandb
    except ModuleNotFoundError as err:
        if err.name != "wandb":  # wandb is there but broken (one of its own dependencies is missing): say that
            raise
        raise ConfigError(WANDB_MISSING) from None
    return wandb


class MetricsLogger:
    def __init__(self, cfg: LoggingConfig, run_dir: Path):
        wandb = None
        if cfg.wandb:  # first: a missing wandb fails before this logger opens a file
            import os

            os.environ.setdefault("WANDB_MODE", cfg.wandb_mode)
            wandb = _import_wandb()
        self.cfg = cfg
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a", buffering=1)
        self._started = time.time()
        self._wandb = None
        if wandb is not None:
            self._wandb = wandb.init(project=cfg.wandb_project, name=cfg.name, dir=str(run_dir), mode=cfg.wandb_mode)
        from rich.console import Console

        self.console = Console(highlight=False, soft_wrap=True)
        self._live: Any = None
        self._events: deque[str] = deque(maxlen=3)

    @contextlib.contextmanager
    def live_view(self) -> Iterator[None]:
        """While open, and only on a TTY with `logging.console`: a live table of the latest step and events."""
        if not (self.cfg.console and sys.stdout.isatty()):
            yield
            return
        from rich.live import Live

        with Live(self._table({}), console=self.console, refresh_per_second=2, transient=False) as live:
            self._live = live
            try:
                yield
            finally:
                self._live = None

    def _table(self, metrics: dict[str, Any]) -> Any:
        from rich.table import Table

        table = Table(title=f"asyncrl {self.cfg.name}", show_header=False, expand=False)
        table.add_column("metric", style="bold")
        table.add_column("value", justify="right")
        for key in LIVE_FIELDS:
            value = metrics.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                table.add_row(key, f"{value:.4g}")
        table.add_row("elapsed", f"{time.time() - self._started:.0f} s")
        for line in self._events:
            table.add_row("event", line)
        return table

    def info(self, message: str) -> None:
        if self.cfg.console:
            self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {message}")

    def event(self, kind: str, **fields: Any) -> None:
        """A non-step record (config change, restart, ...) in metrics.jsonl."""
        record = {"event": kind, "time": time.time(), **_jsonable(fields)}
        self._file.write(json.dumps(record, default=str) + "\n")
        self._events.append(f"{kind} " + " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)[:100])

    def log_step(self, metrics: dict[str, Any]) -> None:
        record = {"time": time.time(), **_jsonable(metrics)}
        self._file.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if isinstance(v, int | float)}, step=int(metrics["step"]))
        if self.cfg.console:
            parts = [
                f"{label} {fmt.format(metrics[key])}"
                for key, label, fmt in CONSOLE_FIELDS
                if isinstance(metrics.get(key), int | float)
            ]
            self.console.print("  ".join(parts))
            if self._live is not None:
                self._live.update(self._table(metrics))

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
