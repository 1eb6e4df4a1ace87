"""Run logging: one JSON object per step in runs/<name>/metrics.jsonl, a console line per step, optional wandb.

On a terminal (stdout is a TTY) the console shows a live dashboard instead of the step lines (asyncrl/console.py: a
progress bar with step i of N, elapsed and ETA, the few numbers that matter, recent events); elsewhere (pipes, tests,
CI) it prints the plain lines.

wandb runs offline unless `logging.wandb_mode=online` (with an API key and no network, online `init` hangs). It is an
optional extra: `pip install 'asyncrl[wandb]'`; `logging.wandb=true` without it raises a ConfigError that says so.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from asyncrl.console import RunView, is_terminal, live_dashboard
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


def step_line(metrics: dict[str, Any]) -> str:
    """The plain console line of a step (`CONSOLE_FIELDS` that were measured)."""
    return "  ".join(
        f"{label} {fmt.format(metrics[key])}"
        for key, label, fmt in CONSOLE_FIELDS
        if isinstance(metrics.get(key), int | float)
        and not isinstance(metrics.get(key), bool)
        and math.isfinite(metrics[key])  # a step whose interval saw no sample has no reward: not "nan"
    )


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


def _cut_torn_tail(path: Path) -> None:
    """A metrics.jsonl whose last record a killed run left half written: cut back to its last whole line, so that the
    resumed run's records start on a line of their own (they were glued to the fragment, and the file was no longer
    readable past it)."""
    try:
        with path.open("rb+") as handle:
            size = handle.seek(0, 2)
            if size == 0:
                return
            handle.seek(size - 1)
            if handle.read(1) == b"\n":
                return
            tail = min(size, 1 << 20)
            handle.seek(size - tail)
            end = handle.read(tail).rfind(b"\n")
            handle.truncate(size - tail + end + 1 if end >= 0 else (0 if tail == size else size))
    except FileNotFoundError:
        return


WANDB_INIT_TIMEOUT_S = 30.0
"""How long `wandb.init` may try to reach the server in `online` mode before the run goes on offline."""


def _wandb_init(wandb: Any, cfg: LoggingConfig, run_dir: Path) -> Any:
    """`wandb.init`; in `online` mode without a reachable server (it retried about 90 s, then a CommError ended the
    run with a traceback) the run goes on with wandb offline, saying so (`wandb sync` uploads it later)."""
    kwargs = {"project": cfg.wandb_project, "name": cfg.name, "dir": str(run_dir)}
    if cfg.wandb_mode != "online":
        return wandb.init(mode=cfg.wandb_mode, **kwargs)
    try:
        return wandb.init(mode="online", settings=wandb.Settings(init_timeout=WANDB_INIT_TIMEOUT_S), **kwargs)
    except Exception as err:  # wandb.errors.CommError, UsageError (no key), a timeout: the run must not die of it
        print(f"asyncrl: wandb could not start online ({type(err).__name__}: {str(err)[:200]}); logging offline "
              f"instead under {run_dir / 'wandb'} (`wandb sync` uploads it)", file=sys.stderr)  # fmt: skip
        return wandb.init(mode="offline", **kwargs)


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


class EnvMetrics:
    """The multi-turn episode metrics of a step (rollout_workers/episodes.py counters; none in single-turn runs):

    - `env/episodes`, `env/turns_mean`, `env/tool_calls` (per episode), `env/masked_share` (observation tokens over
      all response tokens of pushed trajectories): over the interval since the previous step;
    - `env/errors`, `env/timeouts`, `env/groups_dropped`: run totals (retired workers' included, like reward/errors).
    """

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def update(self, totals: dict[str, float]) -> dict[str, float]:
        """The metrics from the supervisor's run totals (`WorkerPool.totals`); {} when no episode ran yet."""
        if not totals.get("env_episodes"):
            return {}
        keys = ("env_episodes", "env_turns", "env_tool_calls", "env_masked_tokens", "tokens")
        delta = {key: totals.get(key, 0.0) - self._last.get(key, 0.0) for key in keys}
        self._last = {key: totals.get(key, 0.0) for key in keys}
        episodes = delta["env_episodes"]
        masked, all_tokens = delta["env_masked_tokens"], delta["env_masked_tokens"] + delta["tokens"]
        return {
            "env/episodes": episodes,
            "env/turns_mean": delta["env_turns"] / episodes if episodes else float("nan"),
            "env/tool_calls": delta["env_tool_calls"] / episodes if episodes else float("nan"),
            "env/masked_share": masked / all_tokens if all_tokens else float("nan"),
            "env/errors": totals.get("env_errors", 0.0),
            "env/timeouts": totals.get("env_timeouts", 0.0),
            "env/groups_dropped": totals.get("env_groups_dropped", 0.0),
        }


class MetricsLogger:
    def __init__(self, cfg: LoggingConfig, run_dir: Path):
        wandb = None
        if cfg.wandb:  # first: a missing wandb fails before this logger opens a file
            import os

            os.environ.setdefault("WANDB_MODE", cfg.wandb_mode)
            wandb = _import_wandb()
        self.cfg = cfg
        self.path = run_dir / "metrics.jsonl"
        _cut_torn_tail(self.path)
        self._file = self.path.open("a", buffering=1)
        self._wandb = None
        if wandb is not None:
            self._wandb = _wandb_init(wandb, cfg, run_dir)
        from rich.console import Console

        self.console = Console(highlight=False, soft_wrap=True)
        self._view: RunView | None = None  # the live dashboard's state while `live_view` is open on a terminal

    @contextlib.contextmanager
    def live_view(self, total_steps: int, start_step: int = 0) -> Iterator[None]:
        """While open, and only on a TTY with `logging.console`: the live dashboard (asyncrl/console.py) of a run of
        `total_steps` steps, `start_step` of them done before (a resumed run), in place of the step lines."""
        if not is_terminal(self.cfg.console):
            yield
            return
        self._view = RunView(name=self.cfg.name, total_steps=total_steps, start_step=start_step)
        try:
            with live_dashboard(self._view, self.console):
                yield
        finally:
            self._view = None

    def info(self, message: str) -> None:
        if self.cfg.console:
            self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {message}")

    def event(self, kind: str, **fields: Any) -> None:
        """A non-step record (config change, restart, ...) in metrics.jsonl, and a line of the live dashboard's recent
        events (its scalar fields); an evaluation's `eval/*` figures go to wandb too, at the step record of the last
        step it followed (`after_steps - 1`: a step record's `step` counts from 0)."""
        record = {"event": kind, "time": time.time(), **_jsonable(fields)}
        self._file.write(json.dumps(record, default=str) + "\n")
        if self._wandb is not None and kind == "eval" and isinstance(fields.get("after_steps"), int):
            figures = {k: v for k, v in fields.items() if k.startswith("eval/") and isinstance(v, int | float)}
            self._wandb.log(figures, step=max(fields["after_steps"] - 1, 0))
        if self._view is not None:
            line = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None and not isinstance(v, dict))
            self._view.record_event(f"{kind} {line}"[:160], record["time"])

    def log_step(self, metrics: dict[str, Any]) -> None:
        record = {"time": time.time(), **_jsonable(metrics)}
        self._file.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if isinstance(v, int | float)}, step=int(metrics["step"]))
        if self._view is not None:
            self._view.record_step(metrics, time.monotonic())
        elif self.cfg.console:
            self.console.print(step_line(metrics))

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
