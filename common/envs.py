"""The environment interface of multi-turn, tool-using rollouts (issue 21), and how an environment is loaded.

An environment runs one episode at a time (the worker makes one instance per episode):

    prompt = env.reset(problem)            # the first prompt: text, or chat messages [{role, content}, ...]
    loop:  model text (generated until one of env.stop_strings, or EOS)
           result = env.step(model_text)   # StepResult(observation, reward, done, info)
           done -> the episode ends; else the observation's tokens are appended and the model continues

`problem` is the leased row: `{"index", "prompt", "answer", ...}`. An observation is text (appended as it is), chat
messages (formatted with the tokenizer's chat template, when it has one), or None (nothing appended). Per-turn
rewards make the episode's one reward as `env.turn_rewards` says (`combine_turn_reward`: summed by default).
Observation tokens are context only: the trajectory's loss mask is 0 on them (common.wire).

Environments are loaded like reward functions (common.reward_fns): `env.fn` is `path/to/file.py:Class` or
`package.module:Class` (or a built-in: `asyncrl:arith_tool`, common/tasks/arith_tool.py), called with the keyword
arguments `env.args` to make one instance per episode. `env.max_turns`, `env.max_total_tokens` and `env.timeout_s`
bound an episode; an environment that raises or runs past its timeout ends the episode with reward 0, counted by the
worker.

This module is torch-free: the worker (rollout_workers/episodes.py) drives the episodes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias, runtime_checkable

from common.config_schema import TURN_REWARDS
from common.reward_fns import BUILTIN_FNS, RewardFnError, check_spec, load_fn, parse_spec

Messages: TypeAlias = list[dict[str, str]]
Observation: TypeAlias = "str | Messages | None"

BUILTIN_ENVS = {"asyncrl:arith_tool": "common.tasks.arith_tool:CalculatorEnv"}
"""Built-in environments by name -> `module:Class` (`data.task=arith_tool` with builtin:tiny-tool, issue 21)."""


class EnvError(ValueError):
    """An environment spec that is malformed or names nothing loadable, or an environment's malformed answer."""


@dataclass(slots=True)
class StepResult:
    """What an environment answers to one model turn."""

    observation: str | Messages | None
    """Appended to the context before the next model turn (text, chat messages, or None for nothing)."""
    reward: float
    """This turn's reward; the episode's reward combines its turns' (`env.turn_rewards`, default their sum)."""
    done: bool
    """Whether the episode is over (the worker also ends it at `env.max_turns` / `env.max_total_tokens`)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form; numeric `tool_calls` is summed into the worker's `env/tool_calls`."""


@runtime_checkable
class Environment(Protocol):
    stop_strings: tuple[str, ...]
    """Where a model turn ends (besides EOS): the text up to and including the first of them goes to `step`."""

    def reset(self, problem: dict[str, Any]) -> str | Messages:
        """Start an episode on `problem` (the leased row); returns the first prompt."""
        ...

    def step(self, model_text: str) -> StepResult:
        """The model's turn (text up to and including a stop string, or to EOS / the token limit)."""
        ...


def combine_turn_reward(mode: str, reward_so_far: float, turn_reward: float, first_turn: bool) -> float:
    """The episode's reward after one more turn, as `env.turn_rewards` (`mode`) says, over the turn rewards r_1..r_t:

        sum   R_t = R_{t-1} + r_t      (R = sum_t r_t)
        last  R_t = r_t                (R = r_T, the final turn's reward)
        max   R_t = max(R_{t-1}, r_t)  (R = max_t r_t)

    `first_turn`: r_t is r_1 (then R_1 = r_1 in every mode, whatever `reward_so_far` holds)."""
    if mode not in TURN_REWARDS:
        raise EnvError(f"`env.turn_rewards` must be one of {', '.join(TURN_REWARDS)}, got {mode!r}")
    if first_turn or mode == "last":
        return float(turn_reward)
    if mode == "sum":
        return float(reward_so_far) + float(turn_reward)
    return max(float(reward_so_far), float(turn_reward))


def episode_reward(mode: str, turn_rewards: list[float]) -> float:
    """The one reward of an episode whose turns were rewarded `turn_rewards` (0.0 without turns)."""
    reward = 0.0
    for t, turn_reward in enumerate(turn_rewards):
        reward = combine_turn_reward(mode, reward, turn_reward, first_turn=t == 0)
    return reward


def env_spec(spec: str) -> str:
    """A built-in name resolved to its `module:Class`; anything else unchanged."""
    return BUILTIN_ENVS.get(spec.strip(), spec.strip())


def _resolved_env_spec(spec: str, key: str) -> str:
    """`env_spec(spec)`; EnvError for an `asyncrl:` name that is no built-in environment (the reward loader would
    otherwise resolve `asyncrl:arith` to a reward function)."""
    resolved = env_spec(spec)
    location, _, name = resolved.rpartition(":")
    if location == "asyncrl":
        raise EnvError(f"`{key}` {spec!r}: no built-in environment {name!r}; valid: {', '.join(BUILTIN_ENVS)}")
    return resolved


