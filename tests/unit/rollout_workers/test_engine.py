"""The embedded engine against the Hugging Face forward: log-prob parity, batching, versions across a swap."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from quant_sync.export import export_rollout_tensors
from quant_sync.quantizers import QuantizedWeight, quantize_weight, quantized_linear
from quant_sync.update import WeightUpdate
from rollout_workers.embedded.engine import EmbeddedEngine
from rollout_workers.embedded.fp8_linear import PackedFp8
from rollout_workers.embedded.int8_linear import PackedInt8, int8_kernel_name
from rollout_workers.embedded.model import (
    EXACT_FP32_MAX_IN_FEATURES,
    PACK_FP32_MIN_FEATURES,
    ModelDirError,
    PackedFp32,
    UpcastQuantized,
    linear,
    prepare_linear,
)
from rollout_workers.engine import Engine, SamplingParams
from rollout_workers.sglang_api.backend import SGLangEngine

ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
         "qwen3": (Qwen3Config, Qwen3ForCausalLM)}  # fmt: skip
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14], [20, 21, 22, 23]]
SMALL_INT8_FORM = UpcastQuantized if int8_kernel_name() == "onednn" else PackedInt8
"""Small int8 weights run as exact fp32 GEMMs only where oneDNN is the int8 kernel (the C++ ones are faster)."""


def make_model(tmp_path, arch: str, tie: bool = False, **overrides):
    config_cls, model_cls = ARCHS[arch]
    torch.manual_seed(0)
    sizes = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)  # fmt: skip
    config = config_cls(**{**sizes, **overrides}, max_position_embeddings=128, tie_word_embeddings=tie,
                        eos_token_id=1)  # fmt: skip
    model = model_cls(config).eval()
    model.save_pretrained(tmp_path)
    return model


def engine_for(model, model_dir, scheme: str = "none", seed: int = 0, **kwargs) -> EmbeddedEngine:
    engine = EmbeddedEngine(model_dir, seed=seed, **kwargs)
    engine.stage_weights(WeightUpdate(0, export_rollout_tensors(model.state_dict(), scheme), scheme))
    return engine


def hf_logp(model, prompt, response, temperature: float = 1.0):
    """Log-probs of `response` under the HF forward (in the model's own dtype), of log_softmax(logits / T)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = (model(ids).logits[0].float() / temperature).log_softmax(-1)
    return logp[len(prompt) - 1 : -1].gather(1, torch.tensor(response)[:, None]).squeeze(1)


def assert_matches_hf(model, prompts, completions, atol: float = 1e-4, temperature: float = 1.0) -> None:
    for prompt, completion in zip(prompts, completions, strict=True):
        ref = hf_logp(model, prompt, completion.response_ids, temperature)
        gap = float((ref - torch.tensor(completion.behav_logp)).abs().max()) if completion.response_ids else 0.0
        assert gap <= atol, (prompt, gap)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("tie", [False, True])
def test_logp_parity_with_hugging_face(tmp_path, arch, tie):
    model = make_model(tmp_path, arch, tie)
    out = engine_for(model, tmp_path).generate(PROMPTS, SamplingParams(max_new_tokens=10, stop_token_ids=(1,)))
    for completion in out:
        assert len(completion.response_ids) == len(completion.behav_logp) == len(completion.versions)
    assert_matches_hf(model, PROMPTS, out)


def test_large_layers_run_packed_and_keep_parity(tmp_path):
    """Hidden >= PACK_FP32_MIN_FEATURES: every decoder linear runs oneDNN's prepacked fp32 GEMM, still at HF parity;
    the LM head stays plain (HEAD_PACKED)."""
    width = PACK_FP32_MIN_FEATURES
    model = make_model(tmp_path, "qwen2", hidden_size=width, intermediate_size=2 * width, vocab_size=width + 11,
                       num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4)  # fmt: skip
    engine = engine_for(model, tmp_path)
    params = SamplingParams(max_new_tokens=6, stop_token_ids=(1,), seed=4)
    out = engine.generate(PROMPTS, params) + engine.generate(PROMPTS[:1], params)  # packed rows, then one row
    layer = engine._weights.layers[0]
    assert all(isinstance(w, PackedFp32) for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
    assert not isinstance(engine._weights.head, PackedFp32)  # not oneDNN-prepacked (fused_decode's fp32 form on CPU)
    assert_matches_hf(model, PROMPTS + PROMPTS[:1], out)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize(
    ("precision", "dtype", "atol"), [("bf16", torch.bfloat16, 5e-3), ("fp16", torch.float16, 1e-3)]
)
def test_half_precision_rollout_matches_hf_in_that_dtype(tmp_path, arch, precision, dtype, atol):
    model = make_model(tmp_path, arch)
    engine = engine_for(model, tmp_path, precision=precision)
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, stop_token_ids=(1,), seed=9))
    assert engine._cache.keys.dtype == dtype and engine._weights.embed.dtype == dtype
    assert_matches_hf(model.to(dtype), PROMPTS, out, atol=atol)


