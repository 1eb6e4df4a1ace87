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
    # v_cur = 5, v_prox = 4: alpha = (4 - v) / (5 - v), clamped to [0, 1]; v >= 5 gives 1 (lp = lc).
    versions = torch.tensor([[5, 4, 3, 1, 6]])
    alpha = loglinear_alpha(versions, 5)
    assert alpha.tolist() == [[1.0, 0.0, 0.5, 0.75, 1.0]]
    behav = torch.tensor([[-2.0, -2.0, -2.0, -2.0, -0.5]])
    cur = torch.tensor([[-1.0, -1.0, -1.0, -3.0, -0.25]], requires_grad=True)
    prox = loglinear_prox(behav, cur, alpha)
    # -2 + 1 * 1, -2 + 0, -2 + 0.5 * 1, -2 + 0.75 * (-1), -0.5 + 1 * 0.25
    torch.testing.assert_close(prox, torch.tensor([[-1.0, -2.0, -1.5, -2.75, -0.25]]), rtol=0, atol=0)
    assert not prox.requires_grad  # lc enters detached: no gradient through lp


def test_a_one_version_batch_is_exactly_the_current_policy():
    assert loglinear_alpha(torch.full((2, 3), 7), 7).eq(1.0).all()
    assert loglinear_alpha(torch.full((2, 3), 6), 7).eq(0.0).all()  # one step behind: lp = lb, as in AReaL


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


def test_loglinear_lp_is_the_interpolation_of_the_first_forward():
    """With one minibatch lc is the policy at the step's start, i.e. recompute's lp: loglinear's lp is its formula."""
    versions = torch.tensor([3, 2, 1, 0])[torch.arange(12) % 4][:, None]
    exact, _, batch = _step("recompute", versions, minibatches=1)
    approx, forwards, _ = _step("loglinear", versions, minibatches=1)
    alpha = loglinear_alpha(batch.versions, 3)
    expected = loglinear_prox(batch.behav_logp, exact.prox_logp, alpha) * batch.mask
    torch.testing.assert_close(approx.prox_logp, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(approx.entropy, exact.entropy, rtol=0, atol=0)  # the same forward's entropies
    assert all(forwards)
    current, _, _ = _step("loglinear", torch.tensor([[3]]), minibatches=1)  # a one-version batch at v_cur ...
    assert current.metrics == pytest.approx({**exact.metrics, "prox/loglinear_alpha": 1.0})  # ... is recompute


def test_loglinear_needs_the_version_and_refuses_acrl():
    model = tiny_model()
    batch = with_behavior(tiny_batch(), model)
    cfg = tiny_config("learner.prox=loglinear")
    with pytest.raises(ValueError, match="version"):
        train_on_batch(model, torch.optim.SGD(model.parameters(), lr=0.1), LossScaler(enabled=False), batch, cfg,
                       AcrlReference(cfg.loss.acrl))  # fmt: skip
    with pytest.raises(ConfigError, match="learner.prox=loglinear"):
        load_config(None, ["learner.prox=loglinear", "loss.weighting=acrl"])
