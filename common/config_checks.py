"""The config's per-key checks: a key's valid choices or range are declared with the field, one walker checks them.

A schema field declares what it accepts where it is declared:

    weighting: str = one_of(WEIGHTINGS, default="tis")
    steps: int = in_range(1, default=100)

`check_section` walks a section's fields (and the sections inside it) and raises `ConfigError` naming the dotted
key: first any non-finite float (NaN anywhere, infinity in a ranged key), then an invalid choice, then a value
out of range. The loader runs it over the whole config (`common/config_rules.py`), the buffer over the sections it
rebuilds. Rules that span fields are not here: they live in the section's `__post_init__` or in config_rules.py.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Iterator, Mapping
from dataclasses import field, fields, is_dataclass
from typing import Any

CHOICES_META = "choices"
RANGE_META = "range"


class ConfigError(ValueError):
    """A configuration problem, with the offending key in the message."""


def one_of(choices: tuple[str, ...], *, default: str) -> Any:
    """A field whose value must be one of `choices` (checked by `check_section`)."""
    return field(default=default, metadata={CHOICES_META: choices})


def in_range(low: float | None, high: float | None = None, *, default: float) -> Any:
    """A field whose value must lie in [low, high] (None: unbounded on that side) and be finite."""
    return field(default=default, metadata={RANGE_META: (low, high)})


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a socket on this machine (127.0.0.0/8, ::1, `localhost`); `buffer.host` check."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a hostname, an interface name or `*`: assume it is reachable from outside
        return False


def _leaves(section: Any, prefix: str) -> Iterator[tuple[str, Any, Mapping[str, Any]]]:
    """(dotted key, value, field metadata) of every leaf field of the dataclass instance `section`."""
    for f in fields(section):
        value = getattr(section, f.name)
        if is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value, f.metadata


def _spell_booleans(section: Any) -> None:
    """A choice among strings that include "true" and "false" (`data.chat_template`), given as YAML's or a dotlist's
    boolean, reaches the string field as 'True' / 'False': spelled as the choice it means."""
    for f in fields(section):
        value = getattr(section, f.name)
        if is_dataclass(value):
            _spell_booleans(value)
        elif value in ("True", "False") and {"true", "false"} <= set(f.metadata.get(CHOICES_META) or ()):
            setattr(section, f.name, value.lower())


def check_section(section: Any, prefix: str = "") -> None:
    """Check every leaf of the config section `section` (a dataclass instance) against its declared choices and
    range; `prefix` is where the section sits in the root config (`"loss."`; `""` for the root), for the messages.

    Raises ConfigError naming the first bad key.
    """
    _spell_booleans(section)
    leaves = list(_leaves(section, prefix))
    for key, value, meta in leaves:  # a NaN passes every comparison below (and would train on NaN weights): none
        if isinstance(value, float) and (math.isnan(value) or (RANGE_META in meta and math.isinf(value))):
            raise ConfigError(f"value {value!r} for `{key}` is not a finite number")
    for key, value, meta in leaves:
        choices = meta.get(CHOICES_META)
        if choices is not None and value not in choices:
            raise ConfigError(f"invalid value {value!r} for `{key}`; valid values: {', '.join(choices)}")
    for key, value, meta in leaves:
        if RANGE_META not in meta or value is None:  # null: the key's documented default applies (`loss.cap`)
            continue
        low, high = meta[RANGE_META]
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
            raise ConfigError(f"value {value!r} for `{key}` is out of range {bounds}")
