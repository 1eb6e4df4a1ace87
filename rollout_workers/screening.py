"""Predictive selective rollout (`algo.skip_predicted`): do not generate a group the policy would answer all correctly.

GRESO's history rule (buffer/selective.py) needs a prompt to come back; a generated stream that seldom repeats one
(the built-in `arith` task: 37% of draws are repeats) escapes it. This rule asks the policy itself, before sampling:
the worker scores the lease's reference answer under the weights that would generate the group, with one prefill of
prompt + answer tokens + end token in the embedded engine (`EmbeddedEngine.submit(..., max_new_tokens=0,
prompt_logprobs_from=len(prompt) - 1)`, at the sampling temperature, so the scores are the behaviour log-probs of
those tokens). Their sum is log p_ans, the probability that one sample is exactly the reference answer, and

    P(all G samples correct) >= p_ans ** G

(other tokenizations or forms of the answer may be correct too: a lower bound, so the rule errs on generating). When
p_ans ** G >= `algo.skip_predicted_above`, dynamic sampling would very likely drop the group: it is generated only
with probability `algo.skip_min_prob` (a draw that is a pure function of the run's seed and the problem index, and
independent of the history rule's), else resolved unsampled: the worker pushes it with no trajectories and the buffer
counts it `screened_groups` (`rollout/screened_prompts`). A group that is generated after all is trained as usual.

Groups all wrong are not predicted (the reference answer's probability says nothing reliable about them; they were
2% of the built-in task's filtered groups). The rule acts only where the reference answer itself scores 1 under the
task's reward and answer + end token fit `rollout.max_new_tokens`. What it costs: one prefill of the prompt and the
answer per leased group (`screen_tokens` and `screen_seconds` in the worker's stats, against G x response tokens of
decoding for a generated group; the engine's prefix cache can serve the prompt's K/V to the group's own prefill).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from common.wire import PromptLease

if TYPE_CHECKING:
    from rollout_workers.embedded.engine import EmbeddedEngine
    from rollout_workers.engine import SamplingParams


def screen_draw(seed: int, index: int) -> float:
    """A uniform number in [0, 1) for problem `index` of the run of `seed` (a blake2b digest: a pure function of both,
    independent of `buffer.selective.uniform_draw`)."""
    digest = hashlib.blake2b(f"asyncrl-screen/{seed}/{index}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) * 2.0**-53


def score_continuations(
    engine: EmbeddedEngine, prompts: list[list[int]], continuations: list[list[int]], temperature: float
) -> list[float]:
    """log p(continuation | prompt) under `log_softmax(logits / temperature)` of the engine's running weights, for
    each pair: one prefill of prompt + continuation each (no token drawn), all queued together."""
    from rollout_workers.engine import SamplingParams

    if len(prompts) != len(continuations):
        raise ValueError(f"{len(prompts)} prompts for {len(continuations)} continuations")
    if any(not ids for ids in prompts) or any(not ids for ids in continuations):
        raise ValueError("score_continuations needs non-empty prompts and continuations")
    params = SamplingParams(max_new_tokens=0, temperature=temperature, stop_token_ids=engine.stop_token_ids)
    sequences = [
        engine.submit(prompt + continuation, params, [0], prompt_logprobs_from=len(prompt) - 1,
                      prompt_logprobs_temperature=temperature)[0]
        for prompt, continuation in zip(prompts, continuations)
    ]  # fmt: skip
    while any(seq.completion is None for seq in sequences):
        engine.step()
    return [math.fsum(seq.prompt_logp) for seq in sequences]


class AnswerScreen:
    """Which leased prompts a worker generates (module doc); counts what it screened and what scoring cost."""

    def __init__(
        self,
        *,
        group_size: int,
        above: float,
        min_prob: float,
        seed: int,
        encode_answer: Callable[[str], list[int]],
        reward: Callable[[str, str], float],
    ) -> None:
        """`encode_answer(text)`: its token ids without special tokens; `reward(response, answer)`: the task's."""
        if group_size < 1 or not 0.0 <= above <= 1.0 or not 0.0 < min_prob <= 1.0:
            raise ValueError(f"AnswerScreen needs group_size >= 1, 0 <= above <= 1 and 0 < min_prob <= 1, got "
                             f"{group_size}, {above}, {min_prob}")  # fmt: skip
        self.group_size, self.above, self.min_prob, self.seed = group_size, above, min_prob, seed
        self.encode_answer = encode_answer
        self.reward = reward
        self.counters: dict[str, float] = {
            "prompts_screened": 0,
            "screen_scored": 0,
            "screen_tokens": 0,
            "screen_seconds": 0.0,
        }

    def p_all_correct(self, answer_logp: float) -> float:
        """The predicted probability of an all-correct group, p_ans ** G, from log p_ans."""
        return math.exp(self.group_size * answer_logp)

    def generates(self, index: int, answer_logp: float) -> bool:
        """Whether problem `index` is generated given its answer's log-prob: always below the threshold, else with
        probability `min_prob`."""
        return self.p_all_correct(answer_logp) < self.above or screen_draw(self.seed, index) < self.min_prob

    def keep(
        self, engine: EmbeddedEngine, leases: list[PromptLease], prompt_ids: list[list[int]], params: SamplingParams
    ) -> list[bool]:
        """For each lease, whether to generate its group (False: resolve it unsampled)."""
        stop = params.stop_token_ids[:1] or engine.stop_token_ids[:1]
        scored: list[int] = []
        continuations: list[list[int]] = []
        for i, lease in enumerate(leases):
            answer = self.encode_answer(lease.answer) if lease.answer else []
            if not answer or len(answer) + len(stop) > params.max_new_tokens or not stop:
                continue  # this answer cannot be the response: nothing to predict
            if self.reward(lease.answer, lease.answer) < 1.0:
                continue  # the reference answer itself does not score 1: p_ans says nothing about the reward
            scored.append(i)
            continuations.append(answer + list(stop))
        keep = [True] * len(leases)
        if not scored:
            return keep
        started = time.perf_counter()
        logps = score_continuations(engine, [prompt_ids[i] for i in scored], continuations, params.temperature)
        self.counters["screen_seconds"] += time.perf_counter() - started
        self.counters["screen_scored"] += len(scored)
        self.counters["screen_tokens"] += sum(len(prompt_ids[i]) + len(c) for i, c in zip(scored, continuations))
        for i, logp in zip(scored, logps):
            keep[i] = self.generates(leases[i].index, logp)
        self.counters["prompts_screened"] += keep.count(False)
        return keep

    def stats(self) -> dict[str, Any]:
        return dict(self.counters)
