"""A decode step's layers in one C++ call (`native_layers`) against the per-op path, on every int8 kernel here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_engine import engine_for, make_model

from quant_sync.export import export_rollout_tensors
from quant_sync.update import WeightUpdate
from rollout_workers.embedded import int8_linear, model, native_layers
from rollout_workers.embedded.model import ArchConfig, KVCache, ModelWeights, decode, prefill
from rollout_workers.embedded.staging import build_weight_map
from rollout_workers.engine import SamplingParams

KERNELS = [k for k in int8_linear.available_kernels() if k in int8_linear._COMPILED_KERNELS]
PROMPT_ROWS = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 10, 11, 12], [14, 0, 0, 0, 0]])
PROMPT_LENGTHS = torch.tensor([3, 5, 1])


def _weights(hf: torch.nn.Module, arch: ArchConfig, scheme: str = "int8") -> ModelWeights:
    tensors = export_rollout_tensors(hf.state_dict(), scheme, quantize_head=True)
    return ModelWeights.build(arch, build_weight_map(WeightUpdate(0, tensors, scheme)))


def _prefilled(arch: ArchConfig, weights: ModelWeights) -> KVCache:
    cache = KVCache(arch, slots=3, max_len=16)
    prefill(arch, weights, cache, PROMPT_ROWS, PROMPT_LENGTHS, torch.arange(3), torch.arange(3))
    return cache


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of every `decode_layers` call."""
    seen, real = [], native_layers.decode_layers

    def counted(plan, arch, x, positions, cache):  # noqa: ANN001, ANN202
        seen.append(x.shape[0])
        return real(plan, arch, x, positions, cache)

    monkeypatch.setattr(native_layers, "decode_layers", counted)
    return seen


@pytest.mark.parametrize("arch_name", ["llama", "qwen2", "qwen3"])  # plain, q/k/v biases, q/k norms
@pytest.mark.parametrize("kernel", KERNELS)
def test_one_call_gives_the_per_op_steps_logits_and_cache(tmp_path, monkeypatch, calls, arch_name, kernel):
    """Two decode steps of three rows at different positions: the logits and every layer's keys and values of the
    one-call path equal the per-op path's to fp32 rounding (SiLU's exp differs from torch's in the last bits), the
    first layer's new keys and values bit for bit (the same kernels up to there)."""
    monkeypatch.setenv(int8_linear.ENV_KERNEL, kernel)
    hf = make_model(tmp_path, arch_name)
    arch = ArchConfig.from_model_dir(tmp_path)
    results = {}
    for one_call in (True, False):
        weights = _weights(hf, arch)
        if not one_call:
            weights.layers_plan = False
        cache = _prefilled(arch, weights)
        positions = PROMPT_LENGTHS.clone()
        logits = []
        for tokens in (torch.tensor([3, 4, 5]), torch.tensor([6, 7, 8])):
            logits.append(decode(arch, weights, cache, tokens, positions))
            positions = positions + 1
        results[one_call] = (torch.stack(logits), cache)
    assert calls == [3, 3]  # the per-op run never took it
    (fast_logits, fast_cache), (ops_logits, ops_cache) = results[True], results[False]
    torch.testing.assert_close(fast_logits, ops_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_cache.keys, ops_cache.keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_cache.values, ops_cache.values, rtol=1e-5, atol=1e-5)
    assert torch.equal(fast_cache.keys[0], ops_cache.keys[0]) and torch.equal(fast_cache.values[0], ops_cache.values[0])


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_get_the_same_bits_alone_and_in_a_batch(tmp_path, calls, threads):
    """On one thread or two (the linears split their columns over them, the attention its rows), a row alone
    and in a batch of three: the same bits."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _rows_alone_and_together(tmp_path)
    finally:
        torch.set_num_threads(previous)
    assert calls == [3, 1, 1, 1]


def _rows_alone_and_together(tmp_path) -> None:
    hf = make_model(tmp_path, "llama")
    arch = ArchConfig.from_model_dir(tmp_path)
    weights = _weights(hf, arch)
    together = decode(arch, weights, _prefilled(arch, weights), torch.tensor([3, 4, 5]), PROMPT_LENGTHS.clone())
    for row in range(3):
        cache = _prefilled(arch, weights)
        if row:  # slot `row`'s cache moved to slot 0, where a one-row step reads it
            cache.copy_slot(row, 0, int(PROMPT_LENGTHS[row]))
        alone = decode(arch, weights, cache, torch.tensor([3 + row]), PROMPT_LENGTHS[row : row + 1].clone())
        assert torch.equal(alone[0], together[row])


def test_a_position_past_the_cache_is_refused(tmp_path, calls):
    hf = make_model(tmp_path, "llama")
    arch = ArchConfig.from_model_dir(tmp_path)
    weights = _weights(hf, arch)
    cache = _prefilled(arch, weights)
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 16\)"):
        decode(arch, weights, cache, torch.tensor([3, 4, 5]), torch.tensor([3, 16, 1]))
    assert calls == [3]


def test_only_int8_weights_on_a_cpp_kernel_take_it(tmp_path, monkeypatch):
    hf = make_model(tmp_path, "llama")
    arch = ArchConfig.from_model_dir(tmp_path)
    assert native_layers.plan_for(_weights(hf, arch, "none")) is None
    monkeypatch.setenv(int8_linear.ENV_KERNEL, "onednn")
    assert native_layers.plan_for(_weights(hf, arch)) is None
    monkeypatch.setenv(int8_linear.ENV_KERNEL, KERNELS[0])
    weights = _weights(hf, arch)
    weights.layers[1].down_lora = SimpleNamespace(native=None)  # an adapter on torch's GEMMs (no C++ form)
    assert native_layers.plan_for(weights) is None


def test_an_engine_generates_through_it_with_prompts_joining(tmp_path, calls):
    """A generate whose prompts do not all fit the batch: steps with prompts joining take the per-op path, the
    rest the one call; every sequence's tokens and log-probs are those it gets alone."""
    hf = make_model(tmp_path, "llama")
    engine = engine_for(hf, tmp_path, "int8", max_batch=2)
    params = SamplingParams(max_new_tokens=6, temperature=1e-4, stop_token_ids=(-5,))
    prompts = [[5, 6, 7], [8, 9, 10, 11], [14], [20, 21, 22, 23]]
    together = engine.generate(prompts, params)
    assert calls and set(calls) <= {1, 2}
    for prompt, seq in zip(prompts, together):
        alone = engine.generate([prompt], params)[0]
        assert alone.response_ids == seq.response_ids
        torch.testing.assert_close(torch.tensor(alone.behav_logp), torch.tensor(seq.behav_logp), rtol=0, atol=1e-5)
    assert model._layers_plan(engine._weights) is not None


