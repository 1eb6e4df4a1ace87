"""The embedded engine against the Hugging Face forward: log-prob parity, batching, versions across a swap."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from quant_sync.export import export_rollout_tensors
from rollout_workers.embedded.engine import EmbeddedEngine
from rollout_workers.embedded.model import ModelDirError
from rollout_workers.engine import SamplingParams, WeightUpdate

ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
         "qwen3": (Qwen3Config, Qwen3ForCausalLM)}  # fmt: skip
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14], [20, 21, 22, 23]]


def make_model(tmp_path, arch: str, tie: bool = False):
    config_cls, model_cls = ARCHS[arch]
    torch.manual_seed(0)
    config = config_cls(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                        tie_word_embeddings=tie, eos_token_id=1)  # fmt: skip
    model = model_cls(config).eval()
    model.save_pretrained(tmp_path)
    return model


def engine_for(model, model_dir, scheme: str = "none", seed: int = 0) -> EmbeddedEngine:
    engine = EmbeddedEngine(model_dir, seed=seed)
    engine.stage_weights(WeightUpdate(0, export_rollout_tensors(model.state_dict(), scheme), scheme))
    return engine


def hf_logp(model, prompt, response):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = model(ids).logits[0].log_softmax(-1)
    return logp[len(prompt) - 1 : -1].gather(1, torch.tensor(response)[:, None]).squeeze(1)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("tie", [False, True])
def test_logp_parity_with_hugging_face(tmp_path, arch, tie):
    model = make_model(tmp_path, arch, tie)
    out = engine_for(model, tmp_path).generate(PROMPTS, SamplingParams(max_new_tokens=10, stop_token_ids=(1,)))
    for prompt, completion in zip(PROMPTS, out):
        assert len(completion.response_ids) == len(completion.behav_logp) == len(completion.versions)
        ref = hf_logp(model, prompt, completion.response_ids)
        assert torch.allclose(ref, torch.tensor(completion.behav_logp), atol=1e-4), arch


def test_temperature_logp_is_of_the_tempered_distribution(tmp_path):
    model = make_model(tmp_path, "llama")
    out = engine_for(model, tmp_path).generate(PROMPTS[:2], SamplingParams(max_new_tokens=6, temperature=0.7))
    for prompt, completion in zip(PROMPTS, out):
        ids = torch.tensor([prompt + completion.response_ids])
        with torch.no_grad():
            logp = (model(ids).logits[0] / 0.7).log_softmax(-1)
        ref = logp[len(prompt) - 1 : -1].gather(1, torch.tensor(completion.response_ids)[:, None]).squeeze(1)
        assert torch.allclose(ref, torch.tensor(completion.behav_logp), atol=1e-4)


def test_greedy_alone_equals_in_mixed_batch(tmp_path):
    model = make_model(tmp_path, "qwen2")
    engine = engine_for(model, tmp_path)
    greedy = SamplingParams(max_new_tokens=8, temperature=1e-4)
    batch = engine.generate(PROMPTS, greedy)
    for prompt, completion in zip(PROMPTS, batch):
        alone = engine.generate([prompt], greedy)[0]
        assert alone.response_ids == completion.response_ids


def test_quantized_engines_are_close_to_fp32(tmp_path):
    model = make_model(tmp_path, "llama")
    for scheme in ("int8", "fp8", "fp8_trunc"):
        quant = engine_for(model, tmp_path, scheme).generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=3))
        for prompt, completion in zip(PROMPTS, quant):
            logp = torch.tensor(completion.behav_logp)
            assert torch.isfinite(logp).all() and (logp <= 0).all()
            ref = hf_logp(model, prompt, completion.response_ids)  # fp32 log-probs of the same tokens
            assert (logp - ref).abs().max() < 0.1, scheme
            assert (logp - ref).abs().max() > 0, scheme  # quantization really happened


def test_versions_follow_a_mid_generation_swap(tmp_path):
    model = make_model(tmp_path, "llama")
    engine = engine_for(model, tmp_path)
    tensors = export_rollout_tensors(model.state_dict(), "none")
    real_forward_calls = {"n": 0}
    original = engine.apply_staged

    def stage_after_three_steps():
        real_forward_calls["n"] += 1
        if real_forward_calls["n"] == 4:  # called once before prefill, then between decode steps
            engine.stage_weights(WeightUpdate(1, tensors, "none"))
        return original()

    engine.apply_staged = stage_after_three_steps
    out = engine.generate([PROMPTS[1]], SamplingParams(max_new_tokens=8, stop_token_ids=(-5,)))[0]
    assert out.versions[:3] == [0, 0, 0]
    assert set(out.versions[3:]) == {1}
    assert engine.version == 1 and engine.swaps == 2


def test_bad_model_dirs_fail_clearly(tmp_path):
    with pytest.raises(ModelDirError, match="no config.json"):
        EmbeddedEngine(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ModelDirError, match="model_type 'gpt2' is not supported"):
        EmbeddedEngine(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelDirError, match="invalid JSON"):
        EmbeddedEngine(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelDirError, match="missing or invalid field"):
        EmbeddedEngine(tmp_path)
