"""Prompt log-probs computed by the prefill that admits a prompt (issue 25 item 1, `EmbeddedEngine.submit(...,
prompt_logprobs_from=p)`): equal to the learner's forward (fp32, 1e-5) from position 0, mid-prompt and the last
scored one, with top-k, across a prefix-cache hit (used only up to p), in chunks, with `max_new_tokens=0` and while
other sequences decode in the same step (continuous batching), without changing what those draw."""

from __future__ import annotations

import pytest
import torch

from common.builtin_model import resolve_model_path

PROMPT = [3, 4, 10, 5, 12, 7, 9, 11, 6, 13, 8, 3, 5, 14, 4, 9, 10, 7, 12]


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(resolve_model_path("builtin:micro", log=lambda *a: None))


@pytest.fixture(scope="module")
def reference(model_dir):
    """The learner's fp32 log-probs of tokens[1:] and the full next-token log-softmax at every position."""
    from transformers import AutoModelForCausalLM

    from learner.logprobs import response_logp

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def compute(tokens: list[int], temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor([tokens])
        positions = torch.arange(1, len(tokens))[None]
        mask = torch.ones((1, len(tokens) - 1), dtype=torch.bool)
        with torch.no_grad():
            logp, _ = response_logp(model, ids, torch.ones_like(ids), positions, ids[:, 1:], mask, temperature)
            full = torch.log_softmax(model(ids).logits[0].float() / temperature, dim=-1)
        return logp[0], full

    return compute


def make_engine(model_dir: str, scheme: str = "none", prefix_cache: bool = True):
    from quant_sync.update import WeightUpdate
    from rollout_workers.embedded.engine import EmbeddedEngine
    from rollout_workers.sglang_api.checkpoint import read_tensors, rollout_tensors

    engine = EmbeddedEngine(model_dir, max_batch=8, prefix_cache=prefix_cache)
    engine.stage_weights(WeightUpdate(0, rollout_tensors(read_tensors(model_dir), scheme), scheme))
    engine.swap_now()
    return engine


def run(engine, seqs) -> None:
    while any(seq.completion is None for seq in seqs):
        engine.step()


def params(max_new_tokens: int, temperature: float = 1.0):
    from rollout_workers.engine import SamplingParams

    return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=(-1,))


@pytest.mark.parametrize("start", [0, 7, len(PROMPT) - 2])
@pytest.mark.parametrize("max_new_tokens", [0, 3])
def test_prefill_scores_equal_the_learners_forward(model_dir, reference, start, max_new_tokens):
    engine = make_engine(model_dir)
    seqs = engine.submit(PROMPT, params(max_new_tokens), [5, 6], top_logprobs_num=3, prompt_logprobs_from=start)
    run(engine, seqs)
    learner, full = reference(PROMPT)
    for seq in seqs:  # n samples share one prefill and its scores
        assert len(seq.prompt_logp) == len(PROMPT) - 1 - start
        assert torch.allclose(torch.tensor(seq.prompt_logp), learner[start:], atol=1e-5, rtol=0)
        top_values, top_ids = torch.topk(full[start:-1], 3, dim=-1)
        served = torch.tensor([[value for value, _ in row] for row in seq.prompt_top_logprobs])
        assert torch.allclose(served, top_values, atol=1e-5, rtol=0)
        assert [[token for _, token in row] for row in seq.prompt_top_logprobs] == top_ids.tolist()
        assert len(seq.completion.response_ids) == max_new_tokens and seq.completion.finish == "length"
    assert engine.prefill_tokens == len(PROMPT)  # the one prefill, no forward of its own


