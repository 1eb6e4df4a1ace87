"""The study file of `asyncrl study`: a base config, named cells (each a dotlist), seeds; loaded and validated.

    name: quantized_rollout            # runs/studies/<name>/
    base: configs/dapo_int8.yaml       # absolute, or relative to the study file's directory, else to the cwd
    seeds: [0, 1]                      # train.seed of each replicate (data.seed stays: one held-out set for all)
    overrides: [train.steps=40]        # optional: every cell, before its own dotlist
    cells:                             # cell name -> dotlist (an empty list is the base config itself)
      int8_tis: [quant.scheme=int8, loss.weighting=tis]
    metrics: [norm_update, lr:last]    # optional: extra table columns, each a step metric over the run's steps:
                                       # KEY (its mean), KEY:mean|max|min|last; KEY may be `A / B`, the per-step
                                       # ratio A / B
    quick:                             # optional: what `--quick` runs (defaults: the first two cells, the first
      cells: [int8_tis]                # seed, train.steps=3 data.eval_size=16); names runs/studies/<name>-quick/
      seeds: [0]
      overrides: [train.steps=3]

Every run of the study is `asyncrl up BASE <overrides> <cell dotlist> [quick overrides] train.seed=<k>
logging.dir=<root>/<name>/<cell> logging.name=seed<k> logging.console=false`; the study sets the last four, so a
study file that sets them is refused. `load_study` builds and validates every run's config before anything runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from common.config import Config, ConfigError, load_config
from common.config_schema import MAX_SEED

STUDY_KEYS = ("name", "base", "cells", "seeds", "overrides", "metrics", "quick")
QUICK_KEYS = ("cells", "seeds", "overrides")
MANAGED_KEYS = ("train.seed", "logging.dir", "logging.name", "logging.console")
"""Keys the study sets for each run (seed, run directory, quiet console): a study file may not set them."""
QUICK_OVERRIDES = ("train.steps=3", "data.eval_size=16")
"""`--quick` overrides when the study file has no `quick.overrides`: a few steps, a small held-out evaluation."""
QUICK_CELLS = 2
QUICK_SUFFIX = "-quick"
METRIC_STATS = ("mean", "max", "min", "last")
"""How an extra metric column reduces a run's steps (`KEY:STAT`; plain `KEY` is its mean)."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


class StudyError(ValueError):
    """A bad study file: the message names the file and the key or cell at fault."""


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One cell x seed: an `asyncrl up` run in `run_dir`."""

    cell: str
    seed: int
    run_dir: Path
    overrides: tuple[str, ...]
    """Dotlist after the base config: study overrides, the cell's dotlist, quick overrides, then the managed keys."""
    steps: int
    """train.steps of this run (from its validated config)."""
    journal: bool
    """buffer.journal of this run: `asyncrl up --resume` needs it."""

    @property
    def log_path(self) -> Path:
        """The run's console output, beside its run directory (inside it, `asyncrl up` would pick `seed<k>-2`)."""
        return self.run_dir.with_name(self.run_dir.name + ".log")

    @property
    def label(self) -> str:
        return f"{self.cell} seed {self.seed}"


