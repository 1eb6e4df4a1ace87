"""`asyncrl bench sync`: its LoRA rows (an adapter-only version against the full INT8 one, through a real publisher),
and its sync phase with real worker processes."""

from __future__ import annotations

import math

import pytest
from transformers import AutoModelForCausalLM

from asyncrl.bench import sync_bench
from asyncrl.bench.engine_bench import LORA_RANK, lora_adapter_tensors
from common.builtin_model import resolve_model_path
from quant_sync.export import export_rollout_tensors, pack_adapters


def test_the_lora_sync_rows_count_the_adapter_version_against_the_full_int8_one():
    model_dir = str(resolve_model_path("builtin:micro", log=lambda *_: None))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows = sync_bench._lora_sync(model)
    state = model.state_dict()
    full = export_rollout_tensors(state, "int8", quantize_head=True)
    adapters = lora_adapter_tensors(state, sync_dtype=sync_bench.LORA_SYNC_DTYPE)
    packed = pack_adapters(adapters)  # as learner/lora.py publishes an adapter-only version
    assert rows["big_full_version_bytes"] == sum(t.nbytes for t in full.values())
    assert rows[f"big_lora{LORA_RANK}_version_bytes"] == sum(t.nbytes for t in packed.values())
    assert 0 < sum(t.nbytes for t in packed.values()) - sum(t.nbytes for t in adapters.values()) < 8192  # index
    fp32, bf16, int8 = (rows[f"big_lora{LORA_RANK}_{dtype}_version_bytes"] for dtype in ("fp32", "bf16", "int8"))
    for dtype, published in zip(("fp32", "bf16", "int8"), (fp32, bf16, int8), strict=True):
        expected = pack_adapters(lora_adapter_tensors(state, sync_dtype=dtype))
        assert published == sum(t.nbytes for t in expected.values()), dtype
    assert int8 < bf16 < fp32
    payload = {d: sum(t.nbytes for t in lora_adapter_tensors(state, sync_dtype=d).values()) for d in ("fp32", "int8")}
    assert payload["int8"] < 0.3 * payload["fp32"]  # 1 byte a value plus one float32 scale per rank component
    assert rows["big_full_publish_call_s"] > 0 and rows[f"big_lora{LORA_RANK}_publish_call_s"] > 0


def test_extra_cpu_per_version_splits_the_decode_thread_from_the_others():
    # 10 steps of 8 tokens at 1 s each; steady (steps 1-4): 0.010 s decode + 0.001 s other CPU a step; sync (steps
    # 5-9): 0.013 s decode + 0.003 s other a step, with 2 versions applied
    stamps = [float(i) for i in range(10)]
    tokens = [8] * 10
    decode_step = [0.010] * 5 + [0.013] * 5
    other_step = [0.001] * 5 + [0.003] * 5
    decode_cpu = [sum(decode_step[: i + 1]) for i in range(10)]
    cpu = [decode_cpu[i] + sum(other_step[: i + 1]) for i in range(10)]
    decode, other = sync_bench._extra_cpu_per_version(stamps, tokens, cpu, decode_cpu, [(0.5, 4.5)], [(4.5, 9.5)], 2)
    # 5 sync steps, each 0.003 s (decode) and 0.002 s (other) above steady: over 2 versions
    assert decode == pytest.approx(5 * 0.003 / 2)
    assert other == pytest.approx(5 * 0.002 / 2)


