"""Losses against hand-computed values (ALGORITHMS.md), aggregation modes and advantages."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.config import LossConfig
from learner.losses import LossInputs, advantages, aggregate, mismatch_metrics, policy_loss


def one_token(lb: float, lp: float, lc: float, adv: float) -> LossInputs:
    return LossInputs(
        behav_logp=torch.tensor([[lb]]),
        prox_logp=torch.tensor([[lp]]),
        cur_logp=torch.tensor([[lc]], requires_grad=True),
        advantages=torch.tensor([adv]),
        mask=torch.ones(1, 1),
        max_len=4,
    )


LN = math.log
# (weighting, lb, lp, lc, A, expected loss). w = exp(lp - lb), r = exp(lc - lp); cap C = 2, eps 0.2 / 0.28.
CASES = [
    # weighting, lb, lp, lc, A, expected loss, expected sign of -dloss/dlc (+1 raises lc, 0 no gradient)
    ("none", LN(0.5), LN(0.5), LN(0.55), 1.0, -1.1, 1),  # r = 1.1 inside the clip range
    ("none", LN(0.5), LN(0.5), LN(0.75), 1.0, -1.28, 0),  # r = 1.5 clipped at 1.28
    ("tis", LN(0.25), LN(0.5), LN(0.5), 1.0, -1.0 * 2.0, 1),  # w = 2 = C
    ("tis", LN(0.1), LN(0.5), LN(0.5), 1.0, -2.0, 1),  # w = 5 truncated to C = 2
    ("tis", LN(0.5), LN(0.25), LN(0.25), -1.0, 0.5, -1),  # w = 0.5, r = 1, A = -1 -> -(0.5 * -1)
    ("decoupled", LN(0.1), LN(0.5), LN(0.5), 1.0, 0.0, 0),  # w = 5 > C: masked out
    ("decoupled", LN(0.4), LN(0.5), LN(0.5), 1.0, -1.25, 1),  # w = 1.25
    ("mis_token", LN(0.1), LN(0.5), LN(0.5), 1.0, 0.0, 0),
    ("mis_token", LN(0.4), LN(0.5), LN(0.5), -1.0, 1.25, -1),
    ("mis_seq", LN(0.4), LN(0.5), LN(0.5), 1.0, -1.25, 1),
    ("mis_seq", LN(0.1), LN(0.5), LN(0.5), 1.0, 0.0, 0),  # rho = 5 > C
    # ACR: w = 5, wc = 2, s = 0.4, upper bound 1.28 / 0.4 = 3.2; r = 3 stays unclipped: -(2 * 3 * 1)
    ("acr", LN(0.04), LN(0.2), LN(0.6), 1.0, -6.0, 1),
    # the same token under TIS is clipped at 1.28: -(2 * 1.28), no gradient
    ("tis", LN(0.04), LN(0.2), LN(0.6), 1.0, -2.56, 0),
    # ACR with w <= C: s = 1, the ordinary clip: r = 1.5 -> 1.28, weight 1.25
    ("acr", LN(0.4), LN(0.5), LN(0.75), 1.0, -1.25 * 1.28, 0),
]


@pytest.mark.parametrize(("weighting", "lb", "lp", "lc", "adv", "expected", "grad_sign"), CASES)
def test_weightings_hand_computed(weighting, lb, lp, lc, adv, expected, grad_sign):
    inputs = one_token(lb, lp, lc, adv)
    out = policy_loss(inputs, LossConfig(weighting=weighting, cap=2.0))
    assert float(out.loss.detach()) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    out.loss.backward()
    grad = float(inputs.cur_logp.grad)
    assert (grad < 0) - (grad > 0) == grad_sign


def test_clipped_tokens_get_no_gradient():
    inputs = one_token(LN(0.5), LN(0.5), LN(0.75), 1.0)  # r = 1.5 > 1.28 with A > 0
    out = policy_loss(inputs, LossConfig(weighting="none"))
    out.loss.backward()
    assert float(inputs.cur_logp.grad) == 0.0
    assert out.metrics["ppo_clip_high"] == 1.0


def test_dual_clip_bounds_negative_advantages():
    inputs = one_token(LN(0.5), LN(0.1), LN(0.5), -1.0)  # r = 5, A = -1: surrogate -5, dual clip 3 -> -3
    out = policy_loss(inputs, LossConfig(weighting="none", dual_clip=3.0))
    assert float(out.loss.detach()) == pytest.approx(3.0)


def test_aggregations():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert float(aggregate(per_token, mask, "token_mean", 4)) == pytest.approx(10 / 4)
    assert float(aggregate(per_token, mask, "seq_mean_token_mean", 4)) == pytest.approx((2 + 4) / 2)
    assert float(aggregate(per_token, mask, "seq_mean_token_sum_norm", 4)) == pytest.approx((6 / 4 + 4 / 4) / 2)


def test_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    grpo = advantages(rewards, groups, "grpo")
    std0 = torch.tensor([1.0, 0.0, 0.0]).std()
    assert float(grpo[0]) == pytest.approx((1 - 1 / 3) / (float(std0) + 1e-6), rel=1e-5)
    assert float(grpo[:3].sum()) == pytest.approx(0.0, abs=1e-6)
    assert advantages(rewards, groups, "drgrpo").tolist() == pytest.approx(
        [2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3]
    )
    assert advantages(rewards, groups, "rloo").tolist() == pytest.approx([1.0, -0.5, -0.5, -1.0, 0.5, 0.5])
    assert advantages(torch.ones(3), torch.zeros(3, dtype=torch.long), "grpo").abs().max() == 0


def test_mismatch_metrics():
    lb = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    lp = torch.log(torch.tensor([[0.4, 0.2, 0.9]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    m = mismatch_metrics(lb, lp, mask, cap=2.0)
    assert m["mismatch/acrl_d"] == pytest.approx(0.05, rel=1e-5)
    assert m["mismatch/log_ppl_abs_diff"] == pytest.approx(abs(math.log(0.4 / 0.5)), rel=1e-5)
    assert m["mismatch/kl_k1"] == pytest.approx(math.log(0.5 / 0.4) / 2, rel=1e-5)
    assert m["mismatch/w_max"] == pytest.approx(1.0)
