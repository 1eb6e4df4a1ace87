"""`env.turn_rewards` (issue 21): how an episode's per-turn rewards make its one reward, in the formula
(common/envs.py `combine_turn_reward`) and in a real rollout worker running three-turn episodes on the built-in
model."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from common.builtin_model import resolve_model_path
from common.config import ConfigError, load_config, to_dict
from common.envs import EnvError, combine_turn_reward, episode_reward
from common.wire import PromptLease
from quant_sync.export import export_rollout_tensors
from quant_sync.update import WeightUpdate
from rollout_workers.sections import WorkerSections
from rollout_workers.worker import RolloutWorker

TURN_ENV = textwrap.dedent(
    """
    from common.envs import StepResult


    class ThreeTurnEnv:
        '''Three turns rewarded 0.5, 1.5, -1.0 (sum 1.0, last -1.0, max 1.5).'''

        stop_strings = ("=",)
        REWARDS = (0.5, 1.5, -1.0)

        def reset(self, problem):
            self.turn = 0
            return "1+1="

        def step(self, model_text):
            self.turn += 1
            return StepResult("2+3=", self.REWARDS[self.turn - 1], self.turn == 3, {})
    """
)


def make_worker(tmp_path: Path, mode: str) -> RolloutWorker:
    (tmp_path / "turn_env.py").write_text(TURN_ENV)
    overrides = ["train.group_size=2", f"env.fn={tmp_path / 'turn_env.py'}:ThreeTurnEnv", f"env.turn_rewards={mode}",
                 "rollout.max_new_tokens=4"]  # fmt: skip
    cfg = load_config(None, overrides)
    model_dir = str(resolve_model_path(cfg.model.path))
    worker = RolloutWorker(to_dict(WorkerSections.pick(cfg)), "w0", model_dir, "tcp://127.0.0.1:9")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    worker.engine.stage_weights(WeightUpdate(0, export_rollout_tensors(model.state_dict(), "int8"), "int8"))
    return worker


def test_the_modes_follow_their_formulas() -> None:
    rewards = [0.5, 1.5, -1.0]
    assert episode_reward("sum", rewards) == pytest.approx(1.0)
    assert episode_reward("last", rewards) == pytest.approx(-1.0)
    assert episode_reward("max", rewards) == pytest.approx(1.5)
    assert episode_reward("max", [-2.0, -3.0]) == -2.0  # the first turn's reward, not max(0, r_1)
    assert episode_reward("sum", []) == 0.0
    assert combine_turn_reward("sum", 7.0, 1.0, first_turn=True) == 1.0  # R_1 = r_1 whatever was there


def test_an_unknown_mode_is_refused_with_its_key() -> None:
    with pytest.raises(EnvError, match="env.turn_rewards"):
        combine_turn_reward("mean", 0.0, 1.0, first_turn=False)
    with pytest.raises(ConfigError, match="turn_rewards"):
        load_config(None, ["env.turn_rewards=mean"])


@pytest.mark.parametrize(("mode", "expected"), [("sum", 1.0), ("last", -1.0), ("max", 1.5)])
@pytest.mark.parametrize("continuous", [True, False], ids=["continuous", "rounds"])
def test_the_worker_combines_turn_rewards_as_configured(
    tmp_path: Path, mode: str, expected: float, continuous: bool
) -> None:
    worker = make_worker(tmp_path, mode)
    try:
        assert worker.episodes is not None
        worker.episodes.continuous = continuous
        ((_, trajectories),) = worker.rollout([PromptLease("g0", 0, "unused", "", 1e12)])
    finally:
        worker.engine.close()
        worker.rewards.close()
        worker.episodes.close()
    assert worker.counters["env_turns"] == 2 * 3  # every episode ran its three turns
    assert [t.reward for t in trajectories] == [pytest.approx(expected)] * 2
