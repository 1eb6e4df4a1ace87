"""`learner.fused_attention`: the C++ causal attention gives SDPA's values and gradients (against float64), the same
bits on any thread count, and every call it does not fit goes to HF's SDPA function. Its rotary embedding gives
transformers' bits, forward and backward, and a Llama model on it the bits of the model on the attention alone. On a
CPU without its path (AVX-512F), the model stays on SDPA."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from learner import fused_attention
from learner.fused_attention import IMPLEMENTATION, attention_forward, available, use_fused_attention
from learner.fused_ops import use_fused_ops
from learner.logprobs import response_logp

RUNS = available()  # the kernels' path: AVX-512F with FMA, and the library built


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The query shape of every call that ran the fused kernels."""
    calls: list[tuple[int, ...]] = []
    real, real_rope = fused_attention._AttentionFn.apply, fused_attention._RopeAttentionFn.apply

    def counted(query: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(tuple(query.shape))
        return real(query, *args)

    def counted_rope(query: torch.Tensor, *args: object) -> torch.Tensor:  # rows (B, L, H, D): counted as (B, H, L, D)
        calls.append(tuple(query.transpose(1, 2).shape))
        return real_rope(query, *args)

    monkeypatch.setattr(fused_attention._AttentionFn, "apply", counted)
    monkeypatch.setattr(fused_attention._RopeAttentionFn, "apply", counted_rope)
    return calls


def _qkv(batch: int, heads: int, kv_heads: int, length: int, dim: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, heads, dim, generator=generator).transpose(1, 2)  # HF's layout: views
    k = torch.randn(batch, length, kv_heads, dim, generator=generator).transpose(1, 2)
    v = torch.randn(batch, length, kv_heads, dim, generator=generator).transpose(1, 2)
    return [q, k, v]


def _grads(run: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = run(*leaves)
    out.backward(grad)
    return [out.detach(), *(t.grad for t in leaves)]


def _module(groups: int = 2) -> torch.nn.Module:
    """What HF's attention functions read of an attention module."""
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, groups
    return module


@pytest.mark.parametrize(("heads", "kv_heads", "length", "dim"), [(4, 2, 37, 64), (3, 3, 133, 32), (2, 1, 70, 128)])
def test_values_and_gradients_match_float64_sdpa(heads: int, kv_heads: int, length: int, dim: int,
                                                 fused_calls: list) -> None:  # fmt: skip
    q, k, v = _qkv(2, heads, kv_heads, length, dim)
    grad = torch.randn(2, length, heads, dim, generator=torch.Generator().manual_seed(1))
    module = _module()

    def fused(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> torch.Tensor:
        return attention_forward(module, q_, k_, v_, None)[0]

    module.num_key_value_groups = heads // kv_heads

    def exact(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=heads != kv_heads)
        return out.transpose(1, 2)

    got = _grads(fused, q, k, v, grad)
    expected = _grads(exact, *(t.double() for t in (q, k, v)), grad.double())
    assert fused_calls == ([(2, heads, length, dim)] if RUNS else [])
    for mine, ref in zip(got, expected):
        assert mine.dtype == torch.float32 and mine.shape == ref.shape
        torch.testing.assert_close(mine.double(), ref, rtol=0, atol=3e-5)


def test_any_thread_count_gives_the_same_bits(fused_calls: list) -> None:
    q, k, v = _qkv(3, 4, 2, 61, 64, seed=2)
    grad = torch.randn(3, 61, 4, 64, generator=torch.Generator().manual_seed(3))
    results = []
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(_grads(lambda *t: attention_forward(_module(), *t, None)[0], q, k, v, grad))
    finally:
        torch.set_num_threads(previous)
    assert len(fused_calls) == (2 if RUNS else 0)
    if RUNS:  # SDPA's kernel (elsewhere) makes no such promise
        assert all(torch.equal(a, b) for a, b in zip(*results))


def test_calls_it_does_not_fit_go_to_sdpa_with_their_arguments(fused_calls: list) -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v = _qkv(2, 4, 2, 9, 64)
    padded = torch.ones(2, 1, 9, 9, dtype=torch.bool).tril()
    padded[1, :, :, 7:] = False
    not_causal = _module()
    not_causal.is_causal = False
    cases = [
        (_module(), q, k, v, padded, {}),  # a mask: padding or packed rows
        (_module(), q, k, v, None, {"dropout": 0.1}),
        (_module(), q.double(), k.double(), v.double(), None, {}),
        (_module(), *_qkv(2, 4, 2, 9, 16), None, {}),  # head size 16
        (_module(), q, *(t[:, :, :5] for t in (k, v)), None, {}),  # keys from a cache: other lengths
        (not_causal, q, k, v, None, {}),
        (_module(), q[:, :, :1], k[:, :, :1], v[:, :, :1], None, {}),  # one token
        (_module(), *_qkv(1, 2, 1, fused_attention.MAX_LEN + 1, 32), None, {}),  # a long row
    ]
    for module, q_, k_, v_, mask, kwargs in cases:
        torch.manual_seed(0)
        got = attention_forward(module, q_, k_, v_, mask, **kwargs)[0]
        torch.manual_seed(0)
        expected = sdpa_attention_forward(module, q_, k_, v_, mask, **kwargs)[0]
        assert torch.equal(got, expected)
    assert fused_calls == []


def test_under_bf16_autocast_it_runs_on_the_upcast_inputs_in_fp32(fused_calls: list) -> None:
    """`precision.train=bf16`: the projections give bf16 q, k, v; the kernels take them upcast (SDPA's CPU path would
    run the attention in bf16, 2.0 s of a 8.7 s one-thread step of the e2e decode shape against 0.7 s fused)."""
    q, k, v = (t.bfloat16() for t in _qkv(2, 4, 2, 9, 64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = attention_forward(_module(), q, k, v, None)[0]
    assert len(fused_calls) == (1 if RUNS else 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # another dtype than autocast's still goes to SDPA
        attention_forward(_module(), q.half(), k.half(), v.half(), None)
    assert len(fused_calls) == (1 if RUNS else 0)
    expected = attention_forward(_module(), q.float(), k.float(), v.float(), None)[0]  # no autocast: fp32 inputs
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    plain, fused = _pair(seed=4)  # a Llama model: the rotary kernel too, its logits and gradients near HF's
    use_fused_ops(fused)
    fused_calls.clear()
    ids = torch.randint(0, 40, (3, 19), generator=torch.Generator().manual_seed(8))
    runs = []
    for model in (plain, fused):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        runs.append([out.logits.detach().float(), *(p.grad for p in model.parameters())])
    assert fused_calls == [(3, 2, 19, 64)] * (2 if RUNS else 0)
    for got, hf in zip(runs[1], runs[0]):
        assert float((got - hf).abs().max()) <= 0.02 * float(hf.abs().max())


def _pair(seed: int = 0) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    config = LlamaConfig(vocab_size=40, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(seed)
    plain = LlamaForCausalLM(config).train()
    fused = LlamaForCausalLM(copy.deepcopy(config)).train()  # a config of its own: the fused one changes it
    fused.load_state_dict(plain.state_dict())
    return plain, fused


def test_a_model_moves_onto_it_where_its_cpu_runs_it_and_keeps_its_values(fused_calls: list, tmp_path) -> None:  # noqa: ANN001
    plain, fused = _pair()
    assert plain.config._attn_implementation == "sdpa"
    assert use_fused_ops(fused)["attention"] is RUNS
    assert fused.config._attn_implementation == (IMPLEMENTATION if RUNS else "sdpa")
    ids = torch.randint(0, 40, (3, 11), generator=torch.Generator().manual_seed(5))
    results = []
    for model in (plain, fused):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        results.append((out.logits.detach(), [p.grad for p in model.parameters()]))
    assert fused_calls == ([(3, 2, 11, 64)] * 2 if RUNS else [])  # one call a layer
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    for got, expected in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    fused.save_pretrained(tmp_path)  # what the learner exports: a directory any transformers loads
    assert IMPLEMENTATION not in json.dumps(json.loads((tmp_path / "config.json").read_text()))


PROMPT, RESPONSE = 4, 20
"""`_packed_case`'s shape: long responses behind a short shared prompt, what packs as tokens (`learner.packing`)."""


def _packed_case(seed: int) -> tuple[torch.Tensor, ...]:
    """Two groups of 3 rows behind a shared prompt, two of the responses shorter (right padding)."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, 40, (2, PROMPT), generator=generator).repeat_interleave(3, 0)
    ids = torch.cat([prompt, torch.randint(1, 40, (6, RESPONSE), generator=generator)], dim=1)
    mask = torch.ones(6, RESPONSE)
    mask[1, 13:], mask[4, 18:] = 0, 0
    attention = torch.cat([torch.ones(6, PROMPT, dtype=torch.long), mask.long()], dim=1)
    weights = torch.randn(6, RESPONSE, generator=generator) * mask
    positions = torch.arange(PROMPT, PROMPT + RESPONSE).repeat(6, 1)
    return ids, attention, positions, mask, torch.tensor([0] * 3 + [1] * 3), weights


def _packed_logp(model: torch.nn.Module, case: tuple[torch.Tensor, ...], groups: bool) -> list[torch.Tensor]:
    ids, attention, pos, mask, group_index, weights = case
    model.zero_grad(set_to_none=True)
    logp, _ = response_logp(model, ids, attention, pos, ids[:, PROMPT:] * mask.long(), mask, 0.7,
                            groups=group_index if groups else None)  # fmt: skip
    (logp * weights).sum().backward()
    return [logp.detach(), *(p.grad for p in model.parameters())]


def _on_fused_attention(model: torch.nn.Module) -> None:
    """The model on the fused attention, and on its kernels where this CPU runs them (elsewhere the attention
    function gives every call to SDPA: the row layout still applies)."""
    use_fused_ops(model)
    fused_attention._register()
    model.config._attn_implementation = IMPLEMENTATION


@pytest.mark.parametrize("rope", [True, False])
def test_packed_tokens_attend_as_their_rows_with_the_kernels(fused_calls: list, rope: bool) -> None:
    from transformers.models.llama.modeling_llama import LlamaAttention

    from learner.packing import pack_groups

    plain, fused = _pair(seed=1)
    _on_fused_attention(fused)
    if not rope:  # transformers' rotation on the packed tokens, then the attention function's own row gather
        for layer in fused.model.layers:
            layer.self_attn.__class__ = LlamaAttention
    case = _packed_case(seed=6)
    ids, attention, _, _, group_index, _ = case
    width = PROMPT + RESPONSE - 1  # the tokens the loss reads
    packed = pack_groups(ids[:, :width], attention[:, :width], group_index, IMPLEMENTATION)
    assert packed is not None and packed.rows is not None
    assert packed.tokens == PROMPT * 2 + int(attention[:, PROMPT:width].sum())  # each prompt once, no padding
    got = _packed_logp(fused, case, groups=True)
    expected = _packed_logp(plain, case, groups=False)  # SDPA row by row, with the padding mask
    assert fused_calls == [(6, 2, PROMPT + RESPONSE - 1, 64)] * (2 if RUNS else 0)  # each layer: the rows
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=2e-6)
    for mine, ref in zip(got[1:], expected[1:]):
        torch.testing.assert_close(mine, ref, rtol=0, atol=5e-6 * float(ref.abs().max()))


def test_packed_rows_the_kernels_do_not_take_run_sdpa_on_the_gathered_rows(
    fused_calls: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain, fused = _pair(seed=3)
    _on_fused_attention(fused)
    monkeypatch.setattr(fused_attention, "MAX_LEN", 8)  # rows of 23 positions: too long for the kernels
    case = _packed_case(seed=8)
    got = _packed_logp(fused, case, groups=True)
    expected = _packed_logp(plain, case, groups=False)
    assert fused_calls == []
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=2e-6)
    for mine, ref in zip(got[1:], expected[1:]):
        torch.testing.assert_close(mine, ref, rtol=0, atol=5e-6 * float(ref.abs().max()))


def test_capped_to_avx2_switched_off_or_off_the_cpu_the_model_stays_on_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    _, model = _pair()
    assert not use_fused_attention(model, enabled=False)
    with torch.device("meta"):  # parameters off the CPU (a GPU learner): SDPA's kernels stay
        elsewhere = LlamaForCausalLM(copy.deepcopy(model.config))
    assert not use_fused_attention(elsewhere) and elsewhere.config._attn_implementation == "sdpa"
    monkeypatch.setenv("ASYNCRL_ISA_CAP", "avx2")
    assert not available() and not use_fused_attention(model)
    assert model.config._attn_implementation == "sdpa"


def _rotary(batch: int, length: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Llama rotary tables (batch, length, dim) at random positions."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=dim * 2, num_attention_heads=2, max_position_embeddings=512)
    positions = torch.randint(0, 400, (batch, length), generator=torch.Generator().manual_seed(seed))
    return LlamaRotaryEmbedding(config)(torch.zeros(1), positions)


@pytest.mark.parametrize(("batch", "rotary_batch", "heads", "dim"), [(3, 3, 4, 64), (2, 1, 2, 32), (1, 1, 3, 128)])
def test_the_rotary_kernels_give_transformers_bits_forward_and_backward(batch: int, rotary_batch: int, heads: int,
                                                                         dim: int) -> None:  # fmt: skip
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    lib = fused_attention.LIBRARY.require("test")  # plain C++: built on every CPU that builds the library
    length, generator = 29, torch.Generator().manual_seed(dim)
    cos, sin = _rotary(rotary_batch, length, dim, seed=heads)
    x = torch.randn(batch, length, heads, dim, generator=generator, requires_grad=True)
    grad = torch.randn(batch, length, heads, dim, generator=generator)
    expected, _ = apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), cos, sin)  # HF's (B, H, L, D) views
    expected = expected.transpose(1, 2)
    expected.backward(grad)
    got = fused_attention._rope(lib.ta_rope, x.detach(), cos, sin, torch.empty_like(x))
    assert torch.equal(got, expected.detach())
    assert torch.equal(fused_attention._rope(lib.ta_rope_backward, grad, cos, sin, torch.empty_like(grad)), x.grad)
    in_place = grad.clone()  # what the backward does with the attention's dq and dk
    assert torch.equal(fused_attention._rope(lib.ta_rope_backward, in_place, cos, sin, in_place), x.grad)


def test_llama_attention_with_the_rotary_kernel_gives_the_bits_of_the_attention_alone(
    fused_calls: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers.models.llama.modeling_llama import LlamaAttention

    plain, fused = _pair(seed=2)
    for model in (plain, fused):
        use_fused_ops(model)
    attention_types = {type(layer.self_attn) for layer in fused.model.layers}
    assert attention_types == ({fused_attention._fused_rope_class()} if RUNS else {LlamaAttention})
    for layer in plain.model.layers:  # the reference: transformers' rotary embedding, then the same attention kernel
        layer.self_attn.__class__ = LlamaAttention
    ids = torch.randint(0, 40, (3, 19), generator=torch.Generator().manual_seed(7))
    results = []
    for model in (plain, fused):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        results.append([out.logits.detach(), *(p.grad for p in model.parameters())])
    assert fused_calls == [(3, 2, 19, 64)] * (4 if RUNS else 0)  # each model's two layers: the plain then the rotary
    assert all(torch.equal(got, expected) for got, expected in zip(results[1], results[0]))
    real = fused_attention.fp32_kernel_inputs

    def rows_not_plain(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...] | None:  # q, k, v rows as if wrapped
        return None if len(tensors) == 5 and tensors[0].shape[1:] == (19, 2, 64) else real(*tensors)

    monkeypatch.setattr(fused_attention, "fp32_kernel_inputs", rows_not_plain)
    fused.zero_grad(set_to_none=True)
    fused_calls.clear()
    out = fused(input_ids=ids, labels=ids)
    out.loss.backward()
    assert fused_calls == [(3, 2, 19, 64)] * (2 if RUNS else 0)  # transformers' rotation, then the attention alone
    rotated_apart = [out.logits.detach(), *(p.grad for p in fused.parameters())]
    assert all(torch.equal(got, expected) for got, expected in zip(rotated_apart, results[0]))
    monkeypatch.setattr(fused_attention, "fp32_kernel_inputs", real)
    padded = torch.ones_like(ids)
    padded[0, :4] = 0  # a padding mask: transformers' forward, SDPA with the mask
    fused_calls.clear()
    with torch.no_grad():
        got, expected = (model(input_ids=ids, attention_mask=padded).logits for model in (fused, plain))
    assert fused_calls == []
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    fused_calls.clear()
    with torch.no_grad():  # a KV cache (the prefill's too): transformers' forward, which writes the cache
        generated = [model.eval().generate(ids[:1, :5], max_new_tokens=6, do_sample=False) for model in (fused, plain)]
    assert torch.equal(generated[0], generated[1])
    assert len(fused_calls) == (4 if RUNS else 0) and all(shape[2] == 5 for shape in fused_calls)  # the prefills'
    # attention (keys as long as the queries), after transformers' rotation; the decode steps' go to SDPA
