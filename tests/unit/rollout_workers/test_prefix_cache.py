"""The embedded engine's prefix cache: a hit prefills only the rest of a prompt and gives the tokens and log-probs of
a cold prefill; hits are counted; entries are evicted least recently used within their budget and dropped on a
weight swap; mixed hits and misses in one continuous batch still equal decoding alone."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch
from test_engine import engine_for, make_model, perturbed, stage_at_call
from test_multiturn import close, make_worker

from common.wire import PromptLease
from quant_sync.export import export_rollout_tensors
from quant_sync.update import WeightUpdate
from rollout_workers.embedded.engine import EmbeddedEngine, Sequence
from rollout_workers.embedded.prefix_cache import BLOCK, PrefixCache
from rollout_workers.engine import SamplingParams

LONG = list(range(2, 22))  # 20 tokens: two full blocks and a half
NO_STOP = (-5,)


def run(engine: EmbeddedEngine, prompt: list[int], params: SamplingParams, key: int = 7, n: int = 1) -> list[Sequence]:
    seqs = engine.submit(prompt, params, [key + i for i in range(n)])
    while engine.busy:
        engine.step()
    return seqs


def assert_same(hit: Sequence, cold: Sequence, atol: float = 1e-5) -> None:
    assert hit.response == cold.response
    assert torch.allclose(torch.tensor(hit.logp), torch.tensor(cold.logp), atol=atol, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
@pytest.mark.parametrize("scheme", ["none", "int8"])
def test_a_hit_prefills_only_the_rest_and_equals_a_cold_prefill(tmp_path, arch, scheme):
    model = make_model(tmp_path, arch)
    warm, cold = engine_for(model, tmp_path, scheme), engine_for(model, tmp_path, scheme, prefix_cache=False)
    for temperature in (1.0, 1e-4):  # sampled (log-probs compared) and greedy (tokens compared)
        params = SamplingParams(max_new_tokens=10, temperature=temperature, stop_token_ids=NO_STOP)
        (first,) = run(warm, LONG, params)
        assert first.cached_tokens == (0 if temperature == 1.0 else len(LONG) - 1)  # the second run: a repeat
        turn = first.tokens + [30, 31, 32]  # the next turn: the context so far and an observation
        before = warm.stats()
        (hit,) = run(warm, turn, params, key=8)
        (reference,) = run(cold, turn, params, key=8)
        assert hit.cached_tokens == len(first.tokens) - 1  # all but the last sampled token, which was never fed
        after = warm.stats()
        assert after["prefix_cached_tokens"] - before["prefix_cached_tokens"] == hit.cached_tokens
        assert after["prefill_tokens"] - before["prefill_tokens"] == len(turn) - hit.cached_tokens == 4
        assert after["prefix_hits"] == before["prefix_hits"] + 1
        assert_same(hit, reference)
        (repeat,) = run(warm, turn, params, key=8)  # a repeated prompt hits its own earlier run
        assert repeat.cached_tokens == len(turn) - 1
        assert_same(repeat, reference)
    assert cold.stats()["prefix_cached_tokens"] == 0


def test_samples_of_a_hit_share_its_copy_and_differ(tmp_path):
    model = make_model(tmp_path, "qwen2")
    warm, cold = engine_for(model, tmp_path), engine_for(model, tmp_path, prefix_cache=False)
    params = SamplingParams(max_new_tokens=8, stop_token_ids=NO_STOP)
    (first,) = run(warm, LONG, params)
    prompt = LONG + [(first.response[0] + 1) % 97, 41]  # diverges from the entry right after LONG
    hits, references = run(warm, prompt, params, key=3, n=4), run(cold, prompt, params, key=3, n=4)
    assert [seq.cached_tokens for seq in hits] == [len(LONG)] * 4
    assert warm.stats()["prefix_hits"] == 1  # one copy source for the group's shared prefill
    assert len({tuple(seq.response) for seq in hits}) > 1
    for hit, reference in zip(hits, references, strict=True):
        assert_same(hit, reference)


def test_continuous_batching_with_mixed_hits_and_misses_equals_decoding_alone(tmp_path):
    """Two slots, hits and misses of different lengths joining mid-flight, one of them with two samples."""
    model = make_model(tmp_path, "qwen3")
    warm = engine_for(model, tmp_path, max_batch=3)
    cold = engine_for(model, tmp_path, prefix_cache=False)
    seed_params = SamplingParams(max_new_tokens=6, stop_token_ids=NO_STOP)
    (seeded,) = run(warm, LONG, seed_params)
    other = list(range(50, 75))
    requests = [  # (prompt, new tokens, samples, expect a hit)
        (seeded.tokens + [33], 9, 1, True),
        (other, 4, 1, False),
        (LONG[:17] + [60, 61], 7, 2, True),  # diverges from the cached entry inside its third block
        ([5, 6, 7], 5, 1, False),
        (other + [9, 9], 6, 1, True),  # joins after `other` retired (three slots): hits its K/V
    ]
    submitted = []
    for index, (prompt, length, n, _) in enumerate(requests):
        params = SamplingParams(max_new_tokens=length, temperature=0.7, stop_token_ids=NO_STOP)
        submitted.append((prompt, params, warm.submit(prompt, params, [100 + 10 * index + i for i in range(n)])))
    steps = 0
    while warm.busy:
        warm.step()
        steps += 1
    assert steps < sum(length * n for _, length, n, _ in requests)  # requests really overlapped
    for (prompt, params, seqs), (_, _, _, expect_hit) in zip(submitted, requests, strict=True):
        for seq in seqs:
            assert (seq.cached_tokens > 0) == expect_hit, (prompt, seq.cached_tokens)
            (alone,) = run(cold, prompt, params, key=seq.key)
            assert seq.completion is not None and len(seq.response) == params.max_new_tokens
            assert_same(seq, alone)
    assert submitted[2][2][0].cached_tokens == 17


def test_prefix_cache_matches_by_block_and_extends_into_the_next_one():
    cache = PrefixCache(budget_tokens=1000)
    kv = torch.arange(40, dtype=torch.float32).view(1, 1, 40, 1).expand(2, 3, 40, 4)
    tokens = list(range(100, 130))  # 30 tokens
    assert cache.retain(tokens, kv, kv * 2)
    entry, length = cache.match(tokens[:20] + [0, 1])
    assert entry is not None and length == 20  # two blocks hashed, four more compared
    assert torch.equal(entry.keys, kv[:, :, :30]) and torch.equal(entry.values, 2 * kv[:, :, :30])
    assert cache.match(tokens)[1] == 29  # never the last token: its logits are needed
    assert cache.match(tokens + [5])[1] == 30
    assert cache.match(tokens[: BLOCK - 1] + [0] * 20) == (None, 0)  # less than a block: not worth a copy
    assert cache.match([7] + tokens) == (None, 0)
    assert not cache.retain(tokens[: BLOCK - 1], kv, kv)  # too short to be found
    assert not cache.retain(tokens[:12], kv, kv)  # covered by the held entry
    assert cache.retain(tokens + [1, 2, 3], kv, kv)  # covers the held entry, which goes
    assert len(cache) == 1 and cache.tokens == 33


def test_prefix_cache_evicts_the_least_recently_used_within_its_budget():
    cache = PrefixCache(budget_tokens=40)
    kv = torch.zeros(1, 1, 16, 1)
    a, b, c = ([base + i for i in range(16)] for base in (100, 200, 300))
    assert cache.retain(a, kv, kv) and cache.retain(b, kv, kv)
    assert cache.match(a + [0])[1] == 16  # a is used again: b is now the least recently used
    assert cache.retain(c, kv, kv)
    assert cache.tokens == 32 and cache.evictions == 1 and len(cache) == 2
    assert cache.match(b + [0]) == (None, 0)
    assert cache.match(a + [0])[1] == 16 and cache.match(c + [0])[1] == 16
    assert not cache.retain(list(range(41)), torch.zeros(1, 1, 41, 1), torch.zeros(1, 1, 41, 1))  # over the budget
    with pytest.raises(ValueError, match="budget"):
        PrefixCache(budget_tokens=BLOCK - 1)


def test_an_engine_whose_prefix_cache_is_full_evicts_and_keeps_admitting(tmp_path):
    model = make_model(tmp_path, "llama")
    warm, cold = engine_for(model, tmp_path, max_batch=2), engine_for(model, tmp_path, prefix_cache=False)
    warm.prefix_cache = PrefixCache(budget_tokens=60)  # two retired sequences at most
    params = SamplingParams(max_new_tokens=6, stop_token_ids=NO_STOP)
    prompts = [[base + i for i in range(20)] for base in (2, 25, 50, 75)]
    firsts = [seq for prompt in prompts for seq in run(warm, prompt, params, key=1)]
    assert warm.prefix_cache.tokens <= 60 and warm.prefix_cache.evictions == 2 and len(warm.prefix_cache) == 2
    order = [firsts[2], firsts[3], firsts[0], firsts[1]]  # four at once into two slots
    seqs = [warm.submit(first.tokens + [5], params, [2])[0] for first in order]
    while warm.busy:
        warm.step()
    assert [seq.cached_tokens > 0 for seq in seqs] == [True, True, False, False]  # the first two were evicted
    for first, seq in zip(order, seqs, strict=True):
        assert_same(seq, run(cold, first.tokens + [5], params, key=2)[0])


@pytest.mark.parametrize("swap_mode", ["in_place", "retract"])
def test_a_weight_swap_drops_the_entries(tmp_path, swap_mode):
    model = make_model(tmp_path, "qwen2")
    warm = engine_for(model, tmp_path, swap_mode=swap_mode)
    params = SamplingParams(max_new_tokens=6, stop_token_ids=NO_STOP)
    (first,) = run(warm, LONG, params)
    assert len(warm.prefix_cache) == 1
    new = WeightUpdate(1, export_rollout_tensors(perturbed(model), "none"), "none")
    warm.stage_weights(new)
    assert warm.swap_now() and len(warm.prefix_cache) == 0
    cold = EmbeddedEngine(tmp_path, prefix_cache=False)
    cold.stage_weights(new)
    (after,) = run(warm, first.tokens + [9], params, key=4)
    assert after.cached_tokens == 0  # the entry of version 0 is gone: a cold prefill with version 1
    assert_same(after, run(cold, first.tokens + [9], params, key=4)[0])
    # a sequence whose K/V spans a swap: kept only where retract recomputed it with the new weights
    warm.flush_prefix_cache()
    stage_at_call(warm, 3, WeightUpdate(2, export_rollout_tensors(model.state_dict(), "none"), "none"))
    (spanning,) = run(warm, LONG + [3], SamplingParams(max_new_tokens=8, stop_token_ids=NO_STOP))
    assert set(spanning.versions) == {1, 2}
    assert len(warm.prefix_cache) == (1 if swap_mode == "retract" else 0)


def test_flush_prefix_cache_and_disabled_cache_keep_nothing(tmp_path):
    model = make_model(tmp_path, "llama")
    warm, cold = engine_for(model, tmp_path), engine_for(model, tmp_path, prefix_cache=False)
    params = SamplingParams(max_new_tokens=4, stop_token_ids=NO_STOP)
    (first,) = run(warm, LONG, params)
    run(cold, LONG, params)
    assert len(warm.prefix_cache) == 1 and len(cold.prefix_cache) == 0
    warm.flush_prefix_cache()
    assert len(warm.prefix_cache) == 0 and run(warm, first.tokens + [3], params)[0].cached_tokens == 0


TALK_ENV = textwrap.dedent(
    """
    from common.envs import StepResult


    class TalkEnv:
        '''Three turns, each ended by "=", answered with the same observation.'''

        stop_strings = ("=",)

        def reset(self, problem):
            self.turn = 0
            return "Sum: 12+34+56+78="

        def step(self, model_text):
            self.turn += 1
            return StepResult(None if self.turn == 3 else " +7=", 1.0, self.turn == 3, {})
    """
)


def test_a_multi_turn_episode_s_next_turns_hit_the_cache(tmp_path):
    """The continuous episode path: each next turn's context (the previous one, its turn, an observation) hits the
    K/V of the previous turn, so it prefills only the observation and the turn's last token; the trajectories are
    those of a worker without the cache."""
    (tmp_path / "talk_env.py").write_text(TALK_ENV)
    env = f"env.fn={tmp_path / 'talk_env.py'}:TalkEnv"
    out = {}
    for enabled in (True, False):
        worker = make_worker(tmp_path, env, "env.timeout_s=30", f"rollout.prefix_cache={enabled}")
        try:
            assert worker.episodes is not None and worker.episodes.continuous
            groups = worker.rollout([PromptLease(f"g{i}", i, "unused", "", 1e12) for i in range(2)])
            out[enabled] = ([t for _, trajectories in groups for t in trajectories], worker.engine.stats())
        finally:
            close(worker)
    (hit_trajs, hit_stats), (cold_trajs, cold_stats) = out[True], out[False]
    for hit, cold in zip(hit_trajs, cold_trajs, strict=True):
        assert hit.response_ids.tolist() == cold.response_ids.tolist()
        assert np.allclose(hit.behav_logp, cold.behav_logp, atol=1e-5)
    prompt_len = len(hit_trajs[0].prompt_ids)
    observation = len(make_tokenizer_ids(" +7="))
    turns = [int(np.sum(np.diff(np.concatenate(([0], t.loss_mask))) == 1)) for t in hit_trajs]  # runs of model tokens
    assert all(n == 3 for n in turns)
    # cold: every turn prefills its whole context; with the cache, only the first turn does
    assert cold_stats["prefix_cached_tokens"] == 0
    assert hit_stats["prefill_tokens"] + hit_stats["prefix_cached_tokens"] == cold_stats["prefill_tokens"]
    # the four episodes start from the same prompt: one shared prefill; each later turn prefills at most the
    # previous turn's last token and the observation
    assert hit_stats["prefill_tokens"] <= prompt_len + 2 * len(hit_trajs) * (observation + 1)
    assert cold_stats["prefill_tokens"] > 2 * hit_stats["prefill_tokens"]
    assert hit_stats["prefix_hits"] > 0


def make_tokenizer_ids(text: str) -> list[int]:
    from transformers import AutoTokenizer

    from common.builtin_model import resolve_model_path
    from common.config import load_config

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(load_config(None, []).model.path)))
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_asyncrl_serve_counts_cached_tokens_and_a_hit_answers_as_the_cold_request(tmp_path):
    from test_sglang_api import PROMPT, start_server

    from common.builtin_model import resolve_model_path

    proc, client = start_server(str(resolve_model_path("builtin:micro", log=lambda *a: None)), "--quant", "int8")
    try:
        body = {"input_ids": PROMPT * 4, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, "sampling_seed": 3}}  # fmt: skip
        cold, warm = client.generate(body), client.generate(body)
        assert cold["meta_info"]["cached_tokens"] == 0
        assert warm["meta_info"]["cached_tokens"] == len(PROMPT) * 4 - 1  # all but the last prompt token
        assert warm["output_ids"] == cold["output_ids"]
        served = [[entry[0] for entry in out["meta_info"]["output_token_logprobs"]] for out in (cold, warm)]
        assert served[1] == pytest.approx(served[0], abs=1e-5)
        turn = {**body, "input_ids": PROMPT * 4 + warm["output_ids"] + PROMPT}  # a next turn: all but 6 cached
        assert client.generate(turn)["meta_info"]["cached_tokens"] == len(PROMPT) * 4 + 6 - 1
    finally:
        proc.terminate()
        proc.wait(timeout=10)
