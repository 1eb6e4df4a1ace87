"""Training batches: groups of trajectories -> padded tensors, token-budget micro-batches, response log-probs.

A batch holds B responses (all groups of one train step, group-major) right-padded to S positions of prompt +
response, and their T response tokens. `mask` is 1 on the tokens the model sampled: padding is 0, and so are the
observation tokens of a multi-turn episode (the trajectory's `loss_mask`), so every loss, advantage normalisation
by token and mismatch metric that weighs tokens by `mask` ignores them. Rows are independent under the causal
mask, so any subset of rows, with the trailing padding trimmed, gives the same per-row log-probs: that is what
micro-batching and the split over learner ranks rely on.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from common.wire import Trajectory
from learner.logprobs import response_logp


@dataclass(slots=True)
class Batch:
    input_ids: torch.Tensor  # (B, S) prompt + response, right-padded
    attention_mask: torch.Tensor  # (B, S)
    response_pos: torch.Tensor  # (B, T) position of each response token in input_ids (0 where padded)
    response_ids: torch.Tensor  # (B, T)
    mask: torch.Tensor  # (B, T) float, 1 on model-sampled response tokens (0 on padding and observation tokens)
    behav_logp: torch.Tensor  # (B, T)
    versions: torch.Tensor  # (B, T) int
    rewards: torch.Tensor  # (B,)
    correct: torch.Tensor  # (B,)
    group_index: torch.Tensor  # (B,) 0..n_groups-1
    truncated: torch.Tensor  # (B,) bool

    def select(self, lo: int, hi: int) -> Batch:
        """Rows lo..hi-1, trimmed to their longest sequence (group ids keep the whole batch's numbering)."""
        seq_len = max(int(self.attention_mask[lo:hi].sum(-1).max()), 1) if hi > lo else 1
        values = {f.name: getattr(self, f.name)[lo:hi] for f in fields(self)}
        values["input_ids"] = values["input_ids"][:, :seq_len]
        values["attention_mask"] = values["attention_mask"][:, :seq_len]
        return Batch(**values)

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])


def collate(groups: list[list[Trajectory]], pad_id: int) -> Batch:
    trajs = [t for group in groups for t in group]
    group_index = torch.tensor([g for g, group in enumerate(groups) for _ in group])
    seq_len = max(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    resp_len = max(len(t.response_ids) for t in trajs)
    n = len(trajs)
    input_ids = torch.full((n, seq_len), pad_id, dtype=torch.long)
    attention = torch.zeros((n, seq_len), dtype=torch.long)
    response_pos = torch.zeros((n, resp_len), dtype=torch.long)
    response_ids = torch.zeros((n, resp_len), dtype=torch.long)
    mask = torch.zeros((n, resp_len))
    behav = torch.zeros((n, resp_len))
    versions = torch.zeros((n, resp_len), dtype=torch.long)
    for i, t in enumerate(trajs):
        p, r = len(t.prompt_ids), len(t.response_ids)
        input_ids[i, :p] = torch.from_numpy(t.prompt_ids.astype("int64"))
        input_ids[i, p : p + r] = torch.from_numpy(t.response_ids.astype("int64"))
        attention[i, : p + r] = 1
        response_pos[i, :r] = torch.arange(p, p + r)
        response_ids[i, :r] = input_ids[i, p : p + r]
        if t.loss_mask is None:
            mask[i, :r] = 1.0
        else:  # a multi-turn episode: observation tokens are context only (ALGORITHMS.md "Loss mask")
            mask[i, :r] = torch.from_numpy(t.loss_mask.astype("float32"))
        behav[i, :r] = torch.from_numpy(t.behav_logp.copy())
        versions[i, :r] = torch.from_numpy(t.versions.astype("int64"))
    return Batch(
        input_ids=input_ids,
        attention_mask=attention,
        response_pos=response_pos,
        response_ids=response_ids,
        mask=mask,
        behav_logp=behav,
        versions=versions,
        rewards=torch.tensor([t.reward for t in trajs], dtype=torch.float32),
        correct=torch.tensor([float(t.correct) for t in trajs]),
        group_index=group_index,
        truncated=torch.tensor([t.finish == "length" for t in trajs]),
    )


def overlong_shaping(lengths: torch.Tensor, truncated: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO overlong reward shaping (ALGORITHMS.md): a penalty per response, 0 when disabled (cache_len = 0)."""
    if cache_len <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    soft = -(lengths.float() - (max_len - cache_len)) / cache_len
    penalty = torch.where(lengths.float() > max_len - cache_len, soft, torch.zeros_like(soft))
    return torch.where(truncated, torch.full_like(penalty, -1.0), penalty)


def micro_batches(batch: Batch, lo: int, hi: int, token_budget: int) -> list[tuple[int, int]]:
    """Split rows lo..hi-1 into consecutive ranges whose padded size (rows x longest sequence) fits the budget.

    A single row longer than the budget still forms its own micro-batch (it cannot be split).
    """
    lengths = batch.attention_mask[lo:hi].sum(-1).tolist()
    ranges: list[tuple[int, int]] = []
    start, longest = lo, 0
    for offset, length in enumerate(lengths):
        row = lo + offset
        grown = max(longest, int(length))
        if row > start and (row - start + 1) * grown > token_budget:
            ranges.append((start, row))
            start, grown = row, int(length)
        longest = grown
    if hi > start:
        ranges.append((start, hi))
    return ranges


def rank_rows(lo: int, hi: int, rank: int, world: int) -> tuple[int, int]:
    """This rank's contiguous share of rows lo..hi-1 (sizes differ by at most one)."""
    n = hi - lo
    return lo + n * rank // world, lo + n * (rank + 1) // world


def token_logp(model: torch.nn.Module, batch: Batch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (B, T) of the response tokens under `model` (at the rollout temperature), with grad, and entropies
    (B, T); 0 on padding. The LM head runs at the response tokens only, in chunks (`learner.logprobs`)."""
    return response_logp(
        model, batch.input_ids, batch.attention_mask, batch.response_pos, batch.response_ids, batch.mask, temperature
    )
