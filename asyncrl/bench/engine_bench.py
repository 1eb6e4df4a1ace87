"""`asyncrl bench engine`: decode throughput of the embedded engine per weight scheme, against fp32 and against HF.

Models (all Llama-family; the random ones are N(0, 0.02) weights, enough for timing):
- `tiny`: `builtin:tiny` (0.8M parameters: per-token overhead, not weights, bounds it);
- `big`: a random ~100M Llama, hidden 1024, 8 layers, 16 heads, 4 KV heads, intermediate 2816, vocab 8192;
- `smol`: a random SmolLM2-135M-shaped Llama: hidden 576, 30 layers, 9 heads, 3 KV heads, intermediate 1536,
  vocab 49,152, tied embeddings.

Ratios (one run, same model, batch, 8-token prompts, response length and sampling: temperature 1, no top-p/k,
no early stop). Decode tokens/s excludes the prefill, for every contender: B * (N - 1) / (t(N) - t(1)), t(n) being
the time of a call generating n tokens for each of the B prompts.
- `engine_vs_hf_b1`: the fp32 engine over Hugging Face `generate` (fp32, KV cache, SDPA) on the built-in model
  (`tiny`: per-token overhead). `big` is reported as `big_b1_engine_tok_per_s` / `big_b1_hf_tok_per_s`: at one
  row both stream the same fp32 weights, so memory bandwidth, not the engine, bounds that ratio.
- `engine_vs_hf_b64`: the same at batch 64, the lower of `tiny` and `big`.
- `engine_int8_vs_hf_b64`: the engine as the main job runs it (INT8 W8A8) over HF `generate` in fp32 (what TRL
  rolls out with), batch 64, the lower of `tiny` and `big`.
- `int8_vs_fp32_b32` (`big`), `smol_int8_vs_fp32_b32` (`smol`): INT8 engine over the fp32 engine at batch 32.
- `w8a16_vs_fp32_b1` (`big`): the weight-only INT8 engine over fp32 at batch 1 (memory-bound: weight bytes).
- `lora_decode_overhead` (`big`, INT8, batch 32): decode seconds per token with rank-16 LoRA adapters on every
  decoder linear (random, as the learner publishes them by default: `lora_adapter_tensors` in int8, which the
  engine runs as they are; fp32 adapters as a metric) over the same engine without
  adapters, minus 1; the two alternate over `LORA_ROUNDS` (8) rounds of 32 tokens even with `--quick` (about 20 s).
- `swap_max_gap_over_median`: the largest gap between two scheduler steps over the median gap while 5 weight
  versions are staged from another thread mid-generation (in_place, `big` in INT8, batch 64; 16 with `quick`),
  gaps in the decode thread's CPU time (see below: what the engine's scheduling adds, not a neighbour's).

Metrics: `<model>_b<B>_<scheme>_tok_per_s` for every scheme (fp32, int8, fp8, w8a16, w4a16) at batches 1, 32, 64
on every model (`--quick`: only the pairs the ratios need), and each one's `_roofline_fraction`: measured tok/s
over min(bandwidth x B / weight bytes per step, GEMM peak / FLOPs per token). Bytes per step: every weight a decode
step reads once in the scheme's published format (decoder linears quantized, norms in fp32, the LM head quantized
for the W8A8 schemes and fp32 otherwise, as `quant.lm_head=auto` publishes it; the embedding is gathered, not
read). FLOPs per token: 2 per multiply-accumulate of the linears and the LM head
(attention, a few percent at these lengths, is not counted). Bandwidth: a large single-thread copy, counting its
read and its write (`bandwidth_gb_per_s`); peaks at 1024^3, measured in this run: fp32 (`fp32_gemm_gflop_per_s`,
the better of MKL's `torch.mm` and oneDNN's prepacked linear), the exact int8 `torch._int_mm`
(`int8_gemm_gop_per_s`, the int8 scheme's peak) and bf16 `torch.mm` (fp8's where faster: e4m3 is exact in bf16).
`cpu_<flag>` is 1 where /proc/cpuinfo lists avx2 / avx512f / avx512_vnni / avx512_bf16 / amx_int8. The JSON's
`details` name the kernel each scheme's linears ran (`kernels`) and the CPU's ISA (`cpu_isa`).

Everything runs on one torch thread, as a rollout worker does by default (`rollout.threads`): on these shared
2-core machines two OpenMP threads contend with the neighbours. Times are the calling thread's CPU time (every
contender computes on it: one torch thread, single-threaded kernels; the peaks and the copy too): wall time here
also counts the waits for a core that other jobs cause, which swung one contender's rate 3x between rounds and a
swap gap past 2 steps. Contenders alternate (a, b, a, b, ...) after a warm-up, so a noisy neighbour slows both
rather than one, and each t(n) is the smallest of its rounds.

AVX2 on a newer core: `ASYNCRL_BENCH_ISA=avx2 asyncrl bench engine` caps every kernel family at AVX2 + FMA in one
switch (ISA_CAP_ENV): our int8, weight-only, FP8, attention / fp32-row and LoRA kernels (`ASYNCRL_ISA_CAP`, and each
family's forcing variable), torch's own kernels (`ATEN_CPU_CAPABILITY`), oneDNN (`ONEDNN_MAX_CPU_ISA`) and MKL
(`MKL_ENABLE_INSTRUCTIONS`). The last three are read when torch starts, so the measurement runs in a fresh Python
process with them set. That process checks the cap took before measuring (`isa_cap_check` in the JSON's details:
each kernel dispatched, torch's capability, and oneDNN's ISA and implementations from one `ONEDNN_VERBOSE=1` run; an
AVX-512 or AMX implementation there fails the bench). It runs AVX2 code on the cores here (Zen 4): a proxy for an
AVX2-only Zen 3, whose two vector multiply pipes match, not for Zen 2 (one pipe). MKL's verbose banner names no
ISA on AMD CPUs; MKL dispatches AVX2 code there anyway.

CUDA: `ASYNCRL_BENCH_DEVICE=cuda` runs the engines (`rollout.device=cuda`) and HF on the GPU. Untested: these
machines have no GPU; it is written to torch's documented CUDA API, and the CPU-side figures (ISA flags, kernel
names) then do not describe what ran.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncrl.bench import BenchResult
from asyncrl.bench.engine_isa import ENV_BENCH_ISA, ISA_CAP_ENV, isa_cap_check, run_capped

PROMPT_TOKENS = 8
SCHEMES = ("none", "int8", "fp8", "w8a16", "w4a16")
LABELS = {"none": "fp32"}  # metric names call the unquantized engine fp32
BATCHES = (1, 32, 64)
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16")
BIG_SHAPE = {"vocab_size": 8192, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
             "num_attention_heads": 16, "num_key_value_heads": 4}  # fmt: skip
SMOL_SHAPE = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
              "num_attention_heads": 9, "num_key_value_heads": 3, "tie_word_embeddings": True}  # fmt: skip
LORA_RANK = 16
"""Rank of the random adapters of the `lora_*` rows (here and in `asyncrl bench sync`)."""
LORA_ROUNDS = 8
"""Alternating rounds of the `lora_*` rows. With 3 rounds of 16 tokens, `lora_decode_overhead` read 0.09-0.15 over
four runs of the same code (Zen 4, one thread), its target (0.10) inside that spread; with 8 of 32, 0.071-0.086."""
LORA_NEW_TOKENS = 32
"""New tokens per sequence in each round of the `lora_*` rows (batch 32)."""
QUICK_GRID = (("big", 32, ("none", "int8")), ("big", 1, ("none", "w8a16")), ("smol", 32, ("none", "int8")))
"""`--quick`: the (model, batch, schemes) the scheme ratios need; the full run measures every combination."""


def _device() -> torch.device:
    return torch.device(os.environ.get("ASYNCRL_BENCH_DEVICE", "cpu"))


def _sync() -> None:
    if _device().type == "cuda":
        torch.cuda.synchronize()


def _clock() -> float:
    """Seconds of this thread's CPU time on CPU (every contender computes on the calling thread: one torch thread,
    single-threaded kernels), wall time on a GPU. On the shared 2-core machines wall time also counts the waits for a
    core that the neighbours' jobs cause, which swung one contender's rate 3x between rounds."""
    return time.perf_counter() if _device().type == "cuda" else time.thread_time()


def _random_llama(tmp_dir: str, shape: dict[str, object]):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights

    config = LlamaConfig(**shape, max_position_embeddings=256, eos_token_id=2, attn_implementation="sdpa")
    with no_init_weights():  # HF's initialisation takes seconds; N(0, 0.02) matrices and unit norms are enough
        model = LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=generator) if param.dim() == 2 else param.fill_(1.0)
    config.save_pretrained(tmp_dir)  # the engine reads config.json; weights reach it as published tensors
    return model.to(_device())


def _tiny_model():
    from transformers import AutoModelForCausalLM

    from common.builtin_model import resolve_model_path

    model_dir = str(resolve_model_path("builtin:tiny"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    return model.to(_device()), model_dir


def _head_quantized(scheme: str) -> bool:
    """The LM head as the main job publishes it (`quant.lm_head=auto` on the embedded engine)."""
    from common.config_rules import W8A8_SCHEMES

    return scheme in W8A8_SCHEMES


def lora_adapter_tensors(
    state: dict[str, torch.Tensor], rank: int = LORA_RANK, alpha: float = 32.0, seed: int = 0, sync_dtype: str = "fp32"
) -> dict[str, torch.Tensor]:
    """Random LoRA adapters on every decoder linear of `state` (`model.lora.targets`' default), named and typed as
    learner/lora.py publishes them: `<linear>.lora_A` (rank, in) and `.lora_B` (out, rank), N(0, 0.02) (a trained
    B, not peft's zero start) in `sync_dtype` (`model.lora.sync_dtype`; int8 with its `_scale` tensors),
    `.lora_scaling` (1,) = alpha / rank."""
    from common.config_schema import LORA_TARGETS
    from quant_sync.export import LORA_A, LORA_B, LORA_SCALING, encode_adapter

    generator = torch.Generator().manual_seed(seed)
    adapters: dict[str, torch.Tensor] = {}
    for name, weight in state.items():
        linear = name.removesuffix(".weight")
        if weight.dim() != 2 or linear == name or linear.rsplit(".", 1)[-1] not in LORA_TARGETS:
            continue
        out_features, in_features = weight.shape
        a = torch.randn(rank, in_features, generator=generator) * 0.02
        b = torch.randn(out_features, rank, generator=generator) * 0.02
        for part, matrix in ((LORA_A, a), (LORA_B, b)):
            for suffix, value in encode_adapter(matrix, part, sync_dtype).items():
                adapters[linear + part + suffix] = value
        adapters[linear + LORA_SCALING] = torch.tensor([alpha / rank], dtype=torch.float32)
    if not adapters:
        raise ValueError(f"lora_adapter_tensors: no linear named like {', '.join(LORA_TARGETS)} in the state dict")
    return adapters


def built_engine(model, model_dir: str, scheme: str, adapters: dict[str, torch.Tensor] | None = None,
                 quantize_head: bool | None = None, **kwargs):  # fmt: skip
    """An embedded engine on `model`'s weights published as `scheme` (and `adapters`), applied: the LM head quantized
    as `quantize_head` says (default: as the main job's `quant.lm_head=auto` does); `kwargs` go to the engine
    (default `max_seq_len` 128, the bench's device)."""
    from quant_sync.export import export_rollout_tensors
    from quant_sync.update import WeightUpdate
    from rollout_workers.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine(model_dir, **{"max_seq_len": 128, "device": str(_device()), **kwargs})
    state = {name: value.cpu() for name, value in model.state_dict().items()}
    head = _head_quantized(scheme) if quantize_head is None else quantize_head
    published = {**export_rollout_tensors(state, scheme, quantize_head=head), **(adapters or {})}
    engine.stage_weights(WeightUpdate(0, published, scheme))
    engine.apply_staged()
    return engine


def _prompts(model, batch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(batch)
    return torch.randint(3, model.config.vocab_size, (batch, PROMPT_TOKENS), generator=generator)


def _engine_rate(engine, prompts: torch.Tensor, new_tokens: int) -> Callable[[], Timing]:
    from rollout_workers.engine import SamplingParams

    prompt_lists = prompts.tolist()
    engine.generate(prompt_lists, SamplingParams(max_new_tokens=2))  # warm-up: allocates the KV cache

    def timed(n: int) -> float:
        start = _clock()
        out = engine.generate(prompt_lists, SamplingParams(max_new_tokens=n, stop_token_ids=(-1,)))
        _sync()
        elapsed = _clock() - start
        assert all(len(c.response_ids) == n for c in out)
        return elapsed

    return lambda: Timing(len(prompt_lists), new_tokens, timed(1), timed(new_tokens))


@dataclass(frozen=True, slots=True)
class Timing:
    """One round of a contender: the seconds of a call generating 1 token (prefill) and N tokens per prompt."""

    batch: int
    new_tokens: int
    prefill_s: float
    total_s: float


def _decode_rate(rounds: list[Timing]) -> float:
    """Decode tokens/s without the prefill: B * (N - 1) / (t(N) - t(1)), each t the least disturbed (smallest) of
    the rounds: the best round of the difference would reward a round whose t(1) a neighbour happened to slow."""
    first = rounds[0]
    decode_s = min(r.total_s for r in rounds) - min(r.prefill_s for r in rounds)
    return first.batch * (first.new_tokens - 1) / max(decode_s, 1e-9)


def _hf_rate(model, prompts: torch.Tensor, new_tokens: int) -> Callable[[], Timing]:
    prompts = prompts.to(_device())
    with torch.inference_mode():  # warm-up
        model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=2, pad_token_id=0)

    def timed(n: int) -> float:
        start = _clock()
        with torch.inference_mode():
            out = model.generate(
                prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0, top_p=1.0,
                top_k=0, max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
            )  # fmt: skip
        _sync()
        elapsed = _clock() - start
        assert out.shape[1] == prompts.shape[1] + n
        return elapsed

    return lambda: Timing(prompts.shape[0], new_tokens, timed(1), timed(new_tokens))


def _best_alternating(contenders: dict[str, Callable[[], Timing]], rounds: int) -> dict[str, float]:
    """Decode tok/s of each contender over `rounds` rounds in which they take turns (see `_decode_rate`)."""
    samples: dict[str, list[Timing]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            samples[name].append(fn())
    return {name: _decode_rate(timings) for name, timings in samples.items()}


def _swap_gaps(model, model_dir: str, batch: int, new_tokens: int, swaps: int) -> tuple[float, float, int]:
    """Step gaps while `swaps` versions are staged from another thread mid-generation: (max, median, swaps done)."""
    from quant_sync.export import export_rollout_tensors
    from quant_sync.update import WeightUpdate
    from rollout_workers.engine import SamplingParams

    engine = built_engine(model, model_dir, "int8", max_batch=batch)
    state = {name: value.cpu() for name, value in model.state_dict().items()}
    tensors = export_rollout_tensors(state, "int8", quantize_head=_head_quantized("int8"))
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
    stamps = [_clock()]
    requested, last_request = 0, 0
    while engine.busy:
        engine.step()
        stamps.append(_clock())
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


def cpu_isa() -> dict[str, bool]:
    """The /proc/cpuinfo flags of CPU_FLAGS (all False where there is no such file)."""
    path = Path("/proc/cpuinfo")
    flags: set[str] = set()
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = set(line.split(":", 1)[1].split())
                break
    return {flag: flag in flags for flag in CPU_FLAGS}


def platform_details() -> dict[str, object]:
    """The CPU's ISA flags and the INT8 kernel this machine's engines run (for a bench's JSON `details`)."""
    return {"cpu_isa": [flag for flag, present in cpu_isa().items() if present], "kernel_by_scheme": {
        "int8": int8_kernel(), "lora_int8": lora_int8_kernel()}}  # fmt: skip


def lora_int8_kernel() -> str:
    """The kernel int8 LoRA adapters built now run on (`low_rank.int8_kernel`: amx or avx512), or "torch" (GEMMs on
    their float32 values) where csrc/lora_gemm.cpp does not run."""
    from rollout_workers.embedded import low_rank

    return low_rank.int8_kernel() or "torch"


def int8_kernel() -> str:
    """The exact INT8 kernel new int8 weights get (`int8_linear.int8_kernel_name`; "unknown" where that module or
    function is missing)."""
    try:
        from rollout_workers.embedded import int8_linear
    except ImportError:
        return "unknown"
    name_of = getattr(int8_linear, "int8_kernel_name", None)
    return name_of() if callable(name_of) else "unknown"


def kernel_of(engine) -> str:
    """What the engine's decoder linears run on (its first layer's gate/up projection, as built)."""
    from rollout_workers.embedded import fused_decode
    from rollout_workers.embedded import model as engine_model
    from rollout_workers.embedded.weight_only import PackedWeightOnly

    weight = engine._weights.layers[0].gate_up
    if isinstance(weight, PackedWeightOnly):
        return f"weight_only:{weight.kernel}" if weight.scheme != "fp32" else f"fp32 row-major:{weight.kernel}"
    if isinstance(weight, fused_decode.PackedLinear):
        return "fp32 fused_decode.linear (batch-invariant)"
    if isinstance(weight, engine_model.UpcastQuantized):
        return f"fp32 GEMM on the exact upcast ({weight.scheme})"
    if isinstance(weight, engine_model.PackedFp32):
        return "fp32 oneDNN prepacked (MKL at one row)"
    if isinstance(weight, torch.Tensor):
        return f"{weight.dtype} torch.nn.functional.linear"
    kind = "fp8" if type(weight).__name__ == "PackedFp8" else "int8"
    kernel = getattr(weight, "kernel", None)
    return f"{kind}:{kernel}" if kernel else type(weight).__name__


def machine_peaks(quick: bool) -> dict[str, float]:
    """Bandwidth (a large copy: read + written bytes per second) and GEMM peaks per second: fp32 FLOPs (the better of
    MKL's `torch.mm` and oneDNN's prepacked linear, the two fp32 paths the engine runs), exact int8 ops
    (`torch._int_mm`) and bf16 FLOPs (`torch.mm` in bf16: the FP8 kernel's products on AVX512-BF16 CPUs)."""
    device, reps = _device(), 3 if quick else 8

    def best(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(reps):
            _sync()
            start = _clock()
            fn()
            _sync()
            times.append(_clock() - start)
        return min(times)

    source = torch.empty(1 << 25, dtype=torch.float32, device=device).fill_(1.0)  # 128 MiB
    target = torch.empty_like(source)
    copy_s = best(lambda: target.copy_(source))
    size = 1024
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    gemm_s = best(lambda: torch.mm(a, b))
    if device.type == "cpu" and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        packed = torch.ops.mkldnn._reorder_linear_weight(b, 64)
        gemm_s = min(gemm_s, best(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")))
    a8 = torch.randint(-127, 128, (size, size), dtype=torch.int8, device=device)
    int8_s = best(lambda: torch._int_mm(a8, a8))
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    bf16_s = best(lambda: torch.mm(a16, b16))
    return {
        "bandwidth_gb_per_s": 2 * source.nbytes / copy_s / 1e9,
        "fp32_gemm_gflop_per_s": 2 * size**3 / gemm_s / 1e9,
        "int8_gemm_gop_per_s": 2 * size**3 / int8_s / 1e9,
        "bf16_gemm_gflop_per_s": 2 * size**3 / bf16_s / 1e9,
    }


def weight_traffic(state: dict[str, torch.Tensor], scheme: str) -> tuple[float, float]:
    """(bytes a decode step reads, FLOPs per token) of a model in `scheme`'s published format (see the docstring)."""
    from quant_sync.export import export_rollout_tensors

    published = export_rollout_tensors(state, scheme, quantize_head=_head_quantized(scheme))
    tied = "lm_head.weight" not in published
    embed = published["model.embed_tokens.weight"]
    read = sum(t.nbytes for name, t in published.items() if name != "model.embed_tokens.weight")
    read += embed.nbytes if tied else 0  # a tied LM head reads the embedding matrix whole
    macs = sum(t.numel() for name, t in published.items() if t.dim() == 2 and name != "model.embed_tokens.weight")
    macs += embed.numel() if tied else 0
    return float(read), 2.0 * macs


def roofline_fraction(
    tok_per_s: float, batch: int, traffic: tuple[float, float], peaks: dict[str, float], scheme: str
) -> float:
    """Measured tok/s over min(bandwidth x B / bytes per step, GEMM peak / FLOPs per token)."""
    bytes_per_step, flops_per_token = traffic
    peak = peaks["int8_gemm_gop_per_s"] if scheme == "int8" else peaks["fp32_gemm_gflop_per_s"]
    if scheme in ("fp8", "fp8_trunc"):  # e4m3 values are exact in bf16: the FP8 kernel may run bf16 products
        peak = max(peak, peaks["bf16_gemm_gflop_per_s"])
    memory_bound = peaks["bandwidth_gb_per_s"] * 1e9 * batch / bytes_per_step
    compute_bound = peak * 1e9 / flops_per_token
    return tok_per_s / min(memory_bound, compute_bound)


def _new_tokens(model_name: str, batch: int, quick: bool) -> int:
    if model_name == "tiny":
        return 48 if batch == 1 else 32
    if model_name == "big":
        return (8 if batch == 1 else 6) if quick else (32 if batch == 1 else 16)
    return (6 if batch == 1 else 4) if quick else (16 if batch == 1 else 8)  # smol: 30 layers, a 49k-token head


def _scheme_rows(
    models: dict[str, tuple[object, str]], grid, rounds: int, quick: bool, peaks: dict[str, float]
) -> tuple[dict[str, float], dict[str, str]]:
    """Every (model, batch, schemes) of `grid`, the schemes alternating: tok/s and roofline fraction per scheme."""
    metrics: dict[str, float] = {}
    kernels: dict[str, str] = {}
    traffic: dict[tuple[str, str], tuple[float, float]] = {}
    for model_name, batch, schemes in grid:
        model, model_dir = models[model_name]
        state = {name: value.cpu() for name, value in model.state_dict().items()}  # type: ignore[attr-defined]
        prompts = _prompts(model, batch)
        engines = {scheme: built_engine(model, model_dir, scheme, max_batch=batch) for scheme in schemes}
        new_tokens = _new_tokens(model_name, batch, quick)
        rates = _best_alternating(
            {scheme: _engine_rate(engine, prompts, new_tokens) for scheme, engine in engines.items()}, rounds
        )
        for scheme, rate in rates.items():
            key = f"{model_name}_b{batch}_{LABELS.get(scheme, scheme)}"
            traffic.setdefault((model_name, scheme), weight_traffic(state, scheme))
            metrics[f"{key}_tok_per_s"] = rate
            metrics[f"{key}_roofline_fraction"] = roofline_fraction(
                rate, batch, traffic[model_name, scheme], peaks, scheme
            )
            kernels[f"{model_name}_{LABELS.get(scheme, scheme)}"] = kernel_of(engines[scheme])
        del engines
    for (model_name, scheme), (bytes_per_step, flops) in traffic.items():
        metrics[f"{model_name}_{LABELS.get(scheme, scheme)}_weight_mb_per_step"] = bytes_per_step / 1e6
        metrics[f"{model_name}_gflop_per_token"] = flops / 1e9
    return metrics, kernels


def _engine_vs_hf(models: dict[str, tuple[object, str]], rounds: int, quick: bool) -> dict[str, float]:
    """fp32 engine, INT8 engine and HF generate (fp32) on `tiny` and `big` at batches 1 and 64."""
    metrics: dict[str, float] = {}
    tokens = {("tiny", 1): 48, ("tiny", 64): 48, ("big", 1): 8 if quick else 32, ("big", 64): 6 if quick else 16}
    for name in ("tiny", "big"):
        model, model_dir = models[name]
        fp32 = built_engine(model, model_dir, "none", max_batch=64)
        int8 = built_engine(model, model_dir, "int8", max_batch=64)
        for batch in (1, 64):
            new_tokens, prompts = tokens[name, batch], _prompts(model, batch)
            contenders = {"engine": _engine_rate(fp32, prompts, new_tokens), "hf": _hf_rate(model, prompts, new_tokens)}
            if batch == 64:
                contenders["int8"] = _engine_rate(int8, prompts, new_tokens)
            rates = _best_alternating(contenders, rounds)
            metrics[f"{name}_b{batch}_engine_tok_per_s"] = rates["engine"]
            metrics[f"{name}_b{batch}_hf_tok_per_s"] = rates["hf"]
            if batch == 64:
                metrics[f"{name}_b{batch}_engine_int8_tok_per_s"] = rates["int8"]
    return metrics


def _lora_decode(model, model_dir: str) -> dict[str, float]:
    """INT8 decode tok/s at batch 32 with and without rank-16 adapters on every decoder linear, alternating: the
    adapters in int8 as the learner publishes them by default (`model.lora.sync_dtype`, run as they are where
    csrc/lora_gemm.cpp's `lr_apply_q8` does), and in fp32 (`..._fp32_adapters_tok_per_s`)."""
    from asyncrl.bench.sync_bench import LORA_SYNC_DTYPE

    batch, prompts = 32, _prompts(model, 32)
    state = {name: value.cpu() for name, value in model.state_dict().items()}
    engines = {
        "base": built_engine(model, model_dir, "int8", max_batch=batch),
        "lora": built_engine(
            model, model_dir, "int8", adapters=lora_adapter_tensors(state, sync_dtype=LORA_SYNC_DTYPE), max_batch=batch
        ),  # fmt: skip
        "fp32": built_engine(model, model_dir, "int8", adapters=lora_adapter_tensors(state), max_batch=batch),
    }
    new_tokens = LORA_NEW_TOKENS  # --quick too: with 6 tokens the ratio was noise
    rates = _best_alternating({k: _engine_rate(e, prompts, new_tokens) for k, e in engines.items()}, LORA_ROUNDS)
    return {f"big_b{batch}_int8_lora_base_tok_per_s": rates["base"],
            f"big_b{batch}_int8_lora{LORA_RANK}_tok_per_s": rates["lora"],
            f"big_b{batch}_int8_lora{LORA_RANK}_fp32_adapters_tok_per_s": rates["fp32"]}  # fmt: skip


def run(quick: bool) -> BenchResult:
    cap = os.environ.get(ENV_BENCH_ISA, "")
    if cap and cap not in ISA_CAP_ENV:
        raise ValueError(f"{ENV_BENCH_ISA}={cap!r} is not one of {', '.join(ISA_CAP_ENV)}")
    if cap and any(os.environ.get(key) != value for key, value in ISA_CAP_ENV[cap].items()):
        return run_capped(cap, quick)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like a rollout worker (rollout.threads); 2 threads on a shared 2-core box thrash
    try:
        check = isa_cap_check(cap) if cap else {}
        result = _run(quick)
    finally:
        torch.set_num_threads(threads)
    result.details.update(isa_cap=cap or "none", **({"isa_cap_check": check} if cap else {}))
    return result


def main(argv: list[str] | None = None) -> int:
    """`python -m asyncrl.bench.engine_bench [--quick] [--json PATH]`: the bench in this process (as `asyncrl bench
    engine` runs it; `ASYNCRL_BENCH_ISA` re-runs it capped), its JSON written to PATH."""
    parser = argparse.ArgumentParser(prog="python -m asyncrl.bench.engine_bench", description=main.__doc__)
    parser.add_argument("--quick", action="store_true", help="only the pairs the ratios need")
    parser.add_argument("--json", dest="json_path", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    from asyncrl.bench import write_json

    result = run(args.quick)
    if args.json_path:
        write_json(result, args.json_path)
    return 0


def _run(quick: bool) -> BenchResult:
    from rollout_workers.embedded import fp8_linear, fused_decode, weight_only

    torch.manual_seed(0)
    rounds = 1 if quick else 3
    peaks = machine_peaks(quick)
    isa = cpu_isa()
    metrics: dict[str, float] = {**peaks, **{f"cpu_{flag}": float(present) for flag, present in isa.items()}}
    with tempfile.TemporaryDirectory() as big_dir, tempfile.TemporaryDirectory() as smol_dir:
        models = {"tiny": _tiny_model(), "big": (_random_llama(big_dir, BIG_SHAPE), big_dir)}
        models["smol"] = (_random_llama(smol_dir, SMOL_SHAPE), smol_dir)
        metrics.update(_engine_vs_hf(models, rounds, quick))
        grid = QUICK_GRID if quick else tuple((m, b, SCHEMES) for m in ("tiny", "big", "smol") for b in BATCHES)
        scheme_metrics, kernels = _scheme_rows(models, grid, rounds, quick, peaks)
        metrics.update(scheme_metrics)
        big, _ = models["big"]
        metrics.update(_lora_decode(big, big_dir))
        max_gap, median_gap, swaps = _swap_gaps(big, big_dir, 16 if quick else 64, 28 if quick else 48, 5)
    metrics.update(swap_max_gap_s=max_gap, swap_median_gap_s=median_gap, swaps_applied=float(swaps))
    ratios = {
        "engine_vs_hf_b1": metrics["tiny_b1_engine_tok_per_s"] / metrics["tiny_b1_hf_tok_per_s"],
        "engine_vs_hf_b64": min(
            metrics[f"{m}_b64_engine_tok_per_s"] / metrics[f"{m}_b64_hf_tok_per_s"] for m in ("tiny", "big")
        ),
    }
    ratios["engine_int8_vs_hf_b64"] = min(
        metrics[f"{name}_b64_engine_int8_tok_per_s"] / metrics[f"{name}_b64_hf_tok_per_s"] for name in ("tiny", "big")
    )
    ratios["int8_vs_fp32_b32"] = metrics["big_b32_int8_tok_per_s"] / metrics["big_b32_fp32_tok_per_s"]
    ratios["smol_int8_vs_fp32_b32"] = metrics["smol_b32_int8_tok_per_s"] / metrics["smol_b32_fp32_tok_per_s"]
    ratios["w8a16_vs_fp32_b1"] = metrics["big_b1_w8a16_tok_per_s"] / metrics["big_b1_fp32_tok_per_s"]
    ratios["swap_max_gap_over_median"] = max_gap / median_gap
    ratios["lora_decode_overhead"] = (
        metrics["big_b32_int8_lora_base_tok_per_s"] / metrics[f"big_b32_int8_lora{LORA_RANK}_tok_per_s"] - 1.0
    )
    details = {
        "cpu_isa": [flag for flag, present in isa.items() if present],
        "kernels": kernels,
        "kernel_by_scheme": {
            "int8": int8_kernel(),
            "lora_int8": lora_int8_kernel(),
            "w8a16": weight_only.kernel_name(),
            "w4a16": weight_only.kernel_name(),
            "fp8": fp8_linear.fp8_kernel_name(),
            "attention_isa": str(fused_decode.attention_isa()),
        },
        "device": str(_device()),
        "lm_head": {scheme: "quantized" if _head_quantized(scheme) else "fp32" for scheme in SCHEMES},
    }
    return BenchResult(name="engine", metrics=metrics, ratios=ratios, details=details)


if __name__ == "__main__":
    sys.exit(main())
