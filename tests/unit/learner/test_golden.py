"""Golden-loss regression: a fixed, seeded batch through a tiny seeded Llama and the learner's loss.

The expected numbers below were produced by this code and are stored here on purpose: any change to the loss
math (a weighting, an aggregation, the advantages, the normalisation over micro-batches) changes them and fails
this test. If a change is intended, say why in the commit and regenerate them with `python test_golden.py`.
"""

from __future__ import annotations

import pytest
import torch
from tiny_learner import tiny_batch, tiny_config, tiny_model, with_behavior

from common.config import LossConfig
from learner.acrl import AcrlReference
from learner.batch import overlong_shaping, token_logp
from learner.losses import LossInputs, advantages, policy_loss
from learner.precision import LossScaler
from learner.update import train_on_batch
from learner.weightings import group_discrepancy

# (weighting, extra LossConfig fields) -> (loss, global grad norm over the model's parameters)
GOLDEN_LOSS: dict[tuple[str, str], tuple[float, float]] = {
    ("none", ""): (0.21489867568016052, 2.537421226501465),
    ("decoupled", ""): (0.2400466352701187, 2.12872576713562),
    ("tis", ""): (0.19966542720794678, 2.7879486083984375),
    ("mis_token", ""): (0.2400466352701187, 2.12872576713562),  # = decoupled by definition
    ("mis_seq", ""): (0.06501952558755875, 0.8571276068687439),
    ("acr", ""): (0.19911029934883118, 2.7942824363708496),
    ("acrl", ""): (0.21908104419708252, 2.5373291969299316),
    ("tbpo", ""): (-0.017695724964141846, 2.9155426025390625),
    ("gspo", ""): (0.018223771825432777, 2.765040397644043),
    ("pg_is", ""): (-3.766460657119751, 22.862241744995117),
    ("pg_tis", ""): (-3.0957088470458984, 15.341144561767578),
    ("pg_mis", ""): (-0.30202722549438477, 5.1094841957092285),
    ("tis", "agg=seq_mean_token_mean"): (-0.008660887368023396, 3.1047730445861816),
    ("tis", "agg=seq_mean_token_sum_norm"): (0.13311026990413666, 1.8586326837539673),
    ("tis", "eps_low=0.1"): (0.19988805055618286, 2.7957475185394287),
    ("acr", "eps_high=0.1"): (0.20552664995193481, 2.7813549041748047),
    ("none", "dual_clip=1.2"): (0.21341364085674286, 2.53169584274292),
}
# the whole train step (advantages with overlong shaping, recomputed lp, 2 minibatches, 20-token micro-batches)
GOLDEN_STEP: dict[str, tuple[float, float, float]] = {  # (the step's loss over its 2 minibatches, their mean
    # grad norm, norm_update); every weighting, configured as the driver configures it (decoupled / tis / mis_token /
    # acr agree here: this batch's behavior noise stays inside their bands; GOLDEN_LOSS tells them apart). Until
    # 2026-12-07 the loss and grad norm were the last minibatch's.
    "none": (0.07020149833988398, 3.0097389221191406, 7.505875453444951e-05),
    "decoupled": (0.09161315951496363, 3.4147772789001465, 7.624996197384656e-05),
    "tis": (0.09161315951496363, 3.4147772789001465, 7.624996197384656e-05),
    "mis_token": (0.09161315951496363, 3.4147772789001465, 7.624996197384656e-05),
    "mis_seq": (0.057457310846075416, 3.5667479038238525, 7.392179436291171e-05),
    "acr": (0.09161315951496363, 3.4147772789001465, 7.624996197384656e-05),
    "acrl": (0.05815522570628673, 3.026652693748474, 7.513237158196153e-05),
    "tbpo": (0.027244266122579575, 2.841275215148926, 7.369295364460122e-05),
    "gspo": (0.006230548024177551, 2.874921441078186, 7.628266932637518e-05),
    "pg_is": (-3.1303969621658325, 24.233458518981934, 7.641255640349413e-05),
    "pg_tis": (-3.7539336681365967, 23.888222694396973, 7.623783205330654e-05),
    "pg_mis": (-5.143716812133789, 23.71722984313965, 7.59064048881227e-05),
}

ROW_NOISE = torch.tensor([1e-4, 3e-4, 1e-3, 0.05, 0.3, 1.0])  # |lp - lc| per row: inside and outside every band


def _loss_config(weighting: str, extra: str) -> LossConfig:
    cfg = LossConfig(weighting=weighting, cap=1.3)
    for item in filter(None, extra.split(",")):
        key, value = item.split("=")
        setattr(cfg, key, value if key == "agg" else float(value))
    return cfg


def golden_loss(weighting: str, extra: str) -> tuple[float, float]:
    model = tiny_model(seed=0)
    batch = tiny_batch(seed=0)
    cur_logp, _ = token_logp(model, batch, temperature=1.0)
    gen = torch.Generator().manual_seed(3)
    scale = ROW_NOISE.repeat(batch.rows // len(ROW_NOISE) + 1)[: batch.rows, None]
    prox = (cur_logp.detach() + scale * torch.randn(cur_logp.shape, generator=gen)) * batch.mask
    behav = (prox + 0.3 * torch.randn(prox.shape, generator=gen)) * batch.mask
    lengths = batch.mask.sum(-1)
    shaped = batch.rewards + overlong_shaping(lengths, batch.truncated, 8, 2)
    group_y = group_discrepancy(behav, prox, batch.mask, batch.group_index)
    inputs = LossInputs(
        behav_logp=behav,
        prox_logp=prox,
        cur_logp=cur_logp,
        advantages=advantages(shaped, batch.group_index, "grpo"),
        mask=batch.mask,
        max_len=8,
        group_index=batch.group_index,
        acrl_x=float(group_y[1]),  # groups 0 and 2 fall on either side of X
        acrl_y=group_y,
    )
    out = policy_loss(inputs, _loss_config(weighting, extra))
    out.loss.backward()
    grad_norm = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm()
    return float(out.loss.detach()), float(grad_norm)


def golden_step(weighting: str) -> tuple[float, float, float]:
    model = tiny_model(seed=1)
    batch = with_behavior(tiny_batch(seed=1), model, seed=2)
    cfg = tiny_config(
        f"loss.weighting={weighting}", "learner.minibatches=2", "learner.micro_batch_tokens=20", "loss.cap=2.0"
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    result = train_on_batch(model, optimizer, LossScaler(enabled=False), batch, cfg, AcrlReference(cfg.loss.acrl))
    return result.metrics["loss"], result.metrics["grad_norm"], result.metrics["norm_update"]


@pytest.mark.parametrize(("weighting", "extra"), list(GOLDEN_LOSS))
def test_golden_loss(weighting, extra):
    assert golden_loss(weighting, extra) == pytest.approx(GOLDEN_LOSS[(weighting, extra)], rel=1e-5, abs=1e-7)


def test_every_weighting_has_a_golden_step():
    from common.config import WEIGHTINGS

    assert set(GOLDEN_STEP) == set(WEIGHTINGS)


@pytest.mark.parametrize("weighting", list(GOLDEN_STEP))
def test_golden_train_step(weighting):
    assert golden_step(weighting) == pytest.approx(GOLDEN_STEP[weighting], rel=1e-5, abs=1e-9)


if __name__ == "__main__":  # regenerate the tables above
    for key in GOLDEN_LOSS:
        print(f"    {key!r}: {golden_loss(*key)!r},")
    for name in GOLDEN_STEP:
        print(f"    {name!r}: {golden_step(name)!r},")
