"""The config schema: one dataclass per component, composed into the root `Config`.

Every field's docstring line says what it means and its unit; a key's valid choices (`one_of`) or range
(`in_range`) are declared with the field and checked by `common.config_checks.check_section`. A rule that spans
the fields of one section lives in its `__post_init__`, one that spans sections in `common/config_rules.py`; both
name the key to change. Loading, merging and overrides are in `common/config.py`, which re-exports every name here.

This module must stay importable without torch, ray or zmq: the CLI parses config first.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any

from common.config_checks import ConfigError, in_range, is_loopback, one_of
from common.wire import MAX_GROUP, MAX_STEP

MAX_SEED = 2**32 - 1
"""The largest `train.seed` and `data.seed`: a worker's sampler seed (train.seed x 1,000,003 + a crc32) must fit
torch's 64-bit generator seed."""

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
PROX_MODES = ("recompute", "behav", "loglinear")
MAX_THREADS = 1024
"""Most torch threads a worker or learner rank may ask for: torch.set_num_threads(100000) ends the process (SIGSEGV)."""
THREADS_POLICIES = ("fixed", "throttled", "measured")
QUANT_SCHEMES = ("none", "int8", "fp8", "fp8_trunc", "w8a16", "w4a16")
HEAD_MODES = ("auto", "quantized", "fp32")
PRECISIONS = ("fp32", "bf16", "fp16")
SCHEDULES = ("constant", "cosine", "length_decay")
BACKENDS = ("embedded", "sglang")
TASKS = ("arith", "arith_tool", "jsonl", "dataset")
SWAP_MODES = ("in_place", "retract")
CPU_PRIORITIES = ("auto", "normal", "idle")
"""`rollout.cpu_priority`: how an embedded CPU worker's threads are scheduled."""
ACRL_X_MODES = ("first_batch", "ema")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The decoder-block linears a LoRA adapter may sit on (`model.lora.targets`)."""
LORA_BASES = ("auto", "full", "rollout")
FP32_GEMMS = ("auto", "blas", "onednn")  # learner.fp32_gemm; here: the driver reads the config torch-free
LORA_SYNC_DTYPES = ("fp32", "bf16", "int8")
"""How LoRA adapters travel to the rollout (`model.lora.sync_dtype`, quant_sync/export.py `encode_adapter`)."""
KL_ESTIMATORS = ("k1", "k2", "k3")
TURN_REWARDS = ("sum", "last", "max")
"""How an episode's per-turn rewards make its one reward (`env.turn_rewards`, common/envs.py `combine_turn_reward`)."""