def test_quantized_linears_under_bf16_compute(tmp_path):
    model = make_model(tmp_path, "llama")
    out = engine_for(model, tmp_path, "int8", precision="bf16").generate(PROMPTS, SamplingParams(max_new_tokens=6))
    for prompt, completion in zip(PROMPTS, out):
        logp = torch.tensor(completion.behav_logp)
        assert torch.isfinite(logp).all() and (logp - hf_logp(model, prompt, completion.response_ids)).abs().max() < 0.1


def test_temperature_logp_is_of_the_tempered_distribution(tmp_path):
    model = make_model(tmp_path, "llama")
    out = engine_for(model, tmp_path).generate(PROMPTS[:2], SamplingParams(max_new_tokens=6, temperature=0.7))
    assert_matches_hf(model, PROMPTS[:2], out, temperature=0.7)


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


def perturbed(model):
    """A second weight version: every parameter nudged, so K/V computed with it differs visibly."""
    state = {name: value.clone() for name, value in model.state_dict().items()}
    torch.manual_seed(1)
    for value in state.values():
        value.add_(0.05 * torch.randn_like(value))
    return state


def stage_at_call(engine, call: int, update: WeightUpdate) -> None:
    """Stage `update` just before the `call`-th swap point (one swap point per scheduler step)."""
    calls = {"n": 0}
    original = engine.apply_staged

    def apply_staged():
        calls["n"] += 1
        if calls["n"] == call:
            engine.stage_weights(update)
        return original()

    engine.apply_staged = apply_staged


def test_a_sliced_build_spreads_over_steps_and_the_old_version_decodes_until_it_swaps(tmp_path, monkeypatch):
    # a zero budget: every swap point runs one build part (half a layer), so the build takes 2 * layers + 1 of them
    monkeypatch.setattr("rollout_workers.embedded.engine.BUILD_SLICE_MIN_S", 0.0)
    monkeypatch.setattr("rollout_workers.embedded.engine.BUILD_SLICE_OF_STEP", 0.0)
    model = make_model(tmp_path, "llama")
    engine = engine_for(model, tmp_path, swap_mode="in_place")
    parts = 2 * engine.arch.num_layers + 1
    stage_at_call(engine, 4, WeightUpdate(1, export_rollout_tensors(perturbed(model), "none"), "none"))
    new_tokens = 3 + parts + 2
    out = engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=new_tokens, stop_token_ids=(-5,), seed=2))
    for completion in out:  # staged before the 4th step; its last part runs before step 3 + parts + 1
        assert completion.versions == [0] * (3 + parts - 1) + [1] * (new_tokens - 3 - parts + 1)
    assert engine.version == 1 and engine.swaps >= 1


@pytest.mark.parametrize("swap_mode", ["in_place", "retract"])
def test_versions_and_logp_across_a_mid_generation_swap(tmp_path, swap_mode, monkeypatch):
    # the build finishes at the swap point it starts at (a sliced build takes a step more on a loaded machine; the
    # test above): this test is about the tags and log-probs on each side of the swap
    monkeypatch.setattr("rollout_workers.embedded.engine.BUILD_SLICE_MIN_S", 60.0)
    model = make_model(tmp_path, "llama")
    engine = engine_for(model, tmp_path, swap_mode=swap_mode)
    new_state = perturbed(model)
    stage_at_call(engine, 4, WeightUpdate(1, export_rollout_tensors(new_state, "none"), "none"))
    out = engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=8, stop_token_ids=(-5,), seed=2))
    new_model = type(model)(model.config).eval()
    new_model.load_state_dict(new_state)
    for prompt, completion in zip(PROMPTS, out):
        assert completion.versions == [0, 0, 0] + [1] * 5
        old_ref = hf_logp(model, prompt, completion.response_ids)
        new_ref = hf_logp(new_model, prompt, completion.response_ids)
        logp = torch.tensor(completion.behav_logp)
        assert torch.allclose(logp[:3], old_ref[:3], atol=1e-4)
        after_swap_matches_fresh_forward = torch.allclose(logp[3:], new_ref[3:], atol=1e-4)
        assert after_swap_matches_fresh_forward == (swap_mode == "retract")
    assert engine.version == 1 and engine.swaps == 2
    assert (engine.retracted_tokens > 0) == (swap_mode == "retract")


