"""The config sections a rollout worker reads, as one small typed bundle (never the root config).

    driver: WorkerSections.pick(root config) --to_dict--> Ray --> RolloutWorker actor: WorkerSections.load(values)

`EngineSections` are what an engine built from the config reads (the SGLang backend: its server's flags, the
quantization scheme and float dtype of the weights it is fed); `WorkerSections` adds what the worker loop reads
(sampling and leasing from `rollout`, `train.group_size` and the seed, the task's reward function, the buffer's
keys and heartbeat timeout). A `WorkerSections` is an `EngineSections`, so a worker hands its own bundle to the
engine it builds.

`load` rebuilds a bundle in the process it was sent to: OmegaConf's schema checks (types, unknown keys, a missing
section), then the config's own checks of the choices and ranges declared with each field, section by section
(`common.config.check_section`). The rules that span sections were checked on the root config, where every
section is known.
(`learner.sections` does the same for the learner: the two packages are independent siblings, so each keeps its
copy of these few lines.)
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from common.config import (
    BufferConfig,
    ConfigError,
    DataConfig,
    ModelConfig,
    PrecisionConfig,
    QuantConfig,
    RolloutConfig,
    TrainConfig,
    check_section,
)

Bundle = TypeVar("Bundle", bound="EngineSections")


@dataclass(kw_only=True, slots=True)
class EngineSections:
    """The sections an engine built from the config reads (rollout_workers/sglang_api/backend.py)."""

    rollout: RolloutConfig
    quant: QuantConfig
    """`scheme`: how the published weights are quantized (the server's quantization)."""
    precision: PrecisionConfig
    """`rollout`: the float dtype the engine computes in."""

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
class WorkerSections(EngineSections):
    """The sections a rollout worker reads (rollout_workers/worker.py): its engine's and these."""

    train: TrainConfig
    """`group_size` (responses per prompt) and `seed` (with the worker id, the engine's sampling seed)."""
    data: DataConfig
    """The task's reward function."""
    buffer: BufferConfig
    """CurveZMQ keys and `worker_timeout_s` (the heartbeat interval is a sixth of it)."""
    model: ModelConfig
    """Whether the model directory's own code may run (`model.trust_remote_code`), for its tokenizer."""
