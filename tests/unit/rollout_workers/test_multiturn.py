"""Multi-turn episodes in a real rollout worker on the built-in model (issue 21): an environment loaded from a file
answers each turn; observation tokens are appended with loss mask 0; an environment that raises or sleeps past
`env.timeout_s` ends its episode with reward 0, counted, and the worker goes on."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest

from common.builtin_model import resolve_model_path
from common.config import load_config, to_dict
from common.wire import PromptLease, PushGroup, decode, encode
from quant_sync.export import export_rollout_tensors
from quant_sync.update import WeightUpdate
from rollout_workers.sections import WorkerSections
from rollout_workers.worker import RolloutWorker

ENV = textwrap.dedent(
    """
    import time

    from common.envs import StepResult


    class CountingEnv:
        '''Three turns: after the first two it shows "2+3=" (reward 0.25 each), after the third it is done (0.5).
        Problem 1 raises on its second turn; problem 2 sleeps past the timeout there.'''

        stop_strings = ("=",)

        def __init__(self, sleep_s=3.0):
            self.sleep_s = sleep_s
            self.turn = 0

        def reset(self, problem):
            self.index = problem["index"]
            return "1+1="

        def step(self, model_text):
            self.turn += 1
            if self.turn == 2 and self.index == 1:
                raise RuntimeError("calculator on fire")
            if self.turn == 2 and self.index == 2:
                time.sleep(self.sleep_s)
            if self.turn < 3:
                return StepResult("2+3=", 0.25, False, {"tool_calls": 1})
            return StepResult(None, 0.5, True, {})
    """
)


OVERLAP_ENV = textwrap.dedent(
    """
    import threading

    from common.envs import StepResult

    FINISHED = threading.Event()


    class OverlapEnv:
        '''Problem 0: three turns, then done (sets FINISHED). Problem 1: its first step waits for FINISHED, which
        only comes if problem 0's sequences keep decoding while it waits.'''

        stop_strings = ("=",)

        def reset(self, problem):
            self.index, self.turn = problem["index"], 0
            return "1+1="

        def step(self, model_text):
            self.turn += 1
            if self.index == 0:
                if self.turn < 3:
                    return StepResult("2+3=", 0.0, False, {})
                FINISHED.set()
                return StepResult(None, 1.0, True, {})
            return StepResult(None, 1.0 if FINISHED.wait(20.0) else 0.0, True, {})
    """
)


def make_worker(tmp_path: Path, *overrides: str) -> RolloutWorker:
    (tmp_path / "counting_env.py").write_text(ENV)
    (tmp_path / "overlap_env.py").write_text(OVERLAP_ENV)
    cfg = load_config(
        None,
        [
            "train.group_size=2",
            f"env.fn={tmp_path / 'counting_env.py'}:CountingEnv",
            "env.timeout_s=1.0",
            "env.max_turns=4",
            "rollout.max_new_tokens=6",
            *overrides,
        ],
    )
    model_dir = str(resolve_model_path(cfg.model.path))
    worker = RolloutWorker(to_dict(WorkerSections.pick(cfg)), "w0", model_dir, "tcp://127.0.0.1:9")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    worker.engine.stage_weights(WeightUpdate(0, export_rollout_tensors(model.state_dict(), "int8"), "int8"))
    return worker


def close(worker: RolloutWorker) -> None:
    worker.engine.close()
    worker.rewards.close()
    assert worker.episodes is not None
    worker.episodes.close()


@pytest.fixture
def worker(tmp_path: Path):
    worker = make_worker(tmp_path)
    try:
        yield worker
    finally:
        close(worker)


@pytest.mark.parametrize("continuous", [True, False], ids=["continuous", "rounds"])
def test_episodes_append_masked_observations_and_count_failures(worker: RolloutWorker, continuous: bool) -> None:
    assert worker.episodes is not None and worker.episodes.continuous  # the embedded engine's scheduler
    worker.episodes.continuous = continuous  # False: the rounds of `generate` calls that other engines get
    leases = [PromptLease(f"g{i}", i, "unused", "", 1e12) for i in range(3)]
    groups = worker.rollout(leases)
    assert [lease.group for lease, _ in groups] == ["g0", "g1", "g2"]
    observation = list(worker.tokenizer("2+3=", add_special_tokens=False)["input_ids"])
    for traj in groups[0][1]:  # three model turns, two observations in between
        assert traj.reward == pytest.approx(1.0) and traj.correct and traj.finish == "stop"
        mask = traj.loss_mask
        assert mask is not None and int((mask == 0).sum()) == 2 * len(observation)
        assert traj.response_ids[mask == 0].tolist() == observation * 2
        assert np.all(traj.behav_logp[mask == 0] == 0.0) and np.all(traj.behav_logp[mask == 1] < 0.0)
        assert traj.versions.min() == 0  # every token of version 0, the only one staged
        assert traj.prompt_ids.tolist() == worker.encode_prompt("1+1=")
    for _, trajectories in groups[1:]:  # raised / timed out on the second turn: reward 0, the first turn kept
        for traj in trajectories:
            assert traj.reward == 0.0 and not traj.correct
            assert traj.loss_mask is not None and traj.loss_mask[0] == 1
    counters = worker.counters
    assert counters["env_errors"] == 2 and counters["env_timeouts"] == 2
    assert counters["env_episodes"] == 6 and counters["env_turns"] == 2 * 3 + 4 * 2
    assert counters["env_tool_calls"] == 2 * 2 + 4 * 1
    assert counters["env_masked_tokens"] == 2 * 2 * len(observation) + 4 * len(observation)
    assert "calculator on fire" in worker.last_error  # logged once, with its traceback
    for lease, trajectories in groups:  # the wire carries the masks
        out = decode(encode(PushGroup("w0", lease.group, trajectories)))
        assert isinstance(out, PushGroup)
        for sent, got in zip(trajectories, out.trajectories, strict=True):
            assert got.loss_mask is not None and sent.loss_mask is not None
            assert got.loss_mask.tolist() == sent.loss_mask.tolist()


def test_other_sequences_keep_decoding_while_one_waits_on_its_environment(tmp_path: Path) -> None:
    worker = make_worker(tmp_path, f"env.fn={tmp_path / 'overlap_env.py'}:OverlapEnv", "env.timeout_s=30")
    try:
        groups = worker.rollout([PromptLease(f"g{i}", i, "unused", "", 1e12) for i in range(2)])
    finally:
        close(worker)
    (_, first), (_, waiting) = groups
    assert [t.reward for t in first] == [1.0, 1.0]
    assert [t.reward for t in waiting] == [1.0, 1.0]  # problem 0 finished three turns while these waited
    assert worker.counters["env_timeouts"] == 0 and worker.counters["env_turns"] == 2 * 3 + 2 * 1


PACED_ENV = textwrap.dedent(
    """
    import time

    from common.envs import StepResult


    class PacedEnv:
        '''Three turns; problem p answers after 0.1 x p seconds (`first=low`) or 0.1 x (2 - p) (`first=high`).'''

        stop_strings = ("=",)

        def __init__(self, first="low"):
            self.first = first

        def reset(self, problem):
            self.index, self.turn = problem["index"], 0
            return "Sum: 12+34+"

        def step(self, model_text):
            self.turn += 1
            time.sleep(0.1 * (self.index if self.first == "low" else 2 - self.index))
            return StepResult(None if self.turn == 3 else " +", 1.0, self.turn == 3, {})
    """
)


def test_an_episode_s_tokens_do_not_depend_on_the_order_its_environments_answer_in(tmp_path: Path) -> None:
    """The continuous path: a next turn joins the batch when its environment answers, so the turns' order varies
    with the environments' timing; each episode samples from its own stream, so the same seed gives the same
    trajectories whichever environment answers first."""
    (tmp_path / "paced_env.py").write_text(PACED_ENV)
    out = {}
    for first in ("low", "high"):
        worker = make_worker(tmp_path, f"env.fn={tmp_path / 'paced_env.py'}:PacedEnv", f"env.args={{first: {first}}}",
                             "env.timeout_s=30", "rollout.max_new_tokens=48")  # fmt: skip
        try:
            groups = worker.rollout([PromptLease(f"g{i}", i, "unused", "", 1e12) for i in range(3)])
        finally:
            close(worker)
        out[first] = [t for _, trajectories in groups for t in trajectories]
    assert len(out["low"]) == 6
    for low, high in zip(out["low"], out["high"], strict=True):
        assert int(np.sum(np.diff(np.concatenate(([0], low.loss_mask))) == 1)) >= 2  # two model turns or more
        assert low.response_ids.tolist() == high.response_ids.tolist()
        assert np.allclose(low.behav_logp, high.behav_logp, atol=1e-5)
    assert len({tuple(t.response_ids.tolist()) for t in out["low"]}) > 1  # the episodes' streams differ


NESTED_ENV = textwrap.dedent(
    """
    from common.envs import StepResult


    class NestedEnv:
        '''Appends to its problem's nested list; rewards 1 only if the list it was given was its own.'''

        stop_strings = ("=",)

        def reset(self, problem):
            self.hist = problem["hist"]
            self.hist.append(1)
            return "1+1="

        def step(self, model_text):
            return StepResult(None, 1.0 if len(self.hist) == 1 else 0.0, True, {})
    """
)


def test_each_episode_resets_with_its_own_copy_of_the_row_nested_fields_included(tmp_path: Path) -> None:
    """The episodes of a group shared the row's nested lists: one environment's append reached its siblings."""
    (tmp_path / "nested_env.py").write_text(NESTED_ENV)
    worker = make_worker(tmp_path, f"env.fn={tmp_path / 'nested_env.py'}:NestedEnv", "train.group_size=4")
    try:
        assert worker.episodes is not None
        row = {"index": 0, "prompt": "1+1=", "answer": "2", "hist": []}
        (episodes,) = worker.episodes.run([PromptLease("g0", 0, "1+1=", "2", 1e12)], [row], 4)
        assert [e.reward for e in episodes] == [1.0] * 4 and row["hist"] == []
    finally:
        close(worker)


def test_an_observation_is_cut_to_what_its_tokens_can_reach_before_it_is_tokenized(worker: RolloutWorker) -> None:
    """A 5 MB observation was tokenized whole on the decode thread, every turn (seconds each), then cut."""
    import random

    runner = worker.episodes
    assert runner is not None
    huge = runner._cut_observation("1" * 5_000_000, room=10)
    assert len(huge) <= 2 * 11 * runner._token_chars < 1000
    words = random.Random(0).choices(["12", "+", "=", " ", "345", "\n", "6-7", "(8)"], k=20_000)
    text = "".join(words)
    for room in (1, 7, 50, 400):
        cut = runner._cut_observation(text, room)
        assert len(cut) < len(text)
        assert runner._encode_observation(cut)[:room] == runner._encode_observation(text)[:room]
    messages = [{"role": "tool", "content": text}]
    assert runner._cut_observation(messages, 7) == [{"role": "tool", "content": runner._cut_observation(text, 7)}]


SLOW_ENV = textwrap.dedent(
    """
    import time

    from common.envs import StepResult


    class SlowEnv:
        '''Each reset and step takes 0.3 s: well within env.timeout_s=1.0, but 8 of them on one thread take 2.4 s.'''

        stop_strings = ("=",)

        def reset(self, problem):
            time.sleep(0.3)
            return "1+1="

        def step(self, model_text):
            time.sleep(0.3)
            return StepResult(None, 1.0, True, {})
    """
)


@pytest.mark.parametrize("continuous", [True, False], ids=["continuous", "rounds"])
def test_env_timeout_counts_from_a_call_s_start_not_from_the_queue(tmp_path: Path, continuous: bool) -> None:
    """docs/multiturn.md: `env.timeout_s` is what one reset or step may run. It counted from when a call was queued,
    so calls waiting for one of `env.threads` timed out and their episodes were trained with reward 0."""
    (tmp_path / "slow_env.py").write_text(SLOW_ENV)
    worker = make_worker(tmp_path, f"env.fn={tmp_path / 'slow_env.py'}:SlowEnv", "env.threads=1",
                         "train.group_size=4")  # fmt: skip
    try:
        assert worker.episodes is not None
        worker.episodes.continuous = continuous
        groups = worker.rollout([PromptLease(f"g{i}", i, "unused", "", 1e12) for i in range(2)])
        assert [traj.reward for _, trajs in groups for traj in trajs] == [1.0] * 8
        assert worker.episodes.counters["env_timeouts"] == 0 and worker.episodes.counters["env_groups_dropped"] == 0
    finally:
        close(worker)


STOPS_ENV = textwrap.dedent(
    """
    import numpy as np

    from common.envs import StepResult


    class StopsEnv:
        '''Problem 1 sets malformed stop strings in reset; problem 0 counts a tool call as numpy's int64.'''

        stop_strings = ("=",)

        def reset(self, problem):
            self.index, self.turn = problem["index"], 0
            if self.index == 1:
                self.stop_strings = None
            if self.index == 2:
                self.stop_strings = ("",)
            return "1+1="

        def step(self, model_text):
            self.turn += 1
            return StepResult("2+3=", 1.0, self.turn >= 2, {"tool_calls": np.int64(1)})
    """
)


@pytest.mark.parametrize("continuous", [True, False], ids=["continuous", "rounds"])
def test_stop_strings_set_in_reset_are_checked_per_episode(tmp_path: Path, continuous: bool) -> None:
    """Checked at construction only: None set in `reset` failed the whole batch (TypeError), and ("",) cut every
    turn to one token. Now such an episode alone ends as an environment error; a numpy tool-call count counts."""
    (tmp_path / "stops_env.py").write_text(STOPS_ENV)
    worker = make_worker(tmp_path, f"env.fn={tmp_path / 'stops_env.py'}:StopsEnv", "rollout.max_new_tokens=8")
    try:
        assert worker.episodes is not None
        worker.episodes.continuous = continuous
        groups = worker.rollout([PromptLease(f"g{i}", i, "unused", "", 1e12) for i in range(3)])
        assert [lease.group for lease, _ in groups] == ["g0"]  # the other two failed before their first token
        assert all(traj.reward == 2.0 and traj.finish == "stop" for traj in groups[0][1])  # two turns, summed
        counters = worker.episodes.counters
        assert counters["env_errors"] == 4 and counters["env_groups_dropped"] == 2
        assert counters["env_tool_calls"] == 4.0  # two episodes of problem 0, two steps each
        assert "stop_strings must be a tuple of non-empty str" in worker.episodes.first_error
    finally:
        close(worker)


def tiny_with_template(tmp_path: Path, template: str) -> Path:
    """A copy of builtin:tiny whose tokenizer has `template` as its chat template."""
    import json
    import shutil

    model_dir = tmp_path / "tiny-chat"
    shutil.copytree(resolve_model_path("builtin:tiny", log=lambda *a: None), model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return model_dir


MESSAGES_ENV = textwrap.dedent(
    """
    from common.envs import StepResult


    class MessagesEnv:
        stop_strings = ("=",)

        def reset(self, problem):
            return [{"role": "user", "content": "1+1"}]

        def step(self, model_text):
            return StepResult(None, 1.0, True, {})
    """
)


def test_chat_message_prompts_render_with_a_fast_tokenizer_worker(tmp_path: Path) -> None:
    """A worker whose prompts are not templated encodes with `FastTokenizer` (no `apply_chat_template`): an
    environment's chat-message prompt failed the whole batch with an AttributeError."""

    from transformers import AutoTokenizer

    model_dir = tiny_with_template(tmp_path, "{% for m in messages %}{{ m['content'] }}={% endfor %}")
    (tmp_path / "messages_env.py").write_text(MESSAGES_ENV)
    worker = make_worker(tmp_path, f"env.fn={tmp_path / 'messages_env.py'}:MessagesEnv", f"model.path={model_dir}")
    try:
        assert not hasattr(worker.tokenizer, "apply_chat_template")  # the case under test
        groups = worker.rollout([PromptLease("g0", 0, "unused", "", 1e12)])
        expected = AutoTokenizer.from_pretrained(model_dir)("1+1=", add_special_tokens=False)["input_ids"]
        assert [traj.prompt_ids.tolist() for traj in groups[0][1]] == [expected, expected]
    finally:
        close(worker)