def test_continuous_batching_equals_decoding_alone(tmp_path):
    """Two slots, four requests of different lengths: short ones finish early and queued ones join mid-flight."""
    model = make_model(tmp_path, "qwen3")
    engine = engine_for(model, tmp_path, max_batch=2)
    lengths = [3, 9, 5, 7]
    params = [SamplingParams(max_new_tokens=n, temperature=1e-4, stop_token_ids=(-5,)) for n in lengths]
    sequences = [engine.submit(p, sp, [7])[0] for p, sp in zip(PROMPTS, params)]
    steps = 0
    while engine.busy:
        engine.step()
        steps += 1
    assert steps < sum(lengths)  # requests really overlapped
    for prompt, sp, seq in zip(PROMPTS, params, sequences):
        assert seq.completion.finish == "length" and len(seq.completion.response_ids) == sp.max_new_tokens
        alone = engine.generate([prompt], sp)[0]
        assert alone.response_ids == seq.completion.response_ids
        assert torch.allclose(torch.tensor(alone.behav_logp), torch.tensor(seq.completion.behav_logp), atol=1e-5)


def test_n_samples_share_one_prefill_and_match_hf(tmp_path):
    model = make_model(tmp_path, "qwen2")
    engine = engine_for(model, tmp_path)
    prefills = []
    original = engine._prompts
    engine._prompts = lambda groups, *rest: prefills.append(len(groups)) or original(groups, *rest)
    prompts = [p for p in PROMPTS[:3] for _ in range(4)]
    out = engine.generate(prompts, SamplingParams(max_new_tokens=6, seed=11))
    assert prefills == [3]  # one prefill row per distinct prompt
    assert len({tuple(c.response_ids) for c in out[:4]}) > 1  # the samples of one prompt differ
    assert_matches_hf(model, prompts, out)


def test_seeded_sampling_is_reproducible(tmp_path):
    model = make_model(tmp_path, "llama")
    engine = engine_for(model, tmp_path)
    params = SamplingParams(max_new_tokens=6, seed=5, top_k=20, top_p=0.9)
    first, second = engine.generate(PROMPTS, params), engine.generate(PROMPTS, params)
    assert [c.response_ids for c in first] == [c.response_ids for c in second]
    other = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=6, top_k=20, top_p=0.9))
    assert [c.response_ids for c in first] != [c.response_ids for c in other]


def test_llama3_rope_scaling_parity(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16, "rope_theta": 500000.0}  # fmt: skip
    model = make_model(tmp_path, "llama", rope_scaling=rope)
    prompts = [list(range(2, 30)), [5, 6, 7]]
    out = engine_for(model, tmp_path).generate(prompts, SamplingParams(max_new_tokens=20, stop_token_ids=(-5,)))
    assert_matches_hf(model, prompts, out)


