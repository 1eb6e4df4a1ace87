"""Losses against hand-computed values (ALGORITHMS.md), aggregation modes and advantages."""

from __future__ import annotations

import math

import pytest
import torch

from common.config import WEIGHTINGS, LossConfig
from learner import weightings
from learner.losses import LossInputs, advantages, aggregate, loss_normalizer, mismatch_metrics, policy_loss
from learner.weightings import group_discrepancy


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
    x = math.log(0.4 / 0.5)
    assert m["mismatch/kl_k3"] == pytest.approx((math.exp(x) - 1 - x) / 2, rel=1e-6)


def test_kl_k3_of_a_tiny_mismatch_is_not_lost_to_cancellation():
    """exp(x) - 1 - x >= 0; in fp32, w - 1 - log w of log-ratios ~3e-6 came out negative (mean -1.4e-9, where the
    true mean is 4.5e-12): an fp32 rollout's "floor" read the metric's own rounding."""
    generator = torch.Generator().manual_seed(0)
    lb = -torch.rand((8, 1250), generator=generator) * 5
    lp = lb + torch.randn(lb.shape, generator=generator) * 3e-6
    mask = torch.ones_like(lb)
    x = (lp - lb).double()
    exact = float((x**2 / 2 + x**3 / 6 + x**4 / 24).mean())  # its series: exact to 1e-20 at |x| < 1e-4
    assert mismatch_metrics(lb, lp, mask, cap=2.0)["mismatch/kl_k3"] == pytest.approx(exact, rel=1e-6)


# ---- the weighting table (learner.weightings.WEIGHTINGS) -------------------------------------------------------


def test_the_weighting_table_names_exactly_the_configured_weightings():
    assert tuple(weightings.WEIGHTINGS) == WEIGHTINGS
    weightings.check_names(tuple(weightings.WEIGHTINGS), WEIGHTINGS)  # the import-time check passes


@pytest.mark.parametrize(
    ("table_names", "message"),
    [
        (WEIGHTINGS[:-1], r"missing from the table: \['pg_mis'\]; in the table but not the config: \[\]"),
        ((*WEIGHTINGS, "vtrace"), r"missing from the table: \[\]; in the table but not the config: \['vtrace'\]"),
        (WEIGHTINGS[::-1], "the same names in another order"),
    ],
)
def test_the_table_check_names_the_difference(table_names, message):
    with pytest.raises(RuntimeError, match=message):
        weightings.check_names(table_names, WEIGHTINGS)


def test_every_weighting_is_its_own_function_citing_its_equation():
    functions = [entry.fn for entry in weightings.WEIGHTINGS.values()]
    assert len(set(functions)) == len(functions)
    for name, fn in zip(weightings.WEIGHTINGS, functions, strict=True):
        doc = fn.__doc__ or ""
        assert any(cite in doc for cite in ("eq.", "eqs.", "sec.", "ALGORITHMS.md")), name


def test_sequence_level_weightings_ignore_the_token_aggregation():
    sequence_level = {
        name for name, entry in weightings.WEIGHTINGS.items() if isinstance(entry, weightings.SequenceLevel)
    }
    assert sequence_level == {"tbpo", "gspo", "pg_is", "pg_tis", "pg_mis"}
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    for name in WEIGHTINGS:
        normalizer = loss_normalizer(mask, LossConfig(weighting=name, agg="token_mean"))
        assert normalizer == (2.0 if name in sequence_level else 3.0), name
        assert loss_normalizer(mask, LossConfig(weighting=name, agg="seq_mean_token_mean")) == 2.0, name


def test_an_unknown_weighting_is_refused_by_name():
    cfg = LossConfig()
    cfg.weighting = "vtrace"  # past the config's own check
    with pytest.raises(ValueError, match="unknown loss.weighting 'vtrace'"):
        policy_loss(one_token(LN(0.5), LN(0.5), LN(0.5), 1.0), cfg)


# ---- weightings added with acrl, tbpo, gspo and pg_* ----------------------------------------------------------


def acrl_one_token(pi: float, mu: float, adv: float, x: float) -> LossInputs:
    """One response, one token, its own group: Y = |pi - mu|; lc = lp so r = 1 and the surrogate is A."""
    inputs = one_token(LN(mu), LN(pi), LN(pi), adv)
    inputs.group_index = torch.tensor([0])
    inputs.acrl_x = x
    return inputs


