"""Policy losses: decoupled PPO with the mismatch weightings of ALGORITHMS.md, as pure functions.

Inputs are per-token tensors of shape (B, T) for B responses padded to T tokens (mask marks real tokens) and
per-response advantages (B,). The loss is the negative objective. `loss.weighting` picks its function from the
table `learner.weightings.WEIGHTINGS`:

- a token-level weighting gives a constant weight (B, T) multiplying the PPO surrogate clipppo(r, A) (and, for
  acr, a widened upper clip); the per-token loss -weight * clipppo is aggregated per `loss.agg`;
- a sequence-level one (tbpo, gspo, pg_*) gives one loss per response, always averaged over responses, whatever
  `loss.agg` says (their papers average over responses); `loss.eps_*` and `loss.dual_clip` do not apply to them.

Notation (ALGORITHMS.md): lb behavior (rollout) log-prob, lp proximal, lc current; r = exp(lc - lp) is the PPO
ratio, w = exp(lp - lb) the mismatch weight.

Two optional regularizers are added to either kind (docs/algorithms.md, "KL and entropy terms"), aggregated like the
policy loss (`regularizer_agg`):

- KL penalty, `loss.kl.coef` = beta > 0: `+ beta * agg(k)` with k a per-token estimator of KL(pi_theta || pi_ref)
  against the frozen initial model (`learner.reference`), log r = lref - lc (r = pi_ref / pi_theta):
  k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r (`loss.kl.estimator`);
- entropy bonus, `loss.entropy_coef` = c > 0: `- c * agg(H)` with H = -sum_v pi_theta(v) log pi_theta(v) per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.config import LossConfig
from learner.weightings import SequenceLevel, TokenLevel, loss_row_weights, weighting
from learner.weightings import group_discrepancy as group_discrepancy  # re-exported: learner.update imports it here


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
    ref_logp: torch.Tensor | None = None  # (B, T) lref, the frozen reference's log-probs, no grad; loss.kl.coef > 0
    cur_entropy: torch.Tensor | None = None  # (B, T) entropy of pi_theta, with grad; loss.entropy_coef > 0


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
    return float(loss_row_weights(mask, cfg).sum())


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: torch.Tensor | float):
    """min(r*A, clip(r, 1-eps_low, 1+eps_high)*A) per token; eps_high may be a per-token tensor (ACR)."""
    low = torch.full_like(ratio, 1.0 - eps_low)
    high = torch.as_tensor(1.0 + eps_high, dtype=ratio.dtype).expand_as(ratio)
    clipped = torch.clamp(ratio, min=low, max=high)  # one clamp, inclusive at both bounds: at r = 1 + eps_high
    return torch.minimum(ratio * adv, clipped * adv)  # (eps_high = 0) a minimum passed on 0.75 of the gradient


def policy_loss(inputs: LossInputs, cfg: LossConfig) -> LossOutputs:
    """Decoupled PPO objective with the configured mismatch weighting, plus the KL and entropy terms when their
    coefficients are set; returns the loss and its metrics."""
    out = surrogate_loss(inputs, cfg)
    if cfg.kl.coef > 0 or cfg.entropy_coef > 0:
        term, metrics = regularizers(inputs, cfg)
        out = LossOutputs(loss=out.loss + term, metrics={**out.metrics, **metrics})
    return out


def surrogate_loss(inputs: LossInputs, cfg: LossConfig) -> LossOutputs:
    """The decoupled PPO objective with the configured mismatch weighting alone (no KL, no entropy)."""
    entry = weighting(cfg.weighting)
    if isinstance(entry, SequenceLevel):
        per_seq = entry.fn(inputs, cfg)  # (B,) loss per response
        return LossOutputs(loss=per_seq.loss.mean(), metrics=per_seq.metrics)
    mask = inputs.mask  # (B, T)
    adv = inputs.advantages[:, None].expand_as(mask)  # (B, T)
    ratio = (inputs.cur_logp - inputs.prox_logp.detach()).exp()  # (B, T) r
    token = entry.fn(inputs, cfg)
    eps_high: torch.Tensor | float = cfg.eps_high if token.eps_high is None else token.eps_high
    surrogate = clipped_surrogate(ratio, adv, cfg.eps_low, eps_high)
    if cfg.dual_clip:
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, cfg.dual_clip * adv), surrogate)
    loss = aggregate(-token.weight * surrogate, mask, cfg.agg, inputs.max_len)
    metrics = dict(token.metrics)
    with torch.no_grad():
        n_tokens = mask.sum().clamp_min(1.0)
        upper = 1.0 + eps_high
        metrics["ppo_clip_high"] = float((((ratio > upper) & (adv > 0)).float() * mask).sum() / n_tokens)
        metrics["ppo_clip_low"] = float((((ratio < 1.0 - cfg.eps_low) & (adv < 0)).float() * mask).sum() / n_tokens)
    return LossOutputs(loss=loss, metrics=metrics)


def regularizer_agg(cfg: LossConfig) -> str:
    """How the KL and entropy terms are aggregated: as the policy loss, so `loss_normalizer` splits them alike.

    `loss.agg` for token-level weightings; for sequence-level ones, whose loss is a mean over responses whatever
    `loss.agg` says, the mean over responses of the per-response token mean (`seq_mean_token_mean`)."""
    return cfg.agg if isinstance(weighting(cfg.weighting), TokenLevel) else "seq_mean_token_mean"


def kl_estimate(cur_logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate (B, T) of KL(pi_theta || pi_ref) on the sampled tokens (Schulman, "Approximating KL
    divergence"), with log r = lref - lc: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r.

    Gradients flow through lc (`cur_logp`) only. k3 is computed as expm1(log r) - log r (exact near r = 1, where
    exp(log r) - 1 would cancel), with log r clamped to [-20, 20] inside the expm1 (r stays finite).
    """
    log_r = ref_logp.detach() - cur_logp  # (B, T)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.square()
    if estimator == "k3":
        return torch.expm1(log_r.clamp(-20.0, 20.0)) - log_r
    raise ValueError(f"unknown loss.kl.estimator {estimator!r} (k1, k2 or k3)")