@dataclass(kw_only=True, slots=True)
class LoraConfig:
    rank: int = in_range(0, 1024, default=0)
    """LoRA rank r of every adapter (docs/algorithms.md, "LoRA on a frozen quantized base"); 0: off, the whole
    model trains. On: the base weights are frozen, only the adapters get gradients and optimizer state, and each
    new weight version publishes only the adapters."""
    alpha: float = in_range(1e-6, default=32.0)
    """LoRA alpha: the adapter's output is scaled by alpha / rank."""
    dropout: float = in_range(0.0, 0.99, default=0.0)
    """Dropout on the adapters' input in the learner's forwards (the rollout has none: above 0 the learner's
    log-probs no longer equal the engine's)."""
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """The decoder-block linears that get an adapter, among q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    down_proj (default: all of them)."""
    sync_dtype: str = one_of(LORA_SYNC_DTYPES, default="int8")
    """The adapters' dtype on the wire to the rollout workers: `int8` (symmetric, one float32 scale per rank
    component: per row of A, per column of B; a quarter of fp32's bytes, no accuracy lost on the built-in task,
    docs/lora.md), `bf16` or `fp32`. The learner's forwards run the same rounded A and B the workers receive
    (straight-through gradient to fp32 master adapters), so learner and engine still agree."""

    def __post_init__(self) -> None:
        unknown = [name for name in self.targets if name not in LORA_TARGETS]
        if unknown or not self.targets:
            raise ConfigError(f"`model.lora.targets` must be a non-empty list of {', '.join(LORA_TARGETS)}; "
                              f"got {list(self.targets)}")  # fmt: skip
        if len(set(self.targets)) != len(self.targets):
            raise ConfigError(f"`model.lora.targets` names a linear twice: {list(self.targets)}")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    path: str = "builtin:tiny"
    """A Hugging Face model directory, or `builtin:<name>` for a built-in recipe (built once, cached)."""
    cache_dir: str = ""
    """Where built-in models are cached; empty means $ASYNCRL_CACHE or ~/.cache/asyncrl."""
    trust_remote_code: bool = False
    """Let transformers run Python code shipped in the model directory (`auto_map` modeling files). Off: a model
    directory is data, and one that needs its own code is refused (docs/security.md)."""
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass(kw_only=True, slots=True)
class DataConfig:
    task: str = one_of(TASKS, default="arith")
    """Prompt source: `arith` (built-in procedurally generated arithmetic), `arith_tool` (the same problems, solved
    in multi-turn episodes with a calculator: needs `env.fn=asyncrl:arith_tool`), `jsonl` (a JSONL file) or `dataset`
    (a .jsonl/.json/.parquet file or a `datasets` save_to_disk directory, read with the `datasets` library)."""
    path: str = ""
    """Dataset for task=jsonl (a JSONL file) or task=dataset (a .jsonl/.json/.parquet file or a saved directory)."""
    prompt_key: str = "prompt"
    """Field of a row holding the prompt: text, or (task=dataset) a list of {role, content} messages; task=dataset
    takes dotted paths into nested fields (`extra_info.question`)."""
    answer_key: str = "answer"
    """Field of a row holding the reference answer (scored with math-verify); task=dataset takes dotted paths
    (`reward_model.ground_truth`)."""
    eval_path: str = ""
    """task=dataset: a separate held-out file (same formats and keys) for evaluation; empty: `data.eval_size` rows of
    `data.path`. Rows it shares with `data.path` (same prompt and answer) are counted: a warning at start, and the
    eval line and event say the evaluation is not held out (`eval_path_rows_in_training`)."""
    max_prompt_tokens: int = in_range(0, default=0)
    """task=dataset: drop rows whose prompt (chat template applied) has more tokens than this; 0: keep all. The count
    dropped is printed at start."""
    chat_template: str = one_of(("auto", "true", "false"), default="auto")
    """Render prompts with the tokenizer's chat template (`apply_chat_template(..., add_generation_prompt=True)`):
    `auto` when the prompt is a message list, or when the tokenizer has a template and `data.system_prompt` is set;
    `true` always; `false` never (messages are joined with blank lines)."""
    system_prompt: str = ""
    """System message put before each prompt (unless its messages already start with one); empty: none."""
    tokenizer: str = ""
    """Tokenizer directory used to count prompt tokens for `data.max_prompt_tokens`; empty: the model's (the driver
    fills it in)."""
    digits: int = in_range(1, 18, default=2)
    """Built-in arithmetic difficulty: the maximum number of digits of each operand."""
    ops: str = "+-"
    """Built-in arithmetic operators to draw from (any of `+`, `-`)."""
    seed: int = in_range(0, MAX_SEED, default=1234)
    """Seed of the prompt stream (generation for built-in tasks, shuffling for datasets)."""
    eval_size: int = in_range(0, default=256)
    """Number of evaluation prompts. Built-in tasks: draws from their held-out slice of the problem space, with
    replacement (a problem drawn twice counts twice, as the task's own distribution weighs it: 168 distinct of 256
    for the default arithmetic task; the eval event logs `distinct`). Tasks `jsonl` and `dataset` without
    `data.eval_path`: rows of the training data, also trained on (the eval line says so): not held out."""


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    steps: int = in_range(1, default=100)
    """Number of learner steps (each publishes a new weight version)."""
    groups_per_step: int = in_range(1, MAX_GROUP, default=16)  # one BatchReply carries at most MAX_GROUP groups
    """Prompt groups in each learner batch."""
    group_size: int = in_range(2, MAX_GROUP, default=8)  # one sample per prompt has no baseline: advantage 0
    """Responses sampled per prompt (G)."""
    seed: int = in_range(0, MAX_SEED, default=0)
    """Seed of the learner (init, sampling of minibatches) and of the rollout samplers."""
    eval_every: int = in_range(0, default=0)
    """Evaluate greedy accuracy on the held-out prompts every this many steps (0: only at the end)."""
    stall_timeout_s: float = in_range(0.0, default=0.0)
    """Seconds without a finished train step after which the driver reports a stall (console and a `stall` event)
    and fails the run if nothing can make progress (asyncrl/watchdog.py); 0: max(300 s, 30 x the median step time)."""
    max_nonfinite_steps: int = in_range(0, default=20)
    """Fail the run when this many train steps in a row were skipped for a non-finite loss or gradient (the model
    has diverged: too high an `optim.lr`, or bad data); 0: never. fp16 loss scaling skips a few steps in a row while
    its scale falls (`precision.loss_scale_init`), hence the margin."""


