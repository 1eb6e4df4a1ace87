"""norm_update without a snapshot: the optimizer step taken parameter by parameter is the step, bit for bit."""

from __future__ import annotations

import pytest
import torch
from tiny_learner import tiny_batch, tiny_config, tiny_model, with_behavior

from learner.acrl import AcrlReference
from learner.precision import LossScaler
from learner.update import _update_sums, step_measuring_update, steps_per_parameter, train_on_batch


def _with_grads(seed: int) -> torch.nn.Module:
    model = tiny_model(seed=seed)
    gen = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=gen)
    model.model.norm.weight.grad = None  # a parameter without a gradient is left alone
    return model


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_stepping_parameter_by_parameter_is_one_step_and_measures_it(weight_decay):
    plain, measured = _with_grads(seed=3), _with_grads(seed=3)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=weight_decay) for m in (plain, measured)]
    for _ in range(2):  # the second step runs on AdamW state from the first
        before = [p.detach().clone() for p in plain.parameters()]
        optimizers[0].step()
        sums = step_measuring_update(optimizers[1], measured)
        for a, b in zip(plain.parameters(), measured.parameters()):
            assert torch.equal(a, b)
        assert torch.equal(sums, _update_sums(plain, before))  # the same float64 sums as against a snapshot
        assert float(sums[0]) > 0
        unchanged = [torch.equal(p, old) for p, old in zip(plain.parameters(), before)]
        assert unchanged.count(True) == 1 and measured.model.norm.weight.grad is None  # the one without a gradient
    assert [g["params"] for g in optimizers[1].param_groups] == [list(measured.parameters())]  # restored
    state_plain, state_measured = optimizers[0].state_dict()["state"], optimizers[1].state_dict()["state"]
    assert state_plain.keys() == state_measured.keys()
    for key, state in state_plain.items():
        for name, value in state.items():
            assert torch.equal(state_measured[key][name], value), (key, name)


def test_one_minibatch_step_reports_the_norm_update_of_its_weights():
    model = tiny_model()
    batch = with_behavior(tiny_batch(), model)
    cfg = tiny_config("loss.weighting=tis")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    result = train_on_batch(model, optimizer, LossScaler(enabled=False), batch, cfg, AcrlReference(cfg.loss.acrl))
    delta, base = _update_sums(model, before).tolist()
    assert not result.skipped and result.metrics["norm_update"] == delta / base > 0


def test_an_optimizer_that_may_not_step_per_parameter_keeps_the_snapshot_path():
    class Recording(torch.optim.AdamW):  # overrides step: stepping it per parameter would change what it sees
        calls = 0

        def step(self, closure=None):  # noqa: ANN001, ANN201
            Recording.calls += 1
            return super().step(closure)

    model = tiny_model()
    batch = with_behavior(tiny_batch(), model)
    cfg = tiny_config("loss.weighting=tis")
    assert steps_per_parameter(torch.optim.AdamW(model.parameters())) and not steps_per_parameter(
        Recording(model.parameters())
    )
    optimizer = Recording(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    result = train_on_batch(model, optimizer, LossScaler(enabled=False), batch, cfg, AcrlReference(cfg.loss.acrl))
    delta, base = _update_sums(model, before).tolist()
    assert Recording.calls == 1 and result.metrics["norm_update"] == delta / base > 0


def test_a_small_model_snapshots_and_steps_once_with_the_same_update(monkeypatch):
    """Under `SNAPSHOT_MAX_BYTES` the step is one optimizer call against a snapshot: the same weights, the same sums."""
    import learner.update as update

    outcomes = {}
    for limit in (0, 2**30):  # 0: per parameter (as a large model); 1 GiB: the tiny model snapshots
        monkeypatch.setattr(update, "SNAPSHOT_MAX_BYTES", limit)
        calls = []
        model = tiny_model()
        batch = with_behavior(tiny_batch(), model)
        cfg = tiny_config("loss.weighting=tis")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        optimizer.register_step_pre_hook(lambda *_, calls=calls: calls.append(1))
        result = train_on_batch(model, optimizer, LossScaler(enabled=False), batch, cfg, AcrlReference(cfg.loss.acrl))
        outcomes[limit] = (len(calls), result.metrics["norm_update"], [p.detach().clone() for p in model.parameters()])
    (steps_measured, measured, weights_measured), (steps_snapshot, snapshot, weights_snapshot) = outcomes.values()
    assert steps_measured == len(weights_measured) and steps_snapshot == 1
    assert measured == snapshot > 0
    assert all(torch.equal(a, b) for a, b in zip(weights_measured, weights_snapshot))
