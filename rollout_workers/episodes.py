"""Multi-turn episodes of a rollout worker (issue 21): generate a turn, let the environment answer, go on.

    lease --reset (env thread)--> prompt --generate turn (engine)--> model text --step (env thread)--> observation
          ... until the environment says done, `env.max_turns`, `env.max_total_tokens`, or the engine's context

One episode per sample: `group_size` per leased prompt, each with its own environment instance (common/envs.py).
The response of an episode is everything after its first prompt: model tokens (loss mask 1, their behaviour
log-probs and weight versions, as sampled) and observation tokens (loss mask 0, behaviour log-prob 0.0, the weight
version current when they were appended, so never older than the model tokens before them; staleness, the minimum
version, is therefore the oldest model token's). Every generated token keeps the version that produced it, across
a weight swap mid-episode. The episode's reward is the sum of its turns' rewards.

Scheduling. With the embedded engine, episodes run on its continuous-batching scheduler (`submit` / `step`): a
sequence whose turn ends leaves the batch, its `step` call runs on a thread pool (`env.threads`), off the decode
thread, under `env.timeout_s`, while the other sequences keep decoding; when the answer arrives, the next turn joins
the running batch. Any other engine (the SGLang backend) runs turns in rounds: the turns of all live episodes are
one `engine.generate` call, then their `step` calls run concurrently, so a turn that ended early waits for the
round's longest. Either way each next turn is submitted with its whole context (prompt + response so far), and the
engine's prefix cache keeps that cheap: the embedded engine (`rollout.prefix_cache`) kept the previous turn's K/V
when its sequence retired, so the turn prefills only the previous turn's last token and the observation (unless a
weight swap emptied the cache in between, or it was evicted: then the context is prefilled again, with the new
weights); on SGLang the radix cache does the same (docs/sglang.md). Episodes whose turns start from the same context
(the `group_size` episodes of a prompt, at their first turn) are submitted together and share one prefill.

Stop strings: an environment's stop string that is one token of the tokenizer stops the engine there; a longer
one is found in the turn's text after generation and the turn is cut after it (the tokens past it are dropped,
which leaves the kept tokens' behaviour log-probs exact: they were sampled before them).

An environment that raises or runs past `env.timeout_s` (in its constructor, `reset` or `step`) ends its episode
with reward 0 and the tokens it has; counted in `env_errors` / `env_timeouts`, its first traceback kept for the
worker's `last_error`. An episode that failed before its first model token has no response to train on: the worker
drops its group (`env_groups_dropped`; the lease expires and the prompt returns to the pool). A call past its
timeout keeps its thread until it returns (Python cannot stop a thread): the pool of `env.threads` threads bounds
how many such calls pile up, and calls queued behind them wait (and may time out) too.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import json
import math
import numbers
import random
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from common.envs import (
    EnvError,
    StepResult,
    check_reset_result,
    check_step_result,
    combine_turn_reward,
    load_env_factory,
)
from common.tasks import problem_row
from common.wire import PromptLease
from rollout_workers.token_chars import max_token_chars

if TYPE_CHECKING:
    from common.config_schema import EnvConfig
    from rollout_workers.engine import Engine, SamplingParams

ENV_COUNTERS = (
    "env_episodes", "env_turns", "env_tool_calls", "env_errors", "env_timeouts", "env_masked_tokens",
    "env_groups_dropped",
)  # fmt: skip
"""The worker counters episodes add (the driver logs them as `env/<name>`; `env/turns_mean` = turns / episodes)."""


@dataclass(slots=True)
class Episode:
    """One episode's state; `response_*` grow by a turn and its observation at a time."""

    env: Any
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    behav_logp: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    tool_calls: float = 0.0
    done: bool = False
    finish: str = "stop"
    failed: bool = False
    key: int = 0
    """The episode's sampling stream on the continuous path: turn t samples with `sample_key(key, t)`, so its
    tokens do not depend on the order in which the environments' answers arrive."""

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.response_ids


