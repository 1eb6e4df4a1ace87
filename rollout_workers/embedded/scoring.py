"""Prompt log-probs of the embedded engine (SGLang's input log-probs), from the prefill that admits a prompt: the
final-norm hidden states of the prompt positions asked for go through the LM head and a log-softmax, a chunk of
positions at a time (no [positions x vocab] tensor of the whole prompt, let alone of the batch, is held)."""

from __future__ import annotations

import torch

from rollout_workers.embedded.model import linear

SCORE_CHUNK_ELEMENTS = 1 << 22
"""Logits scored at once: positions per chunk = this // vocab_size (at least 1), 16 MiB of fp32."""


def score_positions(
    head: object, hidden: torch.Tensor, targets: list[int], temperature: float, top_k: int, vocab_size: int
) -> tuple[list[float], list[list[tuple[float, int]]]]:
    """Log-probs of `targets[i]` under `log_softmax(head(hidden[i]) / temperature)` (fp32), and with `top_k` > 0 the
    k most likely (log-prob, token) of each row. `hidden` (P, hidden_size): final-norm states; row i's
    distribution is the one `targets[i]` is scored by (the next token)."""
    if hidden.shape[0] != len(targets):
        raise ValueError(f"score_positions: {hidden.shape[0]} hidden rows for {len(targets)} targets")
    if temperature <= 0:
        raise ValueError(f"score_positions: temperature must be > 0, got {temperature}")
    chunk = max(1, SCORE_CHUNK_ELEMENTS // vocab_size)
    values: list[float] = []
    tops: list[list[tuple[float, int]]] = []
    target_ids = torch.tensor(targets, dtype=torch.long, device=hidden.device)
    for begin in range(0, len(targets), chunk):
        logits = linear(hidden[begin : begin + chunk], head, None).to(torch.float32)
        logp = torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)
        values += logp.gather(1, target_ids[begin : begin + chunk, None]).squeeze(1).tolist()
        if top_k > 0:
            top_values, top_ids = torch.topk(logp, min(top_k, logp.shape[-1]), dim=-1)
            tops += [list(zip(v, i)) for v, i in zip(top_values.tolist(), top_ids.tolist())]
    return values, tops