def _env_error(err: RewardFnError) -> EnvError:
    """A reward-spec error (common.reward_fns, whose loader env.fn shares) said of an environment: a class, the
    environment built-ins."""
    message = str(err)
    for reward_words, env_words in (
        (f"({', '.join(BUILTIN_FNS)})", f"({', '.join(BUILTIN_ENVS)})"),
        ("is not a reward function spec", "is not an environment spec"),
        ("path/to/file.py:name`, `package.module:name`", "path/to/file.py:Class`, `package.module:Class`"),
        ("defines no function", "defines no class"),
        ("has no function", "has no class"),
        ("reward file", "env file"),
    ):
        message = message.replace(reward_words, env_words)
    return EnvError(message)


def check_env_spec(spec: str, key: str = "env.fn") -> None:
    """The start-up check of `env.fn` (file parsed, not run; module imported). Raises EnvError naming the key."""
    try:
        check_spec(_resolved_env_spec(spec, key), key)
    except RewardFnError as err:
        raise _env_error(err) from err


def load_env_factory(spec: str, args: dict[str, Any] | None = None, key: str = "env.fn") -> Callable[[], Any]:
    """A function making one environment instance per episode: the spec's class (or factory) called with `args`."""
    try:
        cls = load_fn(parse_spec(_resolved_env_spec(spec, key), key), key)
    except RewardFnError as err:
        raise _env_error(err) from err
    kwargs = dict(args or {})
    _check_args(cls, kwargs, spec, key)
    if isinstance(cls, type):  # a class: its methods are known before any episode (a factory's are not)
        _check_methods(cls, spec, key)

    def make() -> Any:
        env = cls(**kwargs)
        _check_methods(env, spec, key)
        stops = getattr(env, "stop_strings", ())
        if isinstance(stops, str) or not all(isinstance(s, str) and s for s in stops):
            raise EnvError(f"`{key}` {spec!r}: stop_strings must be a tuple of non-empty str, got {stops!r}"[:300])
        return env

    return make


def _check_methods(env: Any, spec: str, key: str) -> None:
    """EnvError unless `env` (a class or an instance) has the protocol's `reset` and `step`: one without `step`
    failed every episode in the decode loop with a bare `KeyError: <number>` that named nothing."""
    missing = [name for name in ("reset", "step") if not callable(getattr(env, name, None))]
    if missing:
        what = env.__name__ if isinstance(env, type) else type(env).__name__
        raise EnvError(f"`{key}` {spec!r}: {what} has no {' and no '.join(f'`{m}` method' for m in missing)} (an "
                       "environment has reset(problem) -> prompt and step(model_text) -> StepResult)")  # fmt: skip


def _check_args(cls: Callable[..., Any], kwargs: dict[str, Any], spec: str, key: str) -> None:
    """`env.args` bound to the class's (or factory's) signature when the factory loads, so that a misspelled or
    missing argument is one error when the worker starts, not a failure of every episode's construction."""
    import inspect

    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # a class without a readable signature (written in C): its first call says
        return
    signature = signature.replace(return_annotation=inspect.Signature.empty)  # the message shows the parameters
    try:
        signature.bind(**kwargs)
    except TypeError as err:
        raise EnvError(f"`env.args` {sorted(kwargs)} do not fit `{key}` {spec!r}{signature}: {err}"[:400]) from None


def check_step_result(result: Any) -> StepResult:
    """The environment's answer, checked: a StepResult (or a 4-tuple) with a finite reward. EnvError otherwise."""
    import math

    if isinstance(result, tuple) and len(result) == 4:
        result = StepResult(*result)
    if not isinstance(result, StepResult):
        raise EnvError(f"step must return a StepResult, got {type(result).__name__}")
    reward = _number(result.reward)
    if reward is None or not math.isfinite(reward):
        raise EnvError(f"step returned a reward that is not a finite number: {result.reward!r}"[:200])
    obs = result.observation
    if not (obs is None or isinstance(obs, str) or _is_messages(obs)):
        raise EnvError(f"step returned an observation that is not text, messages or None: {type(obs).__name__}")
    if not isinstance(result.info, dict):
        raise EnvError(f"step returned info that is not a dict: {type(result.info).__name__}")
    done = result.done
    numpy_bool = type(done).__module__ == "numpy" and type(done).__name__ in ("bool", "bool_")
    if not (isinstance(done, bool) or numpy_bool or (type(done) is int and done in (0, 1))):
        raise EnvError(f"step returned a `done` that is not a bool: {done!r}"[:200])  # bool("False") is True
    return StepResult(obs, reward, bool(done), result.info)


def check_reset_result(prompt: Any) -> str | Messages:
    """The environment's first prompt, checked: text, or chat messages (dicts whose `content` is text). EnvError
    otherwise."""
    if not (isinstance(prompt, str) or _is_messages(prompt)):
        raise EnvError(f"reset must return the prompt as text or chat messages, got {type(prompt).__name__}: "
                       f"{prompt!r}"[:200])  # fmt: skip
    return prompt


def _is_messages(value: Any) -> bool:
    """Chat messages: a list of dicts whose `content` (when there is one) is text."""
    return isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("content", ""), str) for m in value)


def _number(value: Any) -> float | None:
    """`value` as a float when it is a real number (Python's, or a numpy scalar's such as float32, which numpy
    registers as `numbers.Real`), else None (a bool is not a reward)."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)
