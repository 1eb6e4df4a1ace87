"""The train step: token-budget micro-batches change nothing but memory; a non-finite minibatch undoes the step."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_learner import tiny_batch, tiny_config, tiny_model, with_behavior

from learner.acrl import AcrlReference
from learner.batch import micro_batches, rank_rows
from learner.precision import LossScaler
from learner.update import train_on_batch


def test_micro_batches_respect_the_token_budget_and_cover_every_row_once():
    batch = tiny_batch(groups=4, group_size=4)
    lengths = batch.attention_mask.sum(-1).tolist()
    for budget in (1, 13, 30, 64, 10_000):
        plan = micro_batches(batch, 2, 15, budget)
        assert [r for lo, hi in plan for r in range(lo, hi)] == list(range(2, 15))
        for lo, hi in plan:
            assert hi - lo == 1 or (hi - lo) * max(lengths[lo:hi]) <= budget
    assert micro_batches(batch, 0, 16, 10_000) == [(0, 16)]
    assert [rank_rows(0, 7, r, 2) for r in range(2)] == [(0, 3), (3, 7)]


@pytest.mark.parametrize("weighting", ["tis", "acrl", "gspo"])
def test_gradients_do_not_depend_on_the_micro_batch_budget(weighting):
    grads = {}
    for budget in (12, 100_000):  # one row per micro-batch vs the whole minibatch at once
        model = tiny_model()
        batch = with_behavior(tiny_batch(), model)
        cfg = tiny_config(f"loss.weighting={weighting}", f"learner.micro_batch_tokens={budget}", "optim.grad_clip=0")
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # one step: new weight = old - grad
        before = [p.detach().clone() for p in model.parameters()]
        result = train_on_batch(model, optimizer, LossScaler(enabled=False), batch, cfg, AcrlReference(cfg.loss.acrl))
        grads[budget] = ([old - p.detach() for old, p in zip(before, model.parameters())], result.metrics)
    (small, small_metrics), (whole, whole_metrics) = grads[12], grads[100_000]
    for a, b in zip(small, whole):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert small_metrics["loss"] == pytest.approx(whole_metrics["loss"], rel=1e-5, abs=1e-7)


@pytest.mark.parametrize(
    ("weighting", "agg"),
    [("tis", "seq_mean_token_mean"), ("mis_token", "seq_mean_token_mean"), ("acr", "seq_mean_token_mean"),
     ("mis_seq", "token_mean"), ("pg_tis", "token_mean")],
)  # fmt: skip
def test_share_metrics_do_not_depend_on_the_micro_batch_budget(weighting, agg):
    """The clip, truncation and masking shares are shares of tokens (or of responses for the sequence-level ones) of
    the whole minibatch, whatever `loss.agg` weighs rows by and however the rows were split into micro-batches."""
    from learner.distributed import SINGLE
    from learner.update import minibatch_backward, proximal_logp, step_inputs

    metrics = {}
    for budget in (12, 100_000):
        torch.manual_seed(0)
        model = tiny_model()
        batch = with_behavior(tiny_batch(), model, noise=0.6)
        cfg = tiny_config(f"loss.weighting={weighting}", f"loss.agg={agg}", "loss.cap=1.3",
                          f"learner.micro_batch_tokens={budget}", "learner.share_prefix=false",
                          "learner.skip_zero_adv=false")  # fmt: skip
        prox, _ = proximal_logp(model, batch, cfg.learner, cfg.precision, cfg.rollout, SINGLE)
        inputs = step_inputs(batch, prox, cfg.rollout, cfg.algo, cfg.loss, AcrlReference(cfg.loss.acrl))
        metrics[budget] = minibatch_backward(model, batch, (0, batch.rows), inputs, cfg, LossScaler(enabled=False))[1]
    shares = [key for key in metrics[12] if key in ("ppo_clip_high", "ppo_clip_low", "tis_trunc", "mis_masked")]
    assert shares and any(0.0 < metrics[12][key] < 1.0 for key in shares), metrics[12]  # exercised, not 0 or 1
    for key in shares:
        assert metrics[12][key] == pytest.approx(metrics[100_000][key], abs=1e-6), key


def test_a_nonfinite_second_minibatch_undoes_the_first_ones_update_and_adam_state():
    model = tiny_model()
    batch = with_behavior(tiny_batch(), model)
    cfg = tiny_config("loss.weighting=decoupled", "learner.minibatches=2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # One earlier clean step, so that there is AdamW state to protect.
    train_on_batch(model, optimizer, LossScaler(enabled=False), tiny_batch(seed=3), tiny_config("learner.prox=behav"),
                   AcrlReference(cfg.loss.acrl))  # fmt: skip
    weights = copy.deepcopy(model.state_dict())
    adam = copy.deepcopy(optimizer.state_dict())
    batch.behav_logp[-1, 0] = float("nan")  # the last row, in the second minibatch: its loss is nan
    steps = []
    optimizer.register_step_post_hook(lambda *_: steps.append(1))
    result = train_on_batch(model, optimizer, LossScaler(enabled=False), batch, cfg, AcrlReference(cfg.loss.acrl))
    assert len(steps) == 1  # the first minibatch did step ...
    assert result.skipped and result.metrics["norm_update"] == 0.0  # ... and was undone
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    restored = optimizer.state_dict()
    assert restored["state"].keys() == adam["state"].keys()
    for key, state in adam["state"].items():
        for name, value in state.items():
            assert torch.equal(restored["state"][key][name], value), (key, name)


@pytest.mark.parametrize("weighting", ["none", "tis", "mis_seq", "tbpo", "gspo", "pg_tis", "acrl"])
def test_one_minibatch_takes_lp_from_its_own_forward_with_the_same_result(weighting, monkeypatch):
    """With one minibatch, lp comes from that minibatch's forward (no extra forward) and the step is unchanged."""
    import learner.update as update

    outcomes = {}
    for reuse in (True, False):
        if not reuse:
            monkeypatch.setattr(update, "prox_from_training_forward", lambda learner, loss: False)
        model = tiny_model(seed=1)
        batch = with_behavior(tiny_batch(seed=1), model, seed=2)
        cfg = tiny_config(f"loss.weighting={weighting}", "learner.micro_batch_tokens=20", "loss.cap=2.0")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        forwards: list[bool] = []
        model.get_decoder().register_forward_hook(lambda *_, seen=forwards: seen.append(torch.is_grad_enabled()))
        result = train_on_batch(model, optimizer, LossScaler(enabled=False), batch, cfg, AcrlReference(cfg.loss.acrl))
        outcomes[reuse] = (result, [p.detach().clone() for p in model.parameters()], forwards)
    (fused, fused_weights, fused_forwards), (extra, extra_weights, extra_forwards) = outcomes[True], outcomes[False]
    micro = len(extra_forwards) // 2  # the extra pass runs the same micro-batches without grad
    assert extra_forwards == [False] * micro + [True] * micro
    assert fused_forwards == (extra_forwards if weighting == "acrl" else [True] * micro)
    torch.testing.assert_close(fused.prox_logp, extra.prox_logp, rtol=0, atol=0)
    torch.testing.assert_close(fused.entropy, extra.entropy, rtol=0, atol=0)
    assert fused.metrics == extra.metrics
    for a, b in zip(fused_weights, extra_weights):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_heap_is_trimmed_only_when_memory_is_short_the_first_update_too(monkeypatch):
    from learner import memory, update

    asked = []
    monkeypatch.setattr(update, "trim_heap", lambda below_available_share: asked.append(below_available_share))
    model = tiny_model()
    cfg = tiny_config()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for seed in (1, 2):
        batch = with_behavior(tiny_batch(seed=seed), model)
        train_on_batch(model, optimizer, LossScaler(enabled=False), batch, cfg, AcrlReference(cfg.loss.acrl))
    assert asked == [memory.TRIM_BELOW_AVAILABLE] * 2


