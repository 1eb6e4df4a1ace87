"""`learner.fused_ops`: the learner's fused RMSNorm and SwiGLU give HF's values and gradients to fp32 rounding, the
same bits on every vector path and thread count, and are swapped in only where a module's own forward agrees."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_learner import tiny_batch, tiny_config, tiny_model, with_behavior
from transformers import GemmaConfig, GemmaForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from learner import fused_attention, fused_ops
from learner.acrl import AcrlReference
from learner.fused_ops import FusedMLP, FusedRMSNorm, rms_norm, swiglu, use_fused_ops
from learner.precision import LossScaler
from learner.update import train_on_batch

ISAS = range(fused_ops.best_isa() + 1)  # every vector path this CPU runs


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = LlamaRMSNorm(x.shape[-1], eps=eps).to(x.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm(x)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", [(1, 8), (5, 37), (130, 64), (2, 3, 96)])
def test_rms_norm_and_its_gradients_match_float64(isa: int, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    x, grad = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    weight = 1.0 + 0.3 * torch.randn(shape[-1], generator=gen)
    x64, w64 = x.double().requires_grad_(), weight.double().requires_grad_()
    ref_grads = torch.autograd.grad(_functional_rms(x64, w64, 1e-6), (x64, w64), grad.double())
    x32, w32 = x.clone().requires_grad_(), weight.clone().requires_grad_()
    out = rms_norm(x32, w32, 1e-6, isa=isa)
    out.backward(grad)
    torch.testing.assert_close(out.double(), _functional_rms(x64, w64, 1e-6).detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x32.grad.double(), ref_grads[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w32.grad.double(), ref_grads[1], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out, _hf_rms_norm(x, weight, 1e-6), rtol=1e-6, atol=1e-6)  # HF's module, fp32


def _functional_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("isa", ISAS)
def test_swiglu_and_its_gradients_match_float64_over_the_sigmoid_s_whole_range(isa: int) -> None:
    gen = torch.Generator().manual_seed(1)
    gate = torch.cat([torch.randn(3000, generator=gen) * 4, torch.tensor([-1e4, -120.0, -87.5, -20.0, 0.0, 20.0, 1e4])])
    up, grad = torch.randn(gate.shape, generator=gen), torch.randn(gate.shape, generator=gen)
    g64, u64 = gate.double().requires_grad_(), up.double().requires_grad_()
    ref = F.silu(g64) * u64
    ref_grads = torch.autograd.grad(ref, (g64, u64), grad.double())
    g32, u32 = gate.clone().requires_grad_(), up.clone().requires_grad_()
    out = swiglu(g32, u32, isa=isa)
    out.backward(grad)
    assert torch.isfinite(out).all() and torch.isfinite(g32.grad).all() and torch.isfinite(u32.grad).all()
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g32.grad.double(), ref_grads[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(u32.grad.double(), ref_grads[1], rtol=1e-5, atol=1e-5)


def test_every_vector_path_and_thread_count_gives_the_same_bits() -> None:
    gen = torch.Generator().manual_seed(2)
    x, grad_x = torch.randn(300, 131, generator=gen), torch.randn(300, 131, generator=gen)  # above the parallel size
    weight = torch.randn(131, generator=gen)
    gate, up, grad_h = (torch.randn(41_000, generator=gen) for _ in range(3))
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for isa in ISAS:
                leaves = [t.clone().requires_grad_() for t in (x, weight, gate, up)]
                norm, act = rms_norm(leaves[0], leaves[1], 1e-5, isa=isa), swiglu(leaves[2], leaves[3], isa=isa)
                torch.autograd.backward([norm, act], [grad_x, grad_h])
                results.append([norm.detach(), act.detach(), *(leaf.grad for leaf in leaves)])
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_an_isa_this_cpu_does_not_run_and_mismatched_shapes_are_refused() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="fused ops ISA 3: this CPU runs 0.."):
        rms_norm(x, torch.ones(8), 1e-6, isa=3)
    with pytest.raises(ValueError, match="input width 8 against a weight of 9"):
        rms_norm(x, torch.ones(9), 1e-6)
    with pytest.raises(ValueError, match=r"gate \(2, 8\) and up \(2, 9\) differ"):
        swiglu(x, torch.randn(2, 9))


def _llama(seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=40, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).train()


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_swapped_model_keeps_its_values_gradients_state_dict_and_random_stream(family: str) -> None:
    if family == "llama":
        plain, swapped = _llama(), _llama()
        expected = 2 + 5  # two MLPs; two norms a layer and the final one
    else:
        config = Qwen3Config(vocab_size=40, hidden_size=64, intermediate_size=96, num_hidden_layers=2, head_dim=16,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
        torch.manual_seed(0)
        plain = Qwen3ForCausalLM(config).train()
        swapped = Qwen3ForCausalLM(config).train()
        swapped.load_state_dict(plain.state_dict())
        expected = 2 + 5 + 4  # and each attention's q and k norms
    rng = torch.random.get_rng_state()
    done = use_fused_ops(swapped)
    assert done == {"swapped": expected, "isa": fused_ops.kernel_isa(), "attention": fused_attention.available()}
    assert torch.equal(torch.random.get_rng_state(), rng)  # the probes drew from a forked stream
    assert sum(isinstance(m, (FusedMLP, FusedRMSNorm)) for m in swapped.modules()) == expected
    assert list(swapped.state_dict()) == list(plain.state_dict())
    ids = torch.randint(0, 40, (3, 11), generator=torch.Generator().manual_seed(3))
    (logits, grads), (fused_logits, fused_grads) = _loss_and_grads(plain, ids), _loss_and_grads(swapped, ids)
    torch.testing.assert_close(fused_logits, logits, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_modules_whose_forward_differs_or_does_not_apply_keep_their_own() -> None:
    model = _llama()
    model.model.layers[0].mlp.act_fn = torch.nn.GELU()  # its forward is no longer silu(gate) * up
    assert use_fused_ops(model)["swapped"] == 1 + 5
    assert not isinstance(model.model.layers[0].mlp, FusedMLP) and isinstance(model.model.layers[1].mlp, FusedMLP)
    gemma = GemmaForCausalLM(GemmaConfig(vocab_size=40, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16))  # fmt: skip
    assert use_fused_ops(gemma)["swapped"] == 0  # (1 + weight) norms: not a family of the Llama formula
    bf16 = _llama().to(torch.bfloat16)
    assert use_fused_ops(bf16)["swapped"] == 0
    off = _llama()
    assert use_fused_ops(off, enabled=False) == {"swapped": 0, "isa": "off", "attention": False}
    assert not any(isinstance(m, (FusedMLP, FusedRMSNorm)) for m in off.modules())


def test_under_bf16_autocast_a_swapped_model_runs_the_fused_ops_in_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """`precision.train=bf16`: the norms, the MLP product and the attention run fused in fp32 on the upcast inputs
    (HF's ops in bf16 cost a one-thread step of the e2e decode shape 8.7 s against 6.4 s), the linears in bf16 as
    autocast runs them: logits and gradients within bf16 rounding of HF's autocast run and of fp32 training's."""
    calls: list[str] = []
    real_norm, real_swiglu = fused_ops._RmsNormFn.apply, fused_ops._SwigluFn.apply
    monkeypatch.setattr(fused_ops._RmsNormFn, "apply", lambda *a: calls.append("norm") or real_norm(*a))
    monkeypatch.setattr(fused_ops._SwigluFn, "apply", lambda *a: calls.append("swiglu") or real_swiglu(*a))
    ids = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(4))
    runs = {}
    for name, fused, dtype in (("hf", False, torch.bfloat16), ("fused", True, torch.bfloat16), ("fp32", False, None)):
        model = _llama()
        use_fused_ops(model, fused)
        calls.clear()  # the swap's probes
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            logits = model(input_ids=ids).logits
        logits.float().square().mean().backward()
        runs[name] = [logits.detach().float(), *(p.grad for p in model.parameters())]
        if fused:
            assert calls.count("norm") == 2 * 2 + 1 and calls.count("swiglu") == 2  # each norm and MLP, forward
    for fused, hf, fp32 in zip(runs["fused"], runs["hf"], runs["fp32"]):  # logits, then each parameter's gradient
        scale = float(fp32.abs().max())
        assert float((fused - hf).abs().max()) <= 0.02 * scale  # measured at most 0.0093: bf16 linears both sides
        assert float((fused - fp32).abs().max()) <= 0.03 * scale  # 0.013, where HF's autocast run is 0.014 off


def test_a_learner_step_with_fused_ops_is_the_step_without_to_rounding() -> None:
    cfg = tiny_config()
    params = []
    for fused in (False, True):
        model = tiny_model()
        assert use_fused_ops(model, fused)["swapped"] == (2 + 5 if fused else 0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
        batch = with_behavior(tiny_batch(), model)
        result = train_on_batch(model, optimizer, LossScaler(enabled=False), batch, cfg, AcrlReference(cfg.loss.acrl))
        assert not result.skipped
        params.append([p.detach().clone() for p in model.parameters()])
    for fused, plain in zip(params[1], params[0]):
        torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-5)


def test_the_isa_cap_holds_the_fused_ops_to_avx2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCRL_ISA_CAP", "avx2")
    assert fused_ops.best_isa() <= 1 and fused_ops.kernel_isa() in ("avx2", "baseline")
    with pytest.raises(ValueError, match=r"fused ops ISA 2: this CPU runs 0\.\.[01] "):
        swiglu(torch.randn(4), torch.randn(4), isa=2)
    monkeypatch.setenv("ASYNCRL_ISA_CAP", "sse2")
    with pytest.raises(ValueError, match="ASYNCRL_ISA_CAP='sse2' is not one of avx2"):
        fused_ops.best_isa()