# ACRL eqs. 8-9 with gamma = 0.65, C = 3. |pi - mu| = 0.25 = Y; X = 0.125 gives 1 - Y/X = -1 (Y > X),
# X = 0.5 gives 1 - Y/X = 0.5 (Y < X). alpha = 0.65 * sign(A) * (1 - Y/X); rho = (pi/mu)^alpha; loss = -rho * A.
ACRL_QUADRANTS = [
    # Y > X: decrease the discrepancy (ACRL sec. 4.2, figure 3)
    ("Y>X I: A>0, pi<mu, reward enhanced", 0.25, 0.5, 1.0, 0.125, 2.0**0.65),
    ("Y>X II: A>0, pi>mu, reward reduced", 0.5, 0.25, 1.0, 0.125, 2.0**-0.65),
    ("Y>X III: A<0, pi>mu, punishment enhanced", 0.5, 0.25, -1.0, 0.125, 2.0**0.65),
    ("Y>X IV: A<0, pi<mu, punishment reduced", 0.25, 0.5, -1.0, 0.125, 2.0**-0.65),
    # Y < X: increase the discrepancy (figure 5)
    ("Y<X I: A>0, pi<mu, reward reduced", 0.25, 0.5, 1.0, 0.5, 2.0**-0.325),
    ("Y<X II: A>0, pi>mu, reward enhanced", 0.5, 0.25, 1.0, 0.5, 2.0**0.325),
    ("Y<X III: A<0, pi>mu, punishment reduced", 0.5, 0.25, -1.0, 0.5, 2.0**-0.325),
    ("Y<X IV: A<0, pi<mu, punishment enhanced", 0.25, 0.5, -1.0, 0.5, 2.0**0.325),
]


@pytest.mark.parametrize(("name", "pi", "mu", "adv", "x", "rho"), ACRL_QUADRANTS, ids=[c[0] for c in ACRL_QUADRANTS])
def test_acrl_quadrants(name, pi, mu, adv, x, rho):
    inputs = acrl_one_token(pi, mu, adv, x)
    out = policy_loss(inputs, LossConfig(weighting="acrl", cap=3.0))
    assert float(out.loss.detach()) == pytest.approx(-rho * adv, rel=1e-5)
    enhanced = "enhanced" in name
    assert (rho > 1) == enhanced
    out.loss.backward()
    grad = float(inputs.cur_logp.grad)
    assert grad == pytest.approx(-rho * adv, rel=1e-5)  # d(-rho * r * A)/dlc at r = 1: the update keeps A's sign
    assert out.metrics["acrl/x"] == x
    assert out.metrics["acrl/y_mean"] == pytest.approx(0.25, rel=1e-5)
    assert out.metrics["acrl/alpha_mean"] == pytest.approx(0.65 * math.copysign(1, adv) * (1 - 0.25 / x), rel=1e-5)


def test_acrl_truncates_rho_at_cap():
    # Y / X = 25: alpha = 0.65 * (1 - 25) = -15.6, rho = 2^15.6 >> C = 3
    inputs = acrl_one_token(0.25, 0.5, 1.0, 0.01)
    out = policy_loss(inputs, LossConfig(weighting="acrl", cap=3.0))
    assert float(out.loss.detach()) == pytest.approx(-3.0)
    assert out.metrics["acrl/rho_trunc"] == 1.0


@pytest.mark.parametrize("x", [0.0, 1e-9])
def test_acrl_without_reference_mismatch_is_plain_ppo(x):
    inputs = acrl_one_token(0.25, 0.5, 1.0, x)  # X ~ 0: alpha = 0, rho = 1 (finite, documented)
    out = policy_loss(inputs, LossConfig(weighting="acrl", cap=3.0))
    assert float(out.loss.detach()) == pytest.approx(-1.0)
    assert out.metrics["acrl/alpha_mean"] == 0.0


def test_acrl_requires_group_and_reference():
    with pytest.raises(ValueError, match="group_index"):
        policy_loss(one_token(LN(0.5), LN(0.5), LN(0.5), 1.0), LossConfig(weighting="acrl"))