def test_bad_engine_settings_fail_clearly(tmp_path):
    make_model(tmp_path, "llama")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            EmbeddedEngine(tmp_path, device="cuda")
    with pytest.raises(ValueError, match="rollout.device 'meta' is not supported"):
        EmbeddedEngine(tmp_path, device="meta")
    with pytest.raises(ValueError, match="precision.rollout 'fp8' is not one of"):
        EmbeddedEngine(tmp_path, precision="fp8")
    with pytest.raises(ValueError, match="rollout.swap_mode 'pause' is not one of"):
        EmbeddedEngine(tmp_path, swap_mode="pause")


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
    (tmp_path / "config.json").write_text("[]")
    with pytest.raises(ModelDirError, match="not a JSON object"):
        EmbeddedEngine(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}), encoding="utf-16")
    with pytest.raises(ModelDirError, match="invalid JSON"):
        EmbeddedEngine(tmp_path)
    good = {"model_type": "llama", "vocab_size": 97, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    for change, message in [
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
        ({"num_hidden_layers": -1}, "num_hidden_layers must be a positive integer, got -1"),
        ({"vocab_size": 0}, "vocab_size must be a positive integer"),
        ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer"),
        ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) is not a multiple of num_key_value_heads \(3\)"),
        ({"eos_token_id": ["a"]}, r"eos_token_id must be token ids, got \['a'\]"),
        ({"eos_token_id": -1}, "eos_token_id must be token ids, got -1"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps({**good, **change}))
        with pytest.raises(ModelDirError, match=message):
            EmbeddedEngine(tmp_path)


def test_config_features_the_engine_lacks_are_refused_and_a_sliding_window_caps_its_context(tmp_path):
    """The engine would drop biases and run silu regardless (log-probs 0.16-0.58 away from Hugging Face's): refused,
    naming each; a sliding window is full attention up to the window, so the engine's context stops there."""
    for overrides, message in [
        ({"attention_bias": True}, "attention_bias=true"),
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ]:
        model_dir = tmp_path / message.split("=")[0]
        make_model(model_dir, "llama", **overrides)
        with pytest.raises(ModelDirError, match=f"{message}.*does not implement"):
            EmbeddedEngine(model_dir)
    make_model(tmp_path / "window", "qwen2", use_sliding_window=True, sliding_window=48, max_window_layers=0)
    assert EmbeddedEngine(tmp_path / "window", max_seq_len=100).max_seq_len == 48
    make_model(tmp_path / "window_off", "qwen2", use_sliding_window=False, sliding_window=48)
    assert EmbeddedEngine(tmp_path / "window_off", max_seq_len=100).max_seq_len == 100


def test_end_of_sequence_ids_come_from_generation_config_too(tmp_path):
    """Hugging Face `generate` stops on generation_config.json's eos_token_id: so does the engine, with or without
    config.json's (a model whose config.json lacks it generated to max_new_tokens every time)."""
    make_model(tmp_path, "llama")
    config = json.loads((tmp_path / "config.json").read_text())
    del config["eos_token_id"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 1]}))
    assert EmbeddedEngine(tmp_path).arch.eos_token_ids == (5, 1)


@pytest.mark.parametrize(
    ("scheme", "out_features", "in_features", "form"),
    [
        ("int8", 48, 64, SMALL_INT8_FORM),  # small: an exact fp32 GEMM where the int8 kernel is oneDNN's
        ("int8", 640, 512, PackedInt8),  # larger than UPCAST_INT8_MAX_ELEMENTS: the int8 kernel (int8_linear.py)
        ("int8", 16, EXACT_FP32_MAX_IN_FEATURES + 8, PackedInt8),  # too many inputs for exact fp32 sums
        ("int8", 248, EXACT_FP32_MAX_IN_FEATURES, SMALL_INT8_FORM),  # the widest exact one, at the largest sums
        ("fp8", 48, 64, PackedFp8),
        ("fp8_trunc", 48, 64, PackedFp8),
    ],
)
def test_fast_quantized_linears_equal_the_shared_quantizer(scheme, out_features, in_features, form):
    torch.manual_seed(0)
    weight = quantize_weight(torch.randn(out_features, in_features), scheme)
    x = torch.randn(3, 5, in_features) * 3
    if in_features == EXACT_FP32_MAX_IN_FEATURES:  # every product at +-127 x 127: the partial sums reach 2^24
        weight = QuantizedWeight(q=torch.full_like(weight.q, 127), scale=weight.scale, scheme=scheme)
        x = torch.ones(3, 5, in_features).index_fill_(0, torch.tensor([1]), -1.0)
    bias = torch.randn(out_features)
    fast = prepare_linear(weight)
    assert isinstance(fast, form)  # the engine's own execution form
    if scheme == "int8":
        assert torch.equal(linear(x, fast, bias), quantized_linear(x, weight, bias))
    else:  # exact e4m3 operands and products, fp32 sums in the FP8 kernel's order (fp8_linear.py)
        torch.testing.assert_close(linear(x, fast, bias), quantized_linear(x, weight, bias), rtol=1e-6, atol=1e-5)


