"""A process's own config sections as one small typed bundle (never the root config), sent over Ray as a dict.

    driver: Bundle.pick(root config) --common.config.to_dict--> Ray --> the process: Bundle.load(values)

A bundle is a `@dataclass(kw_only=True, slots=True)` subclass of `SectionBundle` whose fields are named after the
root config's sections and typed with their dataclasses (`learner/sections.py`, `rollout_workers/sections.py`).
`load` rebuilds a bundle in the process it was sent to: OmegaConf's schema checks (types, unknown keys, a missing
section), then the config's own checks of the choices and ranges declared with each field, section by section
(`check_section`). The rules that span sections were checked on the root config, where every section is known.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from common.config_checks import ConfigError, check_section

Bundle = TypeVar("Bundle", bound="SectionBundle")


class SectionBundle:
    """Base of the per-process section bundles: `pick` from the root config, `load` from its dict."""

    __slots__ = ()

    @classmethod
    def pick(cls: type[Bundle], root: object) -> Bundle:
        """This bundle's sections of `root` (the root config): the same section objects, not copies, so a live
        change applied to the root (`asyncrl set`) is seen by the bundle too."""
        return cls(**{f.name: getattr(root, f.name) for f in fields(cls)})  # type: ignore[arg-type]

    @classmethod
    def load(cls: type[Bundle], values: dict[str, Any]) -> Bundle:
        """Rebuild the bundle from `common.config.to_dict(bundle)` output; raises ConfigError naming the key."""
        try:
            merged = OmegaConf.merge(OmegaConf.structured(cls), OmegaConf.create(values))
            bundle = OmegaConf.to_object(merged)
        except OmegaConfBaseException as err:
            raise ConfigError(f"`{getattr(err, 'full_key', '?')}`: {str(err).splitlines()[0]}") from err
        assert isinstance(bundle, cls)
        for f in fields(cls):  # type: ignore[arg-type]
            check_section(getattr(bundle, f.name), f"{f.name}.")  # the choices and ranges declared with each field
        return bundle