def test_group_discrepancy_per_group_mean_of_token_means():
    from learner.weightings import group_discrepancy

    mu = torch.tensor([[0.5, 0.5, 0.9], [0.2, 0.9, 0.9], [0.3, 0.3, 0.3]])
    pi = torch.tensor([[0.4, 0.2, 0.1], [0.2, 0.9, 0.9], [0.3, 0.4, 0.6]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    groups = torch.tensor([0, 0, 1])
    y = group_discrepancy(mu.log(), pi.log(), mask, groups)
    # group 0: response means (0.1 + 0.3) / 2 = 0.2 and 0; group 1: (0 + 0.1 + 0.3) / 3
    assert y.tolist() == pytest.approx([0.1, 0.4 / 3], rel=1e-5)


def test_acrl_uses_the_whole_batch_group_discrepancy():
    # a minibatch holding one response of a two-response group: Y comes from acrl_y, not from the minibatch row
    inputs = acrl_one_token(0.25, 0.5, 1.0, 0.125)
    inputs.acrl_y = torch.tensor([0.0625])  # Y / X = 0.5: alpha = 0.325, rho = 0.5^0.325
    out = policy_loss(inputs, LossConfig(weighting="acrl", cap=3.0))
    assert float(out.loss.detach()) == pytest.approx(-(0.5**0.325), rel=1e-5)


def test_acrl_reference_modes():
    from common.config import AcrlConfig
    from learner.acrl import AcrlReference

    first = AcrlReference(AcrlConfig())
    assert first.update_and_get(torch.tensor([0.01, 0.03])) == pytest.approx(0.02)
    assert first.update_and_get(torch.tensor([0.5, 0.5])) == pytest.approx(0.02)  # frozen after step 0

    override = AcrlReference(AcrlConfig(x=0.013))
    assert override.update_and_get(torch.tensor([0.5])) == 0.013

    ema = AcrlReference(AcrlConfig(x_mode="ema", ema_decay=0.9))
    assert ema.update_and_get(torch.tensor([0.02])) == pytest.approx(0.02)
    assert ema.update_and_get(torch.tensor([0.12])) == pytest.approx(0.9 * 0.02 + 0.1 * 0.12)

    restored = AcrlReference(AcrlConfig(x_mode="ema", ema_decay=0.9))
    restored.load_state_dict(ema.state_dict())
    assert restored.update_and_get(torch.tensor([0.0])) == ema.update_and_get(torch.tensor([0.0]))


def seq_inputs(lb: list[list[float]], lp: list[list[float]], lc: list[list[float]], adv: list[float]) -> LossInputs:
    """Responses given as per-token log-probs; shorter rows are padded (mask 0) with zeros."""
    width = max(len(row) for row in lb)

    def pad(rows):
        return torch.tensor([row + [0.0] * (width - len(row)) for row in rows])

    return LossInputs(
        behav_logp=pad(lb),
        prox_logp=pad(lp),
        cur_logp=pad(lc).requires_grad_(True),
        advantages=torch.tensor(adv),
        mask=pad([[1.0] * len(row) for row in lb]),
        max_len=4,
    )


def one_seq(lp_minus_lb: float, lc_minus_lp: float, adv: float) -> LossInputs:
    """A two-token response with the given per-token log-ratios (lp = log 0.5)."""
    lp = LN(0.5)
    return seq_inputs([[lp - lp_minus_lb] * 2], [[lp] * 2], [[lp + lc_minus_lp] * 2], [adv])


def seq_grad_sign(inputs: LossInputs) -> int:
    grad = float(inputs.cur_logp.grad.sum())
    return (grad < 0) - (grad > 0)


# TBPO (QaRL sec. 3.2, app. E) with the table-2 defaults: s = exp(mean(lc - lp)), w = exp(clip(mean(lp - lb), +-log 2)).
TBPO_CASES = [
    # name, mean(lp - lb), mean(lc - lp), A, dual, expected loss, grad sign, dropped
    ("A>0 inside: -w * s * A", LN(1.5), 0.0, 1.0, True, -1.5, 1, 0.0),
    ("A>0 below 1 stays inside [0, 1 + 4e-4]", LN(1.5), -0.01, 1.0, True, -1.5 * math.exp(-0.01), 1, 0.0),
    ("A>0 above 1 + 4e-4: dropped", LN(1.5), 1e-3, 1.0, True, -1.5 * (1 + 4e-4), 0, 1.0),
    ("w clipped at c = 2", LN(3.0), 0.0, 1.0, True, -2.0, 1, 0.0),
    ("w clipped at 1 / c", LN(0.25), 0.0, 1.0, True, -0.5, 1, 0.0),
    ("A<0 inside the dual band", 0.0, 5e-4, -1.0, True, math.exp(5e-4), -1, 0.0),
    ("A<0 above 1 + 7e-4: dual drops it", 0.0, 1e-3, -1.0, True, 1 + 7e-4, 0, 1.0),
    ("A<0 above 1 + 7e-4 without dual: kept", 0.0, 1e-3, -1.0, False, math.exp(1e-3), -1, 0.0),
    ("A<0 below 1 - 3e-4: dropped (dual)", 0.0, -1e-3, -1.0, True, 1 - 3e-4, 0, 1.0),
    ("A<0 below 1 - 3e-4: dropped (no dual)", 0.0, -1e-3, -1.0, False, 1 - 3e-4, 0, 1.0),
]


@pytest.mark.parametrize(
    ("name", "log_w", "log_s", "adv", "dual", "expected", "grad_sign", "dropped"),
    TBPO_CASES,
    ids=[c[0] for c in TBPO_CASES],
)
def test_tbpo_hand_computed(name, log_w, log_s, adv, dual, expected, grad_sign, dropped):
    from common.config import TbpoConfig

    inputs = one_seq(log_w, log_s, adv)
    out = policy_loss(inputs, LossConfig(weighting="tbpo", tbpo=TbpoConfig(dual=dual)))
    assert float(out.loss.detach()) == pytest.approx(expected, rel=1e-5)
    out.loss.backward()
    assert seq_grad_sign(inputs) == grad_sign
    if grad_sign == 0:
        assert inputs.cur_logp.grad.abs().max() == 0.0
    assert out.metrics["tbpo_dropped"] == dropped


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_sequence_losses_average_over_responses_whatever_the_agg(agg):
    # lengths 1 and 3, both inside the band, w = 1: losses -1 * A_i, mean over the two responses
    inputs = seq_inputs([[-1.0], [-1.0] * 3], [[-1.0], [-1.0] * 3], [[-1.0], [-1.0] * 3], [2.0, -1.0])
    for weighting in ("tbpo", "gspo"):
        out = policy_loss(inputs, LossConfig(weighting=weighting, agg=agg))
        assert float(out.loss.detach()) == pytest.approx((-2.0 + 1.0) / 2)
    out = policy_loss(inputs, LossConfig(weighting="tbpo", agg=agg))
    out.loss.backward()
    # d/dlc_t of -s_i A_i / 2 at s = 1: -A_i / (2 |y_i|)
    assert inputs.cur_logp.grad[0, 0] == pytest.approx(-1.0)
    assert inputs.cur_logp.grad[1].tolist() == pytest.approx([1 / 6] * 3)


GSPO_CASES = [
    # name, mean(lc - lp), A, expected loss, grad sign
    ("A>0 inside", 2e-4, 1.0, -math.exp(2e-4), 1),
    ("A>0 above 1 + 4e-4: clipped", 1e-3, 1.0, -(1 + 4e-4), 0),
    ("A<0 below 1 - 3e-4: clipped", -1e-3, -1.0, 1 - 3e-4, 0),
    ("A<0 above: unclipped, pushed down", 1e-3, -1.0, math.exp(1e-3), -1),
]


@pytest.mark.parametrize(("name", "log_s", "adv", "expected", "grad_sign"), GSPO_CASES, ids=[c[0] for c in GSPO_CASES])
def test_gspo_hand_computed(name, log_s, adv, expected, grad_sign):
    for log_w in (0.0, LN(5.0)):  # GSPO ignores the behavior policy
        inputs = one_seq(log_w, log_s, adv)
        out = policy_loss(inputs, LossConfig(weighting="gspo"))
        assert float(out.loss.detach()) == pytest.approx(expected, rel=1e-6)
        out.loss.backward()
        assert seq_grad_sign(inputs) == grad_sign


# pg_* (FP16 paper eqs. 5-7): two tokens with lc = log 0.6 and lb = log 0.5: rho = 1.2^2 = 1.44 (stopped),
# loss = -rho_w * A * 2 log 0.6, d loss / d lc_t = -rho_w * A (no gradient through rho).
PG_CASES = [
    # weighting, cap, A, rho_w (the weight after truncation / masking)
    ("pg_is", 2.0, 1.0, 1.44),
    ("pg_is", 2.0, -1.0, 1.44),
    ("pg_tis", 1.2, 1.0, 1.2),
    ("pg_tis", 2.0, 1.0, 1.44),
    ("pg_mis", 1.2, 1.0, 0.0),
    ("pg_mis", 2.0, -1.0, 1.44),
]


@pytest.mark.parametrize(("weighting", "cap", "adv", "rho_w"), PG_CASES)
def test_pg_is_family_hand_computed(weighting, cap, adv, rho_w):
    inputs = seq_inputs([[LN(0.5)] * 2], [[LN(0.55)] * 2], [[LN(0.6)] * 2], [adv])
    out = policy_loss(inputs, LossConfig(weighting=weighting, cap=cap))
    assert float(out.loss.detach()) == pytest.approx(-rho_w * adv * 2 * LN(0.6), rel=1e-5)
    out.loss.backward()
    assert inputs.cur_logp.grad[0].tolist() == pytest.approx([-rho_w * adv] * 2, rel=1e-5, abs=1e-8)


def test_pg_is_averages_sequences_and_masks_padding():
    # response 0: one token, rho = 2, A = 1; response 1: two tokens, rho = 1, A = -1; padding holds garbage
    inputs = seq_inputs([[LN(0.25)], [LN(0.5)] * 2], [[LN(0.5)], [LN(0.5)] * 2], [[LN(0.5)], [LN(0.5)] * 2], [1, -1])
    inputs.cur_logp.data[0, 1] = 7.0
    out = policy_loss(inputs, LossConfig(weighting="pg_is", agg="seq_mean_token_sum_norm"))
    expected = (-2.0 * 1 * LN(0.5) + 1.0 * 2 * LN(0.5)) / 2
    assert float(out.loss.detach()) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("weighting", ["pg_mis", "mis_seq"])
def test_masked_is_with_overflowing_ratio_is_zero_not_nan(weighting):
    inputs = seq_inputs([[-200.0] * 2], [[-1.0] * 2], [[-1.0] * 2], [1.0])  # exp(sum) overflows to inf
    out = policy_loss(inputs, LossConfig(weighting=weighting))
    assert float(out.loss.detach()) == 0.0
    assert out.metrics["mis_masked"] == 1.0


# acrl: see test_acrl_truncates_rho_at_cap; pg_is: its sequence weight is untruncated by definition (an inf weight
# is an inf loss, and the step is skipped), which is what pg_tis and pg_mis are for
@pytest.mark.parametrize("weighting", sorted(set(WEIGHTINGS) - {"acrl", "pg_is"}))
def test_a_token_with_an_extreme_mismatch_weight_keeps_the_loss_finite(weighting):
    """w = exp(lp - lb) under- or overflowing in fp32 (lp - lb of -200 or +200) must not make the step nan."""
    lp = LN(0.5)
    inputs = seq_inputs(
        [[lp + 200.0, lp, lp], [lp - 200.0, lp, lp]],
        [[lp] * 3, [lp] * 3],
        [[lp + 0.05] * 3, [lp - 0.05] * 3],
        [1.0, -1.0],
    )
    out = policy_loss(inputs, LossConfig(weighting=weighting, cap=2.0))
    out.loss.backward()
    assert math.isfinite(float(out.loss.detach())) and torch.isfinite(inputs.cur_logp.grad).all(), weighting


@pytest.mark.parametrize("weighting", ["decoupled", "mis_token", "mis_seq", "pg_mis", "acr", "tis"])
def test_a_nan_log_prob_is_never_masked_away_it_fails_the_step(weighting):
    """Masking drops tokens whose weight is too large (even inf); a nan is a bug upstream and must surface."""
    lp = LN(0.5)
    inputs = seq_inputs([[math.nan, lp]], [[lp, lp]], [[lp + 0.05, lp]], [1.0])
    out = policy_loss(inputs, LossConfig(weighting=weighting, cap=2.0))
    assert math.isnan(float(out.loss.detach()))


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_acrl_metrics_of_micro_batches_combine_to_the_whole_batchs(agg):
    # 6 responses of uneven lengths in 3 groups; the step combines micro-batch metrics by each one's loss share
    gen = torch.Generator().manual_seed(0)
    mask = (torch.arange(5)[None, :] < torch.tensor([5, 2, 4, 1, 3, 5])[:, None]).float()
    behav = -torch.rand(6, 5, generator=gen) - 0.1
    prox = behav + 0.3 * torch.randn(6, 5, generator=gen)
    group_index = torch.tensor([0, 0, 1, 1, 2, 2])
    group_y = group_discrepancy(behav, prox, mask, group_index)
    cfg = LossConfig(weighting="acrl", cap=1.5, agg=agg)

    def part(rows: slice) -> LossInputs:
        return LossInputs(behav_logp=behav[rows], prox_logp=prox[rows], cur_logp=prox[rows].clone(),
                          advantages=torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])[rows], mask=mask[rows],
                          max_len=5, group_index=group_index[rows], acrl_x=0.05, acrl_y=group_y)  # fmt: skip

    whole = policy_loss(part(slice(0, 6)), cfg).metrics
    splits = [slice(0, 1), slice(1, 4), slice(4, 6)]
    total = sum(loss_normalizer(mask[rows], cfg) for rows in splits)
    for key in ("acrl/y_mean", "acrl/alpha_mean", "acrl/rho_trunc"):
        combined = sum(
            policy_loss(part(rows), cfg).metrics[key] * loss_normalizer(mask[rows], cfg) / total for rows in splits
        )
        assert combined == pytest.approx(whole[key], rel=1e-6, abs=1e-7), key
    assert 0.0 < whole["acrl/rho_trunc"] < 1.0  # the truncation share is exercised, not trivially 0 or 1


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
def test_rewards_past_float32_s_range_give_finite_advantages(estimator):
    """A reward function may return any finite number (the wire takes float64): 1e39 lies past float32's range and
    1e25's squared deviations do; the batch keeps them and `grpo`'s advantages are those of any other scale."""
    import dataclasses

    from tiny_learner import random_groups

    from learner.batch import collate

    groups = random_groups(vocab=24, n_groups=3, size=4)  # rewards 0, 1, 0, 1 in each group
    unit = collate(groups, pad_id=0)
    expected = advantages(unit.rewards, unit.group_index, estimator)
    for scale in (1e25, 1e39, 1e160, 1e300, 1.7e308):  # 1e160 and up: the squares were inf (advantages 0, then NaN)
        scaled = [[dataclasses.replace(t, reward=t.reward * scale) for t in group] for group in groups]
        batch = collate(scaled, pad_id=0)
        adv = advantages(batch.rewards, batch.group_index, estimator)
        assert adv.dtype == torch.float32
        if estimator == "grpo":
            assert torch.allclose(adv, expected, rtol=1e-5), scale  # to the 1e-6 in the spread at scale 1
        elif scale < 1e38:  # the others keep the rewards' scale: 1e39 is past float32 as an advantage too
            assert torch.isfinite(adv).all() and torch.allclose(adv, expected * scale, rtol=1e-6), scale