def test_an_update_that_leaves_non_finite_weights_fails_the_step_naming_the_optimizer_state():
    """Damaged AdamW moments (flipped bytes in a checkpoint's training state) with a finite loss and gradient: the
    step wrote NaNs into the weights, and the run trained on and saved them (held-out accuracy 0, the run "done")."""
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = tiny_config("learner.prox=behav")
    train_on_batch(model, optimizer, LossScaler(enabled=False), with_behavior(tiny_batch(seed=3), model), cfg,
                   AcrlReference(cfg.loss.acrl))  # fmt: skip
    assert all(bool(p.isfinite().all()) for p in model.parameters())
    next(iter(optimizer.state.values()))["exp_avg_sq"].fill_(-1.0)  # sqrt of a negative moment: NaN
    with pytest.raises(FloatingPointError, match="weights are not finite after the optimizer step.*damaged"):
        train_on_batch(model, optimizer, LossScaler(enabled=False), with_behavior(tiny_batch(seed=4), model), cfg,
                       AcrlReference(cfg.loss.acrl))  # fmt: skip


def test_several_minibatches_report_the_whole_batch_s_shares_and_loss():
    """TIS's w does not move between minibatches (lp is the step's), so its truncated share is the batch's share of
    tokens with w > C; with 3 minibatches the logged `tis_trunc` (and `loss`, `ppo_clip_*`) was the last one's."""
    from learner.losses import mismatch_metrics

    model = tiny_model(seed=1)
    batch = with_behavior(tiny_batch(seed=1), model, seed=2)
    results = {}
    for minibatches in (1, 3):
        cfg = tiny_config("loss.weighting=tis", "loss.cap=1.0", f"learner.minibatches={minibatches}")
        trained = copy.deepcopy(model)
        optimizer = torch.optim.SGD(trained.parameters(), lr=0.0)  # no move: the minibatches see the same policy
        results[minibatches] = train_on_batch(
            trained, optimizer, LossScaler(enabled=False), batch, cfg, AcrlReference(cfg.loss.acrl)
        )
    share = mismatch_metrics(batch.behav_logp, results[3].prox_logp, batch.mask, 1.0)["mismatch/w_over_cap"]
    assert 0.0 < share < 1.0
    for minibatches, result in results.items():
        assert result.metrics["tis_trunc"] == pytest.approx(share, abs=1e-6), minibatches
    for key in ("loss", "ppo_clip_high", "ppo_clip_low"):
        assert results[3].metrics[key] == pytest.approx(results[1].metrics[key], rel=1e-5, abs=1e-7), key
