"""SGLang's min-p sampling in the embedded engine (`asyncrl serve`'s `min_p`): the filter is SGLang's rule written
independently in probability space, a sampled token is never less likely than min_p times the most likely one
(against the Hugging Face model's own logits), its behaviour log-prob stays the temperature distribution's (as with
top-p), and a bad value is refused by name."""

from __future__ import annotations

import pytest
import torch

from common.builtin_model import resolve_model_path
from quant_sync.update import WeightUpdate
from rollout_workers.embedded.engine import EmbeddedEngine
from rollout_workers.embedded.sampling import filter_logits
from rollout_workers.engine import SamplingParams
from rollout_workers.sglang_api.checkpoint import read_tensors, rollout_tensors

PROMPT = [3, 4, 10, 5, 12, 7, 9, 11]


def sglang_kept(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Which tokens SGLang's sampler may draw with min_p (its flashinfer path, `sampler.py`: top-k, renormalize,
    top-p, renormalize, min-p), row by row."""
    kept = torch.zeros_like(probs, dtype=torch.bool)
    for row, p in enumerate(probs.tolist()):
        order = sorted(range(len(p)), key=lambda v: -p[v])[: top_k or None]  # top_k_renorm_prob
        total, mass = sum(p[v] for v in order), 0.0
        for v in order:  # top_p_renorm_prob, on the renormalized top-k
            if mass >= top_p:  # the token that crosses top_p stays
                break
            mass += p[v] / total
            kept[row, v] = p[v] >= min_p * p[order[0]]  # min_p_sampling_from_probs: a ratio, renormalizing aside
    return kept


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (5, 1.0), (0, 0.8), (4, 0.9)])
@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
def test_the_filter_keeps_what_sglang_s_sampler_may_draw(top_k: int, top_p: float, min_p: float) -> None:
    logp = torch.log_softmax(2.0 * torch.randn(6, 17, generator=torch.Generator().manual_seed(1)), -1)
    kept = filter_logits(logp, top_k, top_p, min_p) > float("-inf")
    assert torch.equal(kept, sglang_kept(logp.exp(), top_k, top_p, min_p))
    assert bool(kept.any(-1).all())  # the most likely token always stays


def test_sampled_tokens_clear_min_p_and_keep_the_full_distribution_s_log_probs() -> None:
    from transformers import AutoModelForCausalLM

    model_dir = str(resolve_model_path("builtin:micro", log=lambda *a: None))
    engine = EmbeddedEngine(model_dir, max_batch=8)
    engine.stage_weights(WeightUpdate(0, rollout_tensors(read_tensors(model_dir), "none"), "none"))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    temperature, min_p = 0.8, 0.5  # builtin:micro is a random model: its 16 tokens are near one another
    params = SamplingParams(max_new_tokens=24, temperature=temperature, min_p=min_p, stop_token_ids=(-1,), seed=2)
    free = SamplingParams(max_new_tokens=24, temperature=temperature, stop_token_ids=(-1,), seed=2)
    below = 0  # tokens the unfiltered runs drew under the floor: the filter had something to remove
    for run, sampling in (("min_p", params), ("free", free)):
        for completion in engine.generate([PROMPT] * 4, sampling):
            with torch.no_grad():
                logits = hf(torch.tensor([PROMPT + completion.response_ids])).logits[0, len(PROMPT) - 1 : -1]
            logp = torch.log_softmax(logits / temperature, -1)
            drawn = logp.gather(1, torch.tensor(completion.response_ids)[:, None]).squeeze(1)
            ratio = (drawn - logp.max(-1).values).exp()  # p(token) / p(most likely)
            assert completion.behav_logp == pytest.approx(drawn.tolist(), abs=1e-5)
            if run == "min_p":
                assert bool((ratio >= min_p - 1e-5).all()), ratio
            else:
                below += int((ratio < min_p).sum())
    assert below > 0


def test_a_min_p_outside_0_1_is_refused_by_name() -> None:
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\]"):
            SamplingParams(max_new_tokens=1, min_p=bad)


def test_a_top_p_outside_0_1_or_a_nan_temperature_is_refused_by_name() -> None:
    """top_p 0 masked every token (the engine returned token 0 at every step with its unfiltered log-prob); a NaN
    temperature returned the last token id with NaN log-probs."""
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match=f"top_p must be in \\(0, 1\\], got {bad}"):
            SamplingParams(max_new_tokens=1, top_p=bad)
    with pytest.raises(ValueError, match="temperature must be a finite number, got nan"):
        SamplingParams(max_new_tokens=1, temperature=float("nan"))
    assert SamplingParams(max_new_tokens=1, top_p=1.0).top_p == 1.0
