"""Policy losses: decoupled PPO with the mismatch weightings of ALGORITHMS.md, as pure functions.

Inputs are per-token tensors of shape (B, T) for B responses padded to T tokens (mask marks real tokens) and
per-response advantages (B,). The loss is the negative objective, aggregated per `loss.agg`. Mismatch weights
(w, rho) are constants: computed from detached log-probs, so no gradient flows through them.

Notation (ALGORITHMS.md): lb behavior (rollout) log-prob, lp proximal, lc current; r = exp(lc - lp) is the PPO
ratio, w = exp(lp - lb) the mismatch weight.

Token-level weightings multiply the PPO surrogate per token and are aggregated per `loss.agg`. Sequence-level
ones (tbpo, gspo, pg_*) give one loss per response and are always averaged over responses, whatever `loss.agg`
says (their papers average over responses); `loss.eps_*` and `loss.dual_clip` do not apply to them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from common.config import LossConfig, TbpoConfig

TOKEN_WEIGHTINGS = ("none", "decoupled", "tis", "mis_token", "mis_seq", "acr", "acrl")
SEQUENCE_WEIGHTINGS = ("tbpo", "gspo", "pg_is", "pg_tis", "pg_mis")
IMPLEMENTED = TOKEN_WEIGHTINGS + SEQUENCE_WEIGHTINGS

ACRL_X_MIN = 1e-6
"""Below this reference X (mean |pi - mu| in probability, fp32 rounding noise) ACRL sets alpha = 0: rho = 1."""
GSPO_EPS_LOW, GSPO_EPS_HIGH = 3e-4, 4e-4  # GSPO's sequence clip range (ALGORITHMS.md, `gspo`)


@dataclass(slots=True)
class LossInputs:
    behav_logp: torch.Tensor  # (B, T) lb, from the rollout engine
    prox_logp: torch.Tensor  # (B, T) lp, no grad
    cur_logp: torch.Tensor  # (B, T) lc, with grad
    advantages: torch.Tensor  # (B,)
    mask: torch.Tensor  # (B, T) float, 1 on response tokens
    max_len: int  # L_max, for seq_mean_token_sum_norm
    group_index: torch.Tensor | None = None  # (B,) prompt group ids in 0..n_groups-1; acrl only
    acrl_x: float | None = None  # ACRL reference discrepancy X (learner.acrl.AcrlReference); acrl only
    acrl_y: torch.Tensor | None = None  # (n_groups,) Y_g of the whole batch; None: computed from these rows


@dataclass(slots=True)
class LossOutputs:
    loss: torch.Tensor  # scalar
    metrics: dict[str, float] = field(default_factory=dict)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: str, max_len: int) -> torch.Tensor:
    """Reduce (B, T) per-token losses to a scalar (ALGORITHMS.md, "Loss aggregation")."""
    if agg == "token_mean":
        return (per_token * mask).sum() / mask.sum().clamp_min(1.0)
    per_seq_sum = (per_token * mask).sum(-1)  # (B,)
    if agg == "seq_mean_token_mean":
        return (per_seq_sum / mask.sum(-1).clamp_min(1.0)).mean()
    if agg == "seq_mean_token_sum_norm":
        return (per_seq_sum / max_len).mean()
    raise ValueError(f"unknown loss.agg {agg!r}")


def loss_normalizer(mask: torch.Tensor, cfg: LossConfig) -> float:
    """What `policy_loss` divides by on rows with this mask (B, T): tokens for token_mean, else responses.

    `policy_loss` of a batch is the normalizer-weighted mean of its parts' losses, which is how micro-batches and
    learner ranks split one minibatch (learner.update).
    """
    if cfg.weighting in TOKEN_WEIGHTINGS and cfg.agg == "token_mean":
        return float(mask.sum())
    return float(mask.shape[0])


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: torch.Tensor | float):
    """min(r*A, clip(r, 1-eps_low, 1+eps_high)*A) per token; eps_high may be a per-token tensor (ACR)."""
    upper = 1.0 + eps_high
    clipped = torch.minimum(torch.clamp(ratio, min=1.0 - eps_low), torch.as_tensor(upper, dtype=ratio.dtype))
    return torch.minimum(ratio * adv, clipped * adv)


def seq_mean(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-response token mean (B,) of a (B, T) tensor; padding is ignored even when it holds inf or nan."""
    return torch.where(mask.bool(), per_token, 0.0).sum(-1) / mask.sum(-1).clamp_min(1.0)


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


