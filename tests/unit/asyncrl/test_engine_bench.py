"""`asyncrl bench engine`'s arithmetic: weight traffic, roofline, decode rate, and what it reports about the CPU."""

from __future__ import annotations

import pytest
import torch

from asyncrl.bench import engine_bench


def _state(tied: bool) -> dict[str, torch.Tensor]:
    state = {
        "model.embed_tokens.weight": torch.zeros(50, 128),
        "model.norm.weight": torch.ones(128),
        "model.layers.0.input_layernorm.weight": torch.ones(128),
        "model.layers.0.mlp.up_proj.weight": torch.randn(256, 128),
    }
    if not tied:
        state["lm_head.weight"] = torch.zeros(50, 128)
    return state


@pytest.mark.parametrize("tied", [False, True])
def test_weight_traffic_counts_what_a_decode_step_reads(tied):
    """The LM head (the embedding when tied) and the decoder linears in the scheme's format (the head quantized for
    the W8A8 schemes, as `quant.lm_head=auto` publishes it); never the gathered embedding rows; 2 FLOPs per
    multiply-accumulate of the linears and the head."""
    head, norms = 50 * 128 * 4, 2 * 128 * 4
    read, flops = engine_bench.weight_traffic(_state(tied), "none")
    assert read == head + norms + 256 * 128 * 4 and flops == 2 * (50 * 128 + 256 * 128)
    int8, int8_flops = engine_bench.weight_traffic(_state(tied), "int8")
    assert int8 == 50 * 128 + 50 * 4 + norms + 256 * 128 + 256 * 4  # int8 values and one fp32 scale per row
    assert int8_flops == flops
    int4, _ = engine_bench.weight_traffic(_state(tied), "w4a16")
    assert int4 == head + norms + 256 * 128 + 256 * 1 * 4  # published as int8 (one group of 128 per row)


def test_roofline_fraction_is_the_lower_bound_of_memory_and_compute():
    peaks = {"bandwidth_gb_per_s": 10.0, "fp32_gemm_gflop_per_s": 100.0, "int8_gemm_gop_per_s": 400.0,
             "bf16_gemm_gflop_per_s": 200.0}  # fmt: skip
    traffic = (1e9, 1e9)  # 1 GB per step, 1 GFLOP per token
    # batch 1: memory allows 10 tok/s, compute 100: the bound is 10
    assert engine_bench.roofline_fraction(5.0, 1, traffic, peaks, "none") == pytest.approx(0.5)
    # batch 64: memory allows 640 tok/s, fp32 compute 100 (int8: 400)
    assert engine_bench.roofline_fraction(50.0, 64, traffic, peaks, "none") == pytest.approx(0.5)
    assert engine_bench.roofline_fraction(200.0, 64, traffic, peaks, "int8") == pytest.approx(0.5)
    assert engine_bench.roofline_fraction(100.0, 64, traffic, peaks, "fp8") == pytest.approx(0.5)  # bf16 products


def test_the_decode_rate_takes_each_call_time_at_its_least_disturbed_round():
    rounds = [engine_bench.Timing(4, 11, 0.5, 2.0), engine_bench.Timing(4, 11, 0.2, 3.0)]
    assert engine_bench._decode_rate(rounds) == pytest.approx(4 * 10 / (2.0 - 0.2))


def test_the_cpu_isa_is_read_from_cpuinfo():
    isa = engine_bench.cpu_isa()
    assert set(isa) == set(engine_bench.CPU_FLAGS) and all(isinstance(v, bool) for v in isa.values())
    with open("/proc/cpuinfo") as cpuinfo:
        flags = next(line for line in cpuinfo if line.startswith("flags")).split()
    assert isa["avx2"] == ("avx2" in flags) and isa["avx512_vnni"] == ("avx512_vnni" in flags)


def test_the_kernel_each_scheme_runs_is_named():
    from transformers import AutoModelForCausalLM

    from common.builtin_model import resolve_model_path
    from rollout_workers.embedded import weight_only

    model_dir = str(resolve_model_path("builtin:micro", log=lambda *_: None))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert engine_bench.kernel_of(engine_bench.built_engine(model, model_dir, "w8a16")) == (
        f"weight_only:{weight_only.kernel_name()}"
    )
    assert engine_bench.kernel_of(engine_bench.built_engine(model, model_dir, "int8")).startswith("int8:")
    assert engine_bench.kernel_of(engine_bench.built_engine(model, model_dir, "fp8")).startswith("fp8:")
    assert "batch-invariant" in engine_bench.kernel_of(engine_bench.built_engine(model, model_dir, "none"))
    assert engine_bench.int8_kernel() != "unknown"


def test_the_lora_rows_adapters_sit_on_every_decoder_linear_as_the_learner_publishes_them():
    from common.config_schema import LORA_TARGETS
    from quant_sync.export import LORA_A, LORA_B, LORA_SCALING

    state = {**_state(tied=False), "model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 128)}
    adapters = engine_bench.lora_adapter_tensors(state, rank=4, alpha=8.0)
    linears = {"model.layers.0.mlp.up_proj", "model.layers.0.self_attn.q_proj"}
    assert set(adapters) == {name + suffix for name in linears for suffix in (LORA_A, LORA_B, LORA_SCALING)}
    assert adapters["model.layers.0.mlp.up_proj" + LORA_A].shape == (4, 128)
    assert adapters["model.layers.0.mlp.up_proj" + LORA_B].shape == (256, 4)
    assert adapters["model.layers.0.self_attn.q_proj" + LORA_SCALING].tolist() == [2.0]
    assert all(t.dtype == torch.float32 for t in adapters.values()) and "up_proj" in LORA_TARGETS
    with pytest.raises(ValueError, match="no linear named like"):
        engine_bench.lora_adapter_tensors({"model.norm.weight": torch.ones(8)})


def test_the_lora_decode_row_runs_every_engine_on_the_same_prompts():
    from transformers import AutoModelForCausalLM

    from common.builtin_model import resolve_model_path

    model_dir = str(resolve_model_path("builtin:micro", log=lambda *_: None))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows = engine_bench._lora_decode(model, model_dir)
    lora = f"big_b32_int8_lora{engine_bench.LORA_RANK}"
    assert set(rows) == {"big_b32_int8_lora_base_tok_per_s", f"{lora}_tok_per_s", f"{lora}_fp32_adapters_tok_per_s"}
    assert all(rate > 0 for rate in rows.values())
