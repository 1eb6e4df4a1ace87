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

From it, with the synchronous run's generation core-seconds (`e2e_metrics.bound_step_s`), the two ceilings the
decode ratios cannot pass on these cores while training stays fp32:
- `decode_ceiling_vs_trl_samples_s`: TRL's seconds per step over (our generation's core-seconds + the floor's
  core-seconds) / cores: training at the GEMM rate, generation perfectly overlapped, nothing thrown away;
- `decode_ceiling_async_vs_sync`: the synchronous run's seconds per step over `decode_bound_step_s`: what removing
  every idle core-second from the synchronous run could give; asynchrony gains only idle time.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

from asyncrl.bench.e2e_workloads import parameter_shapes

GEMM_REPEATS = 3
"""Timed repeats per shape after one warm-up; the best is kept (the floor is what the hardware can do)."""


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


def ceilings(
    metrics: dict[str, float], bound_step_s: float, gen_core_s_per_step: float, cores: int
) -> dict[str, float]:
    """The floor against what each contender trained in, and the two ceilings of the module doc."""
    floor_s = metrics.get("decode_train_floor_s", math.nan)
    out = {
        f"decode_{who}_train_vs_floor": metrics.get(f"decode_{who}_steady_train_s", math.nan) / floor_s
        for who in ("trl", "sync", "async")
    }
    packed_s = (gen_core_s_per_step + floor_s * cores) / cores
    out["decode_ceiling_vs_trl_samples_s"] = metrics.get("decode_trl_steady_step_s", math.nan) / packed_s
    out["decode_ceiling_async_vs_sync"] = metrics.get("decode_sync_steady_step_s", math.nan) / bound_step_s
    return out
