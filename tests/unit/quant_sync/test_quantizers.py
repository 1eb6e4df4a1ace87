"""Quantizers: ALGORITHMS.md rounding rules, exact int8 GEMM, fp8 truncation direction, export layout."""

from __future__ import annotations

import pytest
import torch

from quant_sync.export import export_rollout_tensors, is_quantized_linear
from quant_sync.quantizers import (
    fp8_round_toward_zero,
    int8_matmul,
    quantize_fp8_rows,
    quantize_int8_rows,
    quantize_weight,
    quantized_linear,
)


def test_int8_per_channel_scale_and_rounding():
    w = torch.tensor([[1.0, -0.5, 0.25, 0.0], [-2.0, 1.0, 0.006, 0.0]])
    q, scale = quantize_int8_rows(w)
    assert torch.allclose(scale, torch.tensor([1.0 / 127, 2.0 / 127]))
    assert q.dtype == torch.int8
    assert q[0].tolist() == [127, -64, 32, 0]  # -63.5 rounds half to even -> -64; 31.75 -> 32
    assert q[1].tolist() == [-127, 64, 0, 0]  # 63.5 -> 64 (half to even); 0.381 -> 0
    assert int(q.abs().max()) <= 127


def test_int8_matmul_is_exact_for_small_and_large_batches():
    gen = torch.Generator().manual_seed(0)
    b = torch.randint(-127, 128, (24, 64), dtype=torch.int8, generator=gen)
    for rows in (1, 5, 17, 40):
        a = torch.randint(-127, 128, (rows, 64), dtype=torch.int8, generator=gen)
        assert torch.equal(int8_matmul(a, b), (a.long() @ b.long().t()).int())


def test_fp8_nearest_and_truncation_direction():
    x = torch.linspace(-500, 500, 2001)
    nearest = x.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    trunc = fp8_round_toward_zero(x).float()
    assert torch.all(trunc.abs() <= x.abs().clamp(max=448))  # never rounds away from zero
    assert torch.all((trunc == nearest) | (trunc.abs() < nearest.abs()))  # differs only where nearest rounded up
    assert bool((trunc != nearest).any())
    # 19 lies halfway between the fp8 neighbours 18 and 20: nearest-even gives 20, truncation 18
    assert fp8_round_toward_zero(torch.tensor([19.0, -19.0])).float().tolist() == [18.0, -18.0]
    assert torch.tensor([19.0, -19.0]).to(torch.float8_e4m3fn).float().tolist() == [20.0, -20.0]
    q, scale = quantize_fp8_rows(torch.tensor([[448.0, 1.0]]))
    assert float(scale) == 1.0 and q.float().tolist() == [[448.0, 1.0]]


def test_quantized_linear_close_to_float():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(32, 64, generator=gen)
    x = torch.randn(8, 64, generator=gen)
    ref = x @ w.t()
    for scheme, tol in (("int8", 0.03), ("fp8", 0.08), ("fp8_trunc", 0.15)):
        out = quantized_linear(x, quantize_weight(w, scheme))
        rel = float((out - ref).norm() / ref.norm())
        assert rel < tol, (scheme, rel)