def test_requests_joining_mid_flight_grow_the_cache(tmp_path):
    model = make_model(tmp_path, "llama")
    engine = engine_for(model, tmp_path)
    greedy = SamplingParams(max_new_tokens=6, temperature=1e-4, stop_token_ids=(-5,))
    first = engine.submit(PROMPTS[0], greedy, [0])
    engine.step()
    engine.step()
    later = [engine.submit(prompt, greedy, [0, 1])[1] for prompt in PROMPTS[1:]]  # 1 -> 7 slots: the cache grows
    while engine.busy:
        engine.step()
    for prompt, seq in zip(PROMPTS, first + later):
        assert seq.completion.response_ids == engine.generate([prompt], greedy)[0].response_ids


def test_builtin_model_parity_with_hugging_face():
    from transformers import AutoModelForCausalLM

    from common.builtin_model import resolve_model_path

    model_dir = resolve_model_path("builtin:micro")  # seconds to build once, then cached
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = [[1, 4, 5, 13, 6, 7, 15], [1, 9, 14, 3, 15], [1, 4, 5, 13, 6, 7, 15]]
    out = engine_for(model, model_dir).generate(prompts, SamplingParams(max_new_tokens=12, seed=1))
    assert_matches_hf(model, prompts, out)


def test_bad_requests_fail_clearly_and_queue_nothing(tmp_path):
    model = make_model(tmp_path, "llama")
    engine = engine_for(model, tmp_path)
    params = SamplingParams(max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate([PROMPTS[0], list(range(1, 90))], SamplingParams(max_new_tokens=60))
    with pytest.raises(ValueError, match="vocab_size"):
        engine.generate([PROMPTS[0], [5, 97]], params)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([[]], params)
    assert not engine.busy
    assert len(engine.generate(PROMPTS, params)) == len(PROMPTS)


def _misshapen(state: dict, scheme: str, case: str) -> dict:
    tensors = export_rollout_tensors(state, scheme)
    p = "model.layers.1."
    if case == "norm":
        tensors["model.norm.weight"] = tensors["model.norm.weight"][:32]
    elif case == "kv_heads":
        tensors[p + "self_attn.k_proj.weight"] = tensors[p + "self_attn.q_proj.weight"]
        tensors[p + "self_attn.k_proj.weight_scale"] = tensors[p + "self_attn.q_proj.weight_scale"]
    elif case == "scale":
        tensors[p + "mlp.down_proj.weight_scale"] = tensors[p + "mlp.down_proj.weight_scale"][:-1]
    elif case == "mixed_kinds":
        del tensors[p + "self_attn.v_proj.weight_scale"]  # v turns float while q and k stay int8
        tensors[p + "self_attn.v_proj.weight"] = tensors[p + "self_attn.v_proj.weight"].float()
    elif case == "intermediate":
        tensors[p + "mlp.up_proj.weight"] = tensors[p + "mlp.up_proj.weight"][:-1]
        tensors[p + "mlp.up_proj.weight_scale"] = tensors[p + "mlp.up_proj.weight_scale"][:-1]
    return tensors


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("norm", r"model.norm.weight has shape \[32\], the model needs \[64\]"),
        ("kv_heads", r"k_proj.weight has shape \[64, 64\], the model needs \[32, 64\]"),
        ("scale", r"down_proj.weight: scale of shape \[63\]"),
        ("mixed_kinds", r"q/k/v_proj: mixed kinds"),
        ("intermediate", r"up_proj.weight has shape \[127, 64\]"),
    ],
)
def test_a_version_that_does_not_fit_the_model_is_refused_and_the_old_one_keeps_running(tmp_path, case, message):
    model = make_model(tmp_path, "llama")
    engine = engine_for(model, tmp_path, "int8")
    greedy = SamplingParams(max_new_tokens=4, temperature=1e-4)
    before = engine.generate(PROMPTS[:1], greedy)[0].response_ids
    with pytest.raises(ValueError, match=message):
        engine.stage_weights(WeightUpdate(1, _misshapen(model.state_dict(), "int8", case), "int8"))
    assert not engine.swap_now() and engine.version == 0
    assert engine.generate(PROMPTS[:1], greedy)[0].response_ids == before


