"""SGLang's sampling penalties and logit bias on a batch of logits rows (the embedded engine's `_sample`).

For a sequence with response tokens so far `y` (its prompt is not counted: SGLang's penalizers are fed output
tokens only, `penaltylib/*.py` `_cumulate_output_tokens`), `c[v]` = how often token v occurs in `y`:

    z = logits - frequency_penalty * c - presence_penalty * 1[c > 0]          additive (SGLang's overlap mode first)
    z = where(c > 0, where(z < 0, z * repetition_penalty, z / repetition_penalty), z)          scaling
    z = z + logit_bias                                                        `logit_bias` {token id: bias}, last

and the token is drawn from `softmax(z / T)` (top-k / top-p applied to it as usual). SGLang 0.5.9 applies them in
`SamplingBatchInfo.apply_logits_bias` before its sampler divides by the temperature; the stop tokens masked by
`min_new_tokens` (engine `_mask_early_stops`, an additive -inf) stay at -inf.

- **Behaviour log-probs.** A penalised token's behaviour log-prob is `log_softmax(z / T)[token]`: the
  distribution it was actually drawn from, not the model's. SGLang reports the same (its sampler takes the logits
  after `apply_logits_bias`). The learner scores the model without penalties, so an RL run with penalties would see
  them as off-policy mismatch: the rollout config has no penalty keys (the worker never sets them), and they are
  for `asyncrl serve` clients.
- **repetition_penalty.** SGLang 0.5.9 accepts it (in [0, 2]) but registers no penalizer for it, so it has no
  effect there (sgl-project/sglang#28179); the `BatchedRepetitionPenalizer` of SGLang's other sources
  (`penaltylib/repetition_penalty.py`) scales seen tokens' logits as above (output tokens only, unlike Hugging
  Face's, which counts the prompt too). We apply that formula; 1.0 is exactly no penalty. 0 is refused (it divides
  by zero).
- Rows are one `SamplingParams` (the engine groups rows by it); the counts are built per call from the sequences'
  responses (`torch.unique` over (row, token) keys), so nothing is kept between steps and a retracted or aborted
  sequence needs no care, and only the logits of tokens a response holds are touched: 64 rows x 151,936 tokens
  (Qwen's vocabulary) x 256 response tokens cost about one `log_softmax` of the batch (27 ms of CPU on one Zen 4
  core, measured under load), a (B, V) count matrix cost 13 times that.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from rollout_workers.engine import SamplingParams


class _HasResponse(Protocol):
    @property
    def response(self) -> list[int]: ...


def has_penalties(params: SamplingParams) -> bool:
    """Whether `apply_penalties` changes anything for these parameters."""
    return bool(
        params.frequency_penalty or params.presence_penalty or params.repetition_penalty != 1.0 or params.logit_bias
    )


def token_counts(responses: Sequence[Sequence[int]], vocab_size: int, device: torch.device | None = None):
    """The (row, token, count) triples of the tokens each response holds: three 1-D tensors, one entry per distinct
    (response, token) pair (sparse: a step never touches the (B, V) entries of unseen tokens)."""
    lengths = torch.tensor([len(tokens) for tokens in responses], device=device)
    rows = torch.repeat_interleave(torch.arange(len(responses), device=device), lengths)
    tokens = torch.tensor([token for response in responses for token in response], dtype=torch.long, device=device)
    keys, counts = torch.unique(rows * vocab_size + tokens, return_counts=True)
    return keys // vocab_size, keys % vocab_size, counts.to(torch.float32)


def apply_penalties(logits: torch.Tensor, params: SamplingParams, seqs: Sequence[_HasResponse]) -> torch.Tensor:
    """`logits` (B, V) of the sequences `seqs` (one row each, all drawn with `params`) with SGLang's penalties and
    logit bias applied (see the module docstring): the same tensor when `params` has none, else a new float32 one.
    Only the entries of tokens a response holds are penalised (gathered, changed, scattered back)."""
    if not has_penalties(params):
        return logits
    vocab = logits.shape[-1]
    z = logits.to(torch.float32, copy=True)
    if params.frequency_penalty or params.presence_penalty or params.repetition_penalty != 1.0:
        rows, tokens, counts = token_counts([seq.response for seq in seqs], vocab, logits.device)
        seen = z[rows, tokens]
        if params.frequency_penalty or params.presence_penalty:
            seen = seen - params.frequency_penalty * counts - params.presence_penalty
        if params.repetition_penalty != 1.0:
            rep = params.repetition_penalty
            seen = torch.where(torch.isfinite(seen), torch.where(seen < 0, seen * rep, seen / rep), seen)
        z[rows, tokens] = seen
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=logits.device)
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"logit_bias token ids must lie in [0, {vocab - 1}], got {sorted(params.logit_bias)}")
        z[:, ids] += torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=logits.device)
    return z
