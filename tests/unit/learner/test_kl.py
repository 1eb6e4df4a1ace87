"""The KL penalty against the frozen initial model (`loss.kl.coef`, `loss.kl.estimator`): Schulman's k1/k2/k3 by
hand, the direction of their gradients, 0 at step 0 and positive after, the reference rebuilt on resume, in the
training precision under `learner.rollout_aligned`, nothing built at coef 0, and FSDP2 over 2 ranks = one process.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing

import pytest
import torch
import torch.multiprocessing as mp
from tiny_learner import random_groups, tiny_batch, tiny_config, tiny_model, with_behavior

from common.builtin_model import resolve_model_path
from common.config import KlConfig, LossConfig, load_config, to_dict
from learner.acrl import AcrlReference
from learner.aligned import AlignedLinear
from learner.distributed import SINGLE, Dist, broadcast_batch, local_rendezvous, shard_model
from learner.losses import LossInputs, kl_estimate, policy_loss
from learner.precision import LossScaler
from learner.reference import initial_reference
from learner.sections import LearnerSections
from learner.trainer import Learner
from learner.update import metric_names, train_on_batch

LN = math.log


# r = pi_ref / pi_theta = 0.5, 2, 1 on three tokens
CUR = [LN(0.5), LN(0.2), LN(0.9)]
REF = [LN(0.25), LN(0.4), LN(0.9)]
BY_HAND = {
    "k1": [-LN(0.5), -LN(2.0), 0.0],  # -log r
    "k2": [0.5 * LN(0.5) ** 2, 0.5 * LN(2.0) ** 2, 0.0],  # (log r)^2 / 2
    "k3": [0.5 - 1 - LN(0.5), 2.0 - 1 - LN(2.0), 0.0],  # r - 1 - log r
}


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_the_estimators_match_hand_computation(estimator):
    per_token = kl_estimate(torch.tensor([CUR]), torch.tensor([REF]), estimator)
    torch.testing.assert_close(per_token, torch.tensor([BY_HAND[estimator]]), rtol=0.0, atol=1e-6)
    assert per_token[0, 2] == 0.0  # r = 1: no divergence, exactly


def test_an_unknown_estimator_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="loss.kl.estimator"):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


AGG_CASES = [("token_mean", "tis"), ("seq_mean_token_mean", "none"), ("seq_mean_token_sum_norm", "tis"),
             ("token_mean", "gspo")]  # fmt: skip


@pytest.mark.parametrize(("agg", "weighting"), AGG_CASES)
def test_the_kl_term_is_coef_times_the_estimate_aggregated_like_the_policy_loss(agg, weighting):
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    cur = torch.tensor([CUR, CUR], requires_grad=True)
    ref = torch.tensor([REF, REF])
    inputs = LossInputs(behav_logp=cur.detach(), prox_logp=cur.detach(), cur_logp=cur, mask=mask, max_len=4,
                        advantages=torch.tensor([1.0, -1.0]), ref_logp=ref)  # fmt: skip
    plain = policy_loss(inputs, LossConfig(weighting=weighting, agg=agg))
    out = policy_loss(inputs, LossConfig(weighting=weighting, agg=agg, kl=KlConfig(coef=0.1, estimator="k3")))
    k = BY_HAND["k3"]
    expected = {  # gspo is sequence-level: a mean over responses, as its loss, whatever loss.agg says
        "token_mean": (k[0] + k[1] + k[0]) / 3,
        "seq_mean_token_mean": ((k[0] + k[1]) / 2 + k[0]) / 2,
        "seq_mean_token_sum_norm": ((k[0] + k[1]) / 4 + k[0] / 4) / 2,
    }["seq_mean_token_mean" if weighting == "gspo" else agg]
    assert out.metrics["loss/kl"] == pytest.approx(expected, rel=1e-6)
    assert float(out.loss.detach()) == pytest.approx(float(plain.loss.detach()) + 0.1 * expected, rel=1e-6)
    assert "loss/kl" not in plain.metrics
    with pytest.raises(ValueError, match="loss.kl.coef"):  # the reference's log-probs are required
        policy_loss(dataclasses.replace(inputs, ref_logp=None), LossConfig(kl=KlConfig(coef=0.1)))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_the_expected_kl_gradient_points_back_to_the_reference(estimator):
    """Every token as a sample, weighted by its (stopped) probability under pi_theta: the expected gradient of the
    estimator. k2's is the gradient of KL(pi_theta || pi_ref), k3's that of KL(pi_ref || pi_theta): either step moves
    pi_theta toward pi_ref. k1's expected gradient is 0 (E[grad log pi] = 0): a k1 penalty only moves the policy
    through the sampling noise."""
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn((5, 7), generator=gen).requires_grad_()  # logits of pi_theta at 5 positions over 7 tokens
    ref_log = torch.log_softmax(torch.randn((5, 7), generator=gen), -1)
    cur_log = torch.log_softmax(theta, -1)
    per_token = kl_estimate(cur_log, ref_log, estimator)  # (5, 7)
    (grad,) = torch.autograd.grad((cur_log.exp().detach() * per_token).sum(), theta)

    def reverse_kl(logits: torch.Tensor) -> torch.Tensor:  # KL(pi_theta || pi_ref)
        q = torch.log_softmax(logits, -1)
        return (q.exp() * (q - ref_log)).sum()

    def forward_kl(logits: torch.Tensor) -> torch.Tensor:  # KL(pi_ref || pi_theta)
        return (ref_log.exp() * (ref_log - torch.log_softmax(logits, -1))).sum()

    if estimator == "k1":
        torch.testing.assert_close(grad, torch.zeros_like(grad), rtol=0.0, atol=1e-6)
        return
    target = reverse_kl if estimator == "k2" else forward_kl
    (exact,) = torch.autograd.grad(target(theta), theta)
    torch.testing.assert_close(grad, exact, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        stepped = theta - 0.1 * grad
        assert reverse_kl(stepped) < reverse_kl(theta) and forward_kl(stepped) < forward_kl(theta)


def test_a_kl_step_on_the_sampled_tokens_pulls_the_policy_back():
    """The real update: a policy moved away from the reference, advantages 0 (equal rewards), k3 penalty alone: the
    penalty falls step by step, and so does the exact KL over the whole vocabulary at the response positions."""
    reference_model = tiny_model(seed=3)
    model = tiny_model(seed=3)
    with torch.no_grad():
        for param, noise in zip(model.parameters(), tiny_model(seed=9).parameters()):
            param.add_(0.3 * noise)  # a policy that drifted
    batch = with_behavior(tiny_batch(seed=3), model, seed=4)
    batch.rewards = torch.ones_like(batch.rewards)
    cfg = tiny_config("loss.kl.coef=1.0", "loss.kl.estimator=k3", "algo.overlong.len=0", "loss.weighting=none")
    reference = initial_reference(cfg.loss.kl, "", 1.0, SINGLE, policy=reference_model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    penalties, exact = [], []
    for _ in range(4):
        exact.append(vocabulary_kl(model, reference, batch))
        result = train_on_batch(
            model, optimizer, LossScaler(enabled=False), batch, cfg, AcrlReference(cfg.loss.acrl), reference=reference
        )
        penalties.append(result.metrics["loss/kl"])
        assert result.metrics["loss"] == pytest.approx(penalties[-1], rel=1e-6)  # A = 0: the penalty alone
    assert all(a > b for a, b in zip(penalties, penalties[1:])), penalties
    assert all(a > b for a, b in zip(exact, exact[1:])), exact


@torch.no_grad()
def vocabulary_kl(model: torch.nn.Module, reference: torch.nn.Module, batch) -> float:  # noqa: ANN001
    """KL(pi_theta || pi_ref) summed over the vocabulary, averaged over the response positions."""
    pos = (batch.response_pos - 1).clamp_min(0)[..., None]
    logs = []
    for net in (model, reference):
        logits = net(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
        logs.append(torch.log_softmax(logits.gather(1, pos.expand(-1, -1, logits.shape[-1])), -1))
    q, p = logs
    per_position = (q.exp() * (q - p)).sum(-1)  # (B, T)
    return float((per_position * batch.mask).sum() / batch.mask.sum())


def _learner(*overrides: str, resume_dir: str = "") -> Learner:
    model_dir = str(resolve_model_path("builtin:micro", log=lambda *_: None))
    cfg = load_config(None, ["model.path=builtin:micro", "optim.lr=1e-2", *overrides])
    return Learner(to_dict(LearnerSections.pick(cfg)), model_dir, "tcp://127.0.0.1:9", resume_dir=resume_dir)


def _steps(learner: Learner, first: int, count: int) -> list[dict[str, float]]:
    out = []
    for step in range(first, first + count):
        groups = random_groups(learner.model.config.vocab_size, [step])
        learner.fetch = lambda _step, groups=groups: (groups, 0, 0.0)
        out.append(learner.train_step(step))
    return out


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_the_kl_is_0_at_step_0_and_positive_after(estimator):
    learner = _learner("loss.kl.coef=0.05", f"loss.kl.estimator={estimator}")
    try:
        history = _steps(learner, 0, 3)
    finally:
        learner.close()
    assert history[0]["loss/kl"] == 0.0  # the reference is the policy, bit for bit (UAQ applied to both)
    if estimator == "k1":  # k1 has no sign per token; its mean moves off 0
        assert history[2]["loss/kl"] != 0.0
    else:
        assert history[1]["loss/kl"] > 0.0 and history[2]["loss/kl"] > 0.0
    assert history[2]["perf/reference_s"] > 0.0


def test_a_resumed_run_rebuilds_the_reference_from_the_initial_model(tmp_path):
    first = _learner("loss.kl.coef=0.05")
    try:
        before = _steps(first, 0, 2)
        first.save_checkpoint(str(tmp_path / "ckpt"))
        initial = {name: p.detach().clone() for name, p in first.reference.named_parameters()}
    finally:
        first.close()
    resumed = _learner("loss.kl.coef=0.05", resume_dir=str(tmp_path / "ckpt"))
    try:
        rebuilt = dict(resumed.reference.named_parameters())
        assert rebuilt.keys() == initial.keys()
        for name, value in initial.items():
            assert torch.equal(rebuilt[name], value), name  # the initial weights, not the checkpoint's
            assert not rebuilt[name].requires_grad
        trained = dict(resumed.model.named_parameters())
        assert any(not torch.equal(trained[name], value) for name, value in initial.items())
        after = _steps(resumed, 2, 1)[0]
    finally:
        resumed.close()
    assert before[1]["loss/kl"] > 0.0 and after["loss/kl"] > 0.0  # still measured against the initial model


def test_coef_0_builds_no_reference_and_runs_no_reference_pass():
    assert initial_reference(KlConfig(coef=0.0), "/nonexistent/model", 1.5, SINGLE) is None  # nothing is loaded
    learner = _learner()
    try:
        assert learner.reference is None
        metrics = _steps(learner, 0, 1)[0]
    finally:
        learner.close()
    assert "loss/kl" not in metrics and metrics["perf/reference_s"] == 0.0
    assert "loss/kl" not in metric_names(LossConfig()) and "loss/kl" in metric_names(LossConfig(kl=KlConfig(coef=1)))


def test_rollout_aligned_runs_the_reference_in_the_training_precision():
    learner = _learner("loss.kl.coef=0.05", "learner.rollout_aligned=true", "quant.scheme=int8")
    try:
        aligned = [m for m in learner.model.modules() if isinstance(m, AlignedLinear)]
        assert aligned and not any(isinstance(m, AlignedLinear) for m in learner.reference.modules())
        first = _steps(learner, 0, 1)[0]
    finally:
        learner.close()
    # the policy's forward is the rollout's int8 one, the reference's full precision: KL at step 0 is that gap
    assert 0.0 < first["loss/kl"] < 0.05 and math.isfinite(first["loss"])


# --- FSDP2: two gloo ranks give the gradients of one process, with the KL and entropy terms on

KL_CONFIG = ("loss.kl.coef=0.2", "loss.kl.estimator=k3", "loss.entropy_coef=0.01", "learner.minibatches=2",
             "learner.micro_batch_tokens=26", "optim.grad_clip=0.5")  # fmt: skip


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a full copy of every gradient it applies (gathered from the shards under FSDP2)."""

    def __init__(self, params, lr: float) -> None:  # noqa: ANN001
        super().__init__(params, lr=lr)
        self.applied: list[list[torch.Tensor]] = []

    def step(self, closure=None):  # noqa: ANN001, ANN201
        grads = [p.grad for group in self.param_groups for p in group["params"]]
        self.applied.append([(g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone() for g in grads])
        return super().step(closure)


def kl_case(ranks: Dist) -> dict[str, object]:
    model = tiny_model(seed=5)
    batch = with_behavior(tiny_batch(seed=7, groups=3, group_size=3), tiny_model(seed=5), seed=8)
    batch = broadcast_batch(batch if ranks.is_main else None, ranks)
    cfg = tiny_config(*KL_CONFIG)
    reference = initial_reference(cfg.loss.kl, "", 1.0, ranks, policy=model)  # sharded like the policy
    if ranks.world > 1:
        shard_model(model)
    optimizer = RecordingSGD(model.parameters(), lr=0.05)
    metrics = []
    for _ in range(2):  # the second step's KL is against a policy one step away
        result = train_on_batch(model, optimizer, LossScaler(enabled=False), batch, cfg, AcrlReference(cfg.loss.acrl),
                                ranks, reference=reference)  # fmt: skip
        metrics.append(result.metrics)
    return {"grads": optimizer.applied, "metrics": metrics}


def _rank_main(rank: int, world: int, address: str, out_path: str) -> None:
    from learner.distributed import close, init_distributed

    torch.set_num_threads(1)
    ranks = init_distributed(rank, world, address)
    outputs = kl_case(ranks)
    if ranks.is_main:
        torch.save(outputs, out_path)
    close(ranks)


def test_fsdp2_world_2_gives_the_kl_and_entropy_gradients_of_one_process(tmp_path):
    out_path = str(tmp_path / "rank0.pt")
    multiprocessing.get_context("forkserver").set_forkserver_preload([__name__])
    address = local_rendezvous(str(tmp_path))
    mp.start_processes(_rank_main, args=(2, address, out_path), nprocs=2, join=True, start_method="forkserver")
    sharded, single = torch.load(out_path, weights_only=False), kl_case(SINGLE)
    assert len(single["grads"]) == len(sharded["grads"]) == 4  # 2 steps x 2 minibatches, none skipped
    for step_single, step_dist in zip(single["grads"], sharded["grads"]):
        for g_single, g_dist in zip(step_single, step_dist):
            torch.testing.assert_close(g_dist, g_single, rtol=1e-5, atol=1e-5)
    for m_single, m_dist in zip(single["metrics"], sharded["metrics"]):
        for key in ("loss", "loss/kl", "loss/entropy", "grad_norm"):
            assert m_dist[key] == pytest.approx(m_single[key], rel=1e-5, abs=1e-6), key
    assert single["metrics"][1]["loss/kl"] > 0.0