def test_a_text_reset_on_a_message_list_dataset_is_the_user_s_message(tmp_path: Path) -> None:
    """The worker's prompt encoder reads a message-list dataset's prompts as JSON: a text `reset` prompt failed the
    batch with a JSONDecodeError. It is encoded as that dataset's single-turn prompt of one user message."""
    import json

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)})
                            + "\n" for i in range(8)))  # fmt: skip
    worker = make_worker(tmp_path, "data.task=dataset", f"data.path={rows}", "data.prompt_key=messages",
                         "data.chat_template='false'")  # fmt: skip
    try:
        groups = worker.rollout([PromptLease("g0", 0, "unused", "", 1e12)])  # CountingEnv resets with "1+1="
        expected = worker.encode_prompt(json.dumps([{"role": "user", "content": "1+1="}]))
        assert [traj.prompt_ids.tolist() for traj in groups[0][1]] == [list(expected)] * 2
    finally:
        close(worker)


OBSERVING_ENV = textwrap.dedent(
    """
    from common.envs import StepResult


    class ObservingEnv:
        stop_strings = ("=",)

        def reset(self, problem):
            self.turn = 0
            return [{"role": "user", "content": "1+1"}]

        def step(self, model_text):
            self.turn += 1
            if self.turn == 1:
                return StepResult([{"role": "user", "content": "2+3"}], 0.0, False, {})
            return StepResult(None, 1.0, True, {})
    """
)