def acrl_weight(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """ACRL eqs. 7-9: min(rho_t, C) with rho_t = (pi / mu)^alpha, alpha = gamma * sign(A_i) * (1 - Y_g / X).

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
    metrics = {
        "acrl/x": x,
        "acrl/y_mean": float(group_y[inputs.group_index.unique()].mean()),
        "acrl/alpha_mean": float(alpha.mean()),
        "acrl/rho_trunc": float(((rho > cfg.cap) & mask).sum() / mask.sum().clamp_min(1)),
    }
    return torch.clamp(rho, max=cfg.cap), metrics


def mismatch_weight(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The per-token constant multiplying the surrogate, and a per-token keep mask (ALGORITHMS.md weightings)."""
    mask = inputs.mask
    log_w = (inputs.prox_logp - inputs.behav_logp).detach() * mask  # (B, T)
    w = log_w.exp()
    cap = cfg.cap
    ones = torch.ones_like(w)
    metrics: dict[str, float] = {}
    n_tokens = mask.sum().clamp_min(1.0)
    if cfg.weighting == "none":
        return ones, ones, metrics
    if cfg.weighting == "decoupled":  # AReaL: w * surrogate, tokens with w > C masked out
        over = w > cap  # a masked w may be inf (where: inf * 0 is nan); a nan w is not masked, it fails the step
        metrics["mis_masked"] = float((over.float() * mask).sum() / n_tokens)
        return torch.where(over, 0.0, w), ones, metrics
    if cfg.weighting == "tis":  # FlashRL / QuRL eq. 5: min(w, C)
        metrics["tis_trunc"] = float(((w > cap).float() * mask).sum() / n_tokens)
        return torch.clamp(w, max=cap), ones, metrics
    if cfg.weighting == "mis_token":
        over = w > cap
        metrics["mis_masked"] = float((over.float() * mask).sum() / n_tokens)
        return torch.where(over, 0.0, w), ones, metrics
    if cfg.weighting == "mis_seq":  # ACRL eq. 3: rho_i = exp(sum_t (lp - lb)), masked when > C
        rho = log_w.sum(-1).exp()  # (B,)
        over = rho > cap  # where: inf * 0 is nan (a nan rho stays: it fails the step)
        metrics["mis_masked"] = float(over.float().mean())
        return torch.where(over, 0.0, rho)[:, None].expand_as(w), ones, metrics
    if cfg.weighting == "acr":  # handled in policy_loss (it widens the clip range too)
        metrics["tis_trunc"] = float(((w > cap).float() * mask).sum() / n_tokens)
        return torch.clamp(w, max=cap), ones, metrics
    if cfg.weighting == "acrl":
        weight, metrics = acrl_weight(inputs, cfg)
        return weight, ones, metrics
    raise NotImplementedError(
        f"loss.weighting={cfg.weighting!r} is not implemented yet (implemented: {', '.join(IMPLEMENTED)})"
    )


def policy_loss(inputs: LossInputs, cfg: LossConfig) -> LossOutputs:
    """Decoupled PPO objective with the configured mismatch weighting; returns the loss and clip metrics."""
    if cfg.weighting in SEQUENCE_WEIGHTINGS:
        return sequence_policy_loss(inputs, cfg)
    mask = inputs.mask  # (B, T)
    adv = inputs.advantages[:, None].expand_as(mask)  # (B, T)
    ratio = (inputs.cur_logp - inputs.prox_logp.detach()).exp()  # (B, T) r
    weight, keep, metrics = mismatch_weight(inputs, cfg)
    eps_high: torch.Tensor | float = cfg.eps_high
    if cfg.weighting == "acr":  # QuRL eq. 9: upper bound (1 + eps_high) / s with s = min(w, C) / w
        log_w = (inputs.prox_logp - inputs.behav_logp).detach() * mask
        s = (math.log(cfg.cap) - log_w).clamp_max(0.0).exp()  # = min(w, C) / w, in log space: w may be 0 or inf
        eps_high = (1.0 + cfg.eps_high) / s - 1.0
    surrogate = clipped_surrogate(ratio, adv, cfg.eps_low, eps_high)
    if cfg.dual_clip:
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, cfg.dual_clip * adv), surrogate)
    per_token = -weight * keep * surrogate
    loss = aggregate(per_token, mask, cfg.agg, inputs.max_len)
    with torch.no_grad():
        n_tokens = mask.sum().clamp_min(1.0)
        upper = 1.0 + (eps_high if isinstance(eps_high, float) else eps_high)
        metrics["ppo_clip_high"] = float((((ratio > upper) & (adv > 0)).float() * mask).sum() / n_tokens)
        metrics["ppo_clip_low"] = float((((ratio < 1.0 - cfg.eps_low) & (adv < 0)).float() * mask).sum() / n_tokens)
    return LossOutputs(loss=loss, metrics=metrics)


