"""The run configuration: one root dataclass composed of one section per component.

Every field's docstring line says what it means and its unit. YAML files in `configs/` hold only what differs
from these defaults; `asyncrl up CONFIG key=value ...` applies dotlist overrides on top. Validation (unknown
keys, wrong types, invalid choices, cross-field rules) happens here, before Ray or torch are imported, and
raises `ConfigError` naming the key.

This module must stay importable without torch, ray or zmq: the CLI parses config first.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import re
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, get_type_hints

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from common.wire import MAX_GROUP

WEIGHTINGS = (
    "none",
    "decoupled",
    "tis",
    "mis_token",
    "mis_seq",
    "acr",
    "acrl",
    "tbpo",
    "gspo",
    "pg_is",
    "pg_tis",
    "pg_mis",
)
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
ADVANTAGES = ("grpo", "drgrpo", "rloo")
PROX_MODES = ("recompute", "behav")
QUANT_SCHEMES = ("none", "int8", "fp8", "fp8_trunc", "w8a16", "w4a16")
PRECISIONS = ("fp32", "bf16", "fp16")
SCHEDULES = ("constant", "cosine", "length_decay")
BACKENDS = ("embedded", "sglang")
TASKS = ("arith", "jsonl")
SWAP_MODES = ("in_place", "retract")
ACRL_X_MODES = ("first_batch", "ema")


class ConfigError(ValueError):
    """A configuration problem, with the offending key in the message."""


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    path: str = "builtin:tiny"
    """A Hugging Face model directory, or `builtin:<name>` for a built-in recipe (built once, cached)."""
    cache_dir: str = ""
    """Where built-in models are cached; empty means $ASYNCRL_CACHE or ~/.cache/asyncrl."""


@dataclass(kw_only=True, slots=True)
class DataConfig:
    task: str = "arith"
    """Prompt source: `arith` (built-in procedurally generated arithmetic) or `jsonl` (a dataset file)."""
    path: str = ""
    """JSONL dataset file for task=jsonl: one object per line with a prompt and an answer field."""
    prompt_key: str = "prompt"
    """Field of a JSONL row holding the prompt text."""
    answer_key: str = "answer"
    """Field of a JSONL row holding the reference answer (scored with math-verify)."""
    digits: int = 2
    """Built-in arithmetic difficulty: the maximum number of digits of each operand."""
    ops: str = "+-"
    """Built-in arithmetic operators to draw from (any of `+`, `-`)."""
    seed: int = 1234
    """Seed of the prompt stream (generation for built-in tasks, shuffling for datasets)."""
    eval_size: int = 256
    """Number of held-out prompts used for evaluation."""


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    steps: int = 100
    """Number of learner steps (each publishes a new weight version)."""
    groups_per_step: int = 16
    """Prompt groups in each learner batch."""
    group_size: int = 8
    """Responses sampled per prompt (G)."""
    seed: int = 0
    """Seed of the learner (init, sampling of minibatches) and of the rollout samplers."""
    eval_every: int = 0
    """Evaluate greedy accuracy on the held-out prompts every this many steps (0: only at the end)."""


@dataclass(kw_only=True, slots=True)
class SGLangConfig:
    """The SGLang backend (`rollout.backend: sglang`): one server per rollout worker, docs/sglang.md."""

    launcher: str = "sglang"
    """Server program: `sglang` (`python -m sglang.launch_server`, GPUs) or `asyncrl` (`asyncrl serve`: the embedded
    engine behind SGLang's HTTP API, CPU; what the tests run)."""
    python: str = ""
    """Python executable that runs the server; empty: the worker's own interpreter."""
    host: str = "127.0.0.1"
    """Address each server binds to (and the worker reaches it at)."""
    base_port: int = 0
    """Worker i's server listens on base_port + i; 0 picks a free port at every launch."""
    tp: int = 1
    """Tensor-parallel GPUs per SGLang server (`--tp`)."""
    gpus_per_server: int = 0
    """GPUs of each server on its node: worker i's server gets CUDA_VISIBLE_DEVICES i*n .. i*n+n-1; 0: inherit."""
    mem_fraction_static: float = 0.8
    """Fraction of GPU memory SGLang reserves for weights and KV cache (`--mem-fraction-static`)."""
    pause_mode: str = "retract"
    """How a weight update pauses generation: `retract` (KV recomputed with the new weights), `in_place` (KV kept) or
    `abort` (requests end and are resubmitted with their tokens)."""
    weight_sync: str = "disk"
    """How weights reach the server: `disk` (a quantized checkpoint for /update_weights_from_disk) or `distributed`
    (NCCL /update_weights_from_distributed; GPUs only, untested in this project's CI)."""
    ckpt_dir: str = ""
    """Parent directory of the weight checkpoints written for `disk`; empty: /dev/shm (else the temp directory)."""
    startup_timeout_s: float = 600.0
    """Seconds a launched server may take to answer /health."""
    request_timeout_s: float = 600.0
    """Seconds one HTTP request to the server may take."""
    max_restarts: int = 3
    """Relaunches of a dead server before the worker reports failure."""
    max_retries: int = 2
    """Resubmissions of a sample after an abort the worker did not ask for (then it is pushed with finish=abort)."""
    extra_args: list[str] = field(default_factory=list)
    """Extra command-line arguments for the server, e.g. [--attention-backend, fa3]."""


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    backend: str = "embedded"
    """Rollout engine: `embedded` (our PyTorch engine, CPU or GPU) or `sglang` (GPU servers)."""
    num_workers: int = 2
    """Rollout worker actors."""
    max_new_tokens: int = 16
    """Maximum response length in tokens (L_max)."""
    temperature: float = 1.0
    """Sampling temperature; behavior log-probs are those of log_softmax(logits / temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 disables)."""
    top_k: int = 0
    """Top-k sampling (0 disables)."""
    groups_per_lease: int = 2
    """Prompt groups a worker leases and decodes together."""
    swap_mode: str = "in_place"
    """How a new weight version enters in-flight sequences: `in_place` keeps their KV, `retract` recomputes it."""
    threads: int = 1
    """torch intra-op threads per rollout worker."""
    max_batch: int = 256
    """Sequences one embedded engine decodes together (its KV-cache slots; the cache grows to this on demand)."""
    max_seq_len: int = 2048
    """Prompt + response positions per KV-cache slot (capped at the model's max_position_embeddings)."""
    device: str = "cpu"
    """Device of the embedded engine: `cpu`, `cuda` or `cuda:N` (GPU path written to torch's APIs, untested on GPU)."""
    max_restarts: int = 5
    """Restarts of crashed rollout worker actors, over the whole run, before the run fails (asyncrl/supervise.py)."""
    restart_backoff_s: float = 1.0
    """Delay before restarting a crashed worker; doubles with every further crash (capped at 60 s)."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a socket on this machine (127.0.0.0/8, ::1, `localhost`); `buffer.host` check."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a hostname, an interface name or `*`: assume it is reachable from outside
        return False


@dataclass(kw_only=True, slots=True)
class BufferConfig:
    host: str = "127.0.0.1"
    """Address the buffer service binds to; anything but a loopback address (e.g. 0.0.0.0) needs `curve_keys_dir`."""
    port: int = 0
    """TCP port of the buffer service (0 picks a free one)."""
    lease_timeout_s: float = 60.0
    """Seconds after which an unacknowledged prompt lease returns to the pool."""
    max_queued_groups: int = 1024
    """Admitted groups held in memory before producers are told to wait."""
    journal: bool = True
    """Append admitted trajectories and consumption marks to runs/<name>/buffer.journal."""
    fsync: str = "batch"
    """Journal fsync policy: `always`, `batch` (once per burst of requests, before replying) or `never`."""
    worker_timeout_s: float = 30.0
    """Seconds without any request from a worker after which it is declared dead and its leases return; 0: off.
    Rollout workers send a heartbeat every worker_timeout_s / 6 seconds, also while generating."""
    compact_bytes: int = 67108864
    """Journal size in bytes that triggers compaction into a snapshot of the live state."""
    reserve_mb: int = 128
    """MiB of memory the buffer process faults in at start-up and keeps for queued groups, so that admitting them
    does not page-fault on every message (buffer/memory.py; the process starts at about this resident size)."""
    curve_keys_dir: str = ""
    """Directory of CurveZMQ keys (`asyncrl keys DIR`; layout in common/curve.py): encrypts the buffer socket and
    admits only allow-listed clients. Required when `host` is not a loopback address; empty: plain ZMQ."""

    def __post_init__(self) -> None:
        if not self.curve_keys_dir and not is_loopback(self.host):
            raise ConfigError(
                f"`buffer.host={self.host}` binds beyond loopback, so the buffer needs CurveZMQ keys: set "
                "`buffer.curve_keys_dir` to a directory made by `asyncrl keys DIR`"
            )


@dataclass(kw_only=True, slots=True)
class StalenessConfig:
    max_lag: int = 2
    """Largest allowed (train step - oldest token version) of a trained sample; 0 is synchronous RL."""


@dataclass(kw_only=True, slots=True)
class AcrlConfig:
    gamma: float = 0.65
    """ACRL gamma: strength of the adaptive exponent."""
    x: float = 0.0
    """Override of the reference discrepancy X (0: measured on the first training batch)."""
    x_mode: str = "first_batch"
    """`first_batch` (the paper: X frozen after step 0) or `ema` (our optional moving reference)."""
    ema_decay: float = 0.99
    """Decay of the moving reference when x_mode=ema."""


@dataclass(kw_only=True, slots=True)
class TbpoConfig:
    eps_seq_high: float = 4e-4
    """Upper sequence-ratio bound for positive advantages."""
    eps_seq_low: float = 3e-4
    """Lower sequence-ratio bound for negative advantages when dual=false."""
    delta_high: float = 7e-4
    """Dual band upper bound for negative advantages."""
    delta_low: float = 3e-4
    """Dual band lower bound for negative advantages."""
    c: float = 2.0
    """Mismatch weight clip: m_i is clipped to [-log c, log c]."""
    dual: bool = True
    """Use the dual band for negative advantages."""


@dataclass(kw_only=True, slots=True)
class LossConfig:
    weighting: str = "tis"
    """Mismatch weighting (ALGORITHMS.md): none, decoupled, tis, mis_token, mis_seq, acr, acrl, tbpo, gspo, pg_*."""
    cap: float = 2.0
    """C: truncation / masking threshold of the mismatch weight."""
    eps_low: float = 0.2
    """PPO lower clip."""
    eps_high: float = 0.28
    """PPO upper clip (DAPO clip-higher)."""
    agg: str = "token_mean"
    """Loss aggregation: token_mean, seq_mean_token_mean or seq_mean_token_sum_norm."""
    dual_clip: float = 0.0
    """Negative dual clip c (> 1) for A < 0; 0 disables."""
    acrl: AcrlConfig = field(default_factory=AcrlConfig)
    tbpo: TbpoConfig = field(default_factory=TbpoConfig)


@dataclass(kw_only=True, slots=True)
class OverlongConfig:
    len: int = 0
    """DAPO overlong shaping length L_c in tokens (0 disables); truncated responses get -1."""


@dataclass(kw_only=True, slots=True)
class AlgoConfig:
    adv: str = "grpo"
    """Advantage estimator: grpo, drgrpo or rloo."""
    filter_groups: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal."""
    overlong: OverlongConfig = field(default_factory=OverlongConfig)


@dataclass(kw_only=True, slots=True)
class LearnerConfig:
    prox: str = "recompute"
    """Proximal log-probs: `recompute` (the policy at the start of the step: one no-grad forward, or with one minibatch
    and any weighting but acrl that minibatch's own forward, same values) or `behav` (use behavior log-probs)."""
    minibatches: int = 1
    """PPO minibatches (optimizer steps) per learner step."""
    micro_batch_tokens: int = 16384
    """Token budget of one forward/backward micro-batch: its rows x their longest prompt + response, in tokens."""
    rollout_aligned: bool = False
    """QaRL: run the learner's linear forward on the rollout's quantized operands (straight-through backward)."""
    threads: int = 1
    """torch intra-op threads of each learner rank."""
    world_size: int = 1
    """Learner ranks (FSDP2, gloo on CPU), each a Ray actor requesting `ray.learner_cpus / world_size` CPUs."""


@dataclass(kw_only=True, slots=True)
class UaqConfig:
    scale: float = 1.5
    """UAQ scale s (QuRL sec. 4.3), applied once before training; 1.0 disables the reparametrization."""


@dataclass(kw_only=True, slots=True)
class QuantConfig:
    scheme: str = "int8"
    """Rollout weight quantization: none, int8 (W8A8), fp8 (e4m3), fp8_trunc, w8a16, w4a16."""
    uaq: UaqConfig = field(default_factory=UaqConfig)


@dataclass(kw_only=True, slots=True)
class PrecisionConfig:
    train: str = "fp32"
    """Learner compute precision: fp32, bf16 or fp16."""
    rollout: str = "fp32"
    """Rollout compute precision of non-quantized parts: fp32, bf16 or fp16."""
    loss_scale_init: float = 65536.0
    """fp16 training: initial dynamic loss scale, a power of two (halved on every step with inf/nan gradients)."""
    loss_scale_growth_interval: int = 2000
    """fp16 training: consecutive clean optimizer steps after which the loss scale doubles."""


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float = 1e-5
    """Peak learning rate."""
    sched: str = "constant"
    """LR schedule: constant, cosine or length_decay."""
    warmup_steps: int = 0
    """Linear warmup steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    decay_period: int = 0
    """length_decay: halving period in steps (0: 1.8 x the surge step)."""
    surge_factor: float = 1.5
    """length_decay: response-length ratio over its baseline that counts as a surge."""
    surge_window: int = 5
    """length_decay: k, the window of steps averaged for baseline and surge detection."""
    lr_min_ratio: float = 0.1
    """length_decay: floor as a fraction of the peak LR."""


@dataclass(kw_only=True, slots=True)
class LoggingConfig:
    dir: str = "runs"
    """Parent directory of run directories."""
    name: str = ""
    """Run name (runs/<name>); empty: the config file's stem."""
    console: bool = True
    """Print a live line per step."""
    wandb: bool = False
    """Also log to Weights & Biases."""
    wandb_mode: str = "offline"
    """wandb mode (offline by default: wandb hangs without a network)."""
    wandb_project: str = "asyncrl"
    """wandb project name."""


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    every: int = 0
    """Save a resumable checkpoint (runs/<name>/checkpoints/step_<k>) every this many steps (0: only on `down`)."""
    keep_last: int = 2
    """Resumable checkpoints kept on disk (the oldest are deleted)."""
    final: bool = True
    """Save a final Hugging Face model directory when the run ends."""


@dataclass(kw_only=True, slots=True)
class RayConfig:
    address: str = ""
    """Ray cluster address (`auto` or host:port); empty starts a local cluster."""
    num_cpus: int = 2
    """CPUs of the local cluster."""
    worker_cpus: float = 0.5
    """CPU request of each rollout worker actor."""
    learner_cpus: float = 1.0
    """CPU request of the whole learner, split evenly over its `learner.world_size` rank actors."""
    worker_resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each rollout worker actor requests, e.g. {rollout_node: 0.1} to place them on the nodes
    started with `ray start --resources '{"rollout_node": 1}'`."""
    learner_resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources of the whole learner, split evenly over its rank actors like `learner_cpus`."""


@dataclass(kw_only=True, slots=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    ray: RayConfig = field(default_factory=RayConfig)


# key -> valid values; checked after merging so that the message names the key and every choice.
CHOICES: dict[str, tuple[str, ...]] = {
    "data.task": TASKS,
    "rollout.backend": BACKENDS,
    "rollout.swap_mode": SWAP_MODES,
    "rollout.sglang.launcher": ("sglang", "asyncrl"),
    "rollout.sglang.pause_mode": ("retract", "in_place", "abort"),
    "rollout.sglang.weight_sync": ("disk", "distributed"),
    "buffer.fsync": ("always", "batch", "never"),
    "loss.weighting": WEIGHTINGS,
    "loss.agg": AGGREGATIONS,
    "loss.acrl.x_mode": ACRL_X_MODES,
    "algo.adv": ADVANTAGES,
    "learner.prox": PROX_MODES,
    "quant.scheme": QUANT_SCHEMES,
    "precision.train": PRECISIONS,
    "precision.rollout": PRECISIONS,
    "optim.sched": SCHEDULES,
    "logging.wandb_mode": ("offline", "online", "disabled"),
}

# key -> (lowest, highest, inclusive-low); None means unbounded.
RANGES: dict[str, tuple[float | None, float | None]] = {
    "data.digits": (1, 18),
    "data.eval_size": (0, None),
    "train.steps": (1, None),
    "train.groups_per_step": (1, MAX_GROUP),  # one BatchReply carries at most MAX_GROUP groups
    "train.group_size": (2, MAX_GROUP),  # one sample per prompt has no group baseline: every advantage is 0
    "train.eval_every": (0, None),
    "rollout.num_workers": (0, None),
    "rollout.max_new_tokens": (1, None),
    "rollout.temperature": (1e-6, None),
    "rollout.top_p": (1e-6, 1.0),
    "rollout.top_k": (0, None),
    "rollout.groups_per_lease": (1, None),
    "rollout.threads": (1, None),
    "rollout.max_batch": (1, None),
    "rollout.max_seq_len": (2, None),
    "rollout.max_restarts": (0, None),
    "rollout.restart_backoff_s": (0.0, None),
    "rollout.sglang.base_port": (0, 65535),
    "rollout.sglang.tp": (1, None),
    "rollout.sglang.gpus_per_server": (0, None),
    "rollout.sglang.mem_fraction_static": (0.01, 1.0),
    "rollout.sglang.startup_timeout_s": (1.0, None),
    "rollout.sglang.request_timeout_s": (0.1, None),
    "rollout.sglang.max_restarts": (0, None),
    "rollout.sglang.max_retries": (0, None),
    "buffer.port": (0, 65535),
    "buffer.lease_timeout_s": (0.1, None),
    "buffer.max_queued_groups": (1, None),
    "buffer.worker_timeout_s": (0.0, None),
    "buffer.compact_bytes": (1, None),
    "buffer.reserve_mb": (0, 512),  # buffer.memory.MAX_RESERVE_MB
    "staleness.max_lag": (0, 2**31 - 1),  # wire.MAX_STEP: the buffer refuses more
    "loss.cap": (1.0, None),
    "loss.eps_low": (0.0, 1.0),
    "loss.eps_high": (0.0, None),
    "loss.acrl.gamma": (0.0, None),
    "loss.acrl.x": (0.0, None),
    "loss.acrl.ema_decay": (0.0, 1.0),
    "loss.tbpo.c": (1.0, None),
    "loss.tbpo.eps_seq_high": (0.0, 1.0),
    "loss.tbpo.eps_seq_low": (0.0, 1.0),
    "loss.tbpo.delta_high": (0.0, 1.0),
    "loss.tbpo.delta_low": (0.0, 1.0),
    "algo.overlong.len": (0, None),
    "learner.minibatches": (1, None),
    "learner.micro_batch_tokens": (1, None),
    "learner.threads": (1, None),
    "learner.world_size": (1, None),
    "precision.loss_scale_init": (2.0**-24, 2.0**64),
    "precision.loss_scale_growth_interval": (1, None),
    "quant.uaq.scale": (1e-3, None),
    "optim.lr": (0.0, None),
    "optim.warmup_steps": (0, None),
    "optim.weight_decay": (0.0, None),
    "optim.grad_clip": (0.0, None),
    "optim.decay_period": (0, None),
    "optim.surge_factor": (1.0, None),
    "optim.surge_window": (1, None),
    "optim.lr_min_ratio": (0.0, 1.0),
    "checkpoint.every": (0, None),
    "checkpoint.keep_last": (1, None),
    "ray.num_cpus": (1, None),
    "ray.worker_cpus": (0.0, None),
    "ray.learner_cpus": (0.0, None),
}


def _get(cfg: Any, dotted: str) -> Any:
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def all_keys(node: Any = Config, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the config schema, e.g. `loss.acrl.gamma`."""
    keys: list[str] = []
    for f in fields(node):
        dotted = f"{prefix}{f.name}"
        default = f.default_factory() if f.default_factory is not MISSING else f.default  # type: ignore[misc]
        if is_dataclass(default):
            keys.extend(all_keys(type(default), dotted + "."))
        else:
            keys.append(dotted)
    return keys


def _closest(key: str) -> str:
    keys = all_keys()
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
        return ConfigError(f"{source}: unknown config key `{key}`{_closest(key)}")
    first_line = str(err).splitlines()[0]
    return ConfigError(f"{source}: bad value for `{key}`: {first_line}")


def _check_choices_and_ranges(cfg: Config) -> None:
    for key in all_keys():  # a NaN passes every comparison below (and would train on NaN weights): none anywhere
        value = _get(cfg, key)
        if isinstance(value, float) and (math.isnan(value) or (key in RANGES and math.isinf(value))):
            raise ConfigError(f"value {value!r} for `{key}` is not a finite number")
    for key, choices in CHOICES.items():
        value = _get(cfg, key)
        if value not in choices:
            raise ConfigError(f"invalid value {value!r} for `{key}`; valid values: {', '.join(choices)}")
    for key, (low, high) in RANGES.items():
        value = _get(cfg, key)
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
            raise ConfigError(f"value {value!r} for `{key}` is out of range {bounds}")


def _check_cross_field(cfg: Config) -> None:
    if cfg.learner.rollout_aligned and cfg.quant.scheme in ("w8a16", "w4a16") and cfg.precision.rollout != "fp32":
        raise ConfigError(
            f"`learner.rollout_aligned` with weight-only `quant.scheme={cfg.quant.scheme}` needs "
            f"`precision.rollout=fp32` (the engine would compute in {cfg.precision.rollout}, the aligned learner in "
            "fp32: they would not align)"
        )
    scale = cfg.precision.loss_scale_init
    if math.frexp(scale)[0] != 0.5:  # unscaling must be exact: a power of two
        raise ConfigError(f"`precision.loss_scale_init` must be a power of two, got {scale!r}")
    if not cfg.ray.address:  # a local Ray of ray.num_cpus CPUs: every actor must fit, or some wait forever
        need = cfg.ray.learner_cpus + cfg.rollout.num_workers * cfg.ray.worker_cpus
        if need > cfg.ray.num_cpus + 1e-9:
            raise ConfigError(
                f"`ray.learner_cpus` ({cfg.ray.learner_cpus:g}) + `rollout.num_workers` ({cfg.rollout.num_workers}) "
                f"x `ray.worker_cpus` ({cfg.ray.worker_cpus:g}) = {need:g} CPUs > `ray.num_cpus` ({cfg.ray.num_cpus})"
            )
    if cfg.data.task == "jsonl" and not cfg.data.path:
        raise ConfigError("data.task=jsonl needs `data.path` (a JSONL file with prompt and answer fields)")
    if cfg.data.task == "arith" and (not cfg.data.ops or set(cfg.data.ops) - {"+", "-"}):
        raise ConfigError(f"`data.ops` must be made of '+' and '-', got {cfg.data.ops!r}")
    if cfg.loss.dual_clip and cfg.loss.dual_clip <= 1.0:
        raise ConfigError(f"`loss.dual_clip` must be 0 (off) or > 1, got {cfg.loss.dual_clip}")
    if (
        cfg.loss.weighting in ("tis", "acr", "acrl", "decoupled", "mis_token", "mis_seq")
        and cfg.learner.prox == "behav"
    ):
        # Allowed (the QuRL eq. 3 baseline) but every mismatch weight is then exactly 1.
        pass
    if cfg.rollout.backend == "sglang" and cfg.quant.scheme in ("fp8_trunc", "w4a16", "w8a16"):
        raise ConfigError(
            f"`quant.scheme={cfg.quant.scheme}` is a simulation scheme of the embedded engine; "
            "rollout.backend=sglang serves int8 or fp8"
        )
    if cfg.rollout.backend == "sglang":
        _check_sglang(cfg)
    if cfg.algo.overlong.len >= cfg.rollout.max_new_tokens and cfg.algo.overlong.len > 0:
        raise ConfigError(
            f"`algo.overlong.len` ({cfg.algo.overlong.len}) must be below `rollout.max_new_tokens` "
            f"({cfg.rollout.max_new_tokens})"
        )
    if cfg.learner.rollout_aligned and cfg.quant.scheme == "none":
        raise ConfigError("`learner.rollout_aligned=true` needs a quantized `quant.scheme` (int8, fp8, ...), got none")
    if cfg.rollout.num_workers < 1:
        raise ConfigError("`rollout.num_workers` must be at least 1 to start a run")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", cfg.rollout.device):
        raise ConfigError(f"`rollout.device` must be cpu, cuda or cuda:N, got {cfg.rollout.device!r}")
    if cfg.rollout.max_seq_len <= cfg.rollout.max_new_tokens:
        raise ConfigError(
            f"`rollout.max_seq_len` ({cfg.rollout.max_seq_len}) must exceed `rollout.max_new_tokens` "
            f"({cfg.rollout.max_new_tokens}): each slot holds the prompt and the response"
        )
    if len(cfg.optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.optim.betas):
        raise ConfigError(f"`optim.betas` must be two numbers in [0, 1), got {list(cfg.optim.betas)}")
    for key in ("ray.worker_resources", "ray.learner_resources"):
        for name, amount in _get(cfg, key).items():
            if not amount > 0:
                raise ConfigError(f"`{key}.{name}` must be a positive amount of that resource, got {amount}")
    if cfg.model.path.startswith("builtin:"):
        from common.models_registry import BUILTIN_MODELS

        name = cfg.model.path.split(":", 1)[1]
        if name not in BUILTIN_MODELS:
            raise ConfigError(
                f"unknown built-in model {name!r} in `model.path`; valid: "
                + ", ".join(f"builtin:{n}" for n in BUILTIN_MODELS)
            )
    elif not Path(cfg.model.path).expanduser().is_dir():
        raise ConfigError(f"`model.path` {cfg.model.path!r} is not a directory (nor builtin:<name>)")


def _check_sglang(cfg: Config) -> None:
    sglang = cfg.rollout.sglang
    if sglang.launcher == "sglang" and cfg.quant.scheme == "int8":
        raise ConfigError(
            "`quant.scheme=int8` with `rollout.backend=sglang`: SGLang's w8a8_int8 layers cannot reload weights (after "
            "the first load they replace their weights with transposed tensors that have no weight loader, so "
            "/update_weights_from_disk fails and rolls back; docs/sglang.md). Use `quant.scheme=fp8` (block FP8 "
            "reloads), `rollout.backend=embedded` (INT8 on our engine), or `rollout.sglang.launcher=asyncrl`"
        )
    if sglang.launcher == "asyncrl" and sglang.weight_sync == "distributed":
        raise ConfigError("`rollout.sglang.weight_sync=distributed` needs NCCL and real SGLang servers "
                          "(`rollout.sglang.launcher=sglang`); `asyncrl serve` loads weights with `disk`")  # fmt: skip
    if not is_loopback(sglang.host):
        raise ConfigError(f"`rollout.sglang.host={sglang.host}` would expose SGLang's unauthenticated HTTP API "
                          "beyond this machine; keep it on a loopback address")  # fmt: skip


# Valid settings that this version cannot run yet: rejected up front rather than silently ignored.
# key -> (the values that work now, where the rest is coming from)
NOT_YET: dict[str, tuple[tuple[object, ...], str]] = {}


def _check_not_yet(cfg: Config) -> None:
    for key, (working, where) in NOT_YET.items():
        value = _get(cfg, key)
        if value not in working:
            raise ConfigError(
                f"`{key}={value}` is valid but not implemented in this version (it comes with {where}); "
                f"working now: {', '.join(map(str, working))}"
            )


LIVE_KEYS: tuple[str, ...] = (
    "staleness.max_lag",
    "loss.cap",
    "loss.eps_low",
    "loss.eps_high",
    "loss.acrl.gamma",
    "optim.lr",
)
"""Keys `asyncrl set key=value` may change in a running job (applied at the next step boundary)."""


def validate(cfg: Config) -> Config:
    """Run every check that spans fields or needs the merged value; return cfg unchanged."""
    _check_choices_and_ranges(cfg)
    _check_cross_field(cfg)
    _check_not_yet(cfg)
    return cfg


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
    cfg = _merge_overrides(merged, overrides)
    if not cfg.logging.name:
        cfg.logging.name = Path(path).stem if path is not None else "run"
    return validate(cfg)


def _merge_overrides(merged: DictConfig, overrides: list[str] | tuple[str, ...]) -> Config:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value")
        try:
            dotlist = OmegaConf.from_dotlist([item])
            _check_sections(Config, dotlist, f"override {item!r}", "")
            merged = OmegaConf.merge(merged, dotlist)
        except OmegaConfBaseException as err:
            raise _explain(err, f"override {item!r}") from err
        except yaml.YAMLError as err:  # the value is not YAML: `loss.cap=[1`
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({str(err).splitlines()[0]})") from None
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
    return {key: _get(updated, key) for key in LIVE_KEYS if _get(updated, key) != _get(cfg, key)}


def get_key(cfg: Any, dotted: str) -> Any:
    """The value of a dotted key of a config, e.g. `get_key(cfg, "loss.acrl.gamma")`."""
    return _get(cfg, dotted)


def set_key(cfg: Any, dotted: str, value: Any) -> None:
    """Set the dotted key of a config in place (e.g. a validated live change from `live_update`)."""
    section, _, leaf = dotted.rpartition(".")
    setattr(_get(cfg, section) if section else cfg, leaf, value)


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
