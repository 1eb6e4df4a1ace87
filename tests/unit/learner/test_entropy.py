"""The entropy bonus (`loss.entropy_coef`): the entropy of pi_theta from the log-probs' own head chunks, with its
gradient, equal to a direct full-vocabulary computation; its term in the loss; nothing extra when the coefficient is 0.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_learner import VOCAB, tiny_batch, tiny_config, tiny_model, with_behavior

import learner.logprobs as logprobs
from common.config import LossConfig
from learner.acrl import AcrlReference
from learner.batch import Batch, token_logp
from learner.losses import LossInputs, policy_loss
from learner.precision import LossScaler
from learner.update import metric_names, train_on_batch


def direct_entropy(model: torch.nn.Module, batch: Batch, temperature: float) -> torch.Tensor:
    """-sum_v p log p (B, T) of the model's forward at every response position, with grad (0 on padding)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()  # (B, S, V)
    pos = (batch.response_pos - 1).clamp_min(0)
    picked = logits.gather(1, pos[..., None].expand(-1, -1, logits.shape[-1])) / temperature  # (B, T, V)
    probs = torch.softmax(picked, dim=-1)
    return -(probs * torch.log(probs)).sum(-1) * batch.mask


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("rows_per_chunk", [5, 1000])  # several checkpointed chunks; one chunk kept for backward
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_entropy_with_grad_equals_a_direct_computation(rows_per_chunk, temperature, monkeypatch):
    monkeypatch.setattr(logprobs, "LOGITS_CHUNK_ELEMENTS", rows_per_chunk * VOCAB)
    model, batch = tiny_model(seed=4), tiny_batch(seed=4)
    weights = torch.rand(batch.mask.shape, generator=torch.Generator().manual_seed(1)) * batch.mask
    expected = direct_entropy(model, batch, temperature)
    (expected * weights).sum().backward()
    expected_grads = _grads(model)
    with logprobs.entropy_with_grad():
        logp, entropy = token_logp(model, batch, temperature)
    assert entropy.requires_grad
    m = batch.mask.bool()
    torch.testing.assert_close(entropy[m], expected[m].detach(), rtol=0.0, atol=1e-6)
    assert not entropy[~m].any()
    (entropy * weights).sum().backward()
    grads = _grads(model)
    assert grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        # the decoder runs without each row's last token (learner.logprobs.inputs_read): other GEMM shapes, rounding
        torch.testing.assert_close(grads[name], grad, rtol=0.0, atol=4e-6 * float(grad.abs().max()) + 1e-9)
    # outside the block (loss.entropy_coef = 0): the same values, detached, no backward through them
    logp_plain, entropy_plain = token_logp(model, batch, temperature)
    assert not entropy_plain.requires_grad and torch.equal(entropy_plain, entropy.detach())
    assert torch.equal(logp_plain, logp)


@pytest.mark.parametrize(("agg", "weighting"), [("token_mean", "none"), ("seq_mean_token_mean", "tis"),
                                                ("token_mean", "tbpo")])  # fmt: skip
def test_the_entropy_term_is_minus_coef_times_the_aggregated_entropy(agg, weighting):
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    entropy = torch.tensor([[1.0, 2.0, 3.0], [6.0, 9.0, 9.0]], requires_grad=True)
    logp = torch.log(torch.full((2, 3), 0.5))
    inputs = LossInputs(behav_logp=logp, prox_logp=logp, cur_logp=logp.clone().requires_grad_(), mask=mask,
                        advantages=torch.tensor([1.0, -1.0]), max_len=3, cur_entropy=entropy)  # fmt: skip
    plain = policy_loss(inputs, LossConfig(weighting=weighting, agg=agg))
    out = policy_loss(inputs, LossConfig(weighting=weighting, agg=agg, entropy_coef=0.1))
    # by hand: token_mean (1+2+3+6)/4 = 3; the mean of the per-response means (2 + 6)/2 = 4 (tbpo: per response)
    expected = 3.0 if (agg == "token_mean" and weighting != "tbpo") else 4.0
    assert out.metrics["loss/entropy"] == pytest.approx(expected)
    assert float(out.loss.detach()) == pytest.approx(float(plain.loss.detach()) - 0.1 * expected)
    assert "loss/entropy" not in plain.metrics
    (grad,) = torch.autograd.grad(out.loss, entropy)
    assert grad[0, 0] < 0 and not grad[1, 1:].any()  # more entropy lowers the loss; padding gets nothing


def test_the_entropy_term_needs_the_entropy():
    logp = torch.zeros((1, 1))
    inputs = LossInputs(behav_logp=logp, prox_logp=logp, cur_logp=logp, advantages=torch.ones(1),
                        mask=torch.ones((1, 1)), max_len=1)  # fmt: skip
    with pytest.raises(ValueError, match="loss.entropy_coef"):
        policy_loss(inputs, LossConfig(entropy_coef=0.1))


def test_a_train_step_with_the_bonus_raises_the_entropy_and_reports_it():
    """Zero advantages (every reward equal): the step's only gradient is the bonus's, and the entropy goes up."""
    model = tiny_model(seed=6)
    batch = with_behavior(tiny_batch(seed=6), copy.deepcopy(model), seed=2)
    batch.rewards = torch.ones_like(batch.rewards)
    cfg = tiny_config(
        "loss.entropy_coef=0.5", "learner.micro_batch_tokens=20", "loss.weighting=none", "algo.overlong.len=0"
    )
    assert metric_names(cfg.loss) == sorted([*metric_names(tiny_config("loss.weighting=none").loss), "loss/entropy"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    history = []
    for _ in range(3):
        result = train_on_batch(model, optimizer, LossScaler(enabled=False), batch, cfg, AcrlReference(cfg.loss.acrl))
        token_mean = float((result.entropy * batch.mask).sum() / batch.mask.sum())
        assert result.metrics["loss/entropy"] == pytest.approx(token_mean, abs=1e-6)  # one minibatch: lp's forward
        assert result.metrics["loss"] == pytest.approx(-0.5 * token_mean, abs=1e-6)  # A = 0: the bonus alone
        history.append(token_mean)
    assert history[0] < history[1] < history[2]


def test_coef_0_computes_no_entropy_gradient(monkeypatch):
    """loss.entropy_coef = 0: the chunks run as before (the entropy-with-grad function is never called)."""
    calls = []
    original = logprobs._chunk_logp_entropy
    monkeypatch.setattr(logprobs, "_chunk_logp_entropy", lambda *a: calls.append(1) or original(*a))
    model, batch = tiny_model(seed=6), tiny_batch(seed=6)
    for coef in (0.0, 0.1):
        cfg = tiny_config(f"loss.entropy_coef={coef}")
        train_on_batch(model, torch.optim.SGD(model.parameters(), lr=0.0), LossScaler(enabled=False),
                       with_behavior(batch, model), cfg, AcrlReference(cfg.loss.acrl))  # fmt: skip
        assert bool(calls) == (coef > 0)
