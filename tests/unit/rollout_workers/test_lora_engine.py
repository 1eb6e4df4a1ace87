"""LoRA in the embedded engine: `y = Q(W) x + s * B (A x)` on every linear form, fused groups stacked exactly,
misshapen adapters refused, and an adapter version swapped in mid-generation tagged and applied."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from common.builtin_model import resolve_model_path
from learner.aligned import make_rollout_aligned
from quant_sync.export import LORA_A, LORA_B, LORA_SCALING, export_rollout_tensors
from quant_sync.quantizers import quantize_weight
from quant_sync.update import WeightUpdate
from rollout_workers.embedded.engine import EmbeddedEngine
from rollout_workers.embedded.linears import linear, low_rank_linear, prepare_linear
from rollout_workers.embedded.low_rank import stack_low_rank
from rollout_workers.engine import SamplingParams

PROMPTS = [[1, 4, 5, 13, 6, 7, 15], [1, 9, 14, 3, 15]]


def _adapter(rank: int, out: int, inp: int, seed: int, scaling: float = 2.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rank, inp, generator=gen), torch.randn(out, rank, generator=gen), scaling


@pytest.mark.parametrize("form", ["fp32", "int8", "fp8"])
def test_low_rank_linear_adds_the_scaled_adapter_to_any_linear_form(form):
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(96, 64, generator=gen), torch.randn(7, 64, generator=gen)
    base = weight if form == "fp32" else quantize_weight(weight, form)
    prepared = prepare_linear(base)
    a, b, scaling = _adapter(8, 96, 64, seed=1)
    got = low_rank_linear(x, prepared, None, stack_low_rank([(a, b, scaling)], [96]))
    want = linear(x, prepared, None) + scaling * (x @ a.t()) @ b.t()
    # the two sum in different orders (the stacked kernel, or MKL's blocking, which differs by CPU): a few fp32 ulps
    # of the output's scale apart (outputs reach ~200 here)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=4 * torch.finfo(torch.float32).eps * want.abs().max().item())
    assert torch.equal(low_rank_linear(x, prepared, None, None), linear(x, prepared, None))


def test_a_fused_groups_adapters_equal_the_separate_ones_and_a_missing_member_adds_nothing():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 32, generator=gen)
    outs = [32, 16, 16]
    members = [_adapter(4, outs[0], 32, seed=1), None, _adapter(4, outs[2], 32, seed=3, scaling=0.5)]
    stacked = stack_low_rank(members, outs)
    assert stacked is not None and stacked.a.shape == (8, 32) and [b.shape for b in stacked.b_t] == [(4, 32), (4, 16)]
    got = low_rank_linear(x, torch.zeros(64, 32), None, stacked)  # a zero base: only the adapters' part
    (a_q, b_q, s_q), (a_v, b_v, s_v) = members[0], members[2]
    # N(0, 1) adapters: outputs of ~10; the kernel sums in another order than `@` (fp32 rounding, ~1e-6 relative)
    torch.testing.assert_close(got[:, :32], s_q * (x @ a_q.t()) @ b_q.t(), rtol=1e-5, atol=1e-5)
    assert torch.equal(got[:, 32:48], torch.zeros(5, 16))  # no adapter on k: exactly nothing added
    torch.testing.assert_close(got[:, 48:], s_v * (x @ a_v.t()) @ b_v.t(), rtol=1e-5, atol=1e-5)
    assert stack_low_rank([None, None], [8, 8]) is None


def _micro():
    model_dir = str(resolve_model_path("builtin:micro", log=lambda *_: None))
    return model_dir, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _peft_on_aligned_base(model, scheme: str, rank: int = 4, seed: int = 0):
    """The learner's model: the base on the rollout's quantized operands, peft adapters with nonzero B on top."""
    make_rollout_aligned(model, scheme, head=True)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(0.05 * torch.randn(param.shape, generator=gen))
    return model


def _adapter_tensors(model) -> dict[str, torch.Tensor]:
    from learner.lora import adapter_tensors

    return adapter_tensors(model)


@torch.no_grad()
def _logp(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    out = model(input_ids=torch.tensor([prompt + response])).logits[0].log_softmax(-1)
    return out[len(prompt) - 1 : -1].gather(1, torch.tensor(response)[:, None]).squeeze(1)


def test_an_adapter_version_swapped_in_mid_generation_tags_and_runs_the_adapters(monkeypatch):
    """Version 0: the int8 base; version 1 (staged at the 4th step): base + adapters. Retract mode recomputes the
    K/V, so the tokens after the swap are version 1's: they equal the learner's peft forward on the aligned base."""
    # the build finishes at the swap point it starts at: on a loaded machine a sliced build took one step more
    monkeypatch.setattr("rollout_workers.embedded.engine.BUILD_SLICE_MIN_S", 60.0)
    model_dir, model = _micro()
    base = export_rollout_tensors(model.state_dict(), "int8", quantize_head=True)
    learner_model = _peft_on_aligned_base(model, "int8")
    update = WeightUpdate(1, {**base, **_adapter_tensors(learner_model)}, "int8")
    engine = EmbeddedEngine(model_dir, seed=0, swap_mode="retract")
    engine.stage_weights(WeightUpdate(0, base, "int8"))
    calls = {"n": 0}
    original = engine.apply_staged

    def apply_staged():
        calls["n"] += 1
        if calls["n"] == 4:
            engine.stage_weights(update)
        return original()

    engine.apply_staged = apply_staged
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, stop_token_ids=(-5,), seed=2))
    assert engine._weights.layers[0].qkv_lora is not None and engine._weights.layers[0].gate_up_lora is None
    for prompt, completion in zip(PROMPTS, out):
        assert completion.versions == [0, 0, 0] + [1] * 5
        learner_logp = _logp(learner_model, prompt, completion.response_ids)
        gap = (learner_logp[3:] - torch.tensor(completion.behav_logp[3:])).abs().max()
        assert gap <= 1e-5, gap


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.update({"model.layers.0.self_attn.q_proj.lora_A": torch.zeros(4, 3)}), "has shape"),
        (lambda t: t.pop("model.layers.0.self_attn.q_proj.lora_B"), "together"),
        (lambda t: t.update({"model.norm.lora_A": torch.zeros(4, 8)}), "not a decoder linear"),
        (lambda t: t.update({"model.layers.0.mlp.down_proj.lora_scaling": torch.ones(2)}), "has shape"),
    ],
)
def test_misshapen_adapters_are_refused_at_staging(change, message):
    model_dir, model = _micro()
    base = export_rollout_tensors(model.state_dict(), "int8")
    tensors = {**base, **_adapter_tensors(_peft_on_aligned_base(model, "int8"))}
    engine = EmbeddedEngine(model_dir, seed=0)
    engine.stage_weights(WeightUpdate(0, dict(tensors), "int8"))  # the well-formed version is taken
    change(tensors)
    with pytest.raises(ValueError, match=message):
        engine.stage_weights(WeightUpdate(1, tensors, "int8"))


def test_published_adapter_names_are_the_engines():
    _, model = _micro()
    names = set(_adapter_tensors(_peft_on_aligned_base(model, "int8")))
    assert "model.layers.0.self_attn.q_proj" + LORA_A in names
    assert {"model.layers.1.mlp.down_proj" + s for s in (LORA_A, LORA_B, LORA_SCALING)} <= names


def test_adapter_versions_reuse_the_base_forms_built_from_the_same_published_tensors():
    from rollout_workers.embedded import model as model_module
    from rollout_workers.embedded.engine import build_weight_map
    from rollout_workers.embedded.model import ModelWeights

    model_dir, model = _micro()
    base = export_rollout_tensors(model.state_dict(), "int8", quantize_head=True)
    peft_model = _peft_on_aligned_base(model, "int8")
    engine = EmbeddedEngine(model_dir, seed=0)
    first = ModelWeights.build(engine.arch, build_weight_map(WeightUpdate(1, {**base, **_adapter_tensors(peft_model)},
                                                                         "int8")))  # fmt: skip
    with torch.no_grad():
        peft_model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight.add_(1.0)
    second = ModelWeights.build(engine.arch, build_weight_map(WeightUpdate(2, {**base, **_adapter_tensors(peft_model)},
                                                                          "int8")))  # fmt: skip
    assert second.layers[0].qkv is first.layers[0].qkv and second.head is first.head  # the base: built once
    assert not torch.equal(second.layers[0].qkv_lora.b_t[0], first.layers[0].qkv_lora.b_t[0])  # the new adapters
    base["model.layers.0.mlp.down_proj.weight"].add_(1)  # a published tensor changed in place: never reused
    third = ModelWeights.build(engine.arch, build_weight_map(WeightUpdate(3, {**base, **_adapter_tensors(peft_model)},
                                                                         "int8")))  # fmt: skip
    assert third.layers[0].down is not first.layers[0].down and third.layers[1].down is first.layers[1].down
    ModelWeights.build(engine.arch, build_weight_map(WeightUpdate(4, base, "int8")))  # no adapters: no reuse kept
    assert not model_module._PREPARED


@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_the_native_low_rank_kernel_equals_the_reference_on_ragged_shapes(rows):
    """csrc/lora_gemm.cpp (AVX-512F) on shapes off its tiles: rows not a multiple of 4, inputs not of 16, outputs not
    of 32 (masked panels), members of different ranks, one without an adapter; the torch path on the same adapters."""
    import dataclasses

    from rollout_workers.embedded.low_rank import _native_lora, add_low_rank

    gen = torch.Generator().manual_seed(rows)
    inp, outs = 37, [45, 7, 16, 33]
    members = [_adapter(3, outs[0], inp, seed=1), _adapter(5, outs[1], inp, seed=2), None,
               _adapter(2, outs[3], inp, seed=4, scaling=0.5)]  # fmt: skip
    stacked = stack_low_rank(members, outs)
    assert stacked is not None and (stacked.native is not None) == (_native_lora() is not None)
    x, base = torch.randn(rows, inp, generator=gen), torch.randn(rows, sum(outs), generator=gen)
    want = base.double().clone()
    col = 0
    for member, out in zip(members, outs):
        if member is not None:
            a, b, scaling = member
            want[:, col : col + out] += scaling * (x.double() @ a.double().t()) @ b.double().t()
        col += out
    got = add_low_rank(x, base.clone(), stacked)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[:, 52:68], base[:, 52:68])  # the member without an adapter: untouched
    torch_path = add_low_rank(x, base.clone(), dataclasses.replace(stacked, native=None))
    torch.testing.assert_close(torch_path, got, rtol=1e-5, atol=1e-5)


def test_a_decoded_adapter_version_builds_without_copies_and_runs_like_plain_tensors():
    """int8 adapters decoded from a packed version (the subscriber's path) are run in place: the stacked A of q/k/v
    is one view over the decoded A's, each B^T the decoded buffer itself; the logits equal those of the same values
    handed over as plain tensors (copied), bit for bit."""
    from asyncrl.bench.engine_bench import lora_adapter_tensors
    from quant_sync.export import decode_adapters, pack_adapters
    from rollout_workers.embedded import low_rank
    from rollout_workers.embedded.engine import build_weight_map
    from rollout_workers.embedded.model import KVCache, ModelWeights, prefill

    low_rank._STACKED.clear()  # a fresh build (an earlier test's groups of the same pooled buffer would be reused)
    model_dir, model = _micro()
    base = export_rollout_tensors(model.state_dict(), "int8", quantize_head=True)
    encoded = lora_adapter_tensors(model.state_dict(), rank=4, sync_dtype="int8", seed=3)
    decoded, plain = decode_adapters(pack_adapters(encoded)), decode_adapters(encoded)
    engine = EmbeddedEngine(model_dir, seed=0)
    built = {kind: ModelWeights.build(engine.arch, build_weight_map(WeightUpdate(1, {**base, **adapters}, "int8")))
             for kind, adapters in (("decoded", decoded), ("plain", plain))}  # fmt: skip
    q = "model.layers.0.self_attn.q_proj"
    fast, copied = built["decoded"].layers[0].qkv_lora, built["plain"].layers[0].qkv_lora
    assert fast.a.shape == (12, engine.arch.hidden_size) and fast.a.data_ptr() == decoded[q + LORA_A].data_ptr()
    assert fast.b_t[0].data_ptr() == decoded[q + LORA_B].data_ptr() and torch.equal(fast.b_t[0], plain[q + LORA_B].t())
    assert copied.a.data_ptr() != plain[q + LORA_A].data_ptr() and torch.equal(fast.a, copied.a)
    if fast.native is not None:  # the kernel's panels of B^T: the decoded ones, equal to those made from a copy
        assert fast.panels[0].untyped_storage().data_ptr() == decoded[q + LORA_B].untyped_storage().data_ptr()
        assert all(torch.equal(p_fast, p_copy) for p_fast, p_copy in zip(fast.panels, copied.panels))
    tokens = torch.tensor([PROMPTS[0]])
    logits = []
    for weights in built.values():
        cache = KVCache(engine.arch, slots=1, max_len=16)
        lengths, slots = torch.tensor([tokens.shape[1]]), torch.tensor([0])
        logits.append(prefill(engine.arch, weights, cache, tokens, lengths, torch.tensor([0]), slots))
    assert torch.equal(logits[0], logits[1])


def test_a_pooled_buffers_next_version_reuses_its_stacked_groups_and_runs_its_own_values():
    """A version decoded into a pooled buffer an earlier version used (the subscriber's steady state) builds from
    what `stack_low_rank` kept of that buffer's groups (the same kernel arrays), which holds no tensor: the buffer
    is taken again once its version is dropped, and the logits are the new version's, equal to a plain copy's."""
    import gc

    from asyncrl.bench.engine_bench import lora_adapter_tensors
    from quant_sync.export import decode_adapters, pack_adapters
    from rollout_workers.embedded.engine import build_weight_map
    from rollout_workers.embedded.low_rank import _native_lora
    from rollout_workers.embedded.model import KVCache, ModelWeights, prefill

    gc.collect()  # earlier tests' versions: their pooled buffers idle before the first decode, not after it
    model_dir, model = _micro()
    base = export_rollout_tensors(model.state_dict(), "int8", quantize_head=True)
    engine = EmbeddedEngine(model_dir, seed=0)
    q = "model.layers.0.self_attn.q_proj"
    tokens, lengths, slots = torch.tensor([PROMPTS[0]]), torch.tensor([len(PROMPTS[0])]), torch.tensor([0])

    def build(adapters):
        return ModelWeights.build(engine.arch, build_weight_map(WeightUpdate(1, {**base, **adapters}, "int8")))

    def logits(weights):
        return prefill(engine.arch, weights, KVCache(engine.arch, slots=1, max_len=16), tokens, lengths,
                       torch.tensor([0]), slots)  # fmt: skip

    first = decode_adapters(pack_adapters(lora_adapter_tensors(model.state_dict(), rank=4, sync_dtype="int8", seed=3)))
    where, weights = first[q + LORA_A].data_ptr(), build(first)
    kept = weights.layers[0].qkv_lora.native
    del first, weights
    gc.collect()
    encoded = lora_adapter_tensors(model.state_dict(), rank=4, sync_dtype="int8", seed=5)
    second = decode_adapters(pack_adapters(encoded))
    assert second[q + LORA_A].data_ptr() == where  # the same pooled buffer: nothing kept it
    again = build(second)
    if _native_lora() is not None:
        assert again.layers[0].qkv_lora.native is kept
    assert again.layers[0].qkv_lora.a.data_ptr() == where
    assert torch.equal(logits(again), logits(build(decode_adapters(encoded))))