def test_export_quantizes_only_decoder_linears():
    state = {
        "model.embed_tokens.weight": torch.randn(10, 8),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8),
        "model.layers.0.input_layernorm.weight": torch.ones(8),
        "model.norm.weight": torch.ones(8),
    }
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied
    out = export_rollout_tensors(state, "int8")
    assert out["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    assert out["model.layers.0.self_attn.q_proj.weight_scale"].shape == (8,)
    assert out["model.embed_tokens.weight"].dtype == torch.float32
    assert "lm_head.weight" not in out
    assert is_quantized_linear("model.layers.3.mlp.down_proj.weight")
    assert not is_quantized_linear("model.layers.3.input_layernorm.weight")
    plain = export_rollout_tensors(state, "none")
    assert all(t.dtype == torch.float32 for t in plain.values())


@pytest.mark.parametrize("tied", [True, False])
def test_export_quantizes_the_lm_head_on_request_and_keeps_the_embedding_float(tied):
    from quant_sync.quantizers import quantize_weight

    embed = torch.randn(10, 8)
    state = {"model.embed_tokens.weight": embed, "model.layers.0.mlp.up_proj.weight": torch.randn(12, 8)}
    state["lm_head.weight"] = embed if tied else torch.randn(10, 8)
    out = export_rollout_tensors(state, "int8", quantize_head=True)
    expected = quantize_weight(state["lm_head.weight"], "int8")
    assert torch.equal(out["lm_head.weight"], expected.q) and torch.equal(out["lm_head.weight_scale"], expected.scale)
    assert out["model.embed_tokens.weight"].dtype == torch.float32 and torch.equal(
        out["model.embed_tokens.weight"], embed
    )
    del state["lm_head.weight"]  # a tied state dict that lists the matrix once: the head is the embedding
    if tied:
        assert torch.equal(export_rollout_tensors(state, "int8", quantize_head=True)["lm_head.weight"], expected.q)
    assert "lm_head.weight_scale" not in export_rollout_tensors(state, "none", quantize_head=True)
    assert is_quantized_linear("lm_head.weight", head=True) and not is_quantized_linear("lm_head.weight")


def test_weight_only_groups_of_128():
    from quant_sync.quantizers import dequantize_published, quantize_weight_only

    gen = torch.Generator().manual_seed(2)
    w = torch.randn(4, 300, generator=gen)
    w[0, 130] = 10.0  # an outlier only widens the scale of its own group
    for scheme, qmax, tol in (("w8a16", 127, 0.01), ("w4a16", 7, 0.2)):
        q, scale = quantize_weight_only(w, scheme)
        assert q.dtype == torch.int8 and q.shape == w.shape and scale.shape == (4, 3)
        assert int(q.abs().max()) <= qmax
        assert float(scale[0, 1]) == pytest.approx(10.0 / qmax)
        assert float(scale[0, 0]) == pytest.approx(float(w[0, :128].abs().max()) / qmax)
        deq = dequantize_published(q, scale, scheme)
        assert float((deq - w).norm() / w.norm()) < tol
        assert torch.all((deq - w).abs() <= scale.repeat_interleave(128, 1)[:, :300] / 2 + 1e-6)  # round to nearest


def test_weight_only_export_and_engine_weights():
    from quant_sync.update import WeightUpdate
    from rollout_workers.embedded.engine import build_weight_map

    state = {"model.layers.0.mlp.up_proj.weight": torch.randn(8, 256)}
    out = export_rollout_tensors(state, "w4a16")
    assert out["model.layers.0.mlp.up_proj.weight_scale"].shape == (8, 2)
    weights = build_weight_map(WeightUpdate(0, out, "w4a16"))
    deq = weights["model.layers.0.mlp.up_proj.weight"].dequantize()  # kept quantized (GroupQuantized) by the engine
    assert deq.dtype == torch.float32 and float((deq - state["model.layers.0.mlp.up_proj.weight"]).abs().max()) < 0.5


@pytest.mark.parametrize("scheme", ["int8", "fp8", "fp8_trunc"])
def test_a_tiny_row_gets_its_own_scale_and_a_zero_row_stays_zero(scheme):
    """s = max|row| / qmax however small (ALGORITHMS.md has no floor); an all-zero row quantizes to zeros."""
    from quant_sync.quantizers import FP8_E4M3_MAX, INT8_MAX

    weight = torch.tensor([[3e-13, -1e-13, 2e-13, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, -0.5, 0.25, 0.0]])
    quantized = quantize_weight(weight, scheme)
    qmax = INT8_MAX if scheme == "int8" else FP8_E4M3_MAX
    assert quantized.scale[0] == torch.tensor(3e-13) / qmax and quantized.scale[2] == 1.0 / qmax
    assert torch.equal(quantized.q[1].to(torch.float32), torch.zeros(4))
    dequantized = quantized.dequantize()
    assert (dequantized[0] - weight[0]).abs().max() <= 0.07 * 3e-13  # the tiny row keeps its shape


@pytest.mark.parametrize("scheme", ["int8", "fp8", "fp8_trunc"])
def test_a_weight_quantized_in_blocks_of_rows_has_the_whole_matrixs_bits(scheme, monkeypatch):
    from quant_sync import quantizers

    monkeypatch.setattr(quantizers, "WEIGHT_CHUNK_ELEMENTS", 3 * 40)  # blocks of 3 rows: 4 blocks, the last of 1
    weight = torch.randn(10, 40, generator=torch.Generator().manual_seed(3)) * 0.05
    weight[4] = 0.0  # a zero row inside a block
    weight[9, 7] = 3.0  # the last block's row with its own large scale
    blocked = quantizers.quantize_weight(weight, scheme)
    monkeypatch.setattr(quantizers, "WEIGHT_CHUNK_ELEMENTS", 1 << 30)  # one block: the whole matrix at once
    whole = quantizers.quantize_weight(weight, scheme)
    assert blocked.q.dtype == whole.q.dtype and blocked.q.shape == whole.q.shape
    assert torch.equal(blocked.q.view(torch.uint8), whole.q.view(torch.uint8))
    assert torch.equal(blocked.scale, whole.scale) and blocked.scale.shape == (10,)


def test_a_tied_head_gathered_as_a_copy_is_not_published_again():
    """FSDP2's gathered state dict holds the tied head as a copy of the embedding (its own memory): the pointer check
    missed it and every version carried an extra fp32 head (vocab x hidden x 4 bytes)."""
    embed = torch.randn(16, 8)
    state = {"model.embed_tokens.weight": embed, "lm_head.weight": embed.clone(), "model.norm.weight": torch.ones(8)}
    for scheme in ("none", "w4a16", "int8"):
        assert "lm_head.weight" in export_rollout_tensors(state, scheme)  # untied as far as it knows
        published = export_rollout_tensors(state, scheme, tied_head=True)
        assert set(published) == {"model.embed_tokens.weight", "model.norm.weight"}
    head = export_rollout_tensors(state, "int8", quantize_head=True, tied_head=True)  # a quantized head still goes
    assert {"lm_head.weight", "lm_head.weight_scale"} <= set(head)
