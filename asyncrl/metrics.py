"""Run logging: one JSON object per step in runs/<name>/metrics.jsonl, a console line per step, optional wandb.

wandb runs offline unless `logging.wandb_mode=online` (with an API key and no network, online `init` hangs).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from asyncrl.config import LoggingConfig

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


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; null marks "not measured"
    return value


class MetricsLogger:
    def __init__(self, cfg: LoggingConfig, run_dir: Path):
        self.cfg = cfg
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a", buffering=1)
        self._started = time.time()
        self._wandb = None
        if cfg.wandb:
            import os

            os.environ.setdefault("WANDB_MODE", cfg.wandb_mode)
            import wandb

            self._wandb = wandb.init(project=cfg.wandb_project, name=cfg.name, dir=str(run_dir), mode=cfg.wandb_mode)
        from rich.console import Console

        self.console = Console(highlight=False, soft_wrap=True)

    def info(self, message: str) -> None:
        if self.cfg.console:
            self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {message}")

    def event(self, kind: str, **fields: Any) -> None:
        """A non-step record (config change, restart, ...) in metrics.jsonl."""
        self._file.write(json.dumps({"event": kind, "time": time.time(), **fields}) + "\n")

    def log_step(self, metrics: dict[str, Any]) -> None:
        record = {"time": time.time(), **{k: _jsonable(v) for k, v in metrics.items()}}
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

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
