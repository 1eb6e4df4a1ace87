"""The config rules that span sections, and `validate`, the step every loaded config goes through.

`validate(cfg)` first checks each key against the choices and range declared with its field
(`common.config_checks.check_section`), then the rules below; each raises `ConfigError` naming the key to change.
A rule within one section lives in that section's `__post_init__` instead (e.g. `BufferConfig`: a non-loopback
`buffer.host` needs `buffer.curve_keys_dir`).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from common.config_checks import ConfigError, check_section, is_loopback
from common.config_schema import AlgoConfig, Config, LearnerConfig, QuantConfig, RolloutConfig, StalenessConfig

SIMULATED_SCHEMES = ("fp8_trunc", "w4a16", "w8a16")
"""Quantization schemes only the embedded engine simulates; SGLang serves int8 or fp8."""
W8A8_SCHEMES = ("int8", "fp8", "fp8_trunc")


DEVICE_NAMES = re.compile(r"cpu|cuda(:\d+)?")
"""What `rollout.device` and `learner.device` (and the commands that take one) accept: cpu, cuda or cuda:N."""


def is_device_name(name: str) -> bool:
    """Whether `name` is one of `DEVICE_NAMES`."""
    return DEVICE_NAMES.fullmatch(name) is not None


def head_quantized(quant: QuantConfig, rollout: RolloutConfig) -> bool:
    """Whether the rollout's LM head is quantized (`quant.lm_head`, `auto` resolved): the learner that publishes the
    weights and the rollout-aligned forward both ask this."""
    if quant.scheme == "none" or quant.lm_head == "fp32":
        return False
    if quant.lm_head == "quantized":
        return True
    return rollout.backend == "embedded" and quant.scheme in W8A8_SCHEMES


def worker_cpu_priority(rollout: RolloutConfig, staleness: StalenessConfig) -> str:
    """`rollout.cpu_priority` resolved: `auto` is `idle` for an asynchronous run (`staleness.max_lag > 0`) of the
    embedded engine on the CPU, whose workers share the cores with the learner, else `normal` (a synchronous run's
    workers generate while the learner waits, so it takes nothing from them)."""
    if rollout.cpu_priority != "auto":
        return rollout.cpu_priority
    on_cpu = rollout.backend == "embedded" and rollout.device == "cpu"
    return "idle" if on_cpu and staleness.max_lag > 0 else "normal"


def lora_base(learner: LearnerConfig, quant: QuantConfig) -> str:
    """The frozen base under LoRA adapters (`learner.lora_base`, `auto` resolved): `rollout` (the published quantized
    weights, the engine's numerics) when `quant.scheme` is not none, else `full`."""
    if learner.lora_base != "auto":
        return learner.lora_base
    return "full" if quant.scheme == "none" else "rollout"


def _check_lora(cfg: Config) -> None:
    """LoRA (`model.lora.rank > 0`): the base it runs on, and what needs it (any backend, any learner world size)."""
    if cfg.model.lora.rank == 0:
        if cfg.checkpoint.merge_lora:
            raise ConfigError("`checkpoint.merge_lora=true` needs `model.lora.rank > 0`: without LoRA, `final/` is "
                              "already a full Hugging Face model")  # fmt: skip
        return
    # rollout.backend=sglang loads the adapters through SGLang's LoRA API (rollout_workers/sglang_api/lora_sync.py)
    base = lora_base(cfg.learner, cfg.quant)
    if base == "rollout" and cfg.quant.scheme == "none":
        raise ConfigError("`learner.lora_base=rollout` needs a quantized `quant.scheme` (int8, fp8, ...), got none; "
                          "use `learner.lora_base=full`")  # fmt: skip
    if cfg.learner.rollout_aligned and base == "full":
        raise ConfigError("`learner.rollout_aligned=true` with LoRA runs the frozen base on the rollout's operands: "
                          "it needs `learner.lora_base=rollout` (or auto), not full")  # fmt: skip
    if base == "rollout" and cfg.quant.scheme in ("w8a16", "w4a16") and cfg.precision.rollout != "fp32":
        raise ConfigError(f"`learner.lora_base=rollout` with weight-only `quant.scheme={cfg.quant.scheme}` needs "
                          "`precision.rollout=fp32` (the engine and the learner's base would not align)")  # fmt: skip


def validate(cfg: Config) -> Config:
    """Check every key's declared choices and range, then every rule that spans fields; return cfg unchanged."""
    check_section(cfg)
    _check_compute(cfg)  # the rules run in this order: a config breaking several is told of the first
    _check_data(cfg)
    _check_selective_rollout(cfg.algo)
    _check_predictive_skip(cfg)
    if cfg.loss.dual_clip and cfg.loss.dual_clip <= 1.0:
        raise ConfigError(f"`loss.dual_clip` must be 0 (off) or > 1, got {cfg.loss.dual_clip}")
    # `learner.prox=behav` with a mismatch weighting is allowed (the QuRL eq. 3 baseline): every weight is then 1.
    if cfg.learner.prox == "loglinear" and cfg.loss.weighting == "acrl":
        raise ConfigError("`learner.prox=loglinear` cannot serve `loss.weighting=acrl`: its Y_g needs lp of whole "
                          "groups before the first forward; use `learner.prox=recompute`")  # fmt: skip
    _check_rollout(cfg)
    _check_optim_and_resources(cfg)
    _check_model(cfg)
    _check_lora(cfg)
    _check_reward(cfg)
    _check_env(cfg)
    _check_logging(cfg)
    return cfg


def _check_logging(cfg: Config) -> None:
    name = cfg.logging.name
    if name in (".", "..") or any(sep in name for sep in ("/", "\\", "\0")):
        raise ConfigError(f"`logging.name` is the run's directory name under `logging.dir`, not a path: got {name!r} "
                          "(put the parent directories in `logging.dir`)")  # fmt: skip


def _check_compute(cfg: Config) -> None:
    """Precision, quantization and the Ray CPUs every actor needs."""
    if cfg.learner.rollout_aligned and cfg.quant.scheme in ("w8a16", "w4a16") and cfg.precision.rollout != "fp32":
        raise ConfigError(
            f"`learner.rollout_aligned` with weight-only `quant.scheme={cfg.quant.scheme}` needs "
            f"`precision.rollout=fp32` (the engine would compute in {cfg.precision.rollout}, the aligned learner in "
            "fp32: they would not align)"
        )
    scale = cfg.precision.loss_scale_init
    if math.frexp(scale)[0] != 0.5:  # unscaling must be exact: a power of two
        raise ConfigError(f"`precision.loss_scale_init` must be a power of two, got {scale!r}")
    if not cfg.ray.address:  # a local Ray of ray.local_cpus() logical CPUs: every actor must fit, or some wait forever
        need = cfg.ray.learner_cpus + cfg.rollout.num_workers * cfg.ray.worker_cpus
        if need > cfg.ray.local_cpus() + 1e-9:
            raise ConfigError(
                f"`ray.learner_cpus` ({cfg.ray.learner_cpus:g}) + `rollout.num_workers` ({cfg.rollout.num_workers}) "
                f"x `ray.worker_cpus` ({cfg.ray.worker_cpus:g}) = {need:g} CPUs > the local cluster's "
                f"{cfg.ray.local_cpus()} (`ray.num_cpus` {cfg.ray.num_cpus} x `ray.local_oversubscribe` "
                f"{cfg.ray.local_oversubscribe:g}); raise `ray.local_oversubscribe` or lower `ray.worker_cpus`"
            )


def _check_rollout(cfg: Config) -> None:
    if cfg.rollout.continuous and cfg.rollout.backend != "embedded":
        raise ConfigError("`rollout.continuous=true` needs `rollout.backend=embedded` (the SGLang backend has no "
                          "submit / step scheduler to keep full)")  # fmt: skip
    if cfg.rollout.continuous and cfg.env.fn:
        raise ConfigError("`rollout.continuous=true` is for single-turn rollout; with `env.fn` episodes already run "
                          "on the engine's scheduler (rollout_workers/episodes.py): leave it false")  # fmt: skip
    if cfg.rollout.backend == "sglang" and cfg.quant.scheme in SIMULATED_SCHEMES:
        raise ConfigError(
            f"`quant.scheme={cfg.quant.scheme}` is a simulation scheme of the embedded engine; "
            "rollout.backend=sglang serves int8 or fp8"
        )
    if cfg.rollout.backend == "sglang":
        _check_sglang(cfg)
    if cfg.quant.lm_head == "quantized" and cfg.rollout.backend != "embedded":
        raise ConfigError("`quant.lm_head=quantized` is the embedded engine's: SGLang serves the LM head unquantized; "
                          "use `quant.lm_head=auto` or `fp32` with `rollout.backend=sglang`")  # fmt: skip
    if cfg.quant.lm_head == "quantized" and cfg.quant.scheme == "none":
        raise ConfigError("`quant.lm_head=quantized` needs a quantized `quant.scheme` (int8, fp8, ...), got none")
    if cfg.algo.overlong.len > 0 and cfg.env.fn:
        raise ConfigError(
            "`algo.overlong.len` shapes one response's length against `rollout.max_new_tokens` (ALGORITHMS.md), but "
            f"`env.fn` ({cfg.env.fn}) makes episodes of several turns and observations, bounded by "
            "`env.max_total_tokens`: set `algo.overlong.len=0`"
        )
    if cfg.algo.overlong.len >= cfg.rollout.max_new_tokens and cfg.algo.overlong.len > 0:
        raise ConfigError(
            f"`algo.overlong.len` ({cfg.algo.overlong.len}) must be below `rollout.max_new_tokens` "
            f"({cfg.rollout.max_new_tokens})"
        )
    if cfg.learner.rollout_aligned and cfg.quant.scheme == "none":
        raise ConfigError("`learner.rollout_aligned=true` needs a quantized `quant.scheme` (int8, fp8, ...), got none")
    if cfg.rollout.num_workers < 1:
        raise ConfigError("`rollout.num_workers` must be at least 1 to start a run")
    if not is_device_name(cfg.rollout.device):
        raise ConfigError(f"`rollout.device` must be cpu, cuda or cuda:N, got {cfg.rollout.device!r}")
    _check_learner_device(cfg)
    if cfg.rollout.max_seq_len <= cfg.rollout.max_new_tokens:
        raise ConfigError(
            f"`rollout.max_seq_len` ({cfg.rollout.max_seq_len}) must exceed `rollout.max_new_tokens` "
            f"({cfg.rollout.max_new_tokens}): each slot holds the prompt and the response"
        )


def _check_learner_device(cfg: Config) -> None:
    learner = cfg.learner
    if not is_device_name(learner.device):
        raise ConfigError(f"`learner.device` must be cpu, cuda or cuda:N, got {learner.device!r}")
    if learner.device == "cpu":
        return
    aligned = learner.rollout_aligned or (cfg.model.lora.rank > 0 and lora_base(learner, cfg.quant) == "rollout")
    if aligned:
        raise ConfigError(
            f"`learner.device={learner.device}` does not run rollout-aligned forwards yet (`learner.rollout_aligned`, "
            "or LoRA's `learner.lora_base=rollout`, the default with a quantized `quant.scheme`): their quantized "
            "operands are CPU code; set `learner.rollout_aligned=false` / `learner.lora_base=full`, or "
            "`learner.device=cpu`"
        )


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


def skip_zero_variance_on(algo: AlgoConfig) -> bool:
    """Whether selective rollout is on (`algo.skip_zero_variance`, null resolved: it follows `algo.filter_groups`)."""
    return algo.filter_groups if algo.skip_zero_variance is None else algo.skip_zero_variance


def _check_selective_rollout(algo: AlgoConfig) -> None:
    """Skipping a prompt for its zero-variance streak saves only what dynamic sampling would throw away: without
    `algo.filter_groups` such groups are trained on (at advantage 0, or a length-shaping signal), and skipping them
    would change what is trained rather than save generation."""
    if algo.skip_zero_variance and not algo.filter_groups:
        raise ConfigError(
            "`algo.skip_zero_variance=true` needs `algo.filter_groups=true`: it skips prompts whose groups dynamic "
            "sampling would drop; set `algo.filter_groups=true` or leave `algo.skip_zero_variance` null (auto)"
        )


def skip_predicted_on(algo: AlgoConfig, backend: str, custom_reward: bool, multi_turn: bool) -> bool:
    """Whether predictive selective rollout is on (`algo.skip_predicted`, null resolved: with `algo.filter_groups`,
    the embedded engine (it scores the answer in its prefill), the task's own reward (whose reference answer scores
    1) and single-turn episodes (the prompt is the lease's))."""
    if algo.skip_predicted is not None:
        return algo.skip_predicted
    return algo.filter_groups and backend == "embedded" and not custom_reward and not multi_turn


def _check_predictive_skip(cfg: Config) -> None:
    """`algo.skip_predicted=true` needs what its prediction stands on (`skip_predicted_on`)."""
    if not cfg.algo.skip_predicted:
        return
    needs = {
        "`algo.filter_groups=true` (it skips groups that dynamic sampling would drop)": cfg.algo.filter_groups,
        "`rollout.backend=embedded` (the answer is scored in its prefill)": cfg.rollout.backend == "embedded",
        "the task's own reward (`reward.fn`/`reward.fns` empty: its reference answer scores 1)": not cfg.reward.specs(),
        "single-turn episodes (`env.fn` empty)": not cfg.env.fn,
    }
    missing = [need for need, ok in needs.items() if not ok]
    if missing:
        raise ConfigError(f"`algo.skip_predicted=true` needs {'; '.join(missing)}; or leave it null (auto)")


def _check_data(cfg: Config) -> None:
    if cfg.data.task == "jsonl" and not cfg.data.path:
        raise ConfigError("data.task=jsonl needs `data.path` (a JSONL file with prompt and answer fields)")
    if cfg.data.task == "dataset" and not cfg.data.path:
        raise ConfigError(
            "data.task=dataset needs `data.path` (a .jsonl, .json or .parquet file or a `datasets` save_to_disk dir)"
        )
    only_dataset = [key for key, value in (("data.eval_path", cfg.data.eval_path),
                                           ("data.max_prompt_tokens", cfg.data.max_prompt_tokens))
                    if value]  # fmt: skip
    if cfg.data.task != "dataset" and only_dataset:
        raise ConfigError(f"`{'` and `'.join(only_dataset)}` need{'s' if len(only_dataset) == 1 else ''} "
                          f"data.task=dataset (it is {cfg.data.task})")  # fmt: skip
    if cfg.data.task in ("arith", "arith_tool"):  # a file given with the default task was ignored: arithmetic trained
        file_keys = [key for key, value, default in (("data.path", cfg.data.path, ""),
                                                     ("data.prompt_key", cfg.data.prompt_key, "prompt"),
                                                     ("data.answer_key", cfg.data.answer_key, "answer"))
                     if value != default]  # fmt: skip
        if file_keys:
            raise ConfigError(f"`{'`, `'.join(file_keys)}` set, but data.task={cfg.data.task} generates its own "
                              "problems: set data.task=jsonl or data.task=dataset to train on a file")  # fmt: skip
    if cfg.data.task == "arith_tool" and not cfg.env.fn:
        raise ConfigError("data.task=arith_tool runs calculator episodes: set `env.fn=asyncrl:arith_tool`")
    if cfg.data.task in ("arith", "arith_tool") and (not cfg.data.ops or set(cfg.data.ops) - {"+", "-"}):
        raise ConfigError(f"`data.ops` must be made of '+' and '-', got {cfg.data.ops!r}")


def _check_optim_and_resources(cfg: Config) -> None:
    if len(cfg.optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.optim.betas):
        raise ConfigError(f"`optim.betas` must be two numbers in [0, 1), got {list(cfg.optim.betas)}")
    resources = {"ray.worker_resources": cfg.ray.worker_resources, "ray.learner_resources": cfg.ray.learner_resources}
    for key, amounts in resources.items():
        for name, amount in amounts.items():
            if not amount > 0:
                raise ConfigError(f"`{key}.{name}` must be a positive amount of that resource, got {amount}")
    if cfg.ray.launcher == "local" and (cfg.ray.address or cfg.ray.worker_resources or cfg.ray.learner_resources):
        raise ConfigError(
            "`ray.launcher=local` starts every actor on this machine: it takes no `ray.address` and no "
            "`ray.worker_resources` / `ray.learner_resources` (set `ray.launcher=ray` or `auto` for a Ray cluster)"
        )
    if cfg.ray.launcher == "local" and (cfg.ray.worker_gpus or cfg.ray.learner_gpus):
        raise ConfigError(
            "`ray.worker_gpus` / `ray.learner_gpus` are Ray's GPU requests: `ray.launcher=local` places nothing (its "
            "workers use `rollout.device`, its learner ranks GPU r of `learner.device`); set `ray.launcher=ray` or "
            "`auto`, or drop them"
        )


def _check_model(cfg: Config) -> None:
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


def _check_env(cfg: Config) -> None:
    """`env.fn` names a file or module holding the environment (common/envs.py; a file is parsed, not run); its
    episodes are scored by the environment, so a reward function beside it would never run."""
    if not cfg.env.fn:
        return
    if cfg.reward.specs():
        key = "reward.fns" if cfg.reward.fns else "reward.fn"
        raise ConfigError(f"`{key}` is not used with `env.fn`: an episode's reward is its environment's (the "
                          "rewards `step` returns, combined by env.turn_rewards); score there, or unset one of "
                          "them")  # fmt: skip
    from common.envs import EnvError, check_env_spec

    try:
        check_env_spec(cfg.env.fn)
    except EnvError as err:
        raise ConfigError(str(err)) from err


def _check_reward(cfg: Config) -> None:
    """Every reward function spec names a file or module that exists and holds that function (common/reward_fns.py:
    a file is parsed, not run; a module is imported)."""
    from common.reward_fns import RewardFnError, check_spec

    key = "reward.fns" if cfg.reward.fns else "reward.fn"
    for i, spec in enumerate(cfg.reward.specs()):
        try:
            check_spec(spec, f"{key}[{i}]" if cfg.reward.fns else key)
        except RewardFnError as err:
            raise ConfigError(str(err)) from err
