"""Held-out evaluation of a multi-turn, tool-using model (asyncrl/evaluate.py with `env.fn`): every held-out problem
is an episode with the environment on the rollout engine, greedy and sampled, and the tool calls are counted."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from asyncrl.evaluate import EvalWorker
from common.builtin_model import resolve_model_path
from common.config import load_config, to_dict
from quant_sync.export import export_rollout_tensors
from quant_sync.update import WeightUpdate
from rollout_workers.sections import WorkerSections

SCRIPTED_ENV = textwrap.dedent(
    """
    from common.envs import StepResult


    class ScriptedToolEnv:
        '''Two turns whatever the model writes: the first is a tool call (answered "2+3="), the second the answer,
        rewarded 1.0 on problems whose answer is "even", else 0.0. Problem "boom" raises on its first step.'''

        stop_strings = ("=",)

        def reset(self, problem):
            assert problem["eval"] is True and problem["prompt"] == "1+1="
            self.answer, self.turn = problem["answer"], 0
            return problem["prompt"]

        def step(self, model_text):
            self.turn += 1
            if self.answer == "boom":
                raise RuntimeError("calculator on fire")
            if self.turn == 1:
                return StepResult("2+3=", 0.0, False, {"tool_calls": 1})
            return StepResult(None, 1.0 if self.answer == "even" else 0.0, True, {})
    """
)


@pytest.fixture
def evaluator(tmp_path: Path):
    torch_threads = torch.get_num_threads()
    (tmp_path / "scripted_env.py").write_text(SCRIPTED_ENV)
    cfg = load_config(None, [f"env.fn={tmp_path / 'scripted_env.py'}:ScriptedToolEnv", "rollout.max_new_tokens=4"])
    model_dir = str(resolve_model_path(cfg.model.path))
    worker = EvalWorker(to_dict(WorkerSections.pick(cfg)), "evaluator", model_dir, "tcp://127.0.0.1:9")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    worker.engine.stage_weights(WeightUpdate(0, export_rollout_tensors(model.state_dict(), "int8"), "int8"))
    try:
        yield worker
    finally:
        worker.engine.close()
        worker.rewards.close()
        assert worker.episodes is not None
        worker.episodes.close()
        torch.set_num_threads(torch_threads)


def test_held_out_problems_run_as_episodes_with_the_tool(evaluator: EvalWorker) -> None:
    answers = ["even", "odd", "even", "boom"]
    metrics = evaluator._evaluate_episodes(["1+1="] * 4, answers, samples=3)
    assert metrics["eval/acc_greedy_rollout"] == 0.5  # 2 of 4: the episodes' own rewards, not the task's
    assert metrics["eval/tool_calls"] == pytest.approx(3 / 4)  # one call in each greedy episode but the failed one
    assert metrics["eval/turns_mean"] == pytest.approx((2 + 2 + 2 + 1) / 4)
    assert metrics["eval/skipped"] == 0.0  # the failed episode has its first model turn
    assert metrics["eval/mean@3"] == 0.5 and metrics["eval/pass@3"] == 0.5
    assert metrics["eval/reward_mean@3"] == 0.5
    assert metrics["eval/env_errors"] == 1 + 3  # "boom" raised in its greedy episode and in its three draws
    assert evaluator.episodes is not None and evaluator.episodes.params == evaluator.params  # sampling restored


def test_the_greedy_episodes_are_greedy(evaluator: EvalWorker) -> None:
    runner = evaluator.episodes
    assert runner is not None
    first = evaluator._episodes(["1+1="] * 2, ["even", "odd"], 1, top_k=1)
    again = evaluator._episodes(["1+1="] * 2, ["even", "odd"], 1, top_k=1)
    assert [e.response_ids for (e,) in first] == [e.response_ids for (e,) in again]
    assert first[0][0].response_ids == first[1][0].response_ids  # the same prompt: the same greedy turns
    observation = list(evaluator.tokenizer("2+3=", add_special_tokens=False)["input_ids"])
    mask = first[0][0].loss_mask
    assert sum(1 - m for m in mask) == len(observation)  # the tool's answer is in the context, masked
