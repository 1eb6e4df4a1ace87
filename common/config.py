"""The run configuration: load, merge, override and hand it on. The one module callers import config names from.

Defaults come from the schema (`common/config_schema.py`: one dataclass per component, a docstring line per key,
its choices or range declared with it); a YAML file in `configs/` holds only what differs from them, and
`asyncrl up CONFIG key=value ...` applies dotlist overrides on top. Every loaded config goes through `validate`
(`common/config_rules.py`): unknown keys, wrong types, invalid choices, out-of-range values and cross-field rules
fail here, before Ray or torch are imported, with a `ConfigError` naming the key.

    common/config_checks.py   ConfigError, `one_of` / `in_range` field declarations, `check_section`
    common/config_schema.py   the dataclasses, the choice tuples, LIVE_KEYS, all_keys
    common/config_rules.py    the rules that span sections; validate
    common/config.py          this module: loading, overrides, live changes, to_dict / from_dict; re-exports the rest

This module must stay importable without torch, ray or zmq: the CLI parses config first.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any, get_type_hints

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from common.config_checks import ConfigError, check_section, is_loopback
from common.config_rules import validate
from common.config_schema import (
    ACRL_X_MODES,
    ADVANTAGES,
    AGGREGATIONS,
    BACKENDS,
    KL_ESTIMATORS,
    LIVE_KEYS,
    PRECISIONS,
    PROX_MODES,
    QUANT_SCHEMES,
    RESUME_FIXED,
    RESUME_FREE,
    SCHEDULES,
    SWAP_MODES,
    TASKS,
    WEIGHTINGS,
    AcrlConfig,
    AlgoConfig,
    BufferConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    KlConfig,
    LearnerConfig,
    LoggingConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    OverlongConfig,
    PrecisionConfig,
    QuantConfig,
    RayConfig,
    RewardConfig,
    RolloutConfig,
    SGLangConfig,
    StalenessConfig,
    TbpoConfig,
    TrainConfig,
    UaqConfig,
    all_keys,
)

__all__ = [
    "ACRL_X_MODES",
    "ADVANTAGES",
    "AGGREGATIONS",
    "BACKENDS",
    "KL_ESTIMATORS",
    "LIVE_KEYS",
    "PRECISIONS",
    "PROX_MODES",
    "QUANT_SCHEMES",
    "SCHEDULES",
    "SWAP_MODES",
    "TASKS",
    "WEIGHTINGS",
    "AcrlConfig",
    "AlgoConfig",
    "BufferConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "KlConfig",
    "LearnerConfig",
    "LoggingConfig",
    "LossConfig",
    "ModelConfig",
    "OptimConfig",
    "OverlongConfig",
    "PrecisionConfig",
    "QuantConfig",
    "RayConfig",
    "RewardConfig",
    "RolloutConfig",
    "SGLangConfig",
    "StalenessConfig",
    "TbpoConfig",
    "TrainConfig",
    "UaqConfig",
    "all_keys",
    "check_section",
    "from_dict",
    "get_key",
    "is_loopback",
    "live_update",
    "load_config",
    "resume_changes",
    "set_key",
    "to_dict",
    "validate",
]


def _closest(key: str, full_key: str = "") -> str:
    """A "did you mean" for the unknown `key`; a section name (`trian`) is matched against the sections, and where
    the whole dotted key is known (`full_key`, from an override) the suggestion is that key with the section fixed."""
    keys = all_keys()
    if "." not in key and "." in (full_key or "."):  # omegaconf names only the section: its leaves are not what
        sections = sorted({k.split(".", 1)[0] for k in keys})  # was misspelled (a file's key, or `trian.steps=5`)
        section = difflib.get_close_matches(key, sections, n=1, cutoff=0.6)
        if not section:
            return ""
        rest = full_key[len(key) :] if full_key.startswith(key + ".") else ""
        fixed = section[0] + rest
        return f"; did you mean `{fixed}`?" if fixed in keys or not rest else f"; did you mean section `{section[0]}`?"
    leaf = key.rsplit(".", 1)[-1]
    matches = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if not matches:
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in keys}
        leaf_matches = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
        matches = [by_leaf[m] for m in leaf_matches]
    return f"; did you mean `{matches[0]}`?" if matches else ""


def _explain(err: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(err, "full_key", None) or "?"
    if isinstance(err, ConfigKeyError):
        given = source.split("'", 1)[1].split("=", 1)[0] if source.startswith("override '") else ""
        return ConfigError(f"{source}: unknown config key `{key}`{_closest(key, given)}")
    first_line = str(err).splitlines()[0]
    return ConfigError(f"{source}: bad value for `{key}`: {first_line}")


def _check_sections(schema: type, node: DictConfig, source: str, prefix: str) -> None:
    """A section given as a scalar or list (`loss: tis`) is reported by its name, not as a bare merge error."""
    hints = get_type_hints(schema)
    for key in node:
        section = hints.get(str(key))
        if not (isinstance(section, type) and is_dataclass(section)):
            continue
        value = node._get_node(key)  # type: ignore[union-attr]
        if not isinstance(value, DictConfig):
            given = OmegaConf.to_container(node)[key]  # type: ignore[index]
            raise ConfigError(f"{source}: `{prefix}{key}` is a section and must be a mapping of its keys "
                              f"(e.g. `{prefix}{key}.<key>: value`), got {given!r}")  # fmt: skip
        _check_sections(section, value, source, f"{prefix}{key}.")


def load_config(path: str | os.PathLike[str] | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, then the YAML file at `path`, then `key=value` overrides; validated.

    Raises ConfigError naming the offending key (with the closest valid key for typos).
    """
    merged: DictConfig = OmegaConf.structured(Config)
    if path is not None:
        source = str(path)
        if Path(path).is_dir():
            raise ConfigError(f"config file {source!r} is a directory (name a YAML file, e.g. configs/dapo_int8.yaml)")
        if not Path(path).is_file():
            raise ConfigError(f"config file {source!r} does not exist")
        try:
            file_cfg = OmegaConf.load(path)
        except Exception as err:  # yaml syntax errors carry line numbers in their text
            raise ConfigError(f"{source}: cannot parse YAML: {err}") from err
        if not isinstance(file_cfg, DictConfig):
            raise ConfigError(f"{source}: the top level must be a mapping of sections")
        _check_sections(Config, file_cfg, source, "")
        try:
            merged = OmegaConf.merge(merged, file_cfg)
        except OmegaConfBaseException as err:
            raise _explain(err, source) from err
        except TypeError as err:  # omegaconf's "Cannot merge incompatible container types": a list for a map, ...
            raise ConfigError(f"{source}: {_container_mismatch(merged, file_cfg, '') or err}") from None
    cfg = _merge_overrides(merged, overrides)
    if not cfg.logging.name:
        cfg.logging.name = Path(path).stem if path is not None else "run"
    return validate(cfg)