@dataclass(slots=True)
class Study:
    name: str
    base: Path
    cells: dict[str, tuple[str, ...]]
    seeds: tuple[int, ...]
    overrides: tuple[str, ...] = ()
    metrics: tuple[str, ...] = ()
    root: Path = Path("runs/studies")
    runs: list[RunSpec] = field(default_factory=list)

    @property
    def out_dir(self) -> Path:
        """runs/studies/<name>: the runs, results.json, table.md and the PNGs."""
        return self.root / self.name


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml's safe loader, except that a key given twice in one mapping (a cell defined twice, two `overrides:`) is an
    error naming it and its line, as the config loader's (OmegaConf's) is: safe_load kept the last one silently."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key!r} is given twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_study(path: str | Path, root: str | Path = "runs/studies", quick: bool = False) -> Study:
    """Read and validate the study file at `path`; every run's config is built and validated here (a ConfigError of
    any cell is a StudyError naming the cell), so a bad cell fails before the first run starts."""
    source = Path(path)
    if source.is_dir():
        raise StudyError(f"study file {str(source)!r} is a directory (name a YAML file, e.g. configs/studies/*.yaml)")
    if not source.is_file():
        raise StudyError(f"study file {str(source)!r} does not exist")
    try:
        raw = yaml.load(source.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)  # a SafeLoader
    except yaml.YAMLError as err:
        raise StudyError(f"{source}: cannot parse YAML: {err}") from None
    except UnicodeDecodeError as err:
        raise StudyError(f"{source}: not UTF-8 text ({err})") from None
    if not isinstance(raw, dict):
        raise StudyError(f"{source}: the top level must be a mapping with keys {', '.join(STUDY_KEYS)}")
    _check_keys(raw, STUDY_KEYS, str(source))
    for key in ("name", "base", "cells", "seeds"):
        if key not in raw:
            raise StudyError(f"{source}: missing key `{key}`")
    name = raw["name"]
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise StudyError(f"{source}: `name` must be a word of letters, digits, `_`, `.`, `-`, got {name!r}")
    cells = _cells(raw["cells"], source)
    seeds = _seeds(raw["seeds"], f"{source}: `seeds`")
    overrides = _dotlist(raw.get("overrides", []), f"{source}: `overrides`")
    metrics = tuple(_strings(raw.get("metrics", []), f"{source}: `metrics`"))
    for spec in metrics:
        parse_metric(spec, f"{source}: `metrics`")
    quick_spec = _quick(raw.get("quick", {}), source, name, cells, seeds, overrides)  # checked with or without --quick
    if quick:
        name, cells, seeds, overrides = quick_spec
    study = Study(name=name, base=_base(raw["base"], source), cells=cells, seeds=seeds, overrides=overrides,
                  metrics=metrics, root=Path(root))  # fmt: skip
    study.runs = [run for cell in cells for run in _cell_runs(study, cell)]
    return study


def _quick(
    quick: Any, source: Path, name: str, cells: dict[str, tuple[str, ...]], seeds: tuple[int, ...],
    overrides: tuple[str, ...],
) -> tuple[str, dict[str, tuple[str, ...]], tuple[int, ...], tuple[str, ...]]:  # fmt: skip
    if not isinstance(quick, dict):
        raise StudyError(f"{source}: `quick` must be a mapping with keys {', '.join(QUICK_KEYS)}")
    _check_keys(quick, QUICK_KEYS, f"{source}: `quick`")
    chosen = _strings(quick.get("cells", list(cells)[:QUICK_CELLS]), f"{source}: `quick.cells`")
    for cell in chosen:
        if cell not in cells:
            raise StudyError(f"{source}: `quick.cells` names `{cell}`, which is not a cell ({', '.join(cells)})")
    quick_seeds = _seeds(quick.get("seeds", list(seeds)[:1]), f"{source}: `quick.seeds`")
    extra = _dotlist(quick.get("overrides", list(QUICK_OVERRIDES)), f"{source}: `quick.overrides`")
    # Quick overrides come last (after each cell's dotlist), so `train.steps=3` wins wherever steps were set.
    return name + QUICK_SUFFIX, {cell: cells[cell] + extra for cell in chosen}, quick_seeds, overrides


def _cell_runs(study: Study, cell: str) -> list[RunSpec]:
    """The runs of one cell, one per seed. Its config is validated once, with the first seed: the seeds differ only
    in the managed keys, none of which any rule constrains but `train.seed`'s range, which `_seeds` checks."""
    cell_dir = study.out_dir / cell
    runs = []
    for seed in study.seeds:
        overrides = (*study.overrides, *study.cells[cell], f"train.seed={seed}", f"logging.dir={cell_dir}",
                     f"logging.name=seed{seed}", "logging.console=false")  # fmt: skip
        if not runs:
            cfg = validate_run(study.base, overrides, cell)
        runs.append(RunSpec(cell=cell, seed=seed, run_dir=cell_dir / f"seed{seed}", overrides=overrides,
                            steps=cfg.train.steps, journal=cfg.buffer.journal))  # fmt: skip
    return runs


