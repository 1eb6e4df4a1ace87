"""UAQ: function preservation on Llama-family configs, smaller quantization error relative to the update."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from quant_sync.export import export_rollout_tensors
from quant_sync.uaq import apply_uaq, layer_type, quant_error_by_type

ARCHS = [(LlamaConfig, LlamaForCausalLM), (Qwen2Config, Qwen2ForCausalLM), (Qwen3Config, Qwen3ForCausalLM)]


@pytest.mark.parametrize(("config_cls", "model_cls"), ARCHS)
def test_uaq_preserves_logits(config_cls, model_cls):
    torch.manual_seed(0)
    config = config_cls(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    model = model_cls(config).eval()
    ids = torch.randint(0, 50, (3, 12))
    with torch.no_grad():
        before = model(ids).logits
    q_before = model.model.layers[0].self_attn.q_proj.weight.clone()
    norm_before = model.model.layers[1].post_attention_layernorm.weight.clone()
    o_before = model.model.layers[0].self_attn.o_proj.weight.clone()
    assert apply_uaq(model, 1.5) == 2
    with torch.no_grad():
        after = model(ids).logits
    assert torch.allclose(before, after, atol=1e-5, rtol=1e-5)
    assert torch.allclose(model.model.layers[0].self_attn.q_proj.weight, q_before / 1.5)
    assert torch.allclose(model.model.layers[1].post_attention_layernorm.weight, norm_before * 1.5)
    assert torch.equal(model.model.layers[0].self_attn.o_proj.weight, o_before)  # not fed by a norm: untouched


def test_scale_one_is_a_no_op():
    model = LlamaForCausalLM(LlamaConfig(vocab_size=20, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))  # fmt: skip
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert apply_uaq(model, 1.0) == 0
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_quant_error_metrics_by_layer_type():
    gen = torch.Generator().manual_seed(0)
    state = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 32, generator=gen),
        "model.layers.0.mlp.down_proj.weight": torch.randn(32, 16, generator=gen),
        "model.norm.weight": torch.ones(32),
    }
    published = export_rollout_tensors(state, "int8")
    errors = quant_error_by_type(state, published)
    assert set(errors) == {"norm_quant_err", "norm_quant_err/q_proj", "norm_quant_err/down_proj"}
    assert 0 < errors["norm_quant_err"] < 1e-3
    # the error is relative: scaling a weight does not change it, which is why UAQ pays off against the update size
    scaled = {k: v / 1.5 for k, v in state.items()}
    assert quant_error_by_type(scaled, export_rollout_tensors(scaled, "int8"))["norm_quant_err"] == pytest.approx(
        errors["norm_quant_err"], rel=1e-3
    )
    assert layer_type("model.layers.3.mlp.gate_proj.weight") == "gate_proj"