def _container_mismatch(schema: Any, given: Any, prefix: str) -> str:
    """The first key of `given` holding a list where `schema` holds a mapping, or the reverse ("" if none)."""
    if not isinstance(given, DictConfig) or not isinstance(schema, DictConfig):
        return ""
    for key in given:
        if key not in schema:
            continue
        ours, theirs = schema._get_node(key), given._get_node(key)
        kinds = {DictConfig: "a mapping", ListConfig: "a list"}
        ours_kind = next((word for kind, word in kinds.items() if isinstance(ours, kind)), "")
        theirs_kind = next((word for kind, word in kinds.items() if isinstance(theirs, kind)), "")
        if ours_kind and theirs_kind and ours_kind != theirs_kind:
            return f"`{prefix}{key}` must be {ours_kind}, got {theirs_kind}: {OmegaConf.to_container(theirs)!r}"[:300]
        found = _container_mismatch(ours, theirs, f"{prefix}{key}.")
        if found:
            return found
    return ""


def _merge_overrides(merged: DictConfig, overrides: list[str] | tuple[str, ...]) -> Config:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value")
        key = item.split("=", 1)[0].strip()
        if not key or not all(key.split(".")):
            raise ConfigError(f"override {item!r}: `{key}` is not a dotted key (section.key=value)")
        try:
            dotlist = OmegaConf.from_dotlist([item])
            _check_sections(Config, dotlist, f"override {item!r}", "")
            merged = OmegaConf.merge(merged, dotlist)
            value = OmegaConf.select(dotlist, key)
            if isinstance(value, DictConfig):  # `env.args={...}` is the whole map, not a merge into the file's
                OmegaConf.update(merged, key, value, merge=False)
        except OmegaConfBaseException as err:
            raise _explain(err, f"override {item!r}") from err
        except TypeError as err:  # omegaconf's "Cannot merge incompatible container types": a list for a map, ...
            raise ConfigError(f"override {item!r}: {_container_mismatch(merged, dotlist, '') or err}") from None
        except yaml.YAMLError as err:  # the value is not YAML: `loss.cap=[1`
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({str(err).splitlines()[0]})") from None
        except ValueError as err:  # what YAML cannot convert: an integer of more than 4300 digits
            raise ConfigError(f"override `{key}=...`: the value cannot be read ({str(err)[:120]})") from None
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise _explain(err, "config") from err
    assert isinstance(cfg, Config)
    return cfg


def live_update(cfg: Config, items: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Validate `key=value` changes of a running job against `cfg` exactly like a config; returns {key: new value}.

    Raises ConfigError for a malformed item, an unknown key (with the closest valid key), a key that is not live
    (naming the live keys), a wrong type or an out-of-range value. `cfg` itself is not modified.
    """
    for item in items:
        key = item.split("=", 1)[0].strip()
        if "=" in item and key in all_keys() and key not in LIVE_KEYS:
            raise ConfigError(f"`{key}` cannot change in a running job; live keys: {', '.join(LIVE_KEYS)}")
    updated = validate(_merge_overrides(OmegaConf.structured(cfg), items))
    return {key: get_key(updated, key) for key in LIVE_KEYS if get_key(updated, key) != get_key(cfg, key)}


def resume_changes(saved: Config, resumed: Config) -> list[str]:
    """The keys of `RESUME_FIXED` whose value differs between a run's config (`saved`) and the one a resume would
    run with (`resumed`); empty when the resume may go on."""
    fixed = [k for k in all_keys() if k.startswith(RESUME_FIXED) and k not in RESUME_FREE]
    return [key for key in fixed if get_key(saved, key) != get_key(resumed, key)]


def get_key(cfg: Any, dotted: str) -> Any:
    """The value of a dotted key of a config, e.g. `get_key(cfg, "loss.acrl.gamma")`."""
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def set_key(cfg: Any, dotted: str, value: Any) -> None:
    """Set the dotted key of a config in place (e.g. a validated live change from `live_update`)."""
    section, _, leaf = dotted.rpartition(".")
    setattr(get_key(cfg, section) if section else cfg, leaf, value)


def to_dict(cfg: Any) -> dict[str, Any]:
    """A plain nested dict of a config (or section), for JSON, Ray and subprocess hand-off."""
    container = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    assert isinstance(container, dict)
    return container  # type: ignore[return-value]


def from_dict(values: dict[str, Any]) -> Config:
    """Rebuild a validated Config from `to_dict` output (used by processes the driver starts)."""
    merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(values))
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, Config)
    return validate(cfg)
