"""The config sections a rollout worker reads, as one small typed bundle (never the root config).

    driver: WorkerSections.pick(root config) --to_dict--> Ray --> RolloutWorker actor: WorkerSections.load(values)

`EngineSections` are what an engine built from the config reads (the SGLang backend: its server's flags, the
quantization scheme and float dtype of the weights it is fed); `WorkerSections` adds what the worker loop reads
(sampling and leasing from `rollout`, `train.group_size` and the seed, the task's reward function, the buffer's
keys and heartbeat timeout). A `WorkerSections` is an `EngineSections`, so a worker hands its own bundle to the
engine it builds.

`pick` and `load` (and the checks `load` runs) are `common.config_bundle.SectionBundle`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.config import (
    BufferConfig,
    DataConfig,
    ModelConfig,
    PrecisionConfig,
    QuantConfig,
    RewardConfig,
    RolloutConfig,
    StalenessConfig,
    TrainConfig,
)
from common.config_bundle import SectionBundle
from common.config_schema import AlgoConfig, EnvConfig


@dataclass(kw_only=True, slots=True)
class EngineSections(SectionBundle):
    """The sections an engine built from the config reads (rollout_workers/sglang_api/backend.py)."""

    rollout: RolloutConfig
    quant: QuantConfig
    """`scheme`: how the published weights are quantized (the server's quantization)."""
    precision: PrecisionConfig
    """`rollout`: the float dtype the engine computes in."""
    model: ModelConfig
    """`lora` (rank, targets): the SGLang server's LoRA flags; `trust_remote_code`: for the worker's tokenizer."""
    staleness: StalenessConfig
    """`max_lag`: LoRA adapter versions the SGLang backend keeps loaded (`max_lag + 1`, sglang_api/lora_sync.py)."""


@dataclass(kw_only=True, slots=True)
class WorkerSections(EngineSections):
    """The sections a rollout worker reads (rollout_workers/worker.py): its engine's and these."""

    train: TrainConfig
    """`group_size` (responses per prompt) and `seed` (with the worker id, the engine's sampling seed)."""
    data: DataConfig
    """The task's reward function."""
    buffer: BufferConfig
    """CurveZMQ keys and `worker_timeout_s` (the heartbeat interval is a sixth of it)."""
    reward: RewardConfig
    """User reward functions and their timeout (rollout_workers/reward_pool.py); none: the task's own reward."""
    env: EnvConfig
    """Multi-turn episodes (rollout_workers/episodes.py); `env.fn` empty: single-turn."""
    algo: AlgoConfig
    """`skip_predicted*` and `skip_min_prob`: predictive selective rollout (rollout_workers/screening.py)."""
