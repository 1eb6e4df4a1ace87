"""The config sections the learner reads, as one small typed bundle per use (never the root config).

    driver: LearnerSections.pick(root config) --to_dict--> Ray --> Learner actor: LearnerSections.load(values)

`UpdateSections` are what one update on a batch reads (`learner.update.train_on_batch`); `LearnerSections` adds
what a learner rank reads besides (the buffer's address and keys, the data source for evaluation, train step
counts, the quantization scheme it publishes). A `LearnerSections` is an `UpdateSections`, so a learner passes its
own bundle to the update. Live changes (`asyncrl set`) apply to a bundle with `common.config.set_key`, as to the
root config: the dotted keys are the same.

`pick` and `load` (and the checks `load` runs) are `common.config_bundle.SectionBundle`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.config import (
    AlgoConfig,
    BufferConfig,
    DataConfig,
    LearnerConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    PrecisionConfig,
    QuantConfig,
    RolloutConfig,
    StalenessConfig,
    TrainConfig,
)
from common.config_bundle import SectionBundle


@dataclass(kw_only=True, slots=True)
class UpdateSections(SectionBundle):
    """The sections one learner update reads (learner/update.py)."""

    learner: LearnerConfig
    loss: LossConfig
    algo: AlgoConfig
    optim: OptimConfig
    precision: PrecisionConfig
    rollout: RolloutConfig
    """Only `temperature` (of the behavior log-probs) and `max_new_tokens` (overlong shaping, length-normalized
    losses)."""


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
    staleness: StalenessConfig
    """Only `max_lag`: a synchronous run (0) gives the learner every core (learner/threads.py)."""
