"""The weight-only (w8a16 / w4a16) kernels: every path against dequantize-then-matmul, dispatch, the engine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from quant_sync.export import export_rollout_tensors
from quant_sync.quantizers import dequantize_published, quantize_weight_only
from quant_sync.update import WeightUpdate
from rollout_workers.embedded import weight_only
from rollout_workers.embedded.engine import EmbeddedEngine, build_weight_map
from rollout_workers.embedded.weight_only import GroupQuantized, PackedWeightOnly, weight_only_linear
from rollout_workers.embedded.weight_only import pack_weight_only as pack
from rollout_workers.engine import SamplingParams

SCHEMES = ("w8a16", "w4a16")
QMAX = {"w8a16": 127, "w4a16": 7}
PATHS = weight_only.available_kernels()
RANDOM_TOLERANCE = 5e-7
"""On random operands |kernel - reference| <= this x sum_k |x_k w_k| (measured: up to 1e-7; fp32's epsilon is 6e-8)."""


def worst_case_tolerance(in_features: int) -> float:
    """Two fp32 sums of the same K products in different orders differ by at most 2 K u sum_k |x_k w_k| (u = 2^-24,
    the textbook bound for recursive summation), reached on adversarial operands such as K equal terms."""
    return 2 * (in_features + 1) * 2.0**-24


def _assert_matches_dequantized_matmul(x, q, scale, scheme, bias, path, tolerance=RANDOM_TOLERANCE):
    weight = dequantize_published(q, scale, scheme)
    out = weight_only_linear(x, pack(GroupQuantized(q, scale, scheme), path), bias)
    reference = F.linear(x, weight, bias)
    magnitude = (x.abs().double() @ weight.abs().double().t()).float() + (0 if bias is None else bias.abs())
    gap = (out - reference).abs()
    assert out.dtype == torch.float32 and out.shape == reference.shape
    assert bool((gap <= tolerance * magnitude).all()), (path, float((gap / magnitude.clamp_min(1e-30)).max()))


def test_the_compiled_kernels_build_on_this_machine():
    """gcc is on every machine we run: a missing compiled path would silently fall back to the slow torch one."""
    assert PATHS[-1] == "torch" and "reference" in PATHS and weight_only._Library.error == ""


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(
    ("out_features", "in_features", "rows"),
    [(1, 1, 1), (1, 300, 1), (5, 128, 2), (7, 130, 3), (33, 1000, 5), (64, 1024, 1), (9, 257, 17), (4, 2816, 4)],
)
def test_every_path_equals_dequantize_then_matmul_on_random_operands(path, scheme, out_features, in_features, rows):
    generator = torch.Generator().manual_seed(out_features * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=generator) * torch.rand(out_features, 1) * 3
    q, scale = quantize_weight_only(weight, scheme)
    x = torch.randn(rows, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    _assert_matches_dequantized_matmul(x, q, scale, scheme, bias if out_features % 2 else None, path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_path_on_adversarial_operands(path, scheme):
    """Every weight at +-qmax (both signs, and one sign throughout), huge and tiny scales, large activations, odd K."""
    qmax, in_features = QMAX[scheme], 389  # 3 full groups and a partial one; not a multiple of 64 either
    signs = torch.where(torch.arange(in_features) % 3 == 0, -1, 1).to(torch.int8)
    q = torch.stack([signs * qmax, torch.full((in_features,), qmax), torch.full((in_features,), -qmax),
                     torch.zeros(in_features, dtype=torch.int8)]).to(torch.int8)  # fmt: skip
    groups = -(-in_features // 128)
    scale = torch.tensor([[1e30, 1e-30, 1.0, 3.0], [1e-3] * groups, [7.5] * groups, [2.0] * groups])[:, :groups]
    x = torch.stack([torch.full((in_features,), 1e4), torch.linspace(-1e3, 1e3, in_features), -torch.ones(in_features)])
    tolerance = worst_case_tolerance(in_features)
    _assert_matches_dequantized_matmul(x, q, scale.contiguous(), scheme, None, path, tolerance)
    # one output row (N = 1), one input
    _assert_matches_dequantized_matmul(
        x[:1, :1], q[:1, :1], scale[:1, :1].contiguous(), scheme, None, path, worst_case_tolerance(1)
    )


def test_int4_packing_keeps_every_value_and_its_position():
    q = (torch.arange(7 * 200) % 15 - 7).to(torch.int8).view(7, 200)  # every int4 value, at every position mod 64
    scale = torch.ones(7, 2)
    x = torch.eye(200)  # row k of the output is column k of the weight
    for path in PATHS:
        out = weight_only_linear(x, pack(GroupQuantized(q, scale, "w4a16"), path), None)
        assert torch.equal(out, q.t().to(torch.float32)), path


@pytest.mark.parametrize("path", PATHS)
def test_forcing_a_path_through_the_environment(monkeypatch, path):
    monkeypatch.setenv(weight_only.ENV_KERNEL, path)
    generator = torch.Generator().manual_seed(94)
    q, scale = quantize_weight_only(torch.randn(8, 200, generator=generator), "w8a16")
    packed = pack(GroupQuantized(q, scale, "w8a16"))
    assert weight_only.kernel_name() == path and isinstance(packed, PackedWeightOnly) and packed.kernel == path
    x = torch.randn(2, 200, generator=generator)
    # the summation-order bound, not assert_close's fixed tolerance: that one failed about 1 draw in 200 on
    # unseeded operands (err up to 1.5x it over 3000 draws, every path), a sum of 200 products in another order
    weight = dequantize_published(q, scale, "w8a16")
    gap = (weight_only_linear(x, packed, None) - F.linear(x, weight)).abs()
    assert bool((gap <= worst_case_tolerance(200) * (x.abs() @ weight.abs().t())).all())


def test_the_default_path_is_the_best_available_and_bad_names_fail(monkeypatch):
    monkeypatch.delenv(weight_only.ENV_KERNEL, raising=False)
    assert weight_only.kernel_name() == PATHS[0]
    monkeypatch.setenv(weight_only.ENV_KERNEL, "avx1024")
    with pytest.raises(ValueError, match="ASYNCRL_WO_KERNEL"):
        weight_only.kernel_name()
    missing = [name for name in weight_only.KERNELS if name not in PATHS]
    for name in missing:  # e.g. avx512 on an AVX2-only machine: refused, never run (it would crash the process)
        monkeypatch.setenv(weight_only.ENV_KERNEL, name)
        with pytest.raises(ValueError, match="runs only"):
            weight_only.kernel_name()


def test_a_fresh_cache_builds_the_library_once_and_reuses_it(tmp_path):
    code = "from rollout_workers.embedded import weight_only as w; print(w.available_kernels(), w._Library.error)"
    env = {**os.environ, "ASYNCRL_CACHE": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0 and "reference" in first.stdout, first.stderr
    built = list((tmp_path / "kernels").glob("weight_only-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert second.stdout == first.stdout and built[0].stat().st_mtime_ns == stamp
    assert list((tmp_path / "kernels").iterdir()) == built  # no temporary left behind


def test_the_engine_keeps_weight_only_matrices_quantized():
    state = {"model.layers.0.mlp.up_proj.weight": torch.randn(8, 256)}
    weights = build_weight_map(WeightUpdate(0, export_rollout_tensors(state, "w4a16"), "w4a16"))
    published = weights["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(published, GroupQuantized) and published.q.dtype == torch.int8
    assert published.q.abs().max() <= 7 and published.scale.shape == (8, 2)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_aligned_learner_logp_matches_the_weight_only_engine(monkeypatch, path, scheme):
    """QaRL for weight-only schemes: the learner's fp32 matmul on the dequantized weight reproduces the engine's
    fused kernel (another summation order) to 1e-5 in log-prob, on every dispatch path."""
    from transformers import AutoModelForCausalLM

    from common.builtin_model import resolve_model_path
    from learner.aligned import make_rollout_aligned

    monkeypatch.setenv(weight_only.ENV_KERNEL, path)
    model_dir = resolve_model_path("builtin:micro", log=lambda *_: None)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine = EmbeddedEngine(str(model_dir), seed=0)
    engine.stage_weights(WeightUpdate(0, export_rollout_tensors(model.state_dict(), scheme), scheme))
    prompts = [[1, 4, 5, 13, 6, 7, 15], [1, 9, 14, 3, 15]]
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=10, seed=1))
    assert isinstance(engine._weights.layers[0].gate_up, PackedWeightOnly)
    assert engine._weights.layers[0].gate_up.kernel == path
    make_rollout_aligned(model, scheme)
    gap = 0.0
    for prompt, completion in zip(prompts, completions):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion.response_ids])).logits[0]
        logp = logits.log_softmax(-1)[len(prompt) - 1 : -1].gather(1, torch.tensor(completion.response_ids)[:, None])
        gap = max(gap, float((logp.squeeze(1) - torch.tensor(completion.behav_logp)).abs().max()))
    assert gap < 1e-5, gap