def regularizers(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """beta * agg(k) - c * agg(H) for `loss.kl.coef` = beta and `loss.entropy_coef` = c, and their metrics
    `loss/kl` = agg(k) and `loss/entropy` = agg(H) (each only when its coefficient is set)."""
    agg = regularizer_agg(cfg)
    term = torch.zeros(())
    metrics: dict[str, float] = {}
    if cfg.kl.coef > 0:
        if inputs.ref_logp is None:
            raise ValueError("loss.kl.coef > 0 needs LossInputs.ref_logp, the reference log-probs (learner.reference)")
        per_token = kl_estimate(inputs.cur_logp, inputs.ref_logp, cfg.kl.estimator)  # (B, T)
        kl = aggregate(per_token, inputs.mask, agg, inputs.max_len)
        term = term + cfg.kl.coef * kl
        metrics["loss/kl"] = float(kl.detach())
    if cfg.entropy_coef > 0:
        if inputs.cur_entropy is None:
            raise ValueError("loss.entropy_coef > 0 needs LossInputs.cur_entropy (learner.logprobs.entropy_with_grad)")
        entropy = aggregate(inputs.cur_entropy, inputs.mask, agg, inputs.max_len)
        term = term - cfg.entropy_coef * entropy
        metrics["loss/entropy"] = float(entropy.detach())
    return term, metrics


def advantages(rewards: torch.Tensor, group_index: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-response advantages (B,) float32 from rewards (B,) and group ids (B,) in 0..n_groups-1 (ALGORITHMS.md).

    Computed in float64, and `grpo`'s on each group's own scale: a reward past float32's range (a finite float64 from
    a reward function, as the wire accepts it), or whose squared deviation is past float64's (1e160), made a group's
    spread inf and every advantage 0 or NaN; `grpo`'s are the same for any scale of the rewards."""
    rewards = rewards.to(torch.float64)
    n_groups = int(group_index.max()) + 1
    # Deviations from each group's lowest reward, exact: a group of equal rewards then has mean 0 and advantages
    # exactly 0 (its float mean is not its reward in general: 1.1 * 8 / 8 != 1.1), as skip_zero_adv and ACRL's
    # sign(A) need, and a large common offset (3.3e12 + 0.1) no longer rounds the deviations away.
    low = torch.full((n_groups,), torch.inf, dtype=torch.float64).scatter_reduce_(0, group_index, rewards, "amin")
    unit = torch.ones_like(low)  # the scale the deviations are counted in
    deviations = rewards - low[group_index]
    if not torch.isfinite(deviations).all():  # past float64's range (1e308 - -1e308): counted in a group's largest
        unit = _power_of_two_near(_group_max(rewards.abs(), group_index, n_groups))  # |reward|
        deviations = rewards / unit[group_index] - low[group_index] / unit[group_index]
    # each group on its own scale (a power of two: exact), so that no sum or square overflows
    local = _power_of_two_near(_group_max(deviations, group_index, n_groups))[group_index]
    rewards = deviations / local
    scale = local * unit[group_index]  # inf only where the deviations themselves are past float64's range
    counts = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_index, torch.ones_like(rewards))
    sums = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_index, rewards)
    mean = (sums / counts)[group_index]
    if estimator == "grpo":
        sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_index, (rewards - mean) ** 2)
        std = (sq / (counts - 1).clamp_min(1.0)).sqrt()[group_index]  # unbiased, as torch.std
        adv = (rewards - mean) / (std + 1e-6 / scale)  # (r - mean) / (std(r) + 1e-6) on any scale
    elif estimator == "drgrpo":
        adv = (rewards - mean) * scale
    elif estimator == "rloo":
        size = counts[group_index]
        adv = (rewards - mean) * scale * size / (size - 1).clamp_min(1.0)
    else:
        raise ValueError(f"unknown algo.adv {estimator!r}")
    return adv.to(torch.float32)


