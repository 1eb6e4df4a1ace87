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
from learner.packing import packed_micro_batches


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
        else:  # a multi-turn episode: observation tokens are context only (docs/algorithms.md, "Loss mask")
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


AUTO_ACTIVATION_BYTES = 700 * 2**20
"""`learner.micro_batch_tokens=0`: the activation bytes a micro-batch may save for backward (estimated per token by
`activation_bytes_per_token`). SmolLM2-135M: about 510 tokens (the bench's SmolLM row, shared prompts: two groups per
micro-batch, MFU 0.63 and peak RSS 2.8 GB; one group, 280 tokens: 0.56 and 2.8 GB); the built-in tiny model: about
16,000 tokens, the whole batch in one micro-batch (each micro-batch costs a forward's and a backward's fixed overhead,
most of the step on a model that small)."""
FALLBACK_MICRO_BATCH_TOKENS = 512
"""The budget of `learner.micro_batch_tokens=0` for a model without a Llama-style config (no layer count or sizes)."""


def activation_bytes_per_token(config: object) -> int:
    """Estimated fp32 bytes a decoder saves for backward per token: per layer about 10 hidden-size tensors (norms,
    q/k/v, attention output, residuals) and 4 intermediate-size ones (gate, up, their activation and product)."""
    hidden, inter = int(config.hidden_size), int(config.intermediate_size)  # type: ignore[attr-defined]
    return 4 * int(config.num_hidden_layers) * (10 * hidden + 4 * inter)  # type: ignore[attr-defined]


def micro_batch_budget(token_budget: int, model: torch.nn.Module) -> int:
    """`learner.micro_batch_tokens` resolved: itself when > 0, else `AUTO_ACTIVATION_BYTES` over the model's
    `activation_bytes_per_token` (at least 64 tokens)."""
    if token_budget > 0:
        return token_budget
    config = getattr(model, "config", None)
    try:
        per_token = activation_bytes_per_token(config)
    except (AttributeError, TypeError):
        return FALLBACK_MICRO_BATCH_TOKENS
    return max(64, AUTO_ACTIVATION_BYTES // max(per_token, 1))


def micro_batches(
    batch: Batch, lo: int, hi: int, token_budget: int, share_prefix: bool = False
) -> list[tuple[int, int]]:
    """Split rows lo..hi-1 into consecutive ranges whose padded size (rows x longest sequence) fits the budget; with
    `share_prefix`, where sharing pays, ranges of whole groups whose packed size fits it (`learner.packing`).

    A single row longer than the budget still forms its own micro-batch (it cannot be split). A budget <= 0 (the
    unresolved `learner.micro_batch_tokens=0`) is `FALLBACK_MICRO_BATCH_TOKENS`: `micro_batch_budget` resolves it.
    """
    token_budget = token_budget if token_budget > 0 else FALLBACK_MICRO_BATCH_TOKENS
    if share_prefix:
        packed = packed_micro_batches(batch.input_ids, batch.attention_mask, batch.group_index, lo, hi, token_budget)
        if packed is not None:
            return packed
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


def token_logp(
    model: torch.nn.Module, batch: Batch, temperature: float, share_prefix: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (B, T) of the response tokens under `model` (at the rollout temperature), with grad, and entropies
    (B, T); 0 on padding. The LM head runs at the response tokens only, in chunks (`learner.logprobs`); with
    `share_prefix` (`learner.share_prefix`), each group's common prefix runs once (`learner.packing`)."""
    return response_logp(
        model, batch.input_ids, batch.attention_mask, batch.response_pos, batch.response_ids, batch.mask, temperature,
        groups=batch.group_index if share_prefix else None,
    )  # fmt: skip
