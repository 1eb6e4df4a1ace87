"""Multi-turn episodes on the SGLang backend (issue 21 item 5), its server an `asyncrl serve` subprocess: an
environment's stop string reaches the server as `stop`, so a turn ends server-side right after it, and the next turn
is sent as `input_ids` holding the whole context: the prompt, the earlier turns and the observation tokens."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from common.builtin_model import resolve_model_path
from common.config import load_config, to_dict
from common.wire import PromptLease
from quant_sync.export import export_rollout_tensors
from quant_sync.update import WeightUpdate
from rollout_workers.sections import WorkerSections
from rollout_workers.sglang_api.checkpoint import read_tensors
from rollout_workers.worker import RolloutWorker

STOP_ENV = textwrap.dedent(
    """
    from common.envs import StepResult


    class StopEnv:
        '''Two turns: the first ends at the stop string the problem's answer names (none when empty) and is answered
        with the observation "1+1="; the second is rewarded 1.0.'''

        stop_strings = ()

        def reset(self, problem):
            self.stop_strings = (problem["answer"],) if problem["answer"] else ()
            self.turn = 0
            return problem["prompt"]

        def step(self, model_text):
            self.turn += 1
            if self.turn == 1:
                return StepResult("1+1=", 0.0, False, {"tool_calls": 1})
            return StepResult(None, 1.0, True, {})
    """
)
PROMPT = "123+456="


@pytest.fixture
def worker(tmp_path: Path):
    (tmp_path / "stop_env.py").write_text(STOP_ENV)
    cfg = load_config(
        None,
        [
            "model.path=builtin:micro-tool",
            "rollout.backend=sglang",
            "rollout.sglang.launcher=asyncrl",
            f"rollout.sglang.ckpt_dir={tmp_path}",
            "rollout.sglang.startup_timeout_s=120",
            "rollout.top_k=1",  # greedy: the same first turn with and without the stop string
            "rollout.max_new_tokens=12",
            "train.group_size=2",  # two greedy episodes per problem: the same tokens
            f"env.fn={tmp_path / 'stop_env.py'}:StopEnv",
            "env.max_turns=2",
        ],
    )
    model_dir = str(resolve_model_path(cfg.model.path, log=lambda *a: None))
    worker = RolloutWorker(to_dict(WorkerSections.pick(cfg)), "worker-0", model_dir, "tcp://127.0.0.1:9")
    floats = {name: tensor.to(torch.float32) for name, tensor in read_tensors(model_dir).items()}
    worker.engine.stage_weights(WeightUpdate(0, export_rollout_tensors(floats, "int8"), "int8"))
    try:
        yield worker
    finally:
        worker.engine.close()
        worker.rewards.close()
        assert worker.episodes is not None
        worker.episodes.close()


def record_generate(worker: RolloutWorker) -> list[tuple[list[list[int]], Any, list[Any]]]:
    """Every `engine.generate` call of the worker's episodes: (prompts, params, completions)."""
    calls: list[tuple[list[list[int]], Any, list[Any]]] = []
    generate = worker.engine.generate

    def recording(prompts: list[list[int]], params: Any) -> list[Any]:
        completions = generate(prompts, params)
        calls.append(([list(p) for p in prompts], params, completions))
        return completions

    worker.engine.generate = recording  # type: ignore[method-assign]
    return calls


@pytest.mark.slow  # one server start: 10-20 s on 2 shared cores
def test_a_turn_stops_at_its_stop_string_on_the_server_and_the_next_turn_sends_the_observation(worker) -> None:
    assert worker.episodes is not None and not worker.episodes.continuous  # the SGLang backend runs rounds
    calls = record_generate(worker)
    decode = worker.tokenizer.decode
    ((_, (free, _)),) = worker.rollout([PromptLease("g0", 0, PROMPT, "", 1e12)])  # no stop string: EOS or 12 tokens
    first_turn = decode(calls[0][2][0].response_ids, skip_special_tokens=True)
    assert len(first_turn) >= 4, first_turn
    stop = first_turn[1:3]  # two characters, two tokens: a stop string the engine cannot stop on as a token
    assert len(worker.tokenizer(stop, add_special_tokens=False)["input_ids"]) == 2
    cut = first_turn.find(stop) + len(stop)
    assert cut < len(first_turn)
    assert free.reward == 1.0 and free.loss_mask is not None

    calls.clear()
    ((_, (traj, twin)),) = worker.rollout([PromptLease("g1", 1, PROMPT, stop, 1e12)])
    (prompts_1, params_1, (turn_1, _)), (prompts_2, _, (turn_2, _)) = calls
    assert params_1.stop == (stop,)  # sent to the server as `stop`
    # the server ended the turn right after the stop string: no token past it was generated (finish "stop")
    assert decode(turn_1.response_ids, skip_special_tokens=True) == first_turn[:cut]
    assert turn_1.finish == "stop" and len(turn_1.response_ids) < 12
    # the second turn's input_ids: the prompt, the first turn and the observation's tokens
    observation = list(worker.tokenizer("1+1=", add_special_tokens=False)["input_ids"])
    assert prompts_2 == [prompts_1[0] + list(turn_1.response_ids) + observation] * 2
    assert traj.reward == 1.0 and traj.loss_mask is not None
    mask = traj.loss_mask.tolist()
    assert traj.response_ids.tolist() == list(turn_1.response_ids) + observation + list(turn_2.response_ids)
    assert mask == [1] * len(turn_1.response_ids) + [0] * len(observation) + [1] * len(turn_2.response_ids)
    assert (traj.behav_logp[traj.loss_mask == 0] == 0.0).all() and (traj.behav_logp[traj.loss_mask == 1] < 0).all()
    assert traj.response_ids.tolist() == twin.response_ids.tolist()
    assert worker.counters["env_tool_calls"] == 4 and worker.counters["env_turns"] == 8
