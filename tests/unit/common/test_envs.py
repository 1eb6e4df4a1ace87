"""The environment interface (common/envs.py): loading `env.fn` like a reward function, the start-up check, and the
checks of what `step` returns."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from common.config import load_config
from common.config_checks import ConfigError
from common.envs import EnvError, StepResult, check_step_result, load_env_factory

ENV = """
from common.envs import StepResult


class Echo:
    stop_strings = ("=",)

    def __init__(self, bonus=0.0):
        self.bonus = bonus

    def reset(self, problem):
        return problem["prompt"]

    def step(self, model_text):
        return StepResult(model_text, 1.0 + self.bonus, True, {"tool_calls": 1})


class BadStops(Echo):
    stop_strings = "="


class NoStep:
    stop_strings = ("]",)

    def reset(self, problem):
        return problem["prompt"]


def no_step():
    return NoStep()
"""


def test_an_environment_is_loaded_from_a_file_with_its_args(tmp_path: Path) -> None:
    (tmp_path / "envs_file.py").write_text(ENV)
    make = load_env_factory(f"{tmp_path / 'envs_file.py'}:Echo", {"bonus": 0.5})
    env, other = make(), make()
    assert env is not other  # one instance per episode
    assert env.reset({"prompt": "1+1="}) == "1+1="
    assert check_step_result(env.step("2")) == StepResult("2", 1.5, True, {"tool_calls": 1})
    with pytest.raises(EnvError, match="stop_strings"):
        load_env_factory(f"{tmp_path / 'envs_file.py'}:BadStops")()


def test_an_environment_without_step_fails_naming_it(tmp_path: Path) -> None:
    """Every episode failed in the decode loop with `KeyError: <number>`, and the run stalled saying only that."""
    (tmp_path / "envs_file.py").write_text(ENV)
    with pytest.raises(EnvError, match=r"`env.fn` .*:NoStep': NoStep has no `step` method \(an environment has "):
        load_env_factory(f"{tmp_path / 'envs_file.py'}:NoStep")  # a class: when it loads
    make = load_env_factory(f"{tmp_path / 'envs_file.py'}:no_step")  # a factory: at its first episode
    with pytest.raises(EnvError, match=r"NoStep has no `step` method"):
        make()


@pytest.mark.parametrize("args", [{"bonsu": 0.5}, {"bonus": 0.5, "extra": 1}])
def test_env_args_that_do_not_fit_the_class_fail_when_it_loads(tmp_path: Path, args: dict) -> None:
    """Not at each episode's construction (every episode failed, and the run stalled until its watchdog)."""
    (tmp_path / "envs_file.py").write_text(ENV + "\n\ndef needs(level):\n    return Echo(level)\n")
    with pytest.raises(EnvError, match=r"`env.args` .* do not fit `env.fn` .*Echo.*\(bonus=0.0\).*unexpected keyword"):
        load_env_factory(f"{tmp_path / 'envs_file.py'}:Echo", args)
    with pytest.raises(EnvError, match=r"do not fit .*needs.*\(level\).*missing a required argument: 'level'"):
        load_env_factory(f"{tmp_path / 'envs_file.py'}:needs", {})
    assert load_env_factory(f"{tmp_path / 'envs_file.py'}:needs", {"level": 2})().bonus == 2


def test_a_bad_env_spec_fails_at_start_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"`env.fn`.*does not exist"):
        load_config(None, [f"env.fn={tmp_path / 'missing.py'}:Env"])
    (tmp_path / "envs_file.py").write_text(ENV)
    with pytest.raises(ConfigError, match=r"`env.fn`.*Nope"):
        load_config(None, [f"env.fn={tmp_path / 'envs_file.py'}:Nope"])
    cfg = load_config(None, [f"env.fn={tmp_path / 'envs_file.py'}:Echo", "env.max_turns=3"])
    assert cfg.env.max_turns == 3 and cfg.env.fn.endswith("envs_file.py:Echo")
    with pytest.raises(ConfigError, match="env.max_turns"):
        load_config(None, ["env.max_turns=0"])


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (StepResult(None, math.nan, True), "finite"),
        (StepResult(None, True, True), "finite"),
        (StepResult(3, 0.0, True), "observation"),
        (StepResult(None, 0.0, True, info=[]), "info"),  # type: ignore[arg-type]
        ("done", "StepResult"),
        (StepResult(None, 0.0, "False"), "`done` that is not a bool"),  # bool("False") is True: the episode ended
        (StepResult(None, 0.0, 2), "`done` that is not a bool"),
        (StepResult([{"role": "tool", "content": 7}], 0.0, True), "observation"),
    ],
)
def test_a_malformed_step_result_is_an_env_error(result: object, message: str) -> None:
    with pytest.raises(EnvError, match=message):
        check_step_result(result)