class EpisodeRunner:
    """Runs the episodes of a batch of leases on one engine (see the module docstring)."""

    def __init__(
        self,
        env_cfg: EnvConfig,
        engine: Engine,
        tokenizer: Any,
        encode_prompt: Callable[[str], list[int]],
        params: SamplingParams,
        counters: dict[str, Any],
        seed: int = 0,
        model_dir: str = "",
    ) -> None:
        self.cfg = env_cfg
        self.model_dir = model_dir  # its Hugging Face tokenizer renders chat messages when `tokenizer` cannot
        self._hf_tokenizer: Any = None
        self.engine, self.tokenizer, self.encode_prompt, self.params = engine, tokenizer, encode_prompt, params
        self.make_env = load_env_factory(env_cfg.fn, env_cfg.args)
        self.pool = cf.ThreadPoolExecutor(max_workers=env_cfg.threads, thread_name_prefix="env")
        self.counters = counters
        for name in ENV_COUNTERS:
            counters.setdefault(name, 0)
        self.first_error = ""
        # the embedded engine's own scheduler lets a turn's environment call overlap the other sequences' decoding;
        # any other engine (SGLang) runs turns in rounds of `generate` calls
        from rollout_workers.embedded.engine import EmbeddedEngine

        self.continuous = isinstance(engine, EmbeddedEngine)
        self._keys = random.Random(seed)  # the episodes' sampling streams on the continuous path (`Episode.key`)
        self._token_chars: int | None = None  # `max_token_chars(tokenizer)`, at the first observation

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- environment calls, off the decode thread, under the timeout ----------------------------------------

    def _submit(self, call: Callable[[], Any]) -> tuple[cf.Future, list[float]]:
        """`call` on the pool, and a box that gets its start time (time.monotonic()) once a thread runs it: the
        timeout counts from there, not from the queue (128 resets of 0.7 s on 8 threads timed out at 10 s)."""
        started: list[float] = []

        def run() -> Any:
            started.append(time.monotonic())
            return call()

        return self.pool.submit(run), started

    def _overdue(self, started: list[float], now: float) -> bool:
        return bool(started) and now - started[0] >= self.cfg.timeout_s

    def _stuck(self, jobs: list[tuple[cf.Future, list[float]]], now: float) -> bool:
        """Every pool thread is held by a call past its timeout (threads cannot be stopped): what waits in the
        queue would never start."""
        held = sum(1 for future, started in jobs if not future.done() and self._overdue(started, now))
        return held >= self.cfg.threads

    def _call_all(self, calls: list[Callable[[], Any]]) -> list[tuple[bool, Any]]:
        """Run `calls` concurrently on the pool; (ok, result) each, (False, None) on an error or on running past
        `env.timeout_s` from its own start (or never starting, every thread held by calls past theirs)."""
        jobs = [self._submit(call) for call in calls]
        while True:
            now = time.monotonic()
            waiting = [(f, s) for f, s in jobs if not f.done() and not self._overdue(s, now)]
            if not waiting or (self._stuck(jobs, now) and all(not s for _, s in waiting)):
                break
            starts = [s[0] + self.cfg.timeout_s - now for _, s in waiting if s]
            cf.wait([f for f, _ in waiting], timeout=max(0.001, min(starts, default=0.05)),
                    return_when=cf.FIRST_COMPLETED)  # fmt: skip
        out: list[tuple[bool, Any]] = []
        for future, _ in jobs:
            if not future.done():
                future.cancel()
                self.counters["env_timeouts"] += 1
                self._note(f"environment call ran past env.timeout_s={self.cfg.timeout_s}")
                out.append((False, None))
                continue
            err = future.exception()
            if err is not None:
                self.counters["env_errors"] += 1
                self._note("".join(traceback.format_exception(err, limit=6)))
                out.append((False, None))
                continue
            out.append((True, future.result()))
        return out

    def _note(self, text: str) -> None:
        if not self.first_error:  # logged once: the worker's last_error, which the driver prints
            self.first_error = f"environment {self.cfg.fn}: {text}"[:4000]

    # -- tokens -------------------------------------------------------------------------------------------

    def _encode_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            if getattr(self.encode_prompt, "messages", False):  # a message-list dataset's encoder reads JSON: the
                prompt = json.dumps([{"role": "user", "content": prompt}])  # text is the user's message
            return list(self.encode_prompt(prompt))
        return self._encode_messages(prompt, first=True)

    def _templating_tokenizer(self) -> Any:
        """A tokenizer with `apply_chat_template`: the worker's, or (a `FastTokenizer`, which has none) the Hugging
        Face one of the same directory, loaded the first time chat messages need it."""
        if hasattr(self.tokenizer, "apply_chat_template"):
            return self.tokenizer
        if self._hf_tokenizer is None:
            from common.tasks.chat import load_tokenizer

            self._hf_tokenizer = load_tokenizer(self.model_dir)
        return self._hf_tokenizer

    def _encode_messages(self, messages: list[dict[str, str]], first: bool) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None):
            tokenizer = self._templating_tokenizer()
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            if not first:
                text = self._observation_text(tokenizer, messages, text)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        text = "\n\n".join(str(m.get("content", "")) for m in messages)
        return list(self.tokenizer(text, add_special_tokens=first)["input_ids"])

    @staticmethod
    def _observation_text(tokenizer: Any, messages: list[dict[str, str]], alone: str) -> str:
        """An observation's messages as the template renders them after a turn of the conversation, not as a new
        conversation: what a rendered exchange gains when they follow it. Rendered alone they began with the
        template's preamble (BOS, a default system block) in the middle of the episode. `alone` when the template
        does not render the longer conversation as an extension of the shorter one."""
        exchange = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
        try:
            before = tokenizer.apply_chat_template(exchange, tokenize=False)
            after = tokenizer.apply_chat_template([*exchange, *messages], tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that refuses this exchange (roles it does not take): as before
            return alone
        return after[len(before) :] if after.startswith(before) else alone

    def _cut_observation(self, observation: Any, room: int) -> Any:
        """`observation` without the text its first `room` tokens cannot reach, before it is tokenized (on the decode
        thread): a multi-megabyte observation cost seconds a turn and stalled the worker. Twice the characters `room`
        tokens can stand for (`max_token_chars`) are kept: the first `room` tokens fall well before the cut, so they
        are the whole text's (a tokenizer's merges reach a few characters, not `room` tokens' worth)."""
        if self._token_chars is None:
            self._token_chars = max_token_chars(self.tokenizer)
        limit = 2 * (max(room, 0) + 1) * self._token_chars
        if isinstance(observation, str):
            return observation[:limit]
        if isinstance(observation, list):
            return [
                {**m, "content": m["content"][:limit]} if isinstance(m.get("content"), str) else m for m in observation
            ]
        return observation

    def _encode_observation(self, observation: Any) -> list[int]:
        if observation is None:
            return []
        if isinstance(observation, str):
            return list(self.tokenizer(observation, add_special_tokens=False)["input_ids"])
        return self._encode_messages(observation, first=False)

    def _stop_ids(self, env: Any) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The env's stop strings as single stop tokens where they are one token, and the others as text. EnvError
        when `reset` (or `step`) left them malformed: checked at construction only, None failed the batch, "" cut
        every turn to one token and a plain string stopped on each of its characters."""
        stops = getattr(env, "stop_strings", ())
        if (
            isinstance(stops, str)
            or not isinstance(stops, tuple | list)
            or not all(isinstance(stop, str) and stop for stop in stops)
        ):
            raise EnvError(f"stop_strings must be a tuple of non-empty str, got {stops!r}"[:300])
        ids, texts = list(self.params.stop_token_ids), []
        for stop in stops:
            encoded = list(self.tokenizer(stop, add_special_tokens=False)["input_ids"])
            if len(encoded) == 1:
                ids.append(encoded[0])
            else:
                texts.append(stop)
        return tuple(dict.fromkeys(ids)), tuple(texts)

    def _stops_or_fail(self, e: Episode) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
        """`_stop_ids` of the episode's environment, or None after ending that episode alone as an environment
        error (its stop strings are malformed)."""
        try:
            return self._stop_ids(e.env)
        except EnvError as err:
            self.counters["env_errors"] += 1
            self._note(str(err))
            e.failed, e.done, e.reward = True, True, 0.0
            return None

    def _cut_at_stop(self, tokens: list[int], stops: tuple[str, ...]) -> int:
        """How many tokens of a turn to keep: up to and including the first multi-token stop string."""
        if not stops or not any(s in self.tokenizer.decode(tokens, skip_special_tokens=True) for s in stops):
            return len(tokens)
        for k in range(1, len(tokens) + 1):
            text = self.tokenizer.decode(tokens[:k], skip_special_tokens=True)
            if any(s in text for s in stops):
                return k
        return len(tokens)

    # -- the episodes ---------------------------------------------------------------------------------------

    def run(self, leases: list[PromptLease], rows: list[dict[str, Any]], group_size: int) -> list[list[Episode]]:
        """Run `group_size` episodes per lease; returns them per lease (an episode that failed before its first
        model turn has no tokens: the caller drops its group)."""
        problems = [row for row in rows for _ in range(group_size)]
        created = self._call_all([self.make_env for _ in problems])
        episodes = [Episode(env if ok else None, [], key=self._keys.getrandbits(62)) for ok, env in created]
        for episode in episodes:
            episode.failed = episode.env is None
        live = [i for i, e in enumerate(episodes) if not e.failed]
        # each episode its own copy of the row, nested fields included: one episode's changes never reach another's
        resets = self._call_all([(lambda e=episodes[i], p=problems[i]: e.env.reset(copy.deepcopy(p))) for i in live])
        for i, (ok, prompt) in zip(live, resets, strict=True):
            ok, prompt = self._checked(ok, prompt, check_reset_result)
            episodes[i].failed = not ok
            if ok:
                episodes[i].prompt_ids = self._encode_prompt(prompt)
                if self._room(episodes[i]) < 1:
                    self._note(f"reset's prompt is {len(episodes[i].prompt_ids)} tokens: no room for a model turn "
                               f"within rollout.max_seq_len={self.engine.max_seq_len}")  # fmt: skip
        if self.continuous:
            self._run_continuous(episodes)
        else:
            self._run_rounds(episodes)
        for e in episodes:
            self.counters["env_episodes"] += 1
            self.counters["env_turns"] += e.turns
            self.counters["env_tool_calls"] += e.tool_calls  # with its episode: per-episode ratios stay consistent
            self.counters["env_masked_tokens"] += len(e.loss_mask) - sum(e.loss_mask)
        return [episodes[g * group_size : (g + 1) * group_size] for g in range(len(leases))]

    def _room(self, e: Episode) -> int:
        """Tokens the next turn of `e` may generate (< 1: the episode is out of room and ends, finish "length")."""
        room = min(self.params.max_new_tokens, self.cfg.max_total_tokens - len(e.response_ids))
        limit = self.engine.max_seq_len
        return room if limit is None else min(room, limit - len(e.context))

    def _ready(self, episodes: list[Episode], indices: list[int]) -> list[int]:
        """Those of `indices` that take another turn; the ones out of room end here."""
        out = []
        for i in indices:
            e = episodes[i]
            if e.failed or e.done:
                continue
            if self._room(e) < 1 or not e.prompt_ids:
                e.done, e.finish = True, "length"
                continue
            out.append(i)
        return out

    def _record_turn(self, e: Episode, completion: Any, stop_texts: tuple[str, ...]) -> str:
        """Append a finished turn's model tokens (cut after a multi-token stop string); returns its text."""
        keep = self._cut_at_stop(list(completion.response_ids), stop_texts)
        e.response_ids += list(completion.response_ids[:keep])
        e.behav_logp += [float(x) for x in completion.behav_logp[:keep]]
        e.versions += [int(v) for v in completion.versions[:keep]]
        e.loss_mask += [1] * keep
        e.turns += 1
        e.finish = "abort" if completion.finish == "abort" else "stop"
        return self.tokenizer.decode(list(completion.response_ids[:keep]), skip_special_tokens=True)

    def _run_rounds(self, episodes: list[Episode]) -> None:
        """Any engine: the turns of all live episodes are one `generate` call per set of stop tokens, then their
        `step` calls run concurrently; a turn that ended early waits for the round's longest."""
        from dataclasses import replace

        while True:
            live = self._ready(episodes, list(range(len(episodes))))
            if not live:
                return
            by_stops: dict[tuple[tuple[int, ...], tuple[str, ...], int], list[int]] = {}
            stop_texts: dict[int, tuple[str, ...]] = {}
            for i in list(live):
                found = self._stops_or_fail(episodes[i])
                if found is None:
                    live.remove(i)
                    continue
                ids, stop_texts[i] = found  # each episode its own room: the shortest one capped the others' turns
                by_stops.setdefault((ids, stop_texts[i], self._room(episodes[i])), []).append(i)
            texts_of_turn: dict[int, str] = {}
            for (stop_ids, stops, room), members in by_stops.items():  # stops: multi-token stop strings, which the
                # SGLang backend sends as `stop` (ends server-side)
                params = replace(self.params, max_new_tokens=room, stop_token_ids=stop_ids, stop=stops)
                completions = self.engine.generate([episodes[i].context for i in members], params)
                for i, completion in zip(members, completions, strict=True):
                    texts_of_turn[i] = self._record_turn(episodes[i], completion, stop_texts[i])
            steps = self._call_all([(lambda e=episodes[i], t=texts_of_turn[i]: e.env.step(t)) for i in live])
            for i, (ok, result) in zip(live, steps, strict=True):
                self._apply_step(episodes[i], ok, result)

    def _run_continuous(self, episodes: list[Episode]) -> None:
        """The embedded engine's scheduler (`submit` / `step`): a turn that ends goes to its environment on the pool
        while the other sequences keep decoding; its next turn joins the running batch when the answer arrives."""
        from dataclasses import replace

        from rollout_workers.embedded.sampling import sample_key

        engine: Any = self.engine
        running: dict[int, tuple[int, Any, tuple[str, ...]]] = {}  # id(sequence) -> (episode, sequence, stops)
        pending: dict[cf.Future, tuple[int, float]] = {}  # step call -> (episode, monotonic deadline)
        ready = self._ready(episodes, list(range(len(episodes))))
        while ready or running or pending:
            together: dict[tuple, list[int]] = {}  # the same context and limits: one submission, one shared prefill
            for i in ready:
                e = episodes[i]
                found = self._stops_or_fail(e)
                if found is None:
                    continue
                stop_ids, stops = found
                together.setdefault((tuple(e.context), stop_ids, stops, self._room(e)), []).append(i)
            for (context, stop_ids, stops, room), members in together.items():
                params = replace(self.params, max_new_tokens=room, stop_token_ids=stop_ids)
                keys = [sample_key(episodes[i].key, episodes[i].turns) for i in members]
                seqs = engine.submit(list(context), params, keys)
                for i, seq in zip(members, seqs, strict=True):
                    running[id(seq)] = (i, seq, stops)
            ready = []
            if running:
                for seq in engine.step():
                    i, _, stops = running.pop(id(seq))
                    text = self._record_turn(episodes[i], seq.completion, stops)
                    future, started = self._submit(partial(episodes[i].env.step, text))
                    pending[future] = (i, started)
            if not pending:
                continue
            if not running:  # nothing to decode: wait for the first environment answer (or deadline)
                now = time.monotonic()
                left = [s[0] + self.cfg.timeout_s - now for _, s in pending.values() if s]
                cf.wait(list(pending), timeout=max(0.0, min(left, default=0.05)), return_when=cf.FIRST_COMPLETED)
            now = time.monotonic()
            stuck = self._stuck([(f, s) for f, (_, s) in pending.items()], now)
            for future, (i, started) in list(pending.items()):
                if future.done():
                    del pending[future]
                    err = future.exception()
                    if err is not None:
                        self.counters["env_errors"] += 1
                        self._note("".join(traceback.format_exception(err, limit=6)))
                    self._apply_step(episodes[i], err is None, None if err is not None else future.result())
                elif self._overdue(started, now) or (stuck and not started):
                    del pending[future]
                    future.cancel()
                    self.counters["env_timeouts"] += 1
                    self._note(f"environment call ran past env.timeout_s={self.cfg.timeout_s}")
                    self._apply_step(episodes[i], False, None)
                else:
                    continue
                ready += self._ready(episodes, [i])

    def _checked(self, ok: bool, answer: Any, check: Callable[[Any], Any]) -> tuple[bool, Any]:
        """(ok, the environment's `answer` as `check` returns it); a malformed answer counts as an env error."""
        if not ok:
            return False, answer
        try:
            return True, check(answer)
        except EnvError as err:
            self.counters["env_errors"] += 1
            self._note(str(err))
            return False, answer

    def _apply_step(self, e: Episode, ok: bool, result: Any) -> None:
        ok, result = self._checked(ok, result, check_step_result)
        if not ok:
            e.failed, e.done, e.reward = True, True, 0.0
            return
        assert isinstance(result, StepResult)
        e.reward = combine_turn_reward(self.cfg.turn_rewards, e.reward, result.reward, first_turn=e.turns <= 1)
        calls = result.info.get("tool_calls", 0)
        if isinstance(calls, numbers.Real) and not isinstance(calls, bool) and math.isfinite(calls):  # np.int64 too,
            e.tool_calls += float(calls)  # not a NaN that would make env/tool_calls NaN
        if e.finish == "abort" or result.done:
            e.done = True
            return
        if e.turns >= self.cfg.max_turns:
            e.done, e.finish = True, "length"
            return
        room = self.cfg.max_total_tokens - len(e.response_ids)
        limit = self.engine.max_seq_len  # and the engine's context: tokens past it no turn could read
        if limit is not None:
            room = min(room, limit - len(e.context))
        observation = self._encode_observation(self._cut_observation(result.observation, room))[: max(room, 0)]
        version = max(self.engine.version, max(e.versions, default=0))
        e.response_ids += observation
        e.behav_logp += [0.0] * len(observation)
        e.versions += [version] * len(observation)
        e.loss_mask += [0] * len(observation)
        if len(e.response_ids) >= self.cfg.max_total_tokens or len(observation) >= room:
            e.done, e.finish = True, "length"


def problem_rows(source: Any, leases: list[PromptLease]) -> list[dict[str, Any]]:
    """The problem each lease's environment is reset with: the source's row fields, index, prompt, answer."""
    source_row = getattr(source, "row", None)
    rows = []
    for lease in leases:
        record = source_row(lease.index) if source_row else None
        row = problem_row(lease.index, lease.prompt, lease.answer, record, record_wins=False)
        rows.append(json.loads(json.dumps(row, default=str)))  # a plain copy the environment may keep or change
    return rows
