"""`asyncrl bench NAME`: the registry of benchmarks and their common result shape.

A benchmark is a function `run(quick: bool) -> BenchResult` in a module of this package, registered by name in
`BENCHMARKS` as "module:function" so that listing them imports nothing heavy. Every ratio compares against a
baseline measured in the same run (these machines are noisy); metrics hold the raw figures.
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

BENCHMARKS: dict[str, str] = {
    "wire": "asyncrl.bench.wire_bench:run",
    "engine": "asyncrl.bench.engine_bench:run",
    "buffer": "asyncrl.bench.buffer_bench:run",
    "sync": "asyncrl.bench.sync_bench:run",
    "sync_control": "asyncrl.bench.sync_bench:run_control",
    "learner": "asyncrl.bench.learner_bench:run",
    "e2e": "asyncrl.bench.e2e_bench:run",
    "chaos": "asyncrl.bench.chaos:run",
}


class BenchInputError(ValueError):
    """Options a benchmark refuses before it runs anything; `asyncrl bench` prints it and exits 2 (1 is a run that
    failed)."""


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


def strict_json_value(value: object) -> object:
    """`value` with every non-finite float (nan, inf: a figure never reached, a ratio of a missing one) as None, so
    that it encodes as strict JSON (`null`), which every JSON reader accepts (`NaN` is not JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: strict_json_value(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json_value(item) for item in value]
    return value


def write_json(result: BenchResult, path: str) -> None:
    """The result as strict JSON: non-finite figures are written as `null`."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(strict_json_value(result.to_json()), indent=2, allow_nan=False) + "\n")