def validate_run(base: Path, overrides: tuple[str, ...], cell: str) -> Config:
    """The validated config of one run; a StudyError naming the cell when the config system refuses it."""
    try:
        return load_config(base, list(overrides))
    except ConfigError as err:
        raise StudyError(f"cell `{cell}`: {err}") from None


def parse_metric(spec: str, where: str = "metric") -> tuple[tuple[str, ...], str]:
    """`KEY[:STAT]` -> ((KEY,) or (A, B) for `A / B`, STAT); a StudyError for an empty key or an unknown STAT."""
    key, stat = spec, "mean"
    if ":" in spec:
        key, stat = spec.rsplit(":", 1)
    parts = tuple(part.strip() for part in key.split(" / ")) if " / " in key else (key.strip(),)
    if stat not in METRIC_STATS or not all(parts) or len(parts) > 2:
        raise StudyError(f"{where}: {spec!r} must be KEY, KEY:STAT or `A / B[:STAT]` with STAT one of "
                         f"{', '.join(METRIC_STATS)}")  # fmt: skip
    return parts, stat


def _check_keys(raw: dict[Any, Any], allowed: tuple[str, ...], where: str) -> None:
    for key in raw:
        if key not in allowed:
            raise StudyError(f"{where}: unknown key `{key}`; valid keys: {', '.join(allowed)}")


def _base(value: Any, source: Path) -> Path:
    if not isinstance(value, str) or not value:
        raise StudyError(f"{source}: `base` must be the path of a config file, got {value!r}")
    given = Path(value)
    candidates = [given] if given.is_absolute() else [source.parent / given, Path.cwd() / given]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise StudyError(f"{source}: `base` {value!r} is not a file (looked at {', '.join(map(str, candidates))})")


RESERVED_NAMES = ("table.md", "results.json", "curves", "study.lock")
"""What the study writes in its directory beside the cells' (study_report.py, study_run.py): no cell is named so."""


def _cells(value: Any, source: Path) -> dict[str, tuple[str, ...]]:
    if not isinstance(value, dict) or not value:
        raise StudyError(f"{source}: `cells` must be a non-empty mapping of cell name -> list of key=value")
    cells: dict[str, tuple[str, ...]] = {}
    for cell, dotlist in value.items():
        if not isinstance(cell, str) or not _NAME.fullmatch(cell):
            raise StudyError(f"{source}: cell name {cell!r} must be a word of letters, digits, `_`, `.`, `-`")
        if cell in RESERVED_NAMES or cell.endswith(".png"):
            raise StudyError(f"{source}: cell name {cell!r} is a file the study's report writes beside the cells "
                             f"({', '.join(RESERVED_NAMES)}, *.png): choose another")  # fmt: skip
        cells[cell] = _dotlist(dotlist if dotlist is not None else [], f"{source}: cell `{cell}`")
    return cells


def _seeds(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise StudyError(f"{where} must be a non-empty list of integers, got {value!r}")
    for seed in value:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
            raise StudyError(f"{where}: {seed!r} is not a whole number in [0, {MAX_SEED}] (`train.seed`)")
    if len(set(value)) != len(value):
        raise StudyError(f"{where}: a seed is listed twice ({value})")
    return tuple(value)


def _strings(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise StudyError(f"{where} must be a list of strings, got {value!r}")
    return list(value)


def _dotlist(value: Any, where: str) -> tuple[str, ...]:
    items = _strings(value, where)
    for item in items:
        key = item.split("=", 1)[0].strip()
        if "=" not in item:
            raise StudyError(f"{where}: {item!r} must look like key=value")
        if key in MANAGED_KEYS:
            raise StudyError(f"{where}: `{key}` is set by the study for each run; remove it")
    return tuple(items)