def test_scores_at_a_temperature_and_in_chunks(model_dir, reference, monkeypatch):
    from rollout_workers.embedded import scoring

    monkeypatch.setattr(scoring, "SCORE_CHUNK_ELEMENTS", 3 * 16)  # builtin:micro's vocab is 16: 3 positions a chunk
    engine = make_engine(model_dir)
    (seq,) = engine.submit(PROMPT, params(2, 0.7), [1], prompt_logprobs_from=1, prompt_logprobs_temperature=0.7)
    run(engine, [seq])
    learner, _ = reference(PROMPT, 0.7)
    assert torch.allclose(torch.tensor(seq.prompt_logp), learner[1:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("start", [0, 5, 12, len(PROMPT) - 2])
def test_a_prefix_cache_hit_is_used_only_up_to_the_first_scored_position(model_dir, reference, start):
    engine = make_engine(model_dir)
    run(engine, engine.submit(PROMPT[:14], params(1), [1]))  # retires with PROMPT[:14] in the prefix cache
    (plain,) = engine.submit(PROMPT, params(0), [2])
    run(engine, [plain])
    full_hit = plain.cached_tokens
    assert full_hit >= 13  # the cache holds PROMPT[:14] (and now PROMPT[:-1])
    (seq,) = engine.submit(PROMPT, params(2), [3], top_logprobs_num=2, prompt_logprobs_from=start)
    run(engine, [seq])
    assert seq.cached_tokens == min(start, len(PROMPT) - 1)
    learner, _ = reference(PROMPT)
    assert torch.allclose(torch.tensor(seq.prompt_logp), learner[start:], atol=1e-5, rtol=0)
    assert len(seq.prompt_top_logprobs) == len(PROMPT) - 1 - start


def test_a_scoring_request_joins_while_others_decode(model_dir, reference):
    """Continuous batching: the scored prompt rides along a decode step; the decoding sequences draw what they draw
    without it, and the scores are the learner's."""
    draws = []
    for with_scoring in (False, True):
        engine = make_engine(model_dir, prefix_cache=False)
        running = engine.submit(PROMPT[:6], params(8), [11, 12]) + engine.submit(PROMPT[3:9], params(8), [13])
        engine.step()
        engine.step()
        scored = []
        if with_scoring:
            scored = engine.submit(PROMPT, params(0), [14], prompt_logprobs_from=4)
            scored += engine.submit(PROMPT[2:], params(3), [15], top_logprobs_num=1, prompt_logprobs_from=0)
            engine.step()  # both join this step, with the three decoding ones
            assert all(seq.completion is None for seq in running) and scored[0].completion is not None
        run(engine, running + scored)
        draws.append([(seq.completion.response_ids, seq.completion.behav_logp) for seq in running])
        if with_scoring:
            learner, _ = reference(PROMPT)
            assert torch.allclose(torch.tensor(scored[0].prompt_logp), learner[4:], atol=1e-5, rtol=0)
            learner, _ = reference(PROMPT[2:])
            assert torch.allclose(torch.tensor(scored[1].prompt_logp), learner, atol=1e-5, rtol=0)
            assert len(scored[1].completion.response_ids) == 3
    for (tokens, logps), (tokens_again, logps_again) in zip(*draws):
        assert tokens == tokens_again and logps == pytest.approx(logps_again, abs=1e-5)


def test_int8_prefill_scores_agree_with_the_prefill_that_samples(model_dir):
    """INT8: scoring prompt + sampled token from the last prompt position gives that token's behavior log-prob."""
    engine = make_engine(model_dir, "int8")
    (out,) = engine.submit(PROMPT, params(1, 0.7), [21])
    run(engine, [out])
    token = out.completion.response_ids
    (seq,) = engine.submit(PROMPT + token, params(0, 0.7), [0], prompt_logprobs_from=len(PROMPT) - 1,
                           prompt_logprobs_temperature=0.7)  # fmt: skip
    run(engine, [seq])
    assert seq.prompt_logp == pytest.approx(out.completion.behav_logp, abs=1e-5)


def test_bad_scoring_arguments_are_refused(model_dir):
    engine = make_engine(model_dir)
    with pytest.raises(ValueError, match="prompt_logprobs_from"):
        engine.submit(PROMPT, params(1), [0], prompt_logprobs_from=len(PROMPT))
    with pytest.raises(ValueError, match="prompt_logprobs_temperature"):
        engine.submit(PROMPT, params(1), [0], prompt_logprobs_from=0, prompt_logprobs_temperature=0.0)


def test_served_prompt_logprobs_with_and_without_a_prefix_cache_hit(model_dir, reference):
    """`asyncrl serve` (subprocess, HTTP): `logprob_start_len` 0, mid-prompt and -1, cold and after the prompt's
    K/V was cached, while other requests decode; every score is the learner's (fp32, 1e-5)."""
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    import requests

    command = [sys.executable, "-m", "asyncrl.cli", "serve", model_dir, "--port", "0", "--quant", "none"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "ready on http://" in line, proc.stderr.read()[-3000:]
        url = line.split("ready on ", 1)[1].split()[0]

        def generate(start: int, max_new_tokens: int, prompt: list[int] = PROMPT) -> dict:
            body = {"input_ids": prompt, "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": 2,
                    "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}  # fmt: skip
            out = requests.post(f"{url}/generate", json=body, timeout=60)
            assert out.status_code == 200, out.text
            return out.json()

        learner, _ = reference(PROMPT)
        for attempt in ("cold", "cached"):
            with ThreadPoolExecutor(4) as pool:  # decoding requests alongside the scoring ones
                busy = [pool.submit(generate, -1, 20, PROMPT[:5] + [k]) for k in (3, 4)]
                answers = {start: pool.submit(generate, start, new) for start, new in ((0, 0), (6, 3), (-1, 2))}
                answers = {start: future.result() for start, future in answers.items()}
                assert all(len(future.result()["output_ids"]) == 20 for future in busy)
            for start, out in answers.items():
                meta = out["meta_info"]
                first = start if start >= 0 else len(PROMPT) - 1
                entries = meta["input_token_logprobs"]
                assert [entry[1] for entry in entries] == PROMPT[first:] and entries[0][0] is None
                served = torch.tensor([entry[0] for entry in entries[1:]])
                assert torch.allclose(served, learner[first:], atol=1e-5, rtol=0)
                assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == len(entries)
                if attempt == "cached":  # the prompt's K/V is in the prefix cache: used up to the scored position
                    assert meta["cached_tokens"] == min(first, len(PROMPT) - 1)
                else:
                    assert meta["cached_tokens"] == 0 or start != 0
    finally:
        proc.terminate()
        proc.wait(timeout=10)