def test_a_chat_observation_continues_the_conversation_without_the_template_s_preamble(tmp_path: Path) -> None:
    """Rendered as a conversation of its own, an observation began with the template's BOS (and, with Llama or Qwen
    templates, a system block) in the middle of the episode; it is what the conversation gains by it."""

    model_dir = tiny_with_template(tmp_path, "{{ bos_token }}{% for m in messages %}{{ m['content'] }}={% endfor %}")
    (tmp_path / "observing_env.py").write_text(OBSERVING_ENV)
    worker = make_worker(tmp_path, f"env.fn={tmp_path / 'observing_env.py'}:ObservingEnv", f"model.path={model_dir}")
    try:
        groups = worker.rollout([PromptLease("g0", 0, "unused", "", 1e12)])
        expected = list(worker.tokenizer("2+3=", add_special_tokens=False)["input_ids"])  # no BOS before it
        for traj in groups[0][1]:
            assert traj.response_ids[traj.loss_mask == 0].tolist() == expected
    finally:
        close(worker)


LONG_ENV = textwrap.dedent(
    """
    from common.envs import StepResult


    class LongEnv:
        stop_strings = ("=",)

        def reset(self, problem):
            return "1+1="

        def step(self, model_text):
            return StepResult("1+" * 200, 0.0, False, {})
    """
)


def test_an_observation_stops_at_the_engine_s_context(tmp_path: Path) -> None:
    """Observations were cut to env.max_total_tokens only: on a 64-position model a trajectory of 5 + 203 tokens
    went to the learner, none of them past the 64th readable by any turn."""
    (tmp_path / "long_env.py").write_text(LONG_ENV)
    worker = make_worker(tmp_path, f"env.fn={tmp_path / 'long_env.py'}:LongEnv", "model.path=builtin:micro",
                         "env.max_total_tokens=512")  # fmt: skip
    try:
        groups = worker.rollout([PromptLease("g0", 0, "unused", "", 1e12)])
        for traj in groups[0][1]:
            assert len(traj.prompt_ids) + len(traj.response_ids) == 64 and traj.finish == "length"
    finally:
        close(worker)
