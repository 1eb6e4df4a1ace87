"""Sampling helpers of the embedded engine: top-k / top-p / min-p filtering and counter-based uniforms.

Each sequence draws one uniform per step from a counter-based hash (splitmix64) of its key and the step, so that a
sequence's samples do not depend on what else is in the batch (`engine.EmbeddedEngine._sample`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from rollout_workers.embedded.sequence import Sequence

_MASK64 = (1 << 64) - 1


def filter_logits(logp: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Mask (to -inf) the tokens outside top-k, the top-p nucleus and, with `min_p` > 0, those less likely than
    `min_p` times the row's most likely token (SGLang's order and rule, `sampler.py`), in each row of log-probs
    (B, V)."""
    if top_k > 0 and top_k < logp.shape[-1]:
        kth = torch.topk(logp, top_k, dim=-1).values[:, -1:]
        logp = logp.masked_fill(logp < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
        cumulative = sorted_logp.softmax(-1).cumsum(-1)
        drop_sorted = cumulative - sorted_logp.softmax(-1) >= top_p  # keep the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logp = logp.masked_fill(drop, float("-inf"))
    if min_p > 0.0:  # p < min_p * p_max, in log space (the most likely token survives top-k and top-p)
        floor = logp.max(dim=-1, keepdim=True).values + math.log(min_p)
        logp = logp.masked_fill(logp < floor, float("-inf"))
    return logp


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_key(base: int, index: int) -> int:
    """The sampling stream of sample `index` (>= 0) of a stream `base`: a request's n samples, an episode's turns."""
    return _splitmix64(base ^ _splitmix64(index + 1))


def _uniform(key: int, step: int) -> float:
    """A uniform in (0, 1) from (sequence key, step): 53 random bits, never 0."""
    return ((_splitmix64(key ^ _splitmix64(step)) >> 11) + 0.5) / float(1 << 53)


_SPLITMIX = tuple(np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 30, 27, 31, 11))


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """`_splitmix64` over a uint64 array (numpy's uint64 arithmetic wraps modulo 2^64 and shifts logically)."""
    golden, mul1, mul2, s30, s27, s31, _ = _SPLITMIX
    x = x + golden
    x = (x ^ (x >> s30)) * mul1
    x = (x ^ (x >> s27)) * mul2
    return x ^ (x >> s31)


def uniforms(keys: list[int], steps: list[int]) -> torch.Tensor:
    """float32 tensor of `_uniform(key, step)` per pair, the same values, in a few array ops instead of a Python
    loop (64 rows: about 100 us of a decode step)."""
    with np.errstate(over="ignore"):
        mixed = _splitmix64_array(np.array(keys, dtype=np.uint64) ^ _splitmix64_array(np.array(steps, dtype=np.uint64)))
    bits = (mixed >> _SPLITMIX[-1]).astype(np.float64)
    return torch.from_numpy((bits + 0.5) / float(1 << 53)).to(torch.float32)


def mask_early_stops(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """`logits` with the stop tokens of sequences short of their `min_new_tokens` at -inf (a copy if any)."""
    early = [(row, seq) for row, seq in enumerate(seqs) if len(seq.logp) < seq.min_new_tokens]
    if not early:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    for row, seq in early:
        stops = [token for token in seq.stop_ids if 0 <= token < vocab]
        if stops:
            logits[row, stops] = float("-inf")
    return logits


def record_top(logp: torch.Tensor, seqs: list[Sequence]) -> None:
    """Append each sequence's top-k (log-prob, token) of its row of `logp` (rows in the order of `seqs`)."""
    wanted = [(row, seq) for row, seq in enumerate(seqs) if seq.top_logprobs_num > 0]
    if not wanted:
        return
    k = min(max(seq.top_logprobs_num for _, seq in wanted), logp.shape[-1])
    values, indices = torch.topk(logp[torch.tensor([row for row, _ in wanted])], k, dim=-1)
    for (_, seq), vals, ids in zip(wanted, values.tolist(), indices.tolist()):
        seq.top_logprobs.append(list(zip(vals, ids))[: seq.top_logprobs_num])
