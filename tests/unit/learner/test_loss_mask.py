"""The per-token loss mask of multi-turn trajectories (issue 21): observation tokens are context, never trained.

A trajectory's `loss_mask` (common.wire) becomes the batch's `mask` (learner/batch.py collate), and every loss,
advantage and mismatch metric weighs tokens by it: what the behaviour log-probs of observation tokens say, and
what the model predicts there, changes neither the update nor the metrics.
"""

from __future__ import annotations

import numpy as np
import torch
from tiny_learner import VOCAB, random_groups, tiny_config, tiny_model

from learner.acrl import AcrlReference
from learner.batch import collate, token_logp
from learner.losses import mismatch_metrics
from learner.precision import LossScaler
from learner.update import train_on_batch


def multi_turn_groups(behav_on_observations: float) -> list[list]:
    """random_groups with longer responses whose middle tokens are an observation (mask 0), behaviour log-prob
    `behav_on_observations` there."""
    groups = random_groups(VOCAB, n_groups=2, size=4)
    rng = np.random.default_rng(1)
    for group in groups:
        for traj in group:
            r = 9
            mask = np.array([1, 1, 0, 0, 0, 1, 1, 0, 1], dtype=np.uint8)
            traj.response_ids = rng.integers(3, VOCAB, r).astype(np.int32)
            logp = -rng.uniform(0.5, 3.0, r).astype(np.float32)
            logp[mask == 0] = behav_on_observations
            traj.behav_logp = logp
            traj.versions = np.zeros(r, dtype=np.int32)
            traj.loss_mask = mask
    return groups


def test_collate_ands_the_loss_mask_into_the_response_mask() -> None:
    groups = multi_turn_groups(0.0)
    groups[0][0].loss_mask = None  # a single-turn trajectory in the same batch: all its tokens are trained
    batch = collate(groups, pad_id=0)
    assert batch.mask[0, :9].tolist() == [1.0] * 9
    assert batch.mask[1, :9].tolist() == [1, 1, 0, 0, 0, 1, 1, 0, 1]
    assert float(batch.mask[1, 9:].sum()) == 0.0


def test_observation_tokens_never_receive_gradient() -> None:
    """The log-probs at observation positions are 0 and carry no gradient; the train step and the mismatch metrics
    are the same whatever the behaviour log-probs on observation tokens say."""
    batch = collate(multi_turn_groups(0.0), pad_id=0)
    model = tiny_model(seed=3)
    logp, _ = token_logp(model, batch, temperature=1.0)
    observed = (batch.mask == 0) & (torch.arange(batch.mask.shape[1]) < 9)
    assert observed.any() and bool((logp[observed] == 0).all())
    logp[observed].sum().backward()  # the observation positions alone: no path to any parameter
    assert all(p.grad is None or float(p.grad.abs().max()) == 0.0 for p in model.parameters())

    outcomes = []
    for behav in (0.0, -17.0):  # wildly different "behaviour log-probs" on the observation tokens
        model = tiny_model(seed=3)
        batch = collate(multi_turn_groups(behav), pad_id=0)
        cfg = tiny_config("loss.weighting=tis", "loss.cap=2.0")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        result = train_on_batch(model, optimizer, LossScaler(enabled=False), batch, cfg, AcrlReference(cfg.loss.acrl))
        mismatch = mismatch_metrics(batch.behav_logp, result.prox_logp, batch.mask, cfg.loss.cap)
        outcomes.append(([p.detach().clone() for p in model.parameters()], mismatch))
    (weights_a, mismatch_a), (weights_b, mismatch_b) = outcomes
    for a, b in zip(weights_a, weights_b, strict=True):
        torch.testing.assert_close(a, b, rtol=0.0, atol=0.0)
    assert mismatch_a.keys() == mismatch_b.keys()
    for key in mismatch_a:
        torch.testing.assert_close(torch.tensor(mismatch_a[key]), torch.tensor(mismatch_b[key]), rtol=0.0, atol=0.0)
