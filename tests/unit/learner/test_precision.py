"""precision.train: dynamic loss scaling (pure and through the step), bf16 / fp16 steps, no publication on skip."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_learner import random_groups, tiny_batch, tiny_config, tiny_model, with_behavior

from common.config import to_dict
from learner.acrl import AcrlReference
from learner.precision import LossScaler, autocast
from learner.sections import LearnerSections
from learner.update import train_on_batch


def test_scaler_halves_and_skips_on_nonfinite_then_grows_after_clean_interval():
    scaler = LossScaler(scale=1024.0, growth_interval=3)
    scaler.update(finite=False)
    assert (scaler.scale, scaler.skipped, scaler.clean_steps) == (512.0, 1, 0)
    scaler.update(finite=True)
    scaler.update(finite=True)
    assert scaler.scale == 512.0  # two clean steps: not yet
    scaler.update(finite=False)  # an overflow resets the clean run
    assert (scaler.scale, scaler.clean_steps) == (256.0, 0)
    for _ in range(3):
        scaler.update(finite=True)
    assert (scaler.scale, scaler.clean_steps, scaler.skipped) == (512.0, 0, 2)
    for _ in range(3):
        scaler.update(finite=True)
    assert scaler.scale == 1024.0


def test_scaler_scales_loss_and_unscales_gradients_exactly():
    scaler = LossScaler(scale=2.0**10, growth_interval=5)
    param = torch.nn.Parameter(torch.tensor([0.3, -1.7]))
    coeffs = torch.tensor([0.1, 3.0])
    scaler.scale_loss((param * coeffs).sum()).backward()
    assert torch.equal(param.grad, coeffs * 2**10)
    scaler.unscale_([param])
    assert torch.equal(param.grad, coeffs)  # powers of two: exact


def test_disabled_scaler_is_the_identity():
    scaler = LossScaler(scale=2.0**16, enabled=False)
    assert scaler.scale == 1.0
    loss = torch.tensor(3.0)
    assert scaler.scale_loss(loss) is loss
    scaler.update(finite=False)
    assert scaler.scale == 1.0 and scaler.skipped == 1


def _step(precision: str, *overrides: str, scaler: LossScaler | None = None, model=None):
    model = model if model is not None else tiny_model()
    batch = with_behavior(tiny_batch(), model)
    cfg = tiny_config(f"precision.train={precision}", *overrides)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = scaler or LossScaler(enabled=precision == "fp16")
    result = train_on_batch(model, optimizer, scaler, batch, cfg, AcrlReference(cfg.loss.acrl))
    return model, optimizer, scaler, result


def test_fp16_overflow_skips_the_step_halves_the_scale_and_leaves_weights_and_adam_untouched():
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scaler = LossScaler(scale=2.0**40, growth_interval=1)  # loss * 2^40 overflows fp16 in the backward
    model, optimizer, scaler, result = _step("fp16", "learner.minibatches=2", scaler=scaler, model=model)
    assert result.skipped and result.metrics["skipped_nonfinite"] == 1.0
    assert scaler.scale == 2.0**39 and scaler.skipped == 1
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert result.metrics["norm_update"] == 0.0
    assert not optimizer.state  # no AdamW moments were kept from a skipped step


def test_fp16_clean_step_updates_weights_and_grows_the_scale_after_its_interval():
    scaler = LossScaler(scale=2.0**8, growth_interval=2)
    model, _, scaler, result = _step("fp16", "learner.minibatches=2", scaler=scaler)
    assert not result.skipped
    assert scaler.scale == 2.0**9  # two clean optimizer steps (minibatches) -> doubled once
    assert result.metrics["norm_update"] > 0 and np.isfinite(result.metrics["loss"])


def test_fp16_recovers_from_a_too_large_scale_within_a_few_steps():
    model = tiny_model()
    scaler = LossScaler(scale=2.0**24, growth_interval=1000)
    skipped = 0
    for _ in range(20):
        _, _, _, result = _step("fp16", scaler=scaler, model=model)
        if not result.skipped:
            break
        skipped += 1
    assert not result.skipped and 1 <= skipped < 20
    assert scaler.scale == 2.0 ** (24 - skipped)


@pytest.mark.parametrize("weighting", ["tis", "tbpo"])
def test_bf16_and_fp16_steps_are_finite_and_close_to_fp32(weighting):
    results = {p: _step(p, f"loss.weighting={weighting}")[3].metrics for p in ("fp32", "bf16", "fp16")}
    for precision in ("bf16", "fp16"):
        assert np.isfinite(results[precision]["loss"])
        assert results[precision]["loss"] == pytest.approx(results["fp32"]["loss"], rel=2e-2, abs=2e-3)
        assert results[precision]["grad_norm"] == pytest.approx(results["fp32"]["grad_norm"], rel=3e-2)
    assert results["fp16"]["loss"] != results["fp32"]["loss"]  # really computed in half precision


def test_autocast_computes_matmuls_in_the_training_dtype():
    layer = torch.nn.Linear(8, 8)
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        with autocast(precision):
            assert layer(torch.randn(2, 8)).dtype == dtype
    assert layer.weight.dtype == torch.float32  # master weights stay fp32


def test_a_skipped_fp16_step_republishes_its_unchanged_weights_as_the_next_version(tmp_path):
    """Step k publishes version k + 1 even when it is skipped (the weights it had), so that a synchronous run, whose
    step k + 1 waits for groups of version k + 1, goes on (it waited forever when a skipped step published nothing)."""
    from common.builtin_model import resolve_model_path
    from common.config import load_config
    from learner.trainer import Learner

    model_dir = str(resolve_model_path("builtin:micro", log=lambda *_: None))
    cfg = load_config(None, ["model.path=builtin:micro", "precision.train=fp16", "precision.loss_scale_init=16777216"])
    sections = to_dict(LearnerSections.pick(cfg))
    learner = Learner(sections, model_dir, "tcp://127.0.0.1:9")  # the buffer is never contacted: fetch is ours
    try:
        groups = random_groups(learner.model.config.vocab_size)
        learner.fetch = lambda step: (groups, 0, 0.0)
        before = {k: v.clone() for k, v in learner.model.state_dict().items()}
        scales = []
        for step in range(40):
            metrics = learner.train_step(step)
            scales.append(metrics["loss_scale"])
            assert metrics["version"] == learner.publisher.version == step + 1  # skipped or not
            if metrics["skipped_steps"] == step:  # this step was clean (the `step` before it were skipped)
                break
            assert all(torch.equal(before[k], v) for k, v in learner.model.state_dict().items())
        assert step >= 1  # at least one step was skipped
        assert scales == [2.0 ** (24 - i) for i in range(step + 1)]
        assert any(not torch.equal(before[k], v) for k, v in learner.model.state_dict().items())
    finally:
        learner.close()


def test_an_fp16_run_resumed_from_a_bf16_checkpoint_keeps_its_initial_loss_scale():
    from learner.precision import LossScaler

    bf16 = LossScaler(scale=65536.0, enabled=False)
    bf16.update(finite=False)
    fp16 = LossScaler(scale=65536.0, enabled=True)
    fp16.load_state_dict(bf16.state_dict())
    assert fp16.scale == 65536.0 and fp16.skipped == 1
    resumed = LossScaler(scale=65536.0, enabled=True)
    fp16.update(finite=False)
    resumed.load_state_dict(fp16.state_dict())
    assert resumed.scale == 32768.0  # an fp16 checkpoint's scale carries over


def test_a_skipped_step_leaves_acrls_reference_x_as_it_found_it():
    """A step skipped for an fp16 overflow moved the EMA of X (0.0077 -> 0.0223); one NaN Y_g made X NaN for the rest
    of the run, and ACRL ran with alpha 0."""
    import copy

    model = tiny_model()
    batch = with_behavior(tiny_batch(), model)
    cfg = tiny_config("precision.train=fp16", "loss.weighting=acrl", "loss.acrl.x_mode=ema", "loss.acrl.ema_decay=0.5")
    reference = AcrlReference(cfg.loss.acrl)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    clean = train_on_batch(model, optimizer, LossScaler(scale=2.0**8), copy.deepcopy(batch), cfg, reference)
    x = reference.state_dict()["measured_x"]
    assert not clean.skipped and x is not None and x > 0
    other = with_behavior(tiny_batch(seed=5), model, seed=3, noise=1.0)
    skipped = train_on_batch(model, optimizer, LossScaler(scale=2.0**40), copy.deepcopy(other), cfg, reference)
    assert skipped.skipped and reference.state_dict()["measured_x"] == x
    assert reference.update_and_get(torch.tensor([float("nan")])) == x  # a non-finite Y_g is not folded in


def test_a_disabled_scaler_resumed_from_an_fp16_checkpoint_keeps_scale_one():
    """A bf16 run resumed from an fp16 checkpoint logged loss_scale 524288 (and saved it on)."""
    state = {"scale": 524288.0, "clean_steps": 1, "skipped": 5, "enabled": True}
    disabled = LossScaler(enabled=False)
    disabled.load_state_dict(state)
    assert disabled.scale == 1.0 and disabled.skipped == 5
    fp16 = LossScaler(scale=2.0**16)
    fp16.load_state_dict(state)
    assert fp16.scale == 524288.0 and fp16.clean_steps == 1
    fp16_from_bf16 = LossScaler(scale=2.0**16)
    fp16_from_bf16.load_state_dict({**state, "scale": 1.0, "enabled": False})
    assert fp16_from_bf16.scale == 2.0**16  # its own loss_scale_init