def test_a_version_whose_build_fails_is_dropped_and_the_old_one_keeps_running(tmp_path, monkeypatch):
    import rollout_workers.embedded.model as model_module

    model = make_model(tmp_path, "llama")
    engine = engine_for(model, tmp_path, "int8")
    greedy = SamplingParams(max_new_tokens=4, temperature=1e-4)
    before = engine.generate(PROMPTS[:1], greedy)[0].response_ids
    real = model_module.prepare_linear
    calls = {"n": 0}

    def failing(*args, **kwargs):  # the third linear of the build fails (as an out-of-memory would)
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated build failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(model_module, "prepare_linear", failing)
    engine.stage_weights(WeightUpdate(1, export_rollout_tensors(model.state_dict(), "int8"), "int8"))
    with pytest.raises(RuntimeError, match="simulated build failure"):
        engine.apply_staged()
    assert not engine.apply_staged() and engine.version == 0  # dropped: nothing left half-built
    assert engine.generate(PROMPTS[:1], greedy)[0].response_ids == before
    engine.stage_weights(WeightUpdate(2, export_rollout_tensors(model.state_dict(), "int8"), "int8"))
    assert engine.swap_now() and engine.version == 2 and engine.last_build_s > 0  # the next version builds and runs


@pytest.mark.parametrize(("arch", "scheme"), [("llama", "none"), ("qwen3", "int8"), ("qwen2", "fp8")])
def test_prompts_joining_a_decode_step_share_its_linears_and_match_separate_forwards(
    tmp_path, arch, scheme, monkeypatch
):
    import copy

    import rollout_workers.embedded.model as model_module
    from rollout_workers.embedded.model import KVCache, ModelWeights, Prompts, decode, forward_step, prefill

    model = make_model(tmp_path, arch)
    engine = engine_for(model, tmp_path, scheme)
    engine.swap_now()
    weights, arch_cfg = engine._weights, engine.arch
    cache = KVCache(arch_cfg, 6, 32)
    running = prefill(arch_cfg, weights, cache, torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]]), torch.tensor([4, 2]),
                      torch.tensor([0, 1]), torch.tensor([0, 1]))  # fmt: skip
    assert running is not None and isinstance(weights, ModelWeights)
    tokens, positions = running.argmax(-1), torch.tensor([4, 2])
    joining = Prompts(torch.tensor([[20, 21, 22], [14, 0, 0]]), torch.tensor([3, 1]), torch.tensor([0, 0, 1]),
                      torch.tensor([2, 3, 4]))  # fmt: skip
    apart = copy.deepcopy(cache)
    separate = torch.cat((
        decode(arch_cfg, weights, apart, tokens, positions),
        prefill(arch_cfg, weights, apart, joining.tokens, joining.lengths, joining.slot_rows, joining.slots),
    ))  # fmt: skip
    calls = []
    real = model_module.linear
    monkeypatch.setattr(model_module, "linear", lambda *args: calls.append(1) or real(*args))
    together = forward_step(arch_cfg, weights, cache, (tokens, positions), joining)
    assert len(calls) == 4 * arch_cfg.num_layers + 1  # q/k/v, o, gate/up, down per layer, then the head: once each
    torch.testing.assert_close(together, separate, rtol=1e-5, atol=1e-5)
    for mine, theirs in ((cache.keys, apart.keys), (cache.values, apart.values)):
        torch.testing.assert_close(mine[:, :5], theirs[:, :5], rtol=1e-5, atol=1e-6)


def test_aborting_a_sequence_that_is_not_last_moves_the_last_into_its_slot(tmp_path):
    model = make_model(tmp_path, "llama")
    engine = engine_for(model, tmp_path)
    greedy = SamplingParams(max_new_tokens=8, temperature=1e-4, stop_token_ids=(-5,))
    first, second, third = (engine.submit(prompt, greedy, [0])[0] for prompt in PROMPTS[:3])
    engine.step()
    engine.step()
    assert engine.abort([first]) == [first] and first.completion.finish == "abort"  # outside any inference mode
    assert len(first.completion.response_ids) == len(first.completion.behav_logp) == 2
    while engine.busy:
        engine.step()
    for prompt, seq in zip(PROMPTS[1:3], (second, third)):  # the moved sequence kept its K/V
        assert seq.completion.finish == "length"
        assert seq.completion.response_ids == engine.generate([prompt], greedy)[0].response_ids