def test_grpo_advantages_of_rewards_spanning_float64_s_range():
    """Rewards of +-1.7e308: their deviations (3.4e308) and sums are past float64's range; `grpo` counts them on the
    group's own scale and gives the advantages of +-1."""
    group_index = torch.zeros(4, dtype=torch.long)
    huge = torch.tensor([1.7e308, -1.7e308, 0.0, 1.7e308], dtype=torch.float64)
    adv = advantages(huge, group_index, "grpo")
    assert torch.isfinite(adv).all()
    assert torch.allclose(adv, advantages(torch.tensor([1.0, -1.0, 0.0, 1.0]), group_index, "grpo"), rtol=1e-5)


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
def test_a_group_of_equal_rewards_has_advantages_exactly_zero(estimator):
    """ALGORITHMS.md: equal rewards give A = 0. Exactly, not ~1e-10: `learner.skip_zero_adv` runs a row forward-only
    only when its advantage is 0, and ACRL's alpha takes sign(A). A float group mean is not the reward in general
    (1.1 * 8 / 8), and a large common offset must not swamp the deviations of a group that has them."""
    group_index = torch.tensor([0] * 8 + [1] * 8)
    for reward in (0.1, 1.1, 3.3e12 + 0.1):
        rewards = torch.tensor([reward] * 8 + [reward, reward + 1.0] * 4, dtype=torch.float64)
        adv = advantages(rewards, group_index, estimator)
        assert (adv[:8] == 0).all(), (reward, adv[:8])
        assert torch.allclose(adv[8:], advantages(rewards[8:] - reward, group_index[8:] - 1, estimator)), reward


