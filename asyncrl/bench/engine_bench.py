"""`asyncrl bench engine`: decode throughput of the embedded engine, INT8 speed-up, and the weight-swap pause.

Baselines, measured in the same run on the same model, batch, prompt length, response length and sampling
(temperature 1, no top-p/k, no early stop):

- `engine_vs_hf_b1`, `engine_vs_hf_b64`: engine decode tokens/s over Hugging Face `generate` (fp32, KV cache,
  SDPA attention), on `builtin:tiny` and on a random ~100M-parameter Llama (hidden 1024); the ratio is the min
  of the two models. Decode tokens/s excludes the prompt's prefill, for both: B * (N - 1) / (t(N) - t(1)), where
  t(n) is the time of a call generating n tokens for each of the B prompts (t(1) is the prefill and first token).
- `int8_vs_fp32_b32`: engine tokens/s with INT8 W8A8 weights over fp32 weights, batch 32, hidden-1024 model.
- `swap_max_gap_over_median`: the largest gap between two consecutive scheduler steps over the median gap while
  5 weight versions are staged from another thread mid-generation (in_place mode, hidden-1024 model in INT8,
  batch 64; 16 with `quick`).

Everything runs on one torch thread, as a rollout worker does by default (`rollout.threads`): on these shared
2-core machines two OpenMP threads contend with the neighbours and every op slows by up to 10x. Contenders
alternate (engine, HF, engine, HF, ...) after a short warm-up and each reports its best round, so a noisy
neighbour slows both rather than one.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from collections.abc import Callable

import torch

from asyncrl.bench import BenchResult

PROMPT_TOKENS = 8


def _big_model(tmp_dir: str):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights

    config = LlamaConfig(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=256,
                         eos_token_id=2, attn_implementation="sdpa")  # fmt: skip
    with no_init_weights():  # HF's initialisation takes seconds; N(0, 0.02) matrices and unit norms are enough
        model = LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=generator) if param.dim() == 2 else param.fill_(1.0)
    config.save_pretrained(tmp_dir)  # the engine reads config.json; weights reach it as published tensors
    return model


def _tiny_model():
    from transformers import AutoModelForCausalLM

    from common.builtin_model import resolve_model_path

    model_dir = str(resolve_model_path("builtin:tiny"))
    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval(), model_dir


def _engine(model, model_dir: str, scheme: str, **kwargs):
    from quant_sync.export import export_rollout_tensors
    from quant_sync.update import WeightUpdate
    from rollout_workers.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine(model_dir, **kwargs)
    engine.stage_weights(WeightUpdate(0, export_rollout_tensors(model.state_dict(), scheme), scheme))
    engine.apply_staged()
    return engine


def _prompts(model, batch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(batch)
    return torch.randint(3, model.config.vocab_size, (batch, PROMPT_TOKENS), generator=generator)


def _engine_rate(engine, prompts: torch.Tensor, new_tokens: int) -> Callable[[], float]:
    from rollout_workers.engine import SamplingParams

    prompt_lists = prompts.tolist()
    engine.generate(prompt_lists, SamplingParams(max_new_tokens=2))  # warm-up: allocates the KV cache

    def timed(n: int) -> float:
        start = time.perf_counter()
        out = engine.generate(prompt_lists, SamplingParams(max_new_tokens=n, stop_token_ids=(-1,)))
        elapsed = time.perf_counter() - start
        assert all(len(c.response_ids) == n for c in out)
        return elapsed

    return lambda: _decode_rate(len(prompt_lists), new_tokens, timed)


def _decode_rate(batch: int, new_tokens: int, timed: Callable[[int], float]) -> float:
    """Decode tokens/s without the prefill: B * (N - 1) / (t(N) - t(1))."""
    prefill_s = timed(1)
    total_s = timed(new_tokens)
    return batch * (new_tokens - 1) / max(total_s - prefill_s, 1e-9)


def _hf_rate(model, prompts: torch.Tensor, new_tokens: int) -> Callable[[], float]:
    with torch.inference_mode():  # warm-up
        model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=2, pad_token_id=0)

    def timed(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0, top_p=1.0,
                top_k=0, max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
            )  # fmt: skip
        elapsed = time.perf_counter() - start
        assert out.shape[1] == prompts.shape[1] + n
        return elapsed

    return lambda: _decode_rate(prompts.shape[0], new_tokens, timed)


def _best_alternating(contenders: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            samples[name].append(fn())
    return {name: max(values) for name, values in samples.items()}


def _swap_gaps(model, model_dir: str, batch: int, new_tokens: int, swaps: int) -> tuple[float, float, int]:
    """Step gaps while `swaps` versions are staged from another thread mid-generation: (max, median, swaps done)."""
    from quant_sync.export import export_rollout_tensors
    from quant_sync.update import WeightUpdate
    from rollout_workers.engine import SamplingParams

    engine = _engine(model, model_dir, "int8", max_batch=batch)
    tensors = export_rollout_tensors(model.state_dict(), "int8")
    prompts = _prompts(model, batch).tolist()
    params = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=(-1,))
    engine.generate(prompts, SamplingParams(max_new_tokens=2))  # warm-up
    requests: list[threading.Event] = [threading.Event() for _ in range(swaps)]

    def stager() -> None:
        for version, request in enumerate(requests, start=1):
            request.wait()
            engine.stage_weights(WeightUpdate(version, tensors, "int8"))

    thread = threading.Thread(target=stager, daemon=True)
    thread.start()
    for index, prompt in enumerate(prompts):
        engine.submit(prompt, params, [index])
    every = max(new_tokens // (2 * swaps + 2), 1)
    stamps = [time.perf_counter()]
    requested, last_request = 0, 0
    while engine.busy:
        engine.step()
        stamps.append(time.perf_counter())
        steps = len(stamps) - 1
        # the next version is published once the previous one is in and `every` steps have passed
        if requested < swaps and engine.version == requested and steps - last_request >= every:
            requests[requested].set()
            requested, last_request = requested + 1, steps
    for request in requests:
        request.set()
    thread.join()
    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:])]  # skip the first step: it holds the prefill
    return max(gaps), statistics.median(gaps), engine.swaps - 1


def run(quick: bool) -> BenchResult:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like a rollout worker (rollout.threads); 2 threads on a shared 2-core box thrash
    try:
        return _run(quick)
    finally:
        torch.set_num_threads(threads)


def _run(quick: bool) -> BenchResult:
    torch.manual_seed(0)
    rounds = 1 if quick else 3
    metrics: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as big_dir:
        big = _big_model(big_dir)
        tiny, tiny_dir = _tiny_model()
        tokens = {("tiny", 1): 48, ("tiny", 64): 48, ("big", 1): 8 if quick else 32, ("big", 64): 6 if quick else 16}
        for name, model, model_dir in (("tiny", tiny, tiny_dir), ("big", big, big_dir)):
            engine = _engine(model, model_dir, "none", max_batch=64)
            for batch in (1, 64):
                new_tokens = tokens[name, batch]
                prompts = _prompts(model, batch)
                rates = _best_alternating(
                    {"engine": _engine_rate(engine, prompts, new_tokens), "hf": _hf_rate(model, prompts, new_tokens)},
                    rounds,
                )
                metrics[f"{name}_b{batch}_engine_tok_per_s"] = rates["engine"]
                metrics[f"{name}_b{batch}_hf_tok_per_s"] = rates["hf"]
        for batch in (32, 1):  # b1 is reported too: memory-bound, where 4x smaller weights pay most
            prompts = _prompts(big, batch)
            rates = _best_alternating(
                {
                    scheme: _engine_rate(_engine(big, big_dir, scheme, max_batch=batch), prompts, 6 if quick else 16)
                    for scheme in ("int8", "none")
                },
                rounds,
            )
            metrics[f"big_b{batch}_int8_tok_per_s"] = rates["int8"]
            metrics[f"big_b{batch}_fp32_tok_per_s"] = rates["none"]
        max_gap, median_gap, swaps = _swap_gaps(big, big_dir, 16 if quick else 64, 28 if quick else 48, 5)
    metrics.update(swap_max_gap_s=max_gap, swap_median_gap_s=median_gap, swaps_applied=float(swaps))
    ratios = {
        f"engine_vs_hf_b{batch}": min(
            metrics[f"{name}_b{batch}_engine_tok_per_s"] / metrics[f"{name}_b{batch}_hf_tok_per_s"]
            for name in ("tiny", "big")
        )
        for batch in (1, 64)
    }
    ratios["int8_vs_fp32_b32"] = metrics["big_b32_int8_tok_per_s"] / metrics["big_b32_fp32_tok_per_s"]
    ratios["swap_max_gap_over_median"] = max_gap / median_gap
    return BenchResult(name="engine", metrics=metrics, ratios=ratios)
