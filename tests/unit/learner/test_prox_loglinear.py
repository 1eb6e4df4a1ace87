"""`learner.prox = loglinear` (AReaL): lp interpolated between lb and the forward's own lc by token version."""

from __future__ import annotations

import pytest
import torch
from tiny_learner import tiny_batch, tiny_config, tiny_model, with_behavior

from common.config import ConfigError, load_config
from learner.acrl import AcrlReference
from learner.precision import LossScaler
from learner.update import loglinear_alpha, loglinear_prox, train_on_batch


def test_alpha_and_lp_match_a_hand_computation():
    # v_prox = 5 (the step's start), lc of the second of two minibatches: v_theta = 5.5. alpha = (5 - v) / (5.5 - v),
    # clamped to [0, 1]; v >= 5.5 gives 1.
    versions = torch.tensor([[5, 4, 3, 1, 6]])
    alpha = loglinear_alpha(versions, 5, progress=0.5)
    torch.testing.assert_close(alpha, torch.tensor([[0.0, 2 / 3, 0.8, 8 / 9, 1.0]]))
    behav = torch.tensor([[-2.0, -2.0, -2.0, -2.0, -0.5]])
    cur = torch.tensor([[-1.0, -1.0, -1.0, -3.0, -0.25]], requires_grad=True)
    prox = loglinear_prox(behav, cur, alpha)
    expected = torch.tensor([[-2.0, -2.0 + 2 / 3, -1.2, -2.0 - 8 / 9, -0.25]])
    torch.testing.assert_close(prox, expected)
    assert not prox.requires_grad  # lc enters detached: no gradient through lp


def test_lc_at_the_step_s_start_is_lp_whatever_the_token_s_version():
    """The first minibatch's forward runs at the weights lp is defined at: alpha 1 (the old v_prox = v_cur - 1 gave
    a one-step-old token lb itself, and a two-step-old one half the correction)."""
    assert loglinear_alpha(torch.tensor([[7, 6, 5, 0]]), 7).eq(1.0).all()
    assert loglinear_alpha(torch.full((2, 3), 7), 7, progress=0.5).eq(0.0).all()  # lc moved on: lb is at v_prox


def _step(prox: str, versions: torch.Tensor, minibatches: int = 2):
    """A train step of the tiny model, counting decoder forwards (True: with grad); returns (result, forwards)."""
    model = tiny_model(seed=1)
    batch = with_behavior(tiny_batch(seed=1), model, seed=2)
    batch.versions = versions.expand_as(batch.versions).clone() * batch.mask.long()
    cfg = tiny_config("loss.weighting=tis", f"learner.prox={prox}", f"learner.minibatches={minibatches}",
                      "learner.micro_batch_tokens=20")  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    forwards: list[bool] = []
    model.get_decoder().register_forward_hook(lambda *_: forwards.append(torch.is_grad_enabled()))
    result = train_on_batch(
        model, optimizer, LossScaler(enabled=False), batch, cfg, AcrlReference(cfg.loss.acrl), version=3
    )
    return result, forwards, batch


def test_loglinear_runs_no_proximal_forward():
    versions = torch.tensor([3, 2, 1, 0])[torch.arange(12) % 4][:, None]  # every row a different staleness
    recompute, recompute_forwards, _ = _step("recompute", versions)
    loglinear, loglinear_forwards, _ = _step("loglinear", versions)
    training = recompute_forwards.count(True)
    assert recompute_forwards.count(False) == training  # the extra no-grad pass over every micro-batch ...
    assert loglinear_forwards == [True] * training  # ... which loglinear does not run
    assert loglinear.seconds["proximal"] == 0.0 and recompute.seconds["proximal"] > 0.0
    assert 0.0 < loglinear.metrics["prox/loglinear_alpha"] < 1.0


def test_loglinear_lp_is_recompute_s_on_the_first_minibatch_and_interpolated_after():
    """With one minibatch lc is the policy at the step's start, i.e. recompute's lp, for tokens of every version; a
    second minibatch's lc has moved one optimizer step on: its tokens of the step's version get lb."""
    versions = torch.tensor([3, 2, 1, 0])[torch.arange(12) % 4][:, None]
    exact, _, batch = _step("recompute", versions, minibatches=1)
    approx, forwards, _ = _step("loglinear", versions, minibatches=1)
    torch.testing.assert_close(approx.prox_logp, exact.prox_logp * batch.mask, rtol=0, atol=1e-6)
    torch.testing.assert_close(approx.entropy, exact.entropy, rtol=0, atol=0)  # the same forward's entropies
    assert all(forwards)
    assert approx.metrics == pytest.approx({**exact.metrics, "prox/loglinear_alpha": 1.0})
    exact, _, _ = _step("recompute", versions, minibatches=2)
    approx, _, _ = _step("loglinear", versions, minibatches=2)
    first, second = slice(0, 6), slice(6, 12)
    torch.testing.assert_close(approx.prox_logp[first], (exact.prox_logp * batch.mask)[first], rtol=0, atol=1e-6)
    current = (batch.versions[second] == 3) & batch.mask[second].bool()
    assert current.any()
    torch.testing.assert_close(approx.prox_logp[second][current], batch.behav_logp[second][current], rtol=0, atol=0)
    older = (batch.versions[second] < 3) & batch.mask[second].bool()
    assert not torch.equal(approx.prox_logp[second][older], batch.behav_logp[second][older])


def test_loglinear_needs_the_version_and_refuses_acrl():
    model = tiny_model()
    batch = with_behavior(tiny_batch(), model)
    cfg = tiny_config("learner.prox=loglinear")
    with pytest.raises(ValueError, match="version"):
        train_on_batch(model, torch.optim.SGD(model.parameters(), lr=0.1), LossScaler(enabled=False), batch, cfg,
                       AcrlReference(cfg.loss.acrl))  # fmt: skip
    with pytest.raises(ConfigError, match="learner.prox=loglinear"):
        load_config(None, ["learner.prox=loglinear", "loss.weighting=acrl"])
