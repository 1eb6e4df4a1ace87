"""`learner.skip_zero_adv`: rows with a zero advantage run forward-only, and the step is the one with their backward."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_learner import tiny_batch, tiny_config, tiny_model, with_behavior

from learner.acrl import AcrlReference
from learner.precision import LossScaler
from learner.update import forward_only_order, train_on_batch


def _batch_with_equal_groups(model: torch.nn.Module, equal: dict[int, float], groups: int = 3):
    """tiny_batch's rows, the groups in `equal` given that one reward on every row (their advantage is 0 without the
    overlong penalty: `algo.overlong.len=0`)."""
    batch = with_behavior(tiny_batch(seed=4, groups=groups), model, seed=5)
    for group, reward in equal.items():
        batch.rewards[batch.group_index == group] = reward
    spread = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=batch.rewards.dtype)
    batch.rewards[batch.group_index == 1] = spread  # group 1 keeps a spread
    return batch


def _step(skip: bool, weighting: str, equal: dict[int, float], *overrides: str):
    """One warm-up step (AdamW state to carry), then the measured step; the weights, the result, the grad modes of
    the measured step's decoder forwards and the rows each backward saw."""
    model = tiny_model(seed=2)
    cfg = tiny_config(f"loss.weighting={weighting}", f"learner.skip_zero_adv={str(skip).lower()}", "loss.cap=2.0",
                      "learner.micro_batch_tokens=40", "algo.overlong.len=0", *overrides)  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference = AcrlReference(cfg.loss.acrl)
    warm = with_behavior(tiny_batch(seed=9), model, seed=3)
    train_on_batch(model, optimizer, LossScaler(enabled=False), warm, cfg, reference)
    batch = _batch_with_equal_groups(model, equal)
    forwards: list[bool] = []
    model.get_decoder().register_forward_hook(lambda *_: forwards.append(torch.is_grad_enabled()))
    result = train_on_batch(model, optimizer, LossScaler(enabled=False), batch, cfg, reference)
    return [p.detach().clone() for p in model.parameters()], result, forwards


@pytest.mark.parametrize("weighting", ["tis", "acrl", "tbpo"])
@pytest.mark.parametrize("minibatches", [1, 2])
def test_zero_advantage_rows_skip_their_backward_and_the_step_is_unchanged(weighting, minibatches):
    equal = {0: 1.0, 2: 0.0}
    overrides = (f"learner.minibatches={minibatches}",)
    skip_weights, skip, skip_forwards = _step(True, weighting, equal, *overrides)
    full_weights, full, full_forwards = _step(False, weighting, equal, *overrides)
    assert skip.metrics.pop("learner/forward_only_share") == pytest.approx(2 / 3)
    assert "learner/forward_only_share" not in full.metrics
    assert False in skip_forwards and skip_forwards.count(True) < full_forwards.count(True)
    for a, b in zip(skip_weights, full_weights):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(skip.prox_logp, full.prox_logp, rtol=1e-5, atol=1e-6)  # in the batch's row order
    torch.testing.assert_close(skip.entropy, full.entropy, rtol=1e-5, atol=1e-6)
    assert skip.metrics.keys() == full.metrics.keys()
    for key, value in full.metrics.items():  # ACRL's means too: weighted as the loss weighs rows, split-invariant
        assert skip.metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_a_batch_without_any_advantage_runs_no_backward_and_adamw_still_steps_on_zero_gradients():
    equal = {0: 1.0, 1: 1.0, 2: 0.0}
    model = tiny_model(seed=2)
    batch = _batch_with_equal_groups(model, equal)
    batch.rewards[batch.group_index == 1] = 1.0
    cfg = tiny_config("loss.weighting=tis", "learner.skip_zero_adv=true", "algo.overlong.len=0")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    warm = with_behavior(tiny_batch(seed=9), model, seed=3)
    train_on_batch(model, optimizer, LossScaler(enabled=False), warm, cfg, AcrlReference(cfg.loss.acrl))
    before = [p.detach().clone() for p in model.parameters()]
    forwards: list[bool] = []
    model.get_decoder().register_forward_hook(lambda *_: forwards.append(torch.is_grad_enabled()))
    result = train_on_batch(model, optimizer, LossScaler(enabled=False), batch, cfg, AcrlReference(cfg.loss.acrl))
    assert forwards and not any(forwards)
    assert result.metrics["learner/forward_only_share"] == 1.0 and result.metrics["grad_norm"] == 0.0
    assert not result.skipped and result.metrics["loss"] == 0.0
    # AdamW's momentum from the warm-up step still moves every weight, as a backward of zeros would have
    assert all(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("regularizer", ["loss.kl.coef=0.1", "loss.entropy_coef=0.01"])
def test_a_term_that_survives_a_zero_advantage_keeps_every_backward(regularizer):
    model = tiny_model(seed=2)
    batch = _batch_with_equal_groups(model, {0: 1.0, 2: 0.0})
    cfg = tiny_config("loss.weighting=tis", "learner.skip_zero_adv=true", "algo.overlong.len=0", regularizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference = copy.deepcopy(model)  # before the hook: the reference's own pass runs without grad
    forwards: list[bool] = []
    model.get_decoder().register_forward_hook(lambda *_: forwards.append(torch.is_grad_enabled()))
    result = train_on_batch(model, optimizer, LossScaler(enabled=False), batch, cfg, AcrlReference(cfg.loss.acrl),
                            reference=reference)  # fmt: skip
    assert "learner/forward_only_share" not in result.metrics
    assert forwards and all(forwards)


def test_forward_only_order_keeps_groups_whole_within_each_minibatch():
    adv = torch.tensor([0.0, 0.0, 1.0, -1.0, 0.0, 0.0, 0.5, 0.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])  # group 3: one nonzero row, so the whole group keeps its backward
    order, grad_ends = forward_only_order(adv, groups, [0, 4, 8])
    assert order.tolist() == [2, 3, 0, 1, 6, 7, 4, 5] and grad_ends == [2, 6]
    assert forward_only_order(torch.ones(4), groups[:4], [0, 4]) == (None, [4])
