"""SGLang checkpoint layouts: shapes, dtypes, names and round-trip accuracy."""

from __future__ import annotations

import pytest
import torch

from quant_sync.sglang_formats import (
    dequantize_fp8_blocks,
    export_sglang,
    quantize_fp8_blocks,
    sglang_quantization_config,
)


def test_fp8_block_layout_and_round_trip():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=gen)
    w[150, 10] = 50.0  # one outlier widens only its own [128, 128] block
    q, scale_inv = quantize_fp8_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (200, 300)
    assert scale_inv.shape == (2, 3) and scale_inv.dtype == torch.float32
    assert float(scale_inv[1, 0]) == pytest.approx(50.0 / 448)
    assert float(scale_inv[0, 0]) == pytest.approx(float(w[:128, :128].abs().max()) / 448)
    deq = dequantize_fp8_blocks(q, scale_inv)
    assert float((deq - w).norm() / w.norm()) < 0.05
    assert float(q.float().abs().max()) <= 448


def test_export_names_and_config():
    state = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(64),
        "model.norm.weight": torch.ones(64),
    }
    fp8 = export_sglang(state, "fp8")
    assert fp8["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert fp8["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (1, 1)
    assert fp8["model.layers.0.self_attn.q_proj.bias"].dtype == torch.float32
    int8 = export_sglang(state, "int8")
    assert int8["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    assert int8["model.layers.0.self_attn.q_proj.weight_scale"].shape == (64, 1)
    assert torch.equal(int8["model.norm.weight"], state["model.norm.weight"])
    assert sglang_quantization_config("fp8")["weight_block_size"] == [128, 128]
    assert sglang_quantization_config("int8") == {"quant_method": "w8a8_int8"}
    with pytest.raises(ValueError, match="fp8 or int8"):
        export_sglang(state, "w4a16")