def test_a_version_that_fails_to_build_mid_generation_is_dropped_and_generation_goes_on(tmp_path, monkeypatch):
    import rollout_workers.embedded.model as model_module

    model = make_model(tmp_path, "llama")
    engine = engine_for(model, tmp_path, "int8")
    greedy = SamplingParams(max_new_tokens=6, temperature=1e-4, stop_token_ids=(-5,))
    expected = engine.generate(PROMPTS[:2], greedy)
    real = model_module.prepare_linear
    monkeypatch.setattr(model_module, "prepare_linear", lambda *a, **k: (_ for _ in ()).throw(MemoryError("no room")))
    engine.stage_weights(WeightUpdate(1, export_rollout_tensors(model.state_dict(), "int8"), "int8"))
    out = engine.generate(PROMPTS[:2], greedy)  # the build fails at the first step: decoding stays on version 0
    assert [c.response_ids for c in out] == [c.response_ids for c in expected]
    assert engine.version == 0 and engine.build_errors == 1 and "MemoryError: no room" in engine.last_build_error
    monkeypatch.setattr(model_module, "prepare_linear", real)
    engine.stage_weights(WeightUpdate(2, export_rollout_tensors(model.state_dict(), "int8"), "int8"))
    assert engine.generate(PROMPTS[:1], greedy)[0].versions == [2] * 6


def test_the_embedded_engine_answers_the_whole_engine_protocol(tmp_path):
    engine = engine_for(make_model(tmp_path, "llama"), tmp_path, max_seq_len=64)
    assert isinstance(engine, Engine)
    assert engine.stop_token_ids == (1,) and engine.max_seq_len == 64  # the model's eos_token_id; min(64, 128)
    counters = {"prefill_tokens": 0, "prefix_cached_tokens": 0, "prefix_hits": 0}  # the prefix cache's
    assert (engine.version, engine.swaps, engine.build_errors, engine.stats()) == (-1, 0, 0, counters)
    engine.generate([[5, 6]], SamplingParams(max_new_tokens=2))  # swaps version 0 in
    assert (engine.version, engine.swaps) == (0, 1)
    engine.close()


def test_both_engines_have_every_member_of_the_engine_protocol():
    """What the worker uses of an engine is on the protocol, and both engines have all of it (a property or method
    of the class, or an attribute its constructor sets): the worker never probes with getattr / hasattr."""
    members = [name for name in vars(Engine) if not name.startswith("_")]
    expected = {"version", "swaps", "build_errors", "stop_token_ids", "max_seq_len", "stats", "close"}
    assert expected | {"stage_weights", "generate"} <= set(members)
    for engine_cls in (EmbeddedEngine, SGLangEngine):
        constructor = inspect.getsource(engine_cls.__init__)
        missing = [name for name in members if not hasattr(engine_cls, name) and f"self.{name} = " not in constructor]
        assert not missing, f"{engine_cls.__name__} lacks {missing}"


def test_the_array_uniforms_are_the_scalar_ones_bit_for_bit():
    """Sampling draws its uniforms in array ops (`uniforms`): the same float32 values as `_uniform` per row, so a
    seeded run samples the same tokens as before, whatever the key (0, 2^64 - 1, ...)."""
    import random

    from rollout_workers.embedded.engine import _uniform, uniforms

    rng = random.Random(0)
    keys = [rng.getrandbits(64) for _ in range(2000)] + [0, (1 << 64) - 1, 1 << 63]
    steps = [rng.randrange(0, 1 << 20) for _ in keys]
    draws = uniforms(keys, steps)
    assert draws.dtype == torch.float32
    assert torch.equal(draws, torch.tensor([_uniform(key, step) for key, step in zip(keys, steps)]))
    assert bool((draws > 0).all()) and bool((draws < 1).all())


def test_a_closed_train_gate_holds_the_next_decode_step_and_changes_no_token(tmp_path):
    import threading
    import time

    from common.train_gate import TrainGate

    model = make_model(tmp_path, "llama")
    params = SamplingParams(max_new_tokens=6, seed=5)
    free = engine_for(model, tmp_path).generate(PROMPTS, params)
    engine, gate = engine_for(model, tmp_path), TrainGate(tmp_path / "gate")
    calls: list[float] = []
    engine.before_step = lambda: calls.append(gate.wait())
    gate.close()
    threading.Timer(0.3, gate.open).start()  # the learner's step ends
    start = time.monotonic()
    gated = engine.generate(PROMPTS, params)
    assert time.monotonic() - start >= 0.25 and calls[0] >= 0.25  # the first step waited for the gate
    assert len(calls) >= 6 and all(waited == 0.0 for waited in calls[1:])  # once open, every step went straight on
    assert [c.response_ids for c in gated] == [c.response_ids for c in free]