def sequence_policy_loss(inputs: LossInputs, cfg: LossConfig) -> LossOutputs:
    """tbpo, gspo and pg_*: one loss per response (B,), averaged over responses (not per `loss.agg`)."""
    mask = inputs.mask  # (B, T)
    adv = inputs.advantages  # (B,)
    if cfg.weighting in ("tbpo", "gspo"):
        seq_ratio = seq_mean(inputs.cur_logp - inputs.prox_logp.detach(), mask).exp()  # (B,) s_i, geometric mean
        if cfg.weighting == "tbpo":
            per_seq, metrics = tbpo_loss(seq_ratio, seq_mean(inputs.prox_logp - inputs.behav_logp, mask), adv, cfg.tbpo)
        else:
            per_seq, metrics = gspo_loss(seq_ratio, adv)
    else:
        per_seq, metrics = pg_is_loss(inputs, cfg)
    return LossOutputs(loss=per_seq.mean(), metrics=metrics)


def tbpo_loss(
    seq_ratio: torch.Tensor, seq_log_w: torch.Tensor, adv: torch.Tensor, tbpo: TbpoConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """QaRL TBPO (sec. 3.2 eq. 5, app. E): loss_i = -clip(w_i, 1/c, c) * clip(s_i, band(A_i)) * A_i, (B,).

    A response whose s_i leaves its band is clamped to the bound: no gradient (dropped, counted in tbpo_dropped).
    A_i >= 0 uses the positive band (A_i = 0 contributes nothing either way).
    """
    log_c = math.log(tbpo.c)
    seq_w = seq_log_w.detach().clamp(-log_c, log_c).exp()  # (B,) w_i = exp(m_i), eq. 5
    if tbpo.dual:  # negatives: dual band [1 - delta_low, 1 + delta_high]
        neg_low, neg_high = 1.0 - tbpo.delta_low, 1.0 + tbpo.delta_high
    else:  # ablation: the plain PPO lower bound only
        neg_low, neg_high = 1.0 - tbpo.eps_seq_low, math.inf
    positive = adv >= 0
    low = torch.where(positive, 0.0, neg_low).to(seq_ratio.dtype)  # (B,)
    high = torch.where(positive, 1.0 + tbpo.eps_seq_high, neg_high).to(seq_ratio.dtype)  # (B,)
    clipped = torch.clamp(seq_ratio, min=low, max=high)  # (B,) zero gradient outside [low, high]
    dropped = (seq_ratio < low) | (seq_ratio > high)
    return -seq_w * clipped * adv, {"tbpo_dropped": float(dropped.float().mean())}


def gspo_loss(seq_ratio: torch.Tensor, adv: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: loss_i = -min(s_i * A_i, clip(s_i, 1 - 3e-4, 1 + 4e-4) * A_i), (B,); no mismatch weight."""
    clipped = torch.clamp(seq_ratio, 1.0 - GSPO_EPS_LOW, 1.0 + GSPO_EPS_HIGH)
    with torch.no_grad():
        metrics = {
            "ppo_clip_high": float(((seq_ratio > 1.0 + GSPO_EPS_HIGH) & (adv > 0)).float().mean()),
            "ppo_clip_low": float(((seq_ratio < 1.0 - GSPO_EPS_LOW) & (adv < 0)).float().mean()),
        }
    return -torch.minimum(seq_ratio * adv, clipped * adv), metrics


def pg_is_loss(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """FP16 paper eqs. 5-7: loss_i = -sg(rho_i') * A_i * sum_t lc[t], rho_i' = exp(sum_t (lc - lb)), (B,).

    pg_tis uses min(rho, C), pg_mis rho * 1[rho <= C]; pg_is is unbounded by design (eq. 5).
    """
    mask = inputs.mask.bool()
    log_rho = torch.where(mask, inputs.cur_logp - inputs.behav_logp, 0.0).sum(-1).detach()  # (B,)
    rho = log_rho.exp()  # (B,) pi_theta(y) / mu(y), stopped
    metrics: dict[str, float] = {}
    if cfg.weighting == "pg_tis":  # eq. 6
        metrics["tis_trunc"] = float((rho > cfg.cap).float().mean())
        rho = torch.clamp(rho, max=cfg.cap)
    elif cfg.weighting == "pg_mis":  # eq. 7; where, not a product: inf * 0 is nan
        over = rho > cfg.cap  # a nan rho stays: it fails the step
        metrics["mis_masked"] = float(over.float().mean())
        rho = torch.where(over, 0.0, rho)
    seq_logp = torch.where(mask, inputs.cur_logp, 0.0).sum(-1)  # (B,) log pi_theta(y), with grad
    return -rho * inputs.advantages * seq_logp, metrics


def advantages(rewards: torch.Tensor, group_index: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-response advantages (B,) from rewards (B,) and group ids (B,) in 0..n_groups-1 (ALGORITHMS.md)."""
    n_groups = int(group_index.max()) + 1
    counts = torch.zeros(n_groups).index_add_(0, group_index, torch.ones_like(rewards))
    sums = torch.zeros(n_groups).index_add_(0, group_index, rewards)
    mean = (sums / counts)[group_index]
    if estimator == "grpo":
        sq = torch.zeros(n_groups).index_add_(0, group_index, (rewards - mean) ** 2)
        std = (sq / (counts - 1).clamp_min(1.0)).sqrt()[group_index]  # unbiased, as torch.std
        return (rewards - mean) / (std + 1e-6)
    if estimator == "drgrpo":
        return rewards - mean
    if estimator == "rloo":
        size = counts[group_index]
        return (rewards - mean) * size / (size - 1).clamp_min(1.0)
    raise ValueError(f"unknown algo.adv {estimator!r}")


def mismatch_metrics(
    behav_logp: torch.Tensor, prox_logp: torch.Tensor, mask: torch.Tensor, cap: float
) -> dict[str, float]:
    """The 'Mismatch and health metrics' of ALGORITHMS.md that depend only on lb, lp and the mask."""
    m = mask.bool()
    lb, lp = behav_logp[m], prox_logp[m]
    log_w = lp - lb
    w = log_w.exp()
    seq_diff = ((prox_logp - behav_logp) * mask).sum(-1)  # (B,) sum_t lp - sum_t lb
    return {
        "mismatch/acrl_d": float((lp.exp() - lb.exp()).abs().mean()),
        "mismatch/log_ppl_abs_diff": float(seq_diff.abs().mean()),
        "mismatch/kl_k1": float((lb - lp).mean()),
        "mismatch/kl_k3": float((w - 1 - log_w).mean()),
        "mismatch/w_max": float(w.max()),
        "mismatch/w_p99": float(torch.quantile(w, 0.99)),
        "mismatch/w_over_cap": float((w > cap).float().mean()),
        "mismatch/seq_log_ratio_per_token": float((seq_diff / mask.sum(-1).clamp_min(1.0)).mean()),
    }
