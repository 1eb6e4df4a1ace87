"""The fused decode ops (RMSNorm, decode attention, batch-invariant fp32 linears) and continuous batching with them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_engine import PROMPTS, engine_for, make_model
from torch.profiler import ProfilerActivity, profile
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from rollout_workers.embedded import fused_decode, model
from rollout_workers.embedded.weight_only import pack_fp32, weight_only_linear
from rollout_workers.engine import SamplingParams

DECODE_OPS_MAX = 80
"""ATen ops per decode step of builtin:micro (2 layers) at batch 1: 171 before the fused ops, 71 with them."""


def test_fused_norms_are_hf_rmsnorm_and_the_residual_add():
    torch.manual_seed(0)
    norm = LlamaRMSNorm(200, eps=1e-5).requires_grad_(False)
    norm.weight.normal_()
    x, delta = torch.randn(7, 200) * 3, torch.randn(7, 200)
    torch.testing.assert_close(fused_decode.rms_norm(x, norm.weight, 1e-5), norm(x), rtol=1e-6, atol=1e-6)
    stream = x.clone()
    normed = fused_decode.add_rms_norm_(stream, delta, norm.weight, 1e-5)
    assert torch.equal(stream, x + delta)  # the residual stream, updated in place
    torch.testing.assert_close(normed, norm(x + delta), rtol=1e-6, atol=1e-6)


ATTENTION_ISAS = list(range(fused_decode.attention_isa() + 1))  # 0 portable, 1 AVX2, 2 AVX-512: those this CPU runs


def _attention_case(qk_norms: bool, seed: int = 0, head_dim: int = 16):
    generator = torch.Generator().manual_seed(seed)
    arch = model.ArchConfig(model_type="qwen3" if qk_norms else "llama", vocab_size=11, hidden_size=96,
                            num_layers=1, num_heads=6, num_kv_heads=2, head_dim=head_dim, rms_norm_eps=1e-6,
                            rope_theta=10000.0, tie_word_embeddings=False, eos_token_ids=(1,),
                            max_positions=64)  # fmt: skip
    cache = model.KVCache(arch, slots=5, max_len=32)
    cache.keys.normal_(generator=generator)  # earlier positions: whatever they hold is attended to
    cache.values.normal_(generator=generator)
    norms = [torch.randn(head_dim, generator=generator) if qk_norms else None for _ in range(2)]
    layer = model.LayerWeights(input_norm=None, qkv=None, qkv_bias=None, q_norm=norms[0], k_norm=norms[1],
                               o_proj=None, post_norm=None, gate_up=None, down=None)  # type: ignore[arg-type]  # fmt: skip
    qkv = torch.randn(4, (6 + 2 * 2) * head_dim, generator=generator)
    positions = torch.tensor([3, 17, 0, 31])
    return arch, cache, layer, qkv, positions


@pytest.mark.parametrize("isa", ATTENTION_ISAS)
@pytest.mark.parametrize(("qk_norms", "head_dim"), [(False, 16), (True, 16), (False, 32), (True, 40), (False, 12)])
def test_fused_decode_attention_matches_the_torch_ops(monkeypatch, qk_norms, head_dim, isa):
    """Same keys/values written (RoPE on k, Qwen3 norms), same attention output, against the engine's torch path,
    on each form the CPU runs (`ASYNCRL_ATTENTION_ISA`; a head_dim off the vector width takes a narrower form)."""
    monkeypatch.setenv(fused_decode.ENV_ATTENTION_ISA, str(isa))
    assert fused_decode.attention_isa() == isa
    arch, cache, layer, qkv, positions = _attention_case(qk_norms, head_dim=head_dim)
    reference = model.KVCache(arch, slots=5, max_len=32)
    reference.keys.copy_(cache.keys)
    reference.values.copy_(cache.values)
    fused = model._attend_decode(arch, layer, qkv, cache, 0, positions)
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "0")
    assert not fused_decode.enabled_for(cache.keys)
    torch_ops = model._attend_decode(arch, layer, qkv, reference, 0, positions)
    torch.testing.assert_close(fused, torch_ops, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cache.keys, reference.keys, rtol=1e-6, atol=1e-6)
    assert torch.equal(cache.values, reference.values)


@pytest.mark.parametrize("isa", ATTENTION_ISAS)
def test_fused_decode_attention_is_batch_invariant_and_checks_positions(monkeypatch, isa):
    monkeypatch.setenv(fused_decode.ENV_ATTENTION_ISA, str(isa))
    arch, cache, layer, qkv, positions = _attention_case(qk_norms=True, head_dim=32)
    saved = cache.keys.clone(), cache.values.clone()
    batch = model._attend_decode(arch, layer, qkv, cache, 0, positions)
    for row in range(4):  # the row alone, in slot 0 holding what its slot held
        alone = model.KVCache(arch, slots=1, max_len=32)
        alone.keys[:, 0], alone.values[:, 0] = saved[0][:, row], saved[1][:, row]
        out = model._attend_decode(arch, layer, qkv[row : row + 1], alone, 0, positions[row : row + 1])
        assert torch.equal(out[0], batch[row]) and torch.equal(alone.keys[:, 0], cache.keys[:, row])
    with pytest.raises(ValueError, match="positions"):
        model._attend_decode(arch, layer, qkv[:1], cache, 0, torch.tensor([32]))


@pytest.mark.parametrize(("out_features", "in_features"), [(16, 128), (97, 64), (768, 128), (130, 520), (64, 1024)])
def test_fp32_linears_are_batch_invariant_and_agree_with_f_linear(out_features, in_features):
    """MKL's sgemm sums a row alone, in 2-3 rows and in 4 or more rows differently; these kernels never do."""
    generator = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    x, bias = torch.randn(9, in_features, generator=generator), torch.randn(out_features, generator=generator)
    packed = fused_decode.pack_fp32_linear(weight)
    assert not isinstance(packed, torch.Tensor)
    run = fused_decode.linear if isinstance(packed, fused_decode.PackedLinear) else weight_only_linear
    full = run(x, packed, bias)
    for rows in range(1, 9):
        assert torch.equal(run(x[:rows], packed, bias), full[:rows]), rows
    torch.testing.assert_close(full, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_the_transposed_fp32_linear_gives_the_same_bits_on_every_isa():
    weight, x = torch.randn(200, 96), torch.randn(5, 96)
    packed = fused_decode.pack_linear(weight)
    results = []
    for isa in range(packed.isa + 1):  # 0: the scalar loop, 1: AVX2 + FMA, 2: AVX-512, those this CPU runs
        packed.isa = isa
        results.append(fused_decode.linear(x, packed, None))
    assert all(torch.equal(result, results[0]) for result in results)
    assert isinstance(fused_decode.pack_fp32_linear(torch.randn(8, 512)), type(pack_fp32(torch.randn(8, 512))))


@pytest.mark.parametrize("scheme", ["none", "w8a16", "int8"])
def test_greedy_sequences_alone_equal_them_in_a_continuous_batch(tmp_path, scheme):
    """Queued requests join mid-flight (two slots, four requests): each one's tokens and log-probs at temperature
    1e-4 equal those it gets decoded alone, with the fused ops (GQA, llama)."""
    engine = engine_for(make_model(tmp_path, "llama"), tmp_path, scheme, max_batch=2)
    params = [SamplingParams(max_new_tokens=n, temperature=1e-4, stop_token_ids=(-5,)) for n in (3, 9, 5, 7)]
    sequences = [engine.submit(prompt, sp, [7])[0] for prompt, sp in zip(PROMPTS, params)]
    while engine.busy:
        engine.step()
    assert isinstance(engine._weights.head, fused_decode.PackedLinear)
    for prompt, sp, seq in zip(PROMPTS, params, sequences):
        alone = engine.generate([prompt], sp)[0]
        assert alone.response_ids == seq.completion.response_ids
        assert torch.allclose(torch.tensor(alone.behav_logp), torch.tensor(seq.completion.behav_logp), atol=1e-5)


def test_a_decode_step_runs_few_torch_ops():
    """The per-token dispatch the fused ops remove stays removed (builtin:micro, batch 1)."""
    from transformers import AutoModelForCausalLM

    from common.builtin_model import resolve_model_path
    from quant_sync.export import export_rollout_tensors
    from quant_sync.update import WeightUpdate
    from rollout_workers.embedded.engine import EmbeddedEngine

    model_dir = resolve_model_path("builtin:micro", log=lambda *_: None)
    weights = export_rollout_tensors(AutoModelForCausalLM.from_pretrained(model_dir).state_dict(), "none")
    engine = EmbeddedEngine(str(model_dir))
    engine.stage_weights(WeightUpdate(0, weights, "none"))

    def top_level_ops(new_tokens: int) -> int:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.generate([[1, 4, 5]], SamplingParams(max_new_tokens=new_tokens, stop_token_ids=(-1,)))
        events = [e for e in prof.events() if e.name.startswith("aten::")]
        return sum(1 for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))

    engine.generate([[1, 4, 5]], SamplingParams(max_new_tokens=2))
    per_step = (top_level_ops(9) - top_level_ops(1)) / 8
    assert per_step <= DECODE_OPS_MAX, per_step


def test_the_switch_turns_fusion_off_with_the_same_results(tmp_path, monkeypatch):
    hf_model = make_model(tmp_path, "qwen3")
    params = SamplingParams(max_new_tokens=6, seed=2)
    fused = engine_for(hf_model, tmp_path).generate(PROMPTS, params)
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "0")
    engine = engine_for(hf_model, tmp_path)
    plain = engine.generate(PROMPTS, params)
    assert isinstance(engine._weights.head, torch.Tensor)  # MKL's F.linear, as on a GPU or in bf16
    for a, b in zip(fused, plain):
        assert a.response_ids == b.response_ids
        torch.testing.assert_close(torch.tensor(a.behav_logp), torch.tensor(b.behav_logp), rtol=0, atol=1e-5)
