"""SGLang's sampling penalties and logit bias in the embedded engine (rollout_workers/embedded/penalties.py): every
behaviour log-prob equals the formula applied to the Hugging Face model's logits, computed here independently; the
neutral values change nothing, bit for bit; the RL config has no penalty keys."""

from __future__ import annotations

import pytest
import torch

from common.builtin_model import resolve_model_path
from common.config import ConfigError, load_config
from quant_sync.update import WeightUpdate
from rollout_workers.embedded.engine import EmbeddedEngine
from rollout_workers.embedded.penalties import apply_penalties
from rollout_workers.engine import SamplingParams
from rollout_workers.sglang_api.checkpoint import read_tensors, rollout_tensors

PROMPT = [3, 4, 10, 5, 12, 7, 9, 11]
NO_STOP = (-1,)


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(resolve_model_path("builtin:micro", log=lambda *a: None))


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def fp32_engine(model_dir: str) -> EmbeddedEngine:
    engine = EmbeddedEngine(model_dir, max_batch=8)
    engine.stage_weights(WeightUpdate(0, rollout_tensors(read_tensors(model_dir), "none"), "none"))
    return engine


def reference_logp(hf_model, prompt: list[int], response: list[int], params: SamplingParams) -> list[float]:
    """log_softmax(z / T)[token] per response token, z the model's logits with SGLang's penalties written out one
    position at a time (counts over the response before the token; the prompt is not counted)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].to(torch.float64)
    out = []
    for t, token in enumerate(response):
        z = logits[t].clone()
        for v in range(z.shape[0]):
            count = response[:t].count(v)
            z[v] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
            if count > 0:
                z[v] = z[v] * params.repetition_penalty if z[v] < 0 else z[v] / params.repetition_penalty
        for v, bias in params.logit_bias.items():
            z[v] += bias
        out.append(float(torch.log_softmax(z / params.temperature, -1)[token]))
    return out


@pytest.mark.parametrize(
    "penalties",
    [
        {"frequency_penalty": 0.9},
        {"presence_penalty": -0.6},
        {"repetition_penalty": 1.7},
        {"repetition_penalty": 0.6, "frequency_penalty": 0.4, "presence_penalty": 0.5, "logit_bias": {3: 1.5, 7: -2.0}},
    ],
)
def test_behaviour_logprobs_are_those_of_the_penalised_distribution(model_dir, hf_model, penalties):
    """Each sampled token's behaviour log-prob is the penalised distribution's (the one it was drawn from), for
    several samples decoded together (each with its own counts), to fp32 rounding."""
    params = SamplingParams(max_new_tokens=20, temperature=0.8, stop_token_ids=NO_STOP, seed=5, **penalties)
    completions = fp32_engine(model_dir).generate([PROMPT] * 3, params)
    assert len({tuple(c.response_ids) for c in completions}) > 1  # different responses: different counts per row
    for completion in completions:
        assert len(set(completion.response_ids)) < len(completion.response_ids)  # repeats: the penalties act
        expected = reference_logp(hf_model, PROMPT, completion.response_ids, params)
        assert completion.behav_logp == pytest.approx(expected, abs=1e-5)


def test_frequency_penalty_lowers_repeated_tokens_and_neutral_values_change_nothing(model_dir):
    plain = SamplingParams(max_new_tokens=24, stop_token_ids=NO_STOP, seed=3)
    penalised = SamplingParams(max_new_tokens=24, stop_token_ids=NO_STOP, seed=3, frequency_penalty=2.0)
    (free,) = fp32_engine(model_dir).generate([PROMPT], plain)
    (held,) = fp32_engine(model_dir).generate([PROMPT], penalised)
    most = max(set(free.response_ids), key=free.response_ids.count)
    assert held.response_ids.count(most) < free.response_ids.count(most), (free.response_ids, held.response_ids)
    # neutral values, also through the computing path (a zero bias): the same tokens and log-probs, bit for bit
    for neutral in ({"repetition_penalty": 1.0}, {"repetition_penalty": 1.0, "logit_bias": {0: 0.0}}):
        params = SamplingParams(max_new_tokens=24, stop_token_ids=NO_STOP, seed=3, **neutral)
        (same,) = fp32_engine(model_dir).generate([PROMPT], params)
        assert same.response_ids == free.response_ids and same.behav_logp == free.behav_logp
    logits = torch.randn(2, 16)
    assert apply_penalties(logits, SamplingParams(max_new_tokens=1, repetition_penalty=1.0), []) is logits


def test_a_large_negative_logit_bias_on_the_greedy_token_changes_it(model_dir, hf_model):
    greedy = SamplingParams(max_new_tokens=1, top_k=1, stop_token_ids=NO_STOP)
    (first,) = fp32_engine(model_dir).generate([PROMPT], greedy)
    banned = first.response_ids[0]
    biased = SamplingParams(max_new_tokens=1, top_k=1, stop_token_ids=NO_STOP, logit_bias={banned: -100.0})
    (other,) = fp32_engine(model_dir).generate([PROMPT], biased)
    with torch.no_grad():
        logits = hf_model(torch.tensor([PROMPT])).logits[0, -1]
    runner_up = int(torch.topk(logits, 2).indices[1])
    assert other.response_ids == [runner_up] != first.response_ids
    assert other.behav_logp == pytest.approx(reference_logp(hf_model, PROMPT, [runner_up], biased), abs=1e-5)


def test_bad_penalty_values_are_refused_by_name(model_dir):
    for key, value in (("frequency_penalty", 2.5), ("presence_penalty", -3.0), ("repetition_penalty", 0.0)):
        with pytest.raises(ValueError, match=key):
            SamplingParams(max_new_tokens=1, **{key: value})
    with pytest.raises(ValueError, match="logit_bias"):
        fp32_engine(model_dir).generate([PROMPT], SamplingParams(max_new_tokens=1, logit_bias={99: 1.0}))


def test_the_rl_config_has_no_penalty_keys():
    """Rollouts for training never use penalties (the learner scores the unpenalised model): the keys do not exist."""
    for key in ("frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias"):
        with pytest.raises(ConfigError, match=f"rollout.{key}"):
            load_config(None, [f"rollout.{key}=1"])