@dataclass(kw_only=True, slots=True)
class SGLangConfig:
    """The SGLang backend (`rollout.backend: sglang`): one server per rollout worker, docs/sglang.md."""

    launcher: str = one_of(("sglang", "asyncrl"), default="sglang")
    """Server program: `sglang` (`python -m sglang.launch_server`, GPUs) or `asyncrl` (`asyncrl serve`: the embedded
    engine behind SGLang's HTTP API, CPU; what the tests run)."""
    python: str = ""
    """Python executable that runs the server; empty: the worker's own interpreter."""
    host: str = "127.0.0.1"
    """Address each server binds to (and the worker reaches it at)."""
    base_port: int = in_range(0, 65535, default=0)
    """Worker i's server listens on base_port + i; 0 picks a free port at every launch."""
    tp: int = in_range(1, default=1)
    """Tensor-parallel GPUs per SGLang server (`--tp`)."""
    gpus_per_server: int = in_range(0, default=0)
    """GPUs of each server on its node: worker i's server gets CUDA_VISIBLE_DEVICES i*n .. i*n+n-1; 0: inherit."""
    mem_fraction_static: float = in_range(0.01, 1.0, default=0.8)
    """Fraction of GPU memory SGLang reserves for weights and KV cache (`--mem-fraction-static`)."""
    pause_mode: str = one_of(("retract", "in_place", "abort"), default="retract")
    """How a weight update pauses generation: `retract` (KV recomputed with the new weights), `in_place` (KV kept) or
    `abort` (requests end and are resubmitted with their tokens)."""
    weight_sync: str = one_of(("disk", "distributed"), default="disk")
    """How weights reach the server: `disk` (a quantized checkpoint for /update_weights_from_disk) or `distributed`
    (NCCL /update_weights_from_distributed; GPUs only, untested in this project's CI)."""
    ckpt_dir: str = ""
    """Parent directory of the weight checkpoints written for `disk`; empty: /dev/shm (else the temp directory)."""
    startup_timeout_s: float = in_range(1.0, default=600.0)
    """Seconds a launched server may take to answer /health."""
    request_timeout_s: float = in_range(0.1, default=600.0)
    """Seconds one HTTP request to the server may take; a /generate past it is aborted and counts as a retry."""
    max_restarts: int = in_range(0, default=3)
    """Relaunches of a dead server before the worker reports failure."""
    max_retries: int = in_range(0, default=2)
    """Resubmissions of a sample after an abort the worker did not ask for, or after a request that outlasted
    `request_timeout_s` (aborted on the server by its rid); past them the sample is pushed with finish=abort."""
    extra_args: list[str] = field(default_factory=list)
    """Extra command-line arguments for the server, e.g. [--attention-backend, fa3]."""


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    backend: str = one_of(BACKENDS, default="embedded")
    """Rollout engine: `embedded` (our PyTorch engine, CPU or GPU) or `sglang` (GPU servers)."""
    num_workers: int = in_range(0, default=2)
    """Rollout worker actors."""
    max_new_tokens: int = in_range(1, default=16)
    """Maximum response length in tokens (L_max)."""
    temperature: float = in_range(1e-6, default=1.0)
    """Sampling temperature; behavior log-probs are those of log_softmax(logits / temperature)."""
    top_p: float = in_range(1e-6, 1.0, default=1.0)
    """Nucleus sampling mass (1.0 disables)."""
    top_k: int = in_range(0, default=0)
    """Top-k sampling (0 disables)."""
    groups_per_lease: int = in_range(1, default=2)
    """Prompt groups a worker leases and decodes together (with `rollout.continuous`: keeps in flight)."""
    continuous: bool = False
    """Keep the embedded engine's batch full across leases: a group is scored and pushed as soon as its samples end,
    and prompts leased at once take the freed slots (rollout_workers/continuous.py); false: a worker generates a
    lease's groups in one batch, as long as its longest sample. Single-turn, `rollout.backend=embedded` only."""
    swap_mode: str = one_of(SWAP_MODES, default="in_place")
    """How a new weight version enters in-flight sequences: `in_place` keeps their KV, `retract` recomputes it."""
    threads: int = in_range(1, MAX_THREADS, default=1)
    """torch intra-op threads per rollout worker."""
    cpu_priority: str = one_of(CPU_PRIORITIES, default="auto")
    """OS scheduling of an embedded CPU worker's threads: `idle` (Linux SCHED_IDLE: it runs on the cycles nothing
    else wants, so the learner on the same cores keeps them and generation fills its gaps), `normal`, or `auto`:
    `idle` for an asynchronous run (`staleness.max_lag > 0`) of the embedded engine on the CPU, else `normal`
    (`common.config_rules.worker_cpu_priority`, resolved by the driver; a worker built outside a run with `auto`
    keeps normal priority)."""
    max_batch: int = in_range(1, default=256)
    """Sequences one embedded engine decodes together (its KV-cache slots; the cache grows to this on demand)."""
    max_seq_len: int = in_range(2, default=2048)
    """Prompt + response positions per KV-cache slot (capped at the model's max_position_embeddings)."""
    prefix_cache: bool = True
    """Embedded engine: keep retired sequences' K/V (up to a quarter of the full KV cache's positions, LRU) so that a
    prompt beginning with their tokens (a multi-turn episode's next turn, a shared system prompt) prefills only the
    rest; emptied on every weight swap (rollout_workers/embedded/prefix_cache.py)."""
    pause_during_training: bool = True
    """Embedded CPU workers on the learner's machine pause between decode steps while the learner's step trains on
    every core (`common.train_gate`: filling its short gaps cost it more than they gained); `ray.launcher=local`
    only."""
    device: str = "cpu"
    """Device of the embedded engine: `cpu`, `cuda` or `cuda:N` (GPU path written to torch's APIs, untested on GPU)."""
    max_restarts: int = in_range(0, default=5)
    """Restarts of crashed rollout worker actors, over the whole run, before the run fails (asyncrl/supervise.py)."""
    restart_backoff_s: float = in_range(0.0, default=1.0)
    """Delay before restarting a crashed worker; doubles with every further crash (capped at 60 s)."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)


@dataclass(kw_only=True, slots=True)
class BufferConfig:
    host: str = "127.0.0.1"
    """Address the buffer service binds to; anything but a loopback address (e.g. 0.0.0.0) needs `curve_keys_dir`."""
    port: int = in_range(0, 65535, default=0)
    """TCP port of the buffer service (0 picks a free one)."""
    lease_timeout_s: float = in_range(0.1, default=60.0)
    """Seconds after which an unacknowledged prompt lease returns to the pool."""
    max_queued_groups: int = in_range(1, default=1024)
    """Admitted groups held in memory before producers are told to wait."""
    journal: bool = True
    """Append admitted trajectories and consumption marks to runs/<name>/buffer.journal."""
    fsync: str = one_of(("always", "batch", "never"), default="batch")
    """Journal fsync policy: `always`, `batch` (once per burst of requests, before replying) or `never`."""
    worker_timeout_s: float = in_range(0.0, default=30.0)
    """Seconds without any request from a worker after which it is declared dead and its leases return; 0: off.
    Rollout workers send a heartbeat every worker_timeout_s / 6 seconds, also while generating."""
    compact_bytes: int = in_range(1, default=67108864)
    """Journal size in bytes that triggers compaction into a snapshot of the live state: the queued groups and, for
    a resume, those consumed since the oldest checkpoint on disk (since step 0 before the first, with
    `checkpoint.every > 0`; none with `checkpoint.every = 0`, where a restart from the initial model counts the
    groups consumed before the compaction as `rewind_lost_groups`)."""
    reserve_mb: int = in_range(0, 512, default=128)  # buffer.memory.MAX_RESERVE_MB
    """MiB of memory the buffer process faults in at start-up and keeps for queued groups, so that admitting them
    does not page-fault on every message (buffer/memory.py; the process starts at about this resident size)."""
    curve_keys_dir: str = ""
    """Directory of CurveZMQ keys (`asyncrl keys DIR`; layout in common/curve.py): encrypts the buffer socket and
    admits only allow-listed clients. Required when `host` is not a loopback address; empty: see `run_keys`."""
    run_keys: bool = True
    """With `curve_keys_dir` empty, `asyncrl up` makes CurveZMQ keys of its own for the run (a private temporary
    directory, removed when the run ends), so that another local user's process cannot lease, push, fetch or read
    weights on the loopback ports; false: plain ZMQ, for a machine with one user."""
    max_restarts: int = in_range(0, default=3)
    """Restarts of a dead buffer process over the whole run (same run directory and port, journal replayed) before
    the run fails (asyncrl/supervise.py `BufferSupervisor`)."""

    def __post_init__(self) -> None:
        if ":" in self.host:  # the ZMQ sockets bind IPv4 (no zmq.IPV6): an IPv6 literal failed with a traceback
            raise ConfigError(
                f"`buffer.host={self.host}`: IPv6 addresses are not supported; use an IPv4 address or a host name "
                "(127.0.0.1, the default, keeps the buffer on this machine)"
            )
        if not self.curve_keys_dir and not is_loopback(self.host):
            raise ConfigError(
                f"`buffer.host={self.host}` binds beyond loopback, so the buffer needs CurveZMQ keys: set "
                "`buffer.curve_keys_dir` to a directory made by `asyncrl keys DIR`"
            )


@dataclass(kw_only=True, slots=True)
class StalenessConfig:
    max_lag: int = in_range(0, MAX_STEP, default=2)  # the buffer refuses a larger lag on the wire
    """Largest allowed (train step - oldest token version) of a trained sample; 0 is synchronous RL."""


@dataclass(kw_only=True, slots=True)
class AcrlConfig:
    gamma: float = in_range(0.0, default=0.65)
    """ACRL gamma: strength of the adaptive exponent."""
    x: float = in_range(0.0, default=0.0)
    """Override of the reference discrepancy X (0: measured on the first training batch)."""
    x_mode: str = one_of(ACRL_X_MODES, default="first_batch")
    """`first_batch` (the paper: X frozen after step 0) or `ema` (our optional moving reference)."""
    ema_decay: float = in_range(0.0, 1.0, default=0.99)
    """Decay of the moving reference when x_mode=ema."""


@dataclass(kw_only=True, slots=True)
class TbpoConfig:
    eps_seq_high: float = in_range(0.0, 1.0, default=4e-4)
    """Upper sequence-ratio bound for positive advantages."""
    eps_seq_low: float = in_range(0.0, 1.0, default=3e-4)
    """Lower sequence-ratio bound for negative advantages when dual=false."""
    delta_high: float = in_range(0.0, 1.0, default=7e-4)
    """Dual band upper bound for negative advantages."""
    delta_low: float = in_range(0.0, 1.0, default=3e-4)
    """Dual band lower bound for negative advantages."""
    c: float = in_range(1.0, default=2.0)
    """Mismatch weight clip: m_i is clipped to [-log c, log c]."""
    dual: bool = True
    """Use the dual band for negative advantages."""


@dataclass(kw_only=True, slots=True)
class KlConfig:
    coef: float = in_range(0.0, default=0.0)
    """Weight beta of the KL penalty against the frozen initial model (docs/algorithms.md, "KL and entropy terms"):
    loss += beta * agg(k); 0: off, and no reference model is built."""
    estimator: str = one_of(KL_ESTIMATORS, default="k3")
    """Per-token estimator of KL(pi_theta || pi_ref) (Schulman), with log r = lref - lc: `k1` = -log r, `k2` =
    (log r)^2 / 2, `k3` = r - 1 - log r (low variance, never negative; GRPO's)."""


DEFAULT_CAP = 2.0
"""`loss.cap` left null: C of every weighting but `acrl`."""
ACRL_DEFAULT_CAP = 3.0
"""`loss.cap` left null with `loss.weighting=acrl`: ALGORITHMS.md's default C (the ACRL paper's clip value 3)."""


@dataclass(kw_only=True, slots=True)
class LossConfig:
    weighting: str = one_of(WEIGHTINGS, default="tis")
    """Mismatch weighting (ALGORITHMS.md): none, decoupled, tis, mis_token, mis_seq, acr, acrl, tbpo, gspo, pg_*."""
    cap: float | None = in_range(1.0, 1e30, default=None)
    """C: truncation / masking threshold of the mismatch weight, in [1, 1e30] (the weights are float32: a larger
    one could not be compared with them); null (default): the weighting's own, 3 for `acrl` (ALGORITHMS.md, the ACRL
    paper's clip value) and 2 for every other weighting."""
    eps_low: float = in_range(0.0, 1.0, default=0.2)
    """PPO lower clip."""
    eps_high: float = in_range(0.0, default=0.28)
    """PPO upper clip (DAPO clip-higher)."""
    agg: str = one_of(AGGREGATIONS, default="token_mean")
    """Loss aggregation: token_mean, seq_mean_token_mean or seq_mean_token_sum_norm."""
    dual_clip: float = 0.0
    """Negative dual clip c (> 1) for A < 0; 0 disables."""
    acrl: AcrlConfig = field(default_factory=AcrlConfig)
    tbpo: TbpoConfig = field(default_factory=TbpoConfig)
    kl: KlConfig = field(default_factory=KlConfig)
    entropy_coef: float = in_range(0.0, default=0.0)
    """Weight of the entropy bonus over response tokens: loss -= entropy_coef * agg(H); 0: off (docs/algorithms.md,
    "KL and entropy terms")."""

    @property
    def effective_cap(self) -> float:
        """C as the losses use it: `cap`, or the weighting's default when it is null (read it through this, never
        `cap`: a section's defaults are built before the config's weighting is merged in, so null cannot be resolved
        at construction)."""
        if self.cap is not None:
            return self.cap
        return ACRL_DEFAULT_CAP if self.weighting == "acrl" else DEFAULT_CAP


@dataclass(kw_only=True, slots=True)
class OverlongConfig:
    len: int = in_range(0, default=0)
    """DAPO overlong shaping length L_c in tokens (0 disables); truncated responses get -1."""


@dataclass(kw_only=True, slots=True)
class AlgoConfig:
    adv: str = one_of(ADVANTAGES, default="grpo")
    """Advantage estimator: grpo, drgrpo or rloo."""
    filter_groups: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal."""
    skip_zero_variance: bool | None = None
    """Selective rollout (GRESO): lease a prompt whose latest z groups all had equal rewards only with probability
    max(skip_min_prob, skip_base ** z), so groups that would be filtered are not generated; null (default): on iff
    `algo.filter_groups`; true needs `algo.filter_groups`."""
    skip_base: float = in_range(0.0, 1.0, default=0.25)
    """Selective rollout: lease probability of a prompt after one zero-variance group (GRESO's p_e); z in a row: ^z."""
    skip_min_prob: float = in_range(0.01, 1.0, default=0.05)
    """Selective rollout: the floor of the lease probability, so no prompt is skipped for ever."""
    skip_predicted: bool | None = None
    """Predictive selective rollout: before generating a group, the worker scores the reference answer (one prefill
    of prompt + answer + end token) and, when the policy's probability that all `train.group_size` samples give it,
    p_ans ** G, is at least `algo.skip_predicted_above`, generates the group only with probability
    `algo.skip_min_prob` (else resolves it unsampled: `rollout/screened_prompts`). null (default): on iff
    `algo.filter_groups` with the embedded engine, the task's own reward and single-turn; true needs those."""
    skip_predicted_above: float = in_range(0.0, 1.0, default=0.4)
    """Predictive selective rollout: the predicted probability of an all-correct group (p_ans ** G) from which a
    prompt is skipped."""
    overlong: OverlongConfig = field(default_factory=OverlongConfig)


@dataclass(kw_only=True, slots=True)
class LearnerConfig:
    prox: str = one_of(PROX_MODES, default="recompute")
    """Proximal log-probs: `recompute` (the policy at the start of the step: one no-grad forward, or with one minibatch
    and any weighting but acrl that minibatch's own forward, same values), `behav` (use behavior log-probs) or
    `loglinear` (AReaL: lb and each forward's detached lc interpolated in log space by token version; no extra forward;
    not with `loss.weighting=acrl`)."""
    minibatches: int = in_range(1, default=1)
    """PPO minibatches (optimizer steps) per learner step."""
    micro_batch_tokens: int = in_range(0, default=0)
    """Token budget of one forward/backward micro-batch: its rows x their longest prompt + response (with
    `learner.share_prefix`, its packed groups x the longest), in tokens. 0: from the model's shape, the tokens whose
    saved activations fit `learner.batch.AUTO_ACTIVATION_BYTES` (SmolLM2-135M: about 510; the built-in tiny model:
    the whole batch), and in updates after the first up to 4x the model's parameter bytes within an eighth of the
    available memory (`learner.batch.micro_batch_budget`)."""
    share_prefix: bool = True
    """Run each group's common prefix (its prompt) through the model once per micro-batch, not once per response:
    the group's responses packed into one row with a block mask (`learner/packing.py`); the same log-probs to fp32
    rounding, with fewer tokens to compute (2-3x fewer on GRPO groups of 8 with short responses). With
    `learner.rollout_aligned` and a W8A8 scheme, that rounding can move a value across a quantization step once the
    weights changed (a second minibatch, the next step), so updates then differ by more than rounding (1-14%
    measured), as between any two fp32 orders of summation under quantization."""
    skip_zero_adv: bool = True
    """Rows whose advantage is exactly 0 (the rows of a group whose rewards are all equal, grouped by the minibatch;
    a zero-advantage row beside non-zero ones keeps its backward) run their forward without grad and no backward:
    every loss term is a multiple of the advantage, so their gradient is exactly 0 and the step's update is
    unchanged; their log-probs, entropies and loss metrics are still computed. Applies with one learner rank and
    without `loss.kl.coef` or `loss.entropy_coef` (terms that do not vanish with the advantage)."""
    fp32_gemm: str = one_of(FP32_GEMMS, default="auto")
    """The GEMM of the learner's fp32 linears, forward and backward (`learner/fp32_gemm.py`, docs/kernels.md): `blas`
    (torch's default, MKL), `onednn` (oneDNN's fp32 GEMM from the same wheel: 1.8-2.2x MKL on AMD Zen 5, 1.05-1.25x
    on Zen 4), `auto` (a race of the two at the model's shape when the learner starts; oneDNN if it is 5% faster).
    The same fp32 values to summation order."""
    fused_ops: bool = True
    """RMSNorm and SwiGLU (`silu(gate) * up`) of Llama-family models (Llama, Mistral, Qwen2, Qwen3, SmolLM3) as one
    C++ pass each, forward and backward, on CPU in fp32 (`learner/fused_ops.py`), and, on AVX-512 CPUs, unmasked
    causal SDPA attention (`learner/fused_attention.py`): the same values to rounding, fewer passes over the
    activations; false: HF's torch ops. Other dtypes and FSDP2 shards take HF's ops; under `precision.train` bf16
    or fp16 autocast they run in fp32 on the upcast inputs."""
    rollout_aligned: bool = False
    """QaRL: run the learner's linear forward on the rollout's quantized operands (straight-through backward)."""
    gradient_checkpointing: bool = False
    """Keep only each decoder layer's input for backward and recompute the layer there (`learner/recompute.py`,
    Transformers' activation checkpointing, non-reentrant): the activations saved per token fall from every layer's to
    each layer's input plus one layer's (6.3x fewer by its estimate on the 101M decode shape), for each layer's forward
    once more, and `learner.micro_batch_tokens=0` sizes micro-batches by it. For long responses on large models (the
    7B recipes); the same values as without."""
    threads: int = in_range(1, MAX_THREADS, default=1)
    """torch intra-op threads of each learner rank (the low count of `learner.threads_policy`)."""
    threads_max: int = in_range(0, MAX_THREADS, default=0)
    """The high count of `learner.threads_policy` (at most the cores the learner may run on); 0: those cores."""
    threads_policy: str = one_of(THREADS_POLICIES, default="measured")
    """The learner's torch threads per step (docs/algorithms.md, "Learner threads"; one rank only, with more every rank
    keeps `learner.threads`): `fixed` (`learner.threads`); `throttled` (the high count for a step after the buffer
    refused a lease, else `learner.threads`); `measured` (when the learner is the bound, a few steps at each count,
    then the one with fewer loop seconds per trained sample, checked again every 50 steps)."""
    world_size: int = in_range(1, default=1)
    """Learner ranks (FSDP2, gloo on CPU), each a Ray actor requesting `ray.learner_cpus / world_size` CPUs."""
    device: str = "cpu"
    """Where each learner rank trains: `cpu`; `cuda` (rank r on GPU r modulo the GPUs it sees: under Ray, the one
    `ray.learner_gpus` gave it; FSDP2 over NCCL, CPU tensors over gloo); `cuda:N` (rank r on GPU N + r of the node's,
    e.g. past the rollout's GPUs on one node). The CPU kernels (`learner.fp32_gemm`, `learner.fused_ops`) and the
    train gate apply on `cpu` only (learner/devices.py; written to torch's CUDA APIs, untested on GPU)."""
    lora_base: str = one_of(LORA_BASES, default="auto")
    """With `model.lora.rank > 0`, the frozen base under the adapters: `rollout` runs it on the published quantized
    weights with the engine's numerics (zero base mismatch), `full` in fp32; `auto`: `rollout` when `quant.scheme`
    is not none, else `full` (`common.config_rules.lora_base`)."""
    max_restarts: int = in_range(0, default=2)
    """Restarts of the learner group after a rank died, over the whole run: the driver restarts it (and the rollout
    workers) from the latest checkpoint, or the initial model, with the buffer rewound as `--resume` does. A learner
    whose first start raised in its constructor (a config or machine error) is not restarted: the run fails at once."""

    def __post_init__(self) -> None:
        if self.threads_max and self.threads_max < self.threads:
            raise ConfigError(f"`learner.threads_max` ({self.threads_max}) must be 0 (the cores) or >= "
                              f"`learner.threads` ({self.threads})")  # fmt: skip
        if self.threads_max and self.world_size > 1:
            raise ConfigError("`learner.threads_max` needs `learner.world_size=1` (only rank 0 hears the buffer)")


@dataclass(kw_only=True, slots=True)
class UaqConfig:
    scale: float = in_range(1e-3, default=1.5)
    """UAQ scale s (QuRL sec. 4.3), applied once before training; 1.0 disables the reparametrization."""


@dataclass(kw_only=True, slots=True)
class QuantConfig:
    scheme: str = one_of(QUANT_SCHEMES, default="int8")
    """Rollout weight quantization: none, int8 (W8A8), fp8 (e4m3), fp8_trunc, w8a16, w4a16."""
    lm_head: str = one_of(HEAD_MODES, default="auto")
    """The LM head in rollout: `quantized` with `quant.scheme` like the decoder's linears (the embedded engine only),
    `fp32`, or `auto`: quantized for the W8A8 schemes (int8, fp8, fp8_trunc) on the embedded engine, else fp32
    (`common.config_rules.head_quantized`). The rollout-aligned learner quantizes its head alike."""
    uaq: UaqConfig = field(default_factory=UaqConfig)


@dataclass(kw_only=True, slots=True)
class PrecisionConfig:
    train: str = one_of(PRECISIONS, default="fp32")
    """Learner compute precision: fp32, bf16 or fp16."""
    rollout: str = one_of(PRECISIONS, default="fp32")
    """Rollout compute precision of non-quantized parts: fp32, bf16 or fp16."""
    loss_scale_init: float = in_range(2.0**-24, 2.0**64, default=65536.0)
    """fp16 training: initial dynamic loss scale, a power of two (halved on every step with inf/nan gradients)."""
    loss_scale_growth_interval: int = in_range(1, default=2000)
    """fp16 training: consecutive clean optimizer steps after which the loss scale doubles."""


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float = in_range(0.0, default=1e-5)
    """Peak learning rate."""
    sched: str = one_of(SCHEDULES, default="constant")
    """LR schedule: constant, cosine or length_decay."""
    warmup_steps: int = in_range(0, default=0)
    """Linear warmup steps."""
    weight_decay: float = in_range(0.0, default=0.0)
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    grad_clip: float = in_range(0.0, default=1.0)
    """Global gradient-norm clip (0 disables)."""
    decay_period: int = in_range(0, default=0)
    """length_decay: halving period in steps (0: 1.8 x the surge step)."""
    surge_factor: float = in_range(1.0, default=1.5)
    """length_decay: response-length ratio over its baseline that counts as a surge."""
    surge_window: int = in_range(1, default=5)
    """length_decay: k, the window of steps averaged for baseline and surge detection."""
    lr_min_ratio: float = in_range(0.0, 1.0, default=0.1)
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
    wandb_mode: str = one_of(("offline", "online", "disabled"), default="offline")
    """wandb mode (offline by default: wandb hangs without a network). `online` falls back to offline, saying so, when
    the server cannot be reached within 30 s (`wandb sync` uploads the run later). Evaluations (`eval/*`) are logged
    at the step record of the last step before them."""
    wandb_project: str = "asyncrl"
    """wandb project name."""


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    every: int = in_range(0, default=0)
    """Save a resumable checkpoint (runs/<name>/checkpoints/step_<k>) every this many steps (0: only on `down`)."""
    keep_last: int = in_range(1, default=2)
    """Resumable checkpoints kept on disk (the oldest are deleted)."""
    final: bool = True
    """Save a final Hugging Face model directory when the run ends."""
    merge_lora: bool = False
    """With `model.lora.rank > 0` and `checkpoint.final`: also write `runs/<name>/final-merged/`, the adapters merged
    into the original base (peft `merge_and_unload`, UAQ undone as in `final/`): plain Hugging Face safetensors."""


@dataclass(kw_only=True, slots=True)
class RayConfig:
    address: str = ""
    """Ray cluster address (`auto` or host:port); empty starts a local cluster."""
    launcher: str = one_of(("auto", "ray", "local"), default="auto")
    """What starts the learner, rollout worker and evaluator actors: `ray` (Ray actors; a local Ray cluster when
    `ray.address` is empty), `local` (child processes of the driver serving calls over a private ZMQ socket: no Ray
    on one machine, a shorter start-up; common/local_actors.py) or `auto` (`local` when `ray.address` and the custom
    resources are empty, else `ray`)."""
    num_cpus: int = in_range(1, default=2)
    """Cores of the local cluster; it declares `ray.num_cpus * ray.local_oversubscribe` logical CPUs to Ray."""
    local_oversubscribe: float = in_range(1.0, 64.0, default=4.0)
    """Logical CPUs a local cluster declares per core. Ray's CPUs are scheduling tokens, not pinned cores: actors past
    the cores share them as processes do, so `rollout.num_workers` and `asyncrl scale` may go past the core count.
    1: only what fits the cores. With `ray.address` the cluster's own CPUs count, and workers that do not fit wait as
    `pending` in `asyncrl status`."""
    worker_cpus: float = in_range(0.0, default=0.5)
    """CPU request of each rollout worker actor."""
    learner_cpus: float = in_range(0.0, default=1.0)
    """CPU request of the whole learner, split evenly over its `learner.world_size` rank actors."""
    worker_resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each rollout worker actor requests, e.g. {rollout_node: 0.1} to place them on the nodes
    started with `ray start --resources '{"rollout_node": 1}'`."""
    learner_resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources of the whole learner, split evenly over its rank actors like `learner_cpus`."""
    learner_gpus: float = in_range(0.0, default=0.0)
    """GPU request of the whole learner, split evenly over its rank actors like `learner_cpus`; 0 with
    `learner.device` on CUDA: one GPU per rank (Ray's request; the local launcher starts the ranks on this machine,
    where rank r takes GPU r of `learner.device`). Ignored with `learner.device=cpu`. Above 0: Ray's launcher."""
    worker_gpus: float = in_range(0.0, default=0.0)
    """GPU request of each rollout worker actor: Ray gives it those GPUs and it sees only them, so `rollout.device:
    cuda` (or an SGLang server with `rollout.sglang.gpus_per_server: 0`, which inherits them) runs on its own.
    Above 0: Ray's launcher (`ray.launcher` auto picks it)."""
    allow_unauthenticated: bool = False
    """With `ray.address`: accept a cluster that runs without token authentication (anyone who reaches its ports
    can run code as its user). Off: such a cluster is refused; on: a warning every run (docs/security.md)."""

    def local_cpus(self) -> int:
        """The logical CPUs a local cluster declares to Ray: `num_cpus * local_oversubscribe`, at least `num_cpus`."""
        return max(self.num_cpus, int(self.num_cpus * self.local_oversubscribe + 1e-9))


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """User reward functions (common/reward_fns.py), run in each rollout worker's reward process under a timeout."""

    fn: str = ""
    """One reward function: `path/to/file.py:name` (made absolute at load), `package.module:name`, `asyncrl:arith` or
    `asyncrl:math`, called as `fn(response, answer, row) -> float | dict` (a dict: `score` plus extra metrics, logged
    as `reward/<key>`). Empty, with `reward.fns` empty: the task's own reward (exact match for arith, math-verify for
    datasets)."""
    fns: list[str] = field(default_factory=list)
    """Several reward functions (specs as `reward.fn`), summed with `reward.weights` (TRL's `reward_funcs`)."""
    weights: list[float] = field(default_factory=list)
    """Weight of each of `reward.fns` (same length); empty: 1.0 each. reward = sum_i weights[i] * score_i."""
    timeout_s: float = in_range(0.001, 3600.0, default=10.0)
    """Seconds one call may run; a call that runs longer scores 0, is counted in `reward/timeouts`, and its reward
    process is replaced."""

    def __post_init__(self) -> None:
        from common.reward_fns import absolute_spec

        if self.fn and self.fns:
            raise ConfigError("set one of `reward.fn` (one function) and `reward.fns` (several), not both")
        self.fn = absolute_spec(self.fn) if self.fn else ""  # workers may run in another directory
        self.fns = [absolute_spec(spec) for spec in self.fns]
        if self.weights and len(self.weights) != len(self.specs()):
            raise ConfigError(f"`reward.weights` has {len(self.weights)} weights for {len(self.specs())} reward "
                              f"functions (`reward.fns`): give one per function, or none (1.0 each)")  # fmt: skip
        if not all(math.isfinite(float(w)) for w in self.weights):
            raise ConfigError(f"`reward.weights` must be finite numbers, got {list(self.weights)}")

    def specs(self) -> list[str]:
        """The reward functions to run: `reward.fns`, or `[reward.fn]`; [] means the task's own reward."""
        return list(self.fns) if self.fns else ([self.fn] if self.fn else [])

    def specs_key(self) -> str:
        """The key that set `specs()`, as error messages name it: `reward.fns` (the i-th: `reward.fns[i]`), or
        `reward.fn`."""
        return "reward.fns" if self.fns else "reward.fn"

    def weight_list(self) -> list[float]:
        """One weight per spec (`reward.weights`, or 1.0 each)."""
        return [float(w) for w in self.weights] if self.weights else [1.0] * len(self.specs())


@dataclass(kw_only=True, slots=True)
class EnvConfig:
    """Multi-turn, tool-using episodes (common/envs.py, rollout_workers/episodes.py; issue 21). Empty `fn`:
    single-turn rollouts (one response per prompt, scored by the reward function), as before."""

    fn: str = ""
    """The environment: `path/to/file.py:Class` (made absolute at load) or `package.module:Class`, instantiated
    once per episode with `env.args`; it declares `stop_strings` and implements `reset(problem)` and
    `step(model_text) -> StepResult`. Empty: single-turn."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's constructor."""
    max_turns: int = in_range(1, 256, default=4)
    """Most model turns in one episode; the episode ends (finish "length" unless the environment said done) there."""
    max_total_tokens: int = in_range(1, 65536, default=512)
    """Most response tokens of one episode, model and observation tokens together."""
    timeout_s: float = in_range(0.001, 3600.0, default=10.0)
    """Seconds one `reset` or `step` call may run; past it the episode ends with reward 0 (`env/timeouts`)."""
    threads: int = in_range(1, 256, default=8)
    """Threads that run environment calls off the decode thread (per worker)."""
    turn_rewards: str = one_of(TURN_REWARDS, default="sum")
    """The episode's one reward from its turns' rewards r_1..r_T: `sum` (sum_t r_t), `last` (r_T, the final turn's)
    or `max` (max_t r_t); a failed episode gets 0. Issue 21's `algo.turn_rewards`: here because the worker, which
    reads only its own sections, combines them."""

    def __post_init__(self) -> None:
        from common.reward_fns import absolute_spec

        self.fn = absolute_spec(self.fn) if self.fn else ""  # workers may run in another directory


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """Held-out evaluation (`train.eval_every`, and at the end of a run) through the rollout engine
    (asyncrl/evaluate.py): greedy accuracy, and `samples` draws per prompt at the training temperature."""

    samples: int = in_range(0, 64, default=4)
    """Draws per held-out prompt at `rollout.temperature` on the rollout engine: `eval/mean@k` (mean share correct)
    and `eval/pass@k` (share of prompts with a correct draw), k = samples; 0: greedy only."""


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
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    env: EnvConfig = field(default_factory=EnvConfig)


LIVE_KEYS: tuple[str, ...] = (
    "staleness.max_lag",
    "loss.cap",
    "loss.eps_low",
    "loss.eps_high",
    "loss.acrl.gamma",
    "optim.lr",
)
"""Keys `asyncrl set key=value` may change in a running job (applied at the next step boundary)."""
RESUME_FIXED: tuple[str, ...] = ("model.", "data.", "quant.", "learner.lora_base", "env.", "train.group_size")
"""Keys (and sections, ending in `.`) that `asyncrl up --resume RUN key=value` may not change: the checkpoint's
weights and adapter, the buffer journal's groups and the prompt stream belong to the run's model, data, quantization,
LoRA base (the adapter was trained on it), environment and group size."""
RESUME_FREE: tuple[str, ...] = ("data.eval_size",)
"""Keys under `RESUME_FIXED` that a resume may change anyway (evaluation only)."""


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