def test_a_step_result_may_be_a_tuple_and_messages() -> None:
    messages = [{"role": "tool", "content": "6912"}]
    assert check_step_result((messages, 1, False, {})) == StepResult(messages, 1.0, False, {})


def test_the_calculator_environment_answers_calls_and_scores_the_final_answer() -> None:
    cfg = load_config(None, ["env.fn=asyncrl:arith_tool", "data.digits=5"])
    env = load_env_factory(cfg.env.fn, {"instructions": "Sum: "})()
    assert env.stop_strings == ("</calc>",)
    assert env.reset({"prompt": "12345+67890=", "answer": "80235"}) == "Sum: 12345+67890="
    call = check_step_result(env.step("<calc>12345+67890</calc>"))
    assert call == StepResult("<result>80235</result>", 0.0, False, {"tool_calls": 1})
    bad = check_step_result(env.step("<calc>12345+</calc>"))
    assert bad.observation == "<result>error</result>" and not bad.done
    final = check_step_result(env.step(" so 80235"))
    assert final.reward == 1.0 and final.done and final.info["correct"]
    env.reset({"prompt": "1+1=", "answer": "2"})
    assert check_step_result(env.step("3")).reward == 0.0


def test_env_spec_errors_speak_of_environments_and_their_built_ins(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["env.fn=asyncrl:nope"])
    assert "no built-in environment 'nope'; valid: asyncrl:arith_tool" in str(err.value)
    assert "asyncrl:math" not in str(err.value)
    with pytest.raises(ConfigError, match="no built-in environment 'math'; valid: asyncrl:arith_tool"):
        load_config(None, ["env.fn=asyncrl:math"])  # a reward built-in is no environment
    with pytest.raises(EnvError, match="no built-in environment 'arith'"):
        load_env_factory("asyncrl:arith")
    with pytest.raises(
        ConfigError, match=r"is not an environment spec: write `path/to/file.py:Class`.*\(asyncrl:arith_tool\)"
    ):
        load_config(None, ["env.fn=no_colon"])
    (tmp_path / "envs_file.py").write_text(ENV)
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"env.fn={tmp_path / 'envs_file.py'}:Nope"])
    assert f"env file {str(tmp_path / 'envs_file.py')!r} defines no class 'Nope'" in str(err.value)
    with pytest.raises(EnvError, match="module 'common.tasks.arith_tool' has no class 'Nope'"):
        load_env_factory("common.tasks.arith_tool:Nope")
    assert load_config(None, ["env.fn=asyncrl:arith_tool"]).env.fn == "asyncrl:arith_tool"


def test_numpy_rewards_and_flags_are_taken_as_numbers_and_bools() -> None:
    """A numpy.float32 reward was refused as "not a finite number" (float64, a float subclass, was not)."""
    import numpy as np

    result = check_step_result(StepResult(None, np.float32(0.5), np.bool_(True)))
    assert result == StepResult(None, 0.5, True, {}) and type(result.reward) is float
    assert check_step_result(StepResult(None, np.int64(2), 0)).reward == 2.0


@pytest.mark.parametrize("prompt", [12345, {"prompt": "1+1="}, [{"role": "user", "content": None}], None])
def test_a_reset_that_returns_no_prompt_is_named(prompt: object) -> None:
    from common.envs import check_reset_result

    with pytest.raises(EnvError, match="reset must return the prompt as text or chat messages"):
        check_reset_result(prompt)
    assert check_reset_result("1+1=") == "1+1="