def _group_max(values: torch.Tensor, group_index: torch.Tensor, n_groups: int) -> torch.Tensor:
    return torch.zeros(n_groups, dtype=values.dtype).scatter_reduce_(0, group_index, values, "amax")


def _power_of_two_near(values: torch.Tensor) -> torch.Tensor:
    """2**(e - 1) for each value = m * 2**e (m in [0.5, 1)): value / it is in [1, 2), exactly, and it is finite for
    every finite value (a power of two above 1.8e308 is not)."""
    _, exponent = torch.frexp(values)
    return torch.ldexp(torch.ones_like(values), exponent - 1)


def quantile(values: torch.Tensor, q: float) -> float:
    """`torch.quantile(values, q)` (linear interpolation) of a 1-D tensor of any length: torch.quantile refuses more
    than 2**24 elements (a DAPO-sized batch has more tokens), so the two order statistics come from `kthvalue`."""
    n = values.numel()
    if n == 0:
        return float("nan")
    position = q * (n - 1)
    below = int(position)
    low = values.kthvalue(below + 1).values
    if below + 1 >= n:
        return float(low)
    high = values.kthvalue(below + 2).values
    return float(low + (position - below) * (high - low))


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
        "mismatch/kl_k3": float((torch.expm1(log_w.double()) - log_w.double()).mean()),  # w - 1 - log w cancels
        "mismatch/w_max": float(w.max()),
        "mismatch/w_p99": quantile(w, 0.99),
        "mismatch/w_over_cap": float((w > cap).float().mean()),
        "mismatch/seq_log_ratio_per_token": float((seq_diff / mask.sum(-1).clamp_min(1.0)).mean()),
    }