def test_w_p99_is_torch_s_quantile_and_takes_a_dapo_sized_batch():
    """mismatch/w_p99 interpolates as torch.quantile does, and a batch of more than 2**24 tokens (torch.quantile
    refuses those) gives a number instead of failing the step."""
    from learner.losses import quantile

    generator = torch.Generator().manual_seed(0)
    for n in (1, 2, 3, 100, 1001):
        values = torch.rand(n, generator=generator)
        for q in (0.0, 0.5, 0.99, 1.0):
            assert quantile(values, q) == pytest.approx(float(torch.quantile(values, q)), abs=1e-7), (n, q)
    log_w = torch.zeros(1, 2**24 + 5)
    log_w[0, -1] = 1.0
    metrics = mismatch_metrics(torch.zeros_like(log_w), log_w, torch.ones_like(log_w), cap=2.0)
    assert metrics["mismatch/w_p99"] == 1.0 and metrics["mismatch/w_max"] == pytest.approx(math.e)


def test_overlong_shaping_follows_the_spec_s_window():
    """ALGORITHMS.md: -(|y| - (L_max - L_c)) / L_c when L_max - L_c < |y| <= L_max, -1 when truncated, else 0."""
    from learner.batch import overlong_shaping

    lengths = torch.tensor([4, 5, 6, 8, 9, 8])
    truncated = torch.tensor([False, False, False, False, False, True])
    penalty = overlong_shaping(lengths, truncated, max_len=8, cache_len=4)
    assert penalty.tolist() == [0.0, -0.25, -0.5, -1.0, 0.0, -1.0]


