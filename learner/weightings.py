"""The mismatch weightings of ALGORITHMS.md ("Mismatch weightings"): one function each, chosen from one table.

`WEIGHTINGS` maps every `loss.weighting` name to its function and its level; it is the learner's only list of
weighting names, and it must name exactly `common.config.WEIGHTINGS` (checked at import).

- Token level (`TokenLevel`): the function gives the constant per-token weight (B, T) that multiplies the PPO
  surrogate clipppo(r, A), and optionally a per-token upper clip width (acr); `losses.policy_loss` does the rest.
- Sequence level (`SequenceLevel`): the function gives the whole loss per response (B,); `losses.policy_loss`
  averages it over responses, whatever `loss.agg` says (their papers average over responses), and `loss.eps_*` and
  `loss.dual_clip` do not apply.

Weights are constants: computed from detached log-probs, so no gradient flows through them. Notation
(ALGORITHMS.md): lb behavior (rollout) log-prob, lp proximal, lc current; r = exp(lc - lp) the PPO ratio,
w = exp(lp - lb) the mismatch weight, C = `loss.cap` (null: 3 for acrl, 2 otherwise; `LossConfig.effective_cap`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from common.config import WEIGHTINGS as CONFIG_WEIGHTINGS
from common.config import LossConfig

if TYPE_CHECKING:
    from learner.losses import LossInputs  # losses imports this module: the type only, no runtime import

ACRL_X_MIN = 1e-6
"""Below this reference X (mean |pi - mu| in probability, fp32 rounding noise) ACRL sets alpha = 0: rho = 1."""
GSPO_EPS_LOW, GSPO_EPS_HIGH = 3e-4, 4e-4  # GSPO's sequence clip range (ALGORITHMS.md, `gspo`)


@dataclass(slots=True)
class TokenWeight:
    """What a token-level weighting gives the PPO surrogate."""

    weight: torch.Tensor  # (B, T) constant multiplying clipppo(r, A); loss_t = -weight * clipppo
    metrics: dict[str, float] = field(default_factory=dict)
    eps_high: torch.Tensor | None = None  # (B, T) upper clip width per token (acr); None: `loss.eps_high`


@dataclass(slots=True)
class SequenceLoss:
    """What a sequence-level weighting gives: the loss of each response."""

    loss: torch.Tensor  # (B,) per response, with grad
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TokenLevel:
    """A table entry: a weighting of the PPO surrogate per token, aggregated per `loss.agg`."""

    fn: Callable[[LossInputs, LossConfig], TokenWeight]


@dataclass(frozen=True, slots=True)
class SequenceLevel:
    """A table entry: a loss per response, averaged over responses."""

    fn: Callable[[LossInputs, LossConfig], SequenceLoss]


def seq_mean(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-response token mean (B,) of a (B, T) tensor; padding is ignored even when it holds inf or nan."""
    return torch.where(mask.bool(), per_token, 0.0).sum(-1) / mask.sum(-1).clamp_min(1.0)


def token_log_w(inputs: LossInputs) -> torch.Tensor:
    """log w = lp - lb per token (B, T), detached, 0 on padding."""
    return (inputs.prox_logp - inputs.behav_logp).detach() * inputs.mask


