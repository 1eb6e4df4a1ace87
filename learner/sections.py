"""The config sections the learner reads, as one small typed bundle per use (never the root config).

    driver: LearnerSections.pick(root config) --to_dict--> Ray --> Learner actor: LearnerSections.load(values)

`UpdateSections` are what one update on a batch reads (`learner.update.train_on_batch`); `LearnerSections` adds
what a learner rank reads besides (the buffer's address and keys, the data source for evaluation, train step
counts, the quantization scheme it publishes). A `LearnerSections` is an `UpdateSections`, so a learner passes its
own bundle to the update. Live changes (`asyncrl set`) apply to a bundle with `common.config.set_key`, as to the
root config: the dotted keys are the same.

`load` rebuilds a bundle in the process it was sent to: OmegaConf's schema checks (types, unknown keys, a missing
section), then the config's own checks of the choices and ranges declared with each field, section by section
(`common.config.check_section`). The rules that span sections were checked on the root config, where every
section is known.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from common.config import (
    AlgoConfig,
    BufferConfig,
    ConfigError,
    DataConfig,
    LearnerConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    PrecisionConfig,
    QuantConfig,
    RolloutConfig,
    TrainConfig,
    check_section,
)

Bundle = TypeVar("Bundle", bound="UpdateSections")


@dataclass(kw_only=True, slots=True)
class UpdateSections:
    """The sections one learner update reads (learner/update.py)."""

    learner: LearnerConfig
    loss: LossConfig
    algo: AlgoConfig
    optim: OptimConfig
    precision: PrecisionConfig
    rollout: RolloutConfig
    """Only `temperature` (of the behavior log-probs) and `max_new_tokens` (overlong shaping, length-normalized
    losses)."""

    @classmethod
    def pick(cls: type[Bundle], root: object) -> Bundle:
        """This bundle's sections of `root` (the root config): the same section objects, not copies."""
        return cls(**{f.name: getattr(root, f.name) for f in fields(cls)})

    @classmethod
    def load(cls: type[Bundle], values: dict[str, Any]) -> Bundle:
        """Rebuild the bundle from `common.config.to_dict(bundle)` output; raises ConfigError naming the key."""
        try:
            merged = OmegaConf.merge(OmegaConf.structured(cls), OmegaConf.create(values))
            bundle = OmegaConf.to_object(merged)
        except OmegaConfBaseException as err:
            raise ConfigError(f"`{getattr(err, 'full_key', '?')}`: {str(err).splitlines()[0]}") from err
        assert isinstance(bundle, cls)
        for f in fields(cls):  # the choices and ranges declared with each field
            check_section(getattr(bundle, f.name), f"{f.name}.")
        return bundle


@dataclass(kw_only=True, slots=True)
class LearnerSections(UpdateSections):
    """The sections a learner rank reads (learner/trainer.py): the update's and these."""

    train: TrainConfig
    data: DataConfig
    """The task's reward function, for held-out evaluation."""
    buffer: BufferConfig
    """The buffer's host and CurveZMQ keys: the weight publisher binds where the buffer does."""
    quant: QuantConfig
    model: ModelConfig
    """Whether the model directory's own code may run (`model.trust_remote_code`)."""