def test_interleaved_windows_add_up_as_one_window_of_their_steps():
    # 12 steps of 1 s; tokens 8 a step in steady blocks (steps 1-3, 7-9), 6 in sync blocks (steps 4-6, 10-11);
    # sync steps cost 0.002 s more decode CPU than steady ones, over 3 versions
    stamps = [float(i) for i in range(12)]
    tokens = [8, 8, 8, 8, 6, 6, 6, 8, 8, 8, 6, 6]
    steady, sync = [(0.5, 3.5), (6.5, 9.5)], [(3.5, 6.5), (9.5, 11.5)]
    decode_step = [0.010 if n == 8 else 0.012 for n in tokens]
    decode_cpu = [sum(decode_step[: i + 1]) for i in range(12)]
    assert sync_bench._rate(stamps, tokens, steady) == pytest.approx(48 / 6)
    assert sync_bench._rate(stamps, tokens, sync) == pytest.approx(30 / 5)
    assert sync_bench._per_cpu_second(stamps, tokens, decode_cpu, sync) == pytest.approx(30 / (5 * 0.012))
    decode, other = sync_bench._extra_cpu_per_version(stamps, tokens, decode_cpu, decode_cpu, steady, sync, 3)
    # 5 sync steps at 0.012 s against 30 tokens at steady's 0.010 s per 8 tokens
    assert decode == pytest.approx((5 * 0.012 - 30 * 0.010 / 8) / 3)
    assert other == pytest.approx(0.0)
    assert sync_bench._gap_ratio(stamps, sync) == pytest.approx(1.0)  # no gap spans two windows


@pytest.mark.slow
def test_the_quick_sync_phase_reports_every_worker_figure(tmp_path):
    model_dir = str(resolve_model_path("builtin:tiny", log=lambda *_: None))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    figures = sync_bench._measure("tiny", model, model_dir, quick=True)
    assert figures["tiny_versions_published"] >= 2
    assert figures["tiny_rounds"] == sync_bench.QUICK_ROUNDS  # steady and sync blocks alternate
    assert 0 < figures["tiny_tok_s_ratio_round_min"] <= figures["tiny_tok_s_ratio_round_max"]
    assert figures["tiny_steady_tok_per_s"] > 0 and figures["tiny_sync_tok_per_s"] > 0
    assert figures["tiny_tok_s_ratio_worst_worker"] > 0 and figures["tiny_tok_per_cpu_s_ratio_worst_worker"] > 0
    assert figures["tiny_publish_latency_median_s"] <= figures["tiny_publish_latency_max_s"]
    lost = figures["tiny_decode_s_lost_per_version"]  # the ratio's loss spread over the versions of its window
    assert math.isfinite(lost) and (lost > 0) == (figures["tiny_tok_s_ratio_worst_worker"] < 1)
    for key in ("decode_thread", "other_threads"):
        assert math.isfinite(figures[f"tiny_{key}_cpu_per_version_s"]), key
    # the subscriber's work (fetch, checksums, stage) lands on the other threads: something per version
    assert figures["tiny_other_threads_cpu_per_version_s"] > 0
    assert figures["tiny_publisher_cpu_per_version_s"] > 0  # every publish hashes and writes the version


def test_the_sync_bench_names_the_isa_and_the_kernels_it_ran():
    from asyncrl.bench.engine_bench import int8_kernel
    from rollout_workers.embedded.low_rank import _native_lora
    from rollout_workers.embedded.low_rank import int8_kernel as lora_kernel

    details = sync_bench._details()
    assert "avx2" in details["cpu_isa"] or not details["cpu_isa"]  # x86 CI machines have AVX2
    assert details["kernel_by_scheme"] == {"int8": int8_kernel(), "lora_int8": lora_kernel() or "torch"}
    assert ("lr_apply_q8" in details["lora_kernel"]) == (_native_lora() is not None)  # AVX-512F and a compiler
    assert ("lr_apply_q8_amx" in details["lora_kernel"]) == (lora_kernel() == "amx")  # AMX-BF16 tiles


@pytest.mark.slow
def test_the_control_measures_the_idle_ratio_both_ways():
    model_dir = str(resolve_model_path("builtin:tiny", log=lambda *_: None))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    figures = sync_bench._measure("tiny", model, model_dir, quick=True, publish=False)
    assert set(figures) == {f"tiny_control_{way}_tok_s_ratio_worst_worker" for way in ("interleaved", "sequential")}
    # nothing published: the workers decode at the same speed in both phases, whichever way it is cut
    assert all(0.5 < value < 2.0 for value in figures.values()), figures
