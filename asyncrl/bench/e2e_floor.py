"""The fp32 floor of a decode-workload training step on these cores, measured in the run of `asyncrl bench e2e`.

Every contender trains in fp32 (the fairness pin), so no trainer's step can beat the time the step's matrix
multiplies take at this machine's fp32 GEMM rate. The floor counts only the linear layers: 6 FLOPs per parameter
per token (2 each for the forward, the input gradient and the weight gradient) over the tokens a step reads (each
sample's prompt and its `max_new_tokens` minus the last token, which no contender feeds back). Attention, norms, the
loss and the optimizer come on top, so it is a lower bound for a trainer that runs every row's tokens; asyncrl's runs
each group's shared prompt once (`learner.packing`: 3.4% fewer tokens on this workload), so its training can come
within a few percent of it. The rate is the best of a few fp32 GEMMs of the
step's own shapes (all the step's tokens against the model's MLP and attention projections) on all the machine's
cores, on torch's `matmul` and on oneDNN's (`learner.fp32_gemm`), whichever is faster.

From it, with the synchronous run's generation core-seconds (`e2e_metrics.bound_step_s`), the ceilings the decode
ratios cannot pass on these cores while training stays fp32 (the last from the fp32 and asynchronous runs alone):
- `decode_ceiling_vs_trl_samples_s`: TRL's seconds per step over (our generation's core-seconds + the floor's
  core-seconds) / cores: training at the GEMM rate, generation perfectly overlapped, nothing thrown away;
- `decode_ceiling_async_vs_sync`: the synchronous run's seconds per step over `decode_bound_step_s`: what removing
  every idle core-second from the synchronous run could give; asynchrony gains only idle time.
- `decode_ceiling_int8_vs_fp32`: the same packing with fp32 rollout over it with INT8 rollout: (the synchronous
  run's training core-seconds + a step's fp32 generation core-seconds) over (the same + its INT8 generation
  core-seconds), both generations measured here on idle cores as a worker runs them (`generation_core_s`: a lease's
  rows at once on `rollout.threads` threads). On shared cores INT8 rollout shortens only the generation's part of a
  step; what it gains beyond this ceiling in a run is the fp32 workers' slowing of the learner beside them, and of
  each other (two fp32 workers side by side took 1.20-1.30x their idle core-seconds in the loop, 2026-12-06).
- `decode_ceiling_int8_free_vs_fp32` (`int8_free_ceiling`): the fp32-rollout run's seconds per step over the
  asynchronous (INT8) run's training seconds per step: what `int8_vs_fp32_e2e` would read if INT8 generation cost
  the loop nothing, with every slowing above counted as it happened in the run.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.bench.e2e_workloads import parameter_shapes

if TYPE_CHECKING:
    from common.config import Config

GEMM_REPEATS = 3
"""Timed repeats per shape after one warm-up; the best is kept (the floor is what the hardware can do)."""
GEN_REPEATS = 2
"""Timed generations per rollout scheme after one warm-up; the fastest is kept."""
GEN_SCHEMES = {"int8": "int8", "fp32": "none"}
"""The rollouts `generation_core_s` measures: metric suffix -> `quant.scheme`."""


def linear_parameters(model_dir: str) -> tuple[int, int, int]:
    """(parameters of the decoder's linear layers and the LM head, hidden size, intermediate size) of a HF Llama
    directory (the embedding is a lookup, not a multiply)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = parameter_shapes(model_dir).items()
    total = sum(math.prod(shape) for name, shape in shapes if len(shape) == 2 and "embed_tokens" not in name)
    return total, int(config["hidden_size"]), int(config["intermediate_size"])


def step_tokens(prompts_path: Path, tokenizer_dir: str, samples_per_step: int, max_new_tokens: int) -> float:
    """Tokens one training step reads: samples x (mean prompt tokens of the dumped prompts + max_new_tokens - 1)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = [json.loads(line) for line in prompts_path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{prompts_path}: no prompts to count")
    prompt_tokens = statistics.fmean(len(tokenizer(row["prompt"])["input_ids"]) for row in rows)
    return samples_per_step * (prompt_tokens + max_new_tokens - 1)


def fp32_gemm_gflops(rows: int, hidden: int, intermediate: int) -> float:
    """The best fp32 GEMM rate (GFLOP/s) over the step's shapes: (rows, hidden) x (hidden, intermediate), its
    transpose's (rows, intermediate) x (intermediate, hidden), and (rows, hidden) x (hidden, hidden), on the cores
    torch has (its default: all of them), and over both fp32 GEMMs a trainer could call: torch's `matmul` (MKL) and
    oneDNN's (`learner.fp32_gemm`; on AMD Zen 5 about twice MKL's rate)."""
    import torch

    from learner.fp32_gemm import fp32_matmuls

    best = 0.0
    generator = torch.Generator().manual_seed(0)
    for k, n in ((hidden, intermediate), (intermediate, hidden), (hidden, hidden)):
        a = torch.randn(rows, k, generator=generator)
        b = torch.randn(k, n, generator=generator)
        for gemm in fp32_matmuls().values():
            gemm(a, b)
            for _ in range(GEMM_REPEATS):
                start = time.perf_counter()
                gemm(a, b)
                best = max(best, 2.0 * rows * k * n / (time.perf_counter() - start) / 1e9)
    return best


def decode_floor(model_dir: str, prompts_path: Path, samples_per_step: int, max_new_tokens: int) -> dict[str, float]:
    """`decode_fp32_gemm_gflops`, `decode_train_linear_flops` (per step) and `decode_train_floor_s`."""
    params, hidden, intermediate = linear_parameters(model_dir)
    tokens = step_tokens(prompts_path, model_dir, samples_per_step, max_new_tokens)
    gflops = fp32_gemm_gflops(int(tokens), hidden, intermediate)
    flops = 6.0 * params * tokens
    return {
        "decode_fp32_gemm_gflops": gflops,
        "decode_train_tokens_per_step": tokens,
        "decode_train_linear_flops": flops,
        "decode_train_floor_s": flops / (gflops * 1e9),
    }


def generation_core_s(model_dir: str, prompts_path: Path, config: Config, samples_per_step: int,
                      max_new_tokens: int) -> dict[str, float]:  # fmt: skip
    """`decode_gen_core_s_per_step_<int8|fp32>`: the core-seconds one step's generation takes on idle cores with
    INT8 and with fp32 rollout, on our engine as a worker runs it: a lease's rows (`rollout.groups_per_lease` x
    `train.group_size`, each prompt repeated for its group) at once on `rollout.threads` torch threads, the LM head
    quantized as `quant.lm_head` says, each response run to `max_new_tokens` (the decode model never emits its EOS);
    the fastest of `GEN_REPEATS` after a warm-up, scaled to the step's samples."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.bench.engine_bench import built_engine
    from common.config_rules import head_quantized
    from rollout_workers.engine import SamplingParams

    rollout = config.rollout
    group = config.train.group_size
    rows = [json.loads(line) for line in prompts_path.read_text().splitlines() if line.strip()]
    lease = rows[: rollout.groups_per_lease]
    if len(lease) < rollout.groups_per_lease:
        raise ValueError(f"{prompts_path}: {len(lease)} prompts, a lease needs {rollout.groups_per_lease}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer(row["prompt"])["input_ids"] for row in lease for _ in range(group)]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=rollout.temperature)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(rollout.threads)
    out: dict[str, float] = {}
    try:
        for suffix, scheme in GEN_SCHEMES.items():
            head = head_quantized(replace(config.quant, scheme=scheme), rollout)
            engine = built_engine(model, model_dir, scheme, quantize_head=head, max_batch=rollout.max_batch,
                                  max_seq_len=rollout.max_seq_len, precision=config.precision.rollout,
                                  prefix_cache=rollout.prefix_cache, device="cpu")  # fmt: skip
            best = math.inf
            for attempt in range(GEN_REPEATS + 1):
                start = time.perf_counter()
                done = engine.generate(prompts, params)
                elapsed = time.perf_counter() - start
                if any(len(completion.response_ids) != max_new_tokens for completion in done):
                    raise RuntimeError(f"{model_dir}: a response ended before {max_new_tokens} tokens")
                best = elapsed if attempt else best  # the first call is the warm-up
            out[f"decode_gen_core_s_per_step_{suffix}"] = best * rollout.threads * samples_per_step / len(prompts)
    finally:
        torch.set_num_threads(threads_before)
    return out


def ceilings(
    metrics: dict[str, float], bound_step_s: float, gen_core_s_per_step: float, cores: int
) -> dict[str, float]:
    """The floor against what each contender trained in, and the ceilings of the module doc."""
    floor_s = metrics.get("decode_train_floor_s", math.nan)
    out = {
        f"decode_{who}_train_vs_floor": metrics.get(f"decode_{who}_steady_train_s", math.nan) / floor_s
        for who in ("trl", "trl_malloc", "sync", "async")
    }
    packed_s = (gen_core_s_per_step + floor_s * cores) / cores
    out["decode_ceiling_vs_trl_samples_s"] = metrics.get("decode_trl_steady_step_s", math.nan) / packed_s
    out["decode_ceiling_async_vs_sync"] = metrics.get("decode_sync_steady_step_s", math.nan) / bound_step_s
    train_core_s = bound_step_s * cores - gen_core_s_per_step  # the synchronous run's training, in core-seconds
    int8_s, fp32_s = (metrics.get(f"decode_gen_core_s_per_step_{suffix}", math.nan) for suffix in GEN_SCHEMES)
    out["decode_ceiling_int8_vs_fp32"] = (train_core_s + fp32_s) / (train_core_s + int8_s)
    return out


def int8_free_ceiling(figures: dict[str, dict[str, float]]) -> dict[str, float]:
    """`decode_ceiling_int8_free_vs_fp32` (module doc) from the contenders' figures, when the fp32-rollout and the
    asynchronous runs both ran (the synchronous one is not needed), else nothing."""
    if "decode_fp32" not in figures or "decode_async" not in figures:
        return {}
    return {"decode_ceiling_int8_free_vs_fp32": figures["decode_fp32"]["steady_step_s"]
            / figures["decode_async"]["steady_train_s"]}  # fmt: skip
