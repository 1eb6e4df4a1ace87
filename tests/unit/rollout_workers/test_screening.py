"""Predictive selective rollout on the worker's side (`algo.skip_predicted`, rollout_workers/screening.py): the
answer's log-prob from one prefill equals the learner's forward; a prompt is skipped only when p_ans ** G reaches the
threshold, then generated with the floor probability, deterministically; answers that cannot be the response or do
not score 1 are never screened; a worker resolves screened leases through the buffer without generating them."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from common.builtin_model import resolve_model_path
from common.config import ConfigError, load_config
from common.config_rules import skip_predicted_on
from common.wire import PromptLease
from rollout_workers.screening import AnswerScreen, score_continuations, screen_draw

PROMPT = [3, 4, 10, 5, 12, 7, 9, 11]
ANSWER = [6, 13, 8]


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(resolve_model_path("builtin:micro", log=lambda *a: None))


def make_engine(model_dir: str):
    from quant_sync.update import WeightUpdate
    from rollout_workers.embedded.engine import EmbeddedEngine
    from rollout_workers.sglang_api.checkpoint import read_tensors, rollout_tensors

    engine = EmbeddedEngine(model_dir, max_batch=8)
    engine.stage_weights(WeightUpdate(0, rollout_tensors(read_tensors(model_dir), "none"), "none"))
    engine.swap_now()
    return engine


def params(max_new_tokens: int, temperature: float = 1.0):
    from rollout_workers.engine import SamplingParams

    return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=(2,))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_answer_log_prob_equals_the_learners_forward(model_dir, temperature):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokens = PROMPT + ANSWER
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([tokens])).logits[0].float() / temperature, dim=-1)
    expected = sum(float(logp[len(PROMPT) - 1 + i, token]) for i, token in enumerate(ANSWER))
    engine = make_engine(model_dir)
    short = PROMPT[:5]
    got = score_continuations(engine, [PROMPT, short], [ANSWER, ANSWER[:1]], temperature)
    assert got[0] == pytest.approx(expected, abs=1e-4)
    with torch.no_grad():
        short_logp = torch.log_softmax(model(torch.tensor([short + ANSWER[:1]])).logits[0].float() / temperature, -1)
    assert got[1] == pytest.approx(float(short_logp[len(short) - 1, ANSWER[0]]), abs=1e-4)
    with pytest.raises(ValueError, match="non-empty"):
        score_continuations(engine, [PROMPT], [[]], 1.0)


def _screen(above: float, min_prob: float = 0.05, reward=lambda response, answer: float(response == answer)):
    return AnswerScreen(
        group_size=8, above=above, min_prob=min_prob, seed=3,
        encode_answer=lambda text: [int(c) + 3 for c in text], reward=reward,
    )  # fmt: skip


def test_a_prompt_is_skipped_only_above_the_threshold_then_generated_at_the_floor():
    screen = _screen(above=0.5, min_prob=0.1)
    below = math.log(0.5 ** (1 / 8)) - 1e-6  # p_ans ** 8 just under 0.5
    assert all(screen.generates(index, below) for index in range(2000))
    kept = [screen.generates(index, math.log(0.99)) for index in range(4000)]  # p_ans ** 8 = 0.92
    assert 0.08 < sum(kept) / len(kept) < 0.12  # the floor: 0.1 (4000 draws: 3 standard deviations is 0.014)
    assert kept == [screen.generates(index, math.log(0.99)) for index in range(4000)]  # a pure function of the index
    assert [screen_draw(3, i) < 0.1 for i in range(4000)] == kept


def _leases(answers: list[str]) -> list[PromptLease]:
    return [PromptLease(f"g{i}", i, "p", answer, 0.0) for i, answer in enumerate(answers)]


def test_only_answers_that_can_be_the_response_and_score_one_are_screened(model_dir):
    engine = make_engine(model_dir)
    prompts = [PROMPT] * 4
    screen = _screen(above=0.0, min_prob=0.01)  # every scored prompt is predicted all-correct
    keep = screen.keep(engine, _leases(["12", "1234567", "", "3"]), prompts, params(max_new_tokens=4))
    # "1234567" + end token does not fit 4 new tokens, "" is no answer: both generated unscored
    assert keep[1] and keep[2] and screen.counters["screen_scored"] == 2
    assert screen.counters["screen_tokens"] == 2 * len(PROMPT) + (2 + 1) + (1 + 1)
    draws = [screen_draw(3, i) < 0.01 for i in (0, 3)]
    assert [keep[0], keep[3]] == draws and screen.counters["prompts_screened"] == draws.count(False)
    never = _screen(above=0.0, min_prob=0.01, reward=lambda response, answer: 0.0)  # the answer scores 0
    assert never.keep(engine, _leases(["12", "3"]), prompts[:2], params(4)) == [True, True]
    assert never.counters["screen_scored"] == 0
    strict = _screen(above=1.0, min_prob=0.01)  # p_ans ** 8 = 1 is not reached by a sampling policy
    assert strict.keep(engine, _leases(["12", "3"]), prompts[:2], params(4)) == [True, True]


def test_skip_predicted_follows_filter_groups_and_needs_what_it_stands_on():
    algo = load_config(None, ["algo.filter_groups=true"]).algo
    assert skip_predicted_on(algo, "embedded", custom_reward=False, multi_turn=False)
    assert not skip_predicted_on(algo, "sglang", custom_reward=False, multi_turn=False)
    assert not skip_predicted_on(algo, "embedded", custom_reward=True, multi_turn=False)
    assert not skip_predicted_on(load_config(None, []).algo, "embedded", custom_reward=False, multi_turn=False)
    with pytest.raises(ConfigError, match="algo.filter_groups=true"):
        load_config(None, ["algo.skip_predicted=true"])
    with pytest.raises(ConfigError, match="rollout.backend=embedded"):
        load_config(None, ["algo.filter_groups=true", "algo.skip_predicted=true", "rollout.backend=sglang"])


SCREENED_RUN = [
    "train.group_size=2", "train.groups_per_step=4", "staleness.max_lag=50", "algo.filter_groups=true",
    "algo.skip_zero_variance=false", "algo.skip_predicted_above=0.0", "algo.skip_min_prob=0.25",
]  # fmt: skip
"""Every prompt predicted all-correct (threshold 0): a group is generated only when its draw is under the 0.25 floor."""


@contextlib.contextmanager
def screening_worker(tmp_path, *overrides: str):
    """(config, a rollout worker on the built-in model at INT8 version 0, a buffer client), a real buffer process
    behind both; the buffer is stopped at the end."""
    from transformers import AutoModelForCausalLM

    from buffer.client import BufferClient
    from buffer.launcher import start_service, stop_service
    from common.config import to_dict
    from quant_sync.export import export_rollout_tensors
    from quant_sync.update import WeightUpdate
    from rollout_workers.sections import WorkerSections
    from rollout_workers.worker import RolloutWorker

    cfg = load_config(None, [*SCREENED_RUN, *overrides])
    (tmp_path / "run").mkdir()
    proc, endpoint = start_service(to_dict(cfg), tmp_path / "run")
    client = BufferClient(endpoint, "w0", timeout_s=5.0)
    try:
        model_path = str(resolve_model_path(cfg.model.path))
        worker = RolloutWorker(to_dict(WorkerSections.pick(cfg)), "w0", model_path, endpoint)
        model = AutoModelForCausalLM.from_pretrained(model_path)
        worker.engine.stage_weights(WeightUpdate(0, export_rollout_tensors(model.state_dict(), "int8"), "int8"))
        yield cfg, worker, client
        worker.stop()
    finally:
        client.close()
        stop_service(proc)


def test_a_worker_resolves_screened_leases_in_the_buffer_without_generating_them(tmp_path):
    with screening_worker(tmp_path) as (cfg, worker, client):
        leases, _ = client.lease(8)
        groups = worker.rollout(leases)
        generated = [screen_draw(cfg.train.seed, lease.index) < 0.25 for lease in leases]  # above=0: all predicted
        assert 0 < sum(generated) < len(leases)
        assert sorted((lease.index, len(trajectories)) for lease, trajectories in groups) == [
            (lease.index, 2 if kept else 0) for lease, kept in zip(leases, generated)
        ]
        assert worker.counters["samples"] == 2 * sum(generated)  # screened prompts cost no sample
        assert worker.stats()["prompts_screened"] == generated.count(False)
        for lease, trajectories in groups:
            worker._push(client, lease, trajectories)
        stats = client.stats()
        assert stats["screened_groups"] == generated.count(False) and stats["leased_groups"] == 0
        assert worker.counters["groups_pushed"] == sum(generated)


def test_the_worker_loop_resolves_screened_leases_at_once_and_refills_its_batch(tmp_path):
    with screening_worker(tmp_path, "rollout.groups_per_lease=2") as (cfg, worker, client):
        # every prompt is predicted all-correct (threshold 0): generated only when its draw is under the floor
        leases, _ = client.lease(2)
        kept = worker._screen_and_refill(client, leases)
        stats = client.stats()
        leased = int(stats["leased_total"])  # problems 0 .. leased - 1, in order
        assert [lease.index for lease in kept] == [i for i in range(leased) if screen_draw(cfg.train.seed, i) < 0.25]
        assert len(kept) >= 2 and leased > 2  # refilled until two are kept (or MAX_REFILLS requests were made)
        assert stats["screened_groups"] == leased - len(kept) and stats["leased_groups"] == len(kept)
        assert worker.counters["samples"] == 0  # nothing generated yet: the kept leases go to `rollout`
        groups = worker.rollout(kept, screen=False)
        assert [len(trajectories) for _, trajectories in groups] == [2] * len(kept)
