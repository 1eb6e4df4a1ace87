"""Rollout-aligned forward (QaRL): quantized forward = quant_sync's, straight-through backward, published operands."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_learner import tiny_batch, tiny_config, tiny_model, with_behavior

from common.config import ConfigError, load_config, to_dict
from learner.acrl import AcrlReference
from learner.aligned import AlignedLinear, aligned_layers, full_precision, install_operands, make_rollout_aligned
from learner.batch import token_logp
from learner.precision import LossScaler
from learner.sections import LearnerSections
from learner.update import train_on_batch
from quant_sync.export import export_rollout_tensors
from quant_sync.quantizers import dequantize_published, quantize_weight, quantize_weight_only, quantized_linear
from rollout_workers.embedded.fp8_linear import available_kernels as fp8_kernels
from rollout_workers.embedded.fused_decode import PackedLinear
from rollout_workers.embedded.int8_linear import available_kernels as int8_kernels
from rollout_workers.embedded.model import PackedFp32

W8A8 = ("int8", "fp8", "fp8_trunc")


def _layer(scheme: str, seed: int = 0) -> AlignedLinear:
    torch.manual_seed(seed)
    layer = torch.nn.Linear(48, 24)
    layer.__class__ = AlignedLinear
    layer.enable(scheme, cache=True)
    return layer


@pytest.mark.parametrize("scheme", W8A8)
def test_forward_is_quantized_linear_bit_for_bit(scheme):
    layer = _layer(scheme)
    x = torch.randn(3, 5, 48)
    expected = quantized_linear(x, quantize_weight(layer.weight, scheme), layer.bias)
    assert torch.equal(layer(x), expected)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 training: the aligned layer still computes like rollout
        assert torch.equal(layer(x), expected)


@pytest.mark.parametrize("scheme", ["w8a16", "w4a16"])
def test_weight_only_forward_is_the_engines_dequantized_matmul(scheme):
    layer = _layer(scheme)
    x = torch.randn(7, 48)
    q, scale = quantize_weight_only(layer.weight, scheme)
    assert torch.equal(layer(x), F.linear(x, dequantize_published(q, scale, scheme), layer.bias))


@pytest.mark.parametrize("scheme", ["int8", "fp8", "w4a16"])
def test_backward_is_the_straight_through_full_precision_gradient(scheme):
    layer = _layer(scheme)
    x = torch.randn(4, 6, 48, requires_grad=True)
    upstream = torch.randn(4, 6, 24)
    layer(x).backward(upstream)
    aligned_grads = [x.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone()]
    x.grad = layer.weight.grad = layer.bias.grad = None
    F.linear(x, layer.weight, layer.bias).backward(upstream)  # STE: the quantizers count as the identity
    for got, want in zip(aligned_grads, [x.grad, layer.weight.grad, layer.bias.grad]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))  # while the forward is quantized


def test_published_tensors_are_the_forward_operands_until_the_weights_change():
    model = tiny_model()
    make_rollout_aligned(model, "int8")
    published = export_rollout_tensors(model.state_dict(), "int8")
    install_operands(model, published, "int8")
    layers = dict(aligned_layers(model))
    assert len(layers) == 2 * 7
    batch = tiny_batch()
    token_logp(model, batch, 1.0)[0].sum().backward()
    for name, layer in layers.items():
        assert layer.quantize_calls == 0  # no second quantization: the forward used the published tensors
        assert layer.operand().q is published[name + ".weight"]
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    token_logp(model, batch, 1.0)
    assert all(layer.quantize_calls == 1 for layer in layers.values())  # new weights: quantized once, then cached
    refreshed = export_rollout_tensors(model.state_dict(), "int8")
    for name, layer in layers.items():
        assert torch.equal(layer.operand().q, refreshed[name + ".weight"])


def test_aligned_learner_step_trains_the_master_weights_through_the_quantized_forward():
    model = tiny_model()
    reference = tiny_model()
    make_rollout_aligned(model, "int8")
    batch = with_behavior(tiny_batch(), reference)
    aligned_logp = token_logp(model, batch, 1.0, share_prefix=True)[0]  # as the step packs the rows
    with full_precision(model):
        assert torch.equal(token_logp(model, batch, 1.0)[0], token_logp(reference, batch, 1.0)[0])
    assert not torch.equal(aligned_logp, token_logp(reference, batch, 1.0)[0])
    cfg = tiny_config("learner.rollout_aligned=true", "quant.scheme=int8")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    result = train_on_batch(model, optimizer, LossScaler(enabled=False), batch, cfg, AcrlReference(cfg.loss.acrl))
    assert not result.skipped and result.metrics["norm_update"] > 0
    assert torch.equal(result.prox_logp, aligned_logp * batch.mask + result.prox_logp * (1 - batch.mask))
    moved = [name for name, p in model.named_parameters() if not torch.equal(p, reference.state_dict()[name])]
    assert "model.layers.0.self_attn.q_proj.weight" in moved  # master weights of aligned layers got gradients


def test_learner_publishes_exactly_the_operands_of_its_forward():
    from common.builtin_model import resolve_model_path
    from learner.trainer import Learner

    model_dir = str(resolve_model_path("builtin:micro", log=lambda *_: None))
    cfg = load_config(None, ["model.path=builtin:micro", "learner.rollout_aligned=true", "quant.scheme=fp8"])
    learner = Learner(to_dict(LearnerSections.pick(cfg)), model_dir, "tcp://127.0.0.1:9")
    try:
        sent: dict[str, torch.Tensor] = {}
        learner.publisher.publish = lambda version, tensors, scheme: sent.update(tensors)
        learner._publish(1)
        layers = dict(aligned_layers(learner.model))
        assert layers
        for name, layer in layers.items():
            assert layer.operand().q is sent[name + ".weight"] and layer.operand().scale is sent[name + ".weight_scale"]
    finally:
        learner.close()


def test_rollout_aligned_needs_a_quantized_scheme():
    with pytest.raises(ConfigError, match="learner.rollout_aligned"):
        load_config(None, ["learner.rollout_aligned=true", "quant.scheme=none"])
    with pytest.raises(ValueError, match="quant.scheme"):
        make_rollout_aligned(tiny_model(), "none")


def _engine_and_learner_gaps(scheme: str, head: bool = False):
    """Sample from the embedded engine on builtin:micro's published `scheme` weights; return the largest |log-prob
    gap| between its behavior log-probs and the plain fp32 model's, then the rollout-aligned model's, and the
    engine."""
    from transformers import AutoModelForCausalLM

    from common.builtin_model import resolve_model_path
    from quant_sync.update import WeightUpdate
    from rollout_workers.embedded.engine import EmbeddedEngine
    from rollout_workers.engine import SamplingParams

    model_dir = resolve_model_path("builtin:micro", log=lambda *_: None)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine = EmbeddedEngine(str(model_dir), seed=0)
    published = export_rollout_tensors(model.state_dict(), scheme, quantize_head=head)
    engine.stage_weights(WeightUpdate(0, published, scheme))
    prompts = [[1, 4, 5, 13, 6, 7, 15], [1, 9, 14, 3, 15]]
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=10, seed=1))

    def logp(net: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
        with torch.no_grad():
            out = net(torch.tensor([prompt + response])).logits[0].log_softmax(-1)
        return out[len(prompt) - 1 : -1].gather(1, torch.tensor(response)[:, None]).squeeze(1)

    plain_gap, aligned_gap = 0.0, 0.0
    for prompt, completion in zip(prompts, completions):
        behav = torch.tensor(completion.behav_logp)
        plain_gap = max(plain_gap, float((logp(model, prompt, completion.response_ids) - behav).abs().max()))
    make_rollout_aligned(model, scheme, head=head)
    for prompt, completion in zip(prompts, completions):
        behav = torch.tensor(completion.behav_logp)
        aligned_gap = max(aligned_gap, float((logp(model, prompt, completion.response_ids) - behav).abs().max()))
    return plain_gap, aligned_gap, engine


@pytest.mark.parametrize("head", [False, True], ids=["fp32_head", "quantized_head"])
@pytest.mark.parametrize("scheme", ["int8", "fp8", "fp8_trunc"])
def test_aligned_learner_logp_matches_the_quantized_engine(scheme, head):
    """The point of QaRL: the learner's pi_theta is the rollout engine's mu on the same published weights, with the
    LM head quantized too (`quant.lm_head`) or not."""
    plain_gap, aligned_gap, engine = _engine_and_learner_gaps(scheme, head)
    assert aligned_gap < 1e-5 and plain_gap > 100 * aligned_gap, (aligned_gap, plain_gap)
    float_head = isinstance(engine._weights.head, (torch.Tensor, PackedLinear, PackedFp32))
    assert float_head != head  # a quantized head runs the quantized kernel


@pytest.mark.parametrize(
    ("scheme", "kernel"),
    [("int8", kernel) for kernel in int8_kernels()] + [("fp8_trunc", kernel) for kernel in fp8_kernels()],
)
def test_aligned_learner_logp_matches_the_engine_on_every_kernel(scheme, kernel, monkeypatch):
    """Each kernel the engine may dispatch to (ASYNCRL_INT8_KERNEL / ASYNCRL_FP8_KERNEL force one) keeps the
    agreement: exact int8 arithmetic, and FP8's exact products summed in the kernel's fp32 order."""
    from rollout_workers.embedded import fp8_linear, int8_linear

    module = int8_linear if scheme == "int8" else fp8_linear
    monkeypatch.setenv(module.ENV_KERNEL, kernel)
    plain_gap, aligned_gap, engine = _engine_and_learner_gaps(scheme, head=True)
    if kernel != "onednn":  # oneDNN's small int8 weights run as exact fp32 GEMMs (model.UPCAST_INT8_MAX_ELEMENTS)
        assert engine._weights.layers[0].gate_up.kernel == kernel
    assert aligned_gap < 1e-5 and plain_gap > 100 * aligned_gap, (aligned_gap, plain_gap)
