"""`asyncrl bench NAME`: the registry of benchmarks and their common result shape.

A benchmark is a function `run(quick: bool) -> BenchResult` in a module of this package, registered by name in
`BENCHMARKS` as "module:function" so that listing them imports nothing heavy. Every ratio compares against a
baseline measured in the same run (these machines are noisy); metrics hold the raw figures.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

BENCHMARKS: dict[str, str] = {
    "wire": "asyncrl.bench.wire_bench:run",
    "engine": "asyncrl.bench.engine_bench:run",
    "buffer": "asyncrl.bench.buffer_bench:run",
    "sync": "asyncrl.bench.sync_bench:run",
    "learner": "asyncrl.bench.learner_bench:run",
    "e2e": "asyncrl.bench.e2e_bench:run",
}


@dataclass(slots=True)
class BenchResult:
    name: str
    metrics: dict[str, float] = field(default_factory=dict)
    """Raw measurements, units in the key (e.g. `encode_msgs_per_s`)."""
    ratios: dict[str, float] = field(default_factory=dict)
    """Each a measurement over its same-run baseline; the names are fixed by the issues."""
    details: dict[str, object] = field(default_factory=dict)
    """What the numbers need to be read: settings, curves, per-run records (written only when a bench has any)."""

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"name": self.name, "metrics": self.metrics, "ratios": self.ratios}
        if self.details:
            out["details"] = self.details
        return out


def resolve(name: str) -> Callable[[bool], BenchResult]:
    if name not in BENCHMARKS:
        raise KeyError(f"unknown benchmark {name!r}; available: {', '.join(sorted(BENCHMARKS))}")
    module_name, func_name = BENCHMARKS[name].split(":")
    return getattr(importlib.import_module(module_name), func_name)


def print_table(result: BenchResult) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"asyncrl bench {result.name}")
    table.add_column("kind")
    table.add_column("name")
    table.add_column("value", justify="right")
    for key, value in result.metrics.items():
        table.add_row("metric", key, f"{value:.6g}")
    for key, value in result.ratios.items():
        table.add_row("ratio", key, f"{value:.4g}")
    Console().print(table)


def write_json(result: BenchResult, path: str) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(result.to_json(), indent=2) + "\n")