def mask_over_cap(weight: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """weight * 1[weight <= cap], and where weight > cap (the masked-IS indicator, any shape).

    `where`, not a product: a masked weight may be inf (inf * 0 is nan). A nan weight is not masked: it fails the step.
    """
    over = weight > cap
    return torch.where(over, 0.0, weight), over


# ---- token level ----------------------------------------------------------------------------------------------


def none_weight(inputs: LossInputs, cfg: LossConfig) -> TokenWeight:
    """ALGORITHMS.md `none`: loss_t = -clipppo(r, A); the behavior policy is ignored (weight 1)."""
    return TokenWeight(torch.ones_like(token_log_w(inputs)))


def masked_token_weight(inputs: LossInputs, cfg: LossConfig) -> TokenWeight:
    """w * 1[w <= C] per token (ALGORITHMS.md `decoupled` and `mis_token`: the same formula)."""
    weight, over = mask_over_cap(token_log_w(inputs).exp(), cfg.effective_cap)
    n_tokens = inputs.mask.sum().clamp_min(1.0)
    return TokenWeight(weight, {"mis_masked": float((over.float() * inputs.mask).sum() / n_tokens)})


def decoupled_weight(inputs: LossInputs, cfg: LossConfig) -> TokenWeight:
    """AReaL decoupled PPO (ALGORITHMS.md `decoupled`): loss_t = -w * clipppo(r, A), tokens with w > C masked out."""
    return masked_token_weight(inputs, cfg)


def mis_token_weight(inputs: LossInputs, cfg: LossConfig) -> TokenWeight:
    """Token-level masked IS (ALGORITHMS.md `mis_token`): loss_t = -w * 1[w <= C] * clipppo(r, A)."""
    return masked_token_weight(inputs, cfg)


def tis_weight(inputs: LossInputs, cfg: LossConfig) -> TokenWeight:
    """Truncated IS (FlashRL, QuRL eq. 5): loss_t = -min(w, C) * clipppo(r, A)."""
    w = token_log_w(inputs).exp()  # (B, T)
    n_tokens = inputs.mask.sum().clamp_min(1.0)
    truncated = float(((w > cfg.effective_cap).float() * inputs.mask).sum() / n_tokens)
    return TokenWeight(torch.clamp(w, max=cfg.effective_cap), {"tis_trunc": truncated})


def mis_seq_weight(inputs: LossInputs, cfg: LossConfig) -> TokenWeight:
    """Sequence-level masked IS (ACRL eq. 3): rho_i = exp(sum_t (lp - lb)), per token rho_i * 1[rho_i <= C]."""
    log_w = token_log_w(inputs)  # (B, T)
    weight, over = mask_over_cap(log_w.sum(-1).exp(), cfg.effective_cap)  # (B,)
    return TokenWeight(weight[:, None].expand_as(log_w), {"mis_masked": float(over.float().mean())})


def acr_weight(inputs: LossInputs, cfg: LossConfig) -> TokenWeight:
    """QuRL Adaptive Clipping Range (eq. 9): TIS's weight wc = min(w, C), the upper clip widened to (1 + eps_high) / s.

    loss_t = -wc * min(r*A, clip(r, 1 - eps_low, (1 + eps_high) / s) * A) with s = wc / w in (0, 1], computed in log
    space (w may be 0 or inf).
    """
    truncated = tis_weight(inputs, cfg)
    s = (math.log(cfg.effective_cap) - token_log_w(inputs)).clamp_max(0.0).exp()  # (B, T) min(w, C) / w
    return TokenWeight(truncated.weight, truncated.metrics, eps_high=(1.0 + cfg.eps_high) / s - 1.0)


def group_discrepancy(
    behav_logp: torch.Tensor, prox_logp: torch.Tensor, mask: torch.Tensor, group_index: torch.Tensor
) -> torch.Tensor:
    """ACRL Y_g = (1/G) sum_i (1/|a_i|) sum_t |pi - mu| per group (eqs. 5, 6, 9), shape (n_groups,).

    Ids are 0..max(group_index); an id with no response gets 0, so pass contiguous ids when averaging into X.
    """
    dist = (prox_logp.detach().exp() - behav_logp.detach().exp()).abs()  # (B, T) d_t, eq. 5 (probabilities)
    per_seq = seq_mean(dist, mask)  # (B,)
    n_groups = int(group_index.max()) + 1
    sums = torch.zeros(n_groups, dtype=per_seq.dtype, device=per_seq.device).index_add_(0, group_index, per_seq)
    counts = torch.zeros_like(sums).index_add_(0, group_index, torch.ones_like(per_seq))
    return sums / counts.clamp_min(1.0)


def acrl_weight(inputs: LossInputs, cfg: LossConfig) -> TokenWeight:
    """ACRL eqs. 5-9: min(rho_t, C) with rho_t = (pi / mu)^alpha, alpha = gamma * sign(A_i) * (1 - Y_g / X).

    X <= ACRL_X_MIN (no measurable mismatch at the reference step) makes Y_g / X meaningless: alpha = 0, rho = 1.
    """
    if inputs.group_index is None or inputs.acrl_x is None:
        raise ValueError("loss.weighting=acrl needs LossInputs.group_index and acrl_x (learner.acrl.AcrlReference)")
    group_y = inputs.acrl_y
    if group_y is None:
        group_y = group_discrepancy(inputs.behav_logp, inputs.prox_logp, inputs.mask, inputs.group_index)
    y = group_y[inputs.group_index]  # (B,) Y of each response's group
    x = float(inputs.acrl_x)
    sign = inputs.advantages.sign()  # (B,)
    alpha = cfg.acrl.gamma * sign * (1.0 - y / x) if x > ACRL_X_MIN else torch.zeros_like(y)  # (B,) eq. 9
    mask = inputs.mask.bool()
    log_w = torch.where(mask, inputs.prox_logp - inputs.behav_logp, 0.0).detach()  # (B, T) log(pi / mu)
    rho = (alpha[:, None] * log_w).exp()  # (B, T) eq. 8
    cap = cfg.effective_cap
    truncated = ((rho > cap) & mask).sum(-1) / mask.sum(-1).clamp_min(1)  # (B,) share of each row's tokens
    metrics = {
        "acrl/x": x,
        "acrl/y_mean": loss_share_mean(y, inputs.mask, cfg),
        "acrl/alpha_mean": loss_share_mean(alpha, inputs.mask, cfg),
        "acrl/rho_trunc": loss_share_mean(truncated, inputs.mask, cfg),
    }
    return TokenWeight(torch.clamp(rho, max=cap), metrics)


def loss_row_weights(mask: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """How much each row (B,) of this mask (B, T) counts in `policy_loss`'s mean: its tokens for a token-level
    weighting with `token_mean`, else 1 per response (`losses.loss_normalizer` is their sum)."""
    if isinstance(weighting(cfg.weighting), TokenLevel) and cfg.agg == "token_mean":
        return mask.sum(-1)
    return torch.ones(mask.shape[0], dtype=mask.dtype, device=mask.device)


def loss_share_mean(per_row: torch.Tensor, mask: torch.Tensor, cfg: LossConfig) -> float:
    """The mean of a per-response figure (B,) weighted as the loss weighs the rows (`loss_row_weights`).
    Micro-batches combine their metrics by that same share, so the step's figure is the whole batch's, however it
    was split."""
    weights = loss_row_weights(mask, cfg)
    return float((per_row.float() * weights).sum() / weights.sum().clamp_min(1e-30))


# ---- sequence level -------------------------------------------------------------------------------------------


def seq_ratio(inputs: LossInputs) -> torch.Tensor:
    """s_i = exp(mean_t (lc - lp)) per response (B,), the geometric-mean ratio of tbpo and gspo, with grad."""
    return seq_mean(inputs.cur_logp - inputs.prox_logp.detach(), inputs.mask).exp()


def tbpo_loss(inputs: LossInputs, cfg: LossConfig) -> SequenceLoss:
    """QaRL TBPO (sec. 3.2 eq. 5, app. E): loss_i = -clip(w_i, 1/c, c) * clip(s_i, band(A_i)) * A_i, (B,).

    A response whose s_i leaves its band is clamped to the bound: no gradient (dropped, counted in tbpo_dropped).
    A_i >= 0 uses the positive band (A_i = 0 contributes nothing either way).
    """
    tbpo, adv = cfg.tbpo, inputs.advantages  # (B,)
    ratio = seq_ratio(inputs)  # (B,) s_i
    log_c = math.log(tbpo.c)
    seq_log_w = seq_mean(inputs.prox_logp - inputs.behav_logp, inputs.mask)  # (B,) m_i before its clip
    seq_w = seq_log_w.detach().clamp(-log_c, log_c).exp()  # (B,) w_i = exp(m_i), eq. 5
    if tbpo.dual:  # negatives: dual band [1 - delta_low, 1 + delta_high]
        neg_low, neg_high = 1.0 - tbpo.delta_low, 1.0 + tbpo.delta_high
    else:  # ablation: the plain PPO lower bound only
        neg_low, neg_high = 1.0 - tbpo.eps_seq_low, math.inf
    positive = adv >= 0
    low = torch.where(positive, 0.0, neg_low).to(ratio.dtype)  # (B,)
    high = torch.where(positive, 1.0 + tbpo.eps_seq_high, neg_high).to(ratio.dtype)  # (B,)
    clipped = torch.clamp(ratio, min=low, max=high)  # (B,) zero gradient outside [low, high]
    dropped = (ratio < low) | (ratio > high)
    return SequenceLoss(-seq_w * clipped * adv, {"tbpo_dropped": float(dropped.float().mean())})


def gspo_loss(inputs: LossInputs, cfg: LossConfig) -> SequenceLoss:
    """GSPO (ALGORITHMS.md `gspo`): loss_i = -min(s_i * A_i, clip(s_i, 1 - 3e-4, 1 + 4e-4) * A_i); ignores lb."""
    ratio, adv = seq_ratio(inputs), inputs.advantages  # (B,), (B,)
    clipped = torch.clamp(ratio, 1.0 - GSPO_EPS_LOW, 1.0 + GSPO_EPS_HIGH)
    with torch.no_grad():
        metrics = {
            "ppo_clip_high": float(((ratio > 1.0 + GSPO_EPS_HIGH) & (adv > 0)).float().mean()),
            "ppo_clip_low": float(((ratio < 1.0 - GSPO_EPS_LOW) & (adv < 0)).float().mean()),
        }
    return SequenceLoss(-torch.minimum(ratio * adv, clipped * adv), metrics)


def pg_rho(inputs: LossInputs) -> torch.Tensor:
    """rho_i' = pi_theta(y) / mu(y) = exp(sum_t (lc - lb)) per response (B,), stopped (FP16 paper eq. 5)."""
    return torch.where(inputs.mask.bool(), inputs.cur_logp - inputs.behav_logp, 0.0).sum(-1).detach().exp()


def pg_loss(inputs: LossInputs, seq_weight: torch.Tensor, metrics: dict[str, float]) -> SequenceLoss:
    """loss_i = -seq_weight_i * A_i * sum_t lc[t] (B,): the FP16 paper's policy gradient with a stopped weight."""
    seq_logp = torch.where(inputs.mask.bool(), inputs.cur_logp, 0.0).sum(-1)  # (B,) log pi_theta(y), with grad
    seq_weight = torch.where(inputs.advantages == 0, 0.0, seq_weight)  # an A = 0 row adds 0, also where rho is inf
    return SequenceLoss(-seq_weight * inputs.advantages * seq_logp, metrics)


def pg_is_loss(inputs: LossInputs, cfg: LossConfig) -> SequenceLoss:
    """FP16 paper eq. 5: loss_i = -sg(rho_i') * A_i * sum_t lc[t]; unbounded by design (pg_tis, pg_mis bound it)."""
    return pg_loss(inputs, pg_rho(inputs), {})


def pg_tis_loss(inputs: LossInputs, cfg: LossConfig) -> SequenceLoss:
    """FP16 paper eq. 6: pg_is with the weight truncated, min(rho_i', C)."""
    rho = pg_rho(inputs)  # (B,)
    cap = cfg.effective_cap
    return pg_loss(inputs, torch.clamp(rho, max=cap), {"tis_trunc": float((rho > cap).float().mean())})


def pg_mis_loss(inputs: LossInputs, cfg: LossConfig) -> SequenceLoss:
    """FP16 paper eq. 7: pg_is with the weight masked, rho_i' * 1[rho_i' <= C]."""
    weight, over = mask_over_cap(pg_rho(inputs), cfg.effective_cap)  # (B,)
    return pg_loss(inputs, weight, {"mis_masked": float(over.float().mean())})


# ---- the table ------------------------------------------------------------------------------------------------

WEIGHTINGS: dict[str, TokenLevel | SequenceLevel] = {
    "none": TokenLevel(none_weight),
    "decoupled": TokenLevel(decoupled_weight),
    "tis": TokenLevel(tis_weight),
    "mis_token": TokenLevel(mis_token_weight),
    "mis_seq": TokenLevel(mis_seq_weight),
    "acr": TokenLevel(acr_weight),
    "acrl": TokenLevel(acrl_weight),
    "tbpo": SequenceLevel(tbpo_loss),
    "gspo": SequenceLevel(gspo_loss),
    "pg_is": SequenceLevel(pg_is_loss),
    "pg_tis": SequenceLevel(pg_tis_loss),
    "pg_mis": SequenceLevel(pg_mis_loss),
}


def check_names(table_names: tuple[str, ...], config_names: tuple[str, ...]) -> None:
    """Raise unless the table names exactly the config's `loss.weighting` choices, in the same order."""
    if table_names == config_names:
        return
    missing = [name for name in config_names if name not in table_names]
    extra = [name for name in table_names if name not in config_names]
    if missing or extra:
        difference = f"missing from the table: {missing}; in the table but not the config: {extra}"
    else:
        difference = "the same names in another order"
    raise RuntimeError(
        f"learner.weightings.WEIGHTINGS {table_names} must equal common.config.WEIGHTINGS {config_names} ({difference})"
    )


def weighting(name: str) -> TokenLevel | SequenceLevel:
    """The table entry of `loss.weighting` `name`."""
    if name not in WEIGHTINGS:
        raise ValueError(f"unknown loss.weighting {name!r} (known: {', '.join(WEIGHTINGS)})")
    return WEIGHTINGS[name]


check_names(tuple(WEIGHTINGS), CONFIG_WEIGHTINGS)