@pytest.mark.parametrize("keep_int8", [True, False])  # int8 adapters (lr_apply_q8), float32 ones (lr_apply)
def test_lora_adapters_run_inside_the_one_call_as_after_each_linear(tmp_path, calls, keep_int8):
    """A rank-4 adapter on every linear of an int8 base: the one call's logits and cache equal the per-op path's
    (`add_low_rank` after each linear) to fp32 rounding."""
    from asyncrl.bench.engine_bench import lora_adapter_tensors
    from quant_sync.export import decode_adapters, pack_adapters
    from rollout_workers.embedded.low_rank import _native_lora

    hf = make_model(tmp_path, "llama")
    arch = ArchConfig.from_model_dir(tmp_path)
    base = export_rollout_tensors(hf.state_dict(), "int8", quantize_head=True)
    encoded = lora_adapter_tensors(hf.state_dict(), rank=4, sync_dtype="int8", seed=3)
    adapters = decode_adapters(pack_adapters(encoded), keep_int8=keep_int8)
    if _native_lora() is None:  # no AVX-512F: the adapters run on torch's GEMMs, and so on the per-op path
        weights = ModelWeights.build(arch, build_weight_map(WeightUpdate(1, {**base, **adapters}, "int8")))
        assert weights.layers[0].qkv_lora.native is None and native_layers.plan_for(weights) is None
        return
    results = {}
    for one_call in (True, False):
        weights = ModelWeights.build(arch, build_weight_map(WeightUpdate(1, {**base, **adapters}, "int8")))
        assert weights.layers[0].qkv_lora is not None
        if not one_call:
            weights.layers_plan = False
        cache = _prefilled(arch, weights)
        results[one_call] = (decode(arch, weights, cache, torch.tensor([3, 4, 5]), PROMPT_LENGTHS.clone()), cache)
    assert calls == [3]
    (fast, fast_cache), (ops, ops_cache) = results[True], results[False]
    torch.testing.assert_close(fast, ops, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_cache.keys, ops_cache.keys, rtol=1e-5, atol=1e-5)
    base_only = decode(arch, _weights(hf, arch), _prefilled(arch, _weights(hf, arch)), torch.tensor([3, 4, 5]),
                       PROMPT_LENGTHS.clone())  # fmt: skip
    assert not torch.allclose(base_only, fast, atol=1e-3)  # the adapters took part
