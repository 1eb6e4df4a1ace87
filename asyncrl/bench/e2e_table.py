"""The per-contender tables `asyncrl bench e2e` prints (issue 27's table, turned), before the usual one."""

from __future__ import annotations

import math

COLUMNS = (
    ("launch s", "launch_s", "{:.1f}"),
    ("steady s/step", "steady_step_s", "{:.3f}"),
    ("gen s", "steady_gen_s", "{:.3f}"),
    ("train s", "steady_train_s", "{:.3f}"),
    ("wait s", "steady_wait_s", "{:.3f}"),
    ("samples/s steady", "steady_samples_s", "{:.3g}"),
    ("samples/s whole", "whole_samples_s", "{:.3g}"),
    ("gen tok/s", "gen_tok_s", "{:.3g}"),
    ("gen/trained", "gen_per_trained", "{:.2f}"),
)
"""(header, figure, format) of the throughput columns."""
ACCURACY_COLUMNS = (
    ("time to acc s", "time_to_acc_s"),
    ("steps to acc", "steps_to_acc"),
    ("held-out acc", "heldout_acc"),
    ("held-out acc, last number", "heldout_last_number_acc"),
    ("held-out gaming gap", "heldout_gaming_gap"),
)
"""(header, figure) of the accuracy columns: mean ± std over seeds."""
SCORED_TWICE = ("heldout_last_number_acc", "heldout_gaming_gap")
"""Rows only the smol workload fills (its held-out answers scored by the math reward and by the last number)."""


def _cell(values: dict[str, float], key: str, fmt: str) -> str:
    value = values.get(key, math.nan)
    return "-" if math.isnan(value) else fmt.format(value)


def _spread(values: dict[str, float], key: str) -> str:
    mean, std = values.get(f"{key}_mean", math.nan), values.get(f"{key}_std", math.nan)
    if math.isnan(mean):
        return "-"
    return f"{mean:.3g} ± {std:.2g}" if not math.isnan(std) else f"{mean:.3g}"


def print_contenders(figures: dict[str, dict[str, float]], ratios: dict[str, float]) -> None:
    """One table per workload (a row per figure, a column per contender), then the ratios."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for workload in dict.fromkeys(key.split("_", 1)[0] for key in figures):
        keys = [key for key in figures if key.startswith(f"{workload}_")]
        table = Table(title=f"asyncrl bench e2e: {workload} (steady = after the warm-up steps)")
        table.add_column("figure")
        for key in keys:
            table.add_column(key.split("_", 1)[1], justify="right")
        for header, figure, fmt in COLUMNS:
            table.add_row(header, *(_cell(figures[key], figure, fmt) for key in keys))
        for header, figure in ACCURACY_COLUMNS:
            cells = [_spread(figures[key], figure) for key in keys]
            if figure in SCORED_TWICE and all(cell == "-" for cell in cells):
                continue  # a workload whose held-out answers are scored once
            table.add_row(header, *cells)
        console.print(table)
    console.print("  ".join(f"{name} {value:.3g}" for name, value in ratios.items()))