def test_pg_is_on_an_a_zero_row_whose_sequence_ratio_overflows_is_finite():
    """rho' = exp(sum_t (lc - lb)) is inf past a sum of 88.7 (float32); times A = 0 it gave NaN and skipped the step
    (a zero-variance group, with dynamic sampling off, is such a row)."""
    steps = 200
    lb = torch.full((3, steps), -2.0)
    lc = (lb + torch.tensor([[0.5], [0.01], [0.02]])).requires_grad_(True)
    inputs = LossInputs(lb, lb.clone(), lc, torch.tensor([0.0, 1.0, -1.0]), torch.ones(3, steps), steps)
    out = policy_loss(inputs, LossConfig(weighting="pg_is"))
    out.loss.backward()
    x = lc.detach().double() - lb.double()  # the spec in float64: row 0 adds exactly 0
    rho = x.sum(-1).exp()
    expected = -(rho[1] * lc.detach().double()[1].sum() - rho[2] * lc.detach().double()[2].sum()) / 3  # per row
    assert torch.isfinite(lc.grad).all() and (lc.grad[0] == 0).all()
    assert float(out.loss.detach()) == pytest.approx(float(expected), rel=1e-5)


def test_the_clip_passes_the_whole_gradient_at_its_upper_bound():
    """eps_high = 0 puts every token of an on-policy step (r = 1) on the bound: a minimum of the bound and the
    lower clamp split the gradient, and the outer minimum split it again (0.75 A)."""
    lb = torch.tensor([[-1.0, -2.0]])
    for eps_low, eps_high, adv, grad in ((0.2, 0.28, 1.0, -0.5), (0.2, 0.0, 1.0, -0.5), (0.0, 0.28, -1.0, 0.5)):
        lc = lb.clone().requires_grad_(True)
        inputs = LossInputs(lb, lb.clone(), lc, torch.tensor([adv]), torch.ones(1, 2), 2)
        policy_loss(inputs, LossConfig(weighting="none", eps_low=eps_low, eps_high=eps_high)).loss.backward()
        assert lc.grad.tolist() == [[grad, grad]], (eps_low, eps_high, lc.grad)
