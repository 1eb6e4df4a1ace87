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

import numpy as np
import torch

from common.wire import Trajectory
from learner.logprobs import response_logp
from learner.packing import packed_micro_batches
from learner.recompute import is_checkpointed


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

    def take(self, order: torch.Tensor) -> Batch:
        """The rows in `order` (a permutation or subset of row indices), padding kept as it is."""
        return Batch(**{f.name: getattr(self, f.name).index_select(0, order) for f in fields(self)})

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])


def collate(groups: list[list[Trajectory]], pad_id: int) -> Batch:
    """Pad the groups' trajectories (group-major) into one `Batch`: filled in numpy, row by row where a row has its
    own length, and turned into tensors once (per-row torch ops cost 5 ms of a 70 ms built-in step)."""
    trajs = [t for group in groups for t in group]
    group_index = np.fromiter((g for g, group in enumerate(groups) for _ in group), dtype=np.int64, count=len(trajs))
    prompt_lens = np.fromiter((len(t.prompt_ids) for t in trajs), dtype=np.int64, count=len(trajs))
    resp_lens = np.fromiter((len(t.response_ids) for t in trajs), dtype=np.int64, count=len(trajs))
    n, seq_len, resp_len = len(trajs), int((prompt_lens + resp_lens).max()), int(resp_lens.max())
    input_ids = np.full((n, seq_len), pad_id, dtype=np.int64)
    mask = np.zeros((n, resp_len), dtype=np.float32)
    behav = np.zeros((n, resp_len), dtype=np.float32)
    versions = np.zeros((n, resp_len), dtype=np.int64)
    for i, t in enumerate(trajs):
        p, r = prompt_lens[i], resp_lens[i]
        input_ids[i, :p] = t.prompt_ids
        input_ids[i, p : p + r] = t.response_ids
        # a multi-turn episode: observation tokens are context only (docs/algorithms.md, "Loss mask")
        mask[i, :r] = 1.0 if t.loss_mask is None else t.loss_mask
        behav[i, :r] = t.behav_logp
        versions[i, :r] = t.versions
    in_response = np.arange(resp_len)[None, :] < resp_lens[:, None]  # (B, T)
    response_pos = np.where(in_response, prompt_lens[:, None] + np.arange(resp_len)[None, :], 0)
    response_ids = np.where(in_response, np.take_along_axis(input_ids, response_pos, axis=1), 0)
    attention = (np.arange(seq_len)[None, :] < (prompt_lens + resp_lens)[:, None]).astype(np.int64)
    return Batch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention),
        response_pos=torch.from_numpy(response_pos),
        response_ids=torch.from_numpy(response_ids),
        mask=torch.from_numpy(mask),
        behav_logp=torch.from_numpy(behav),
        versions=torch.from_numpy(versions),
        rewards=torch.tensor([t.reward for t in trajs], dtype=torch.float64),  # any finite reward (`advantages`)
        correct=torch.tensor([float(t.correct) for t in trajs]),
        group_index=torch.from_numpy(group_index),
        truncated=torch.tensor([t.finish == "length" for t in trajs]),
    )


def overlong_shaping(lengths: torch.Tensor, truncated: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO overlong reward shaping (ALGORITHMS.md): a penalty per response, 0 when disabled (cache_len = 0)."""
    if cache_len <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    length = lengths.float()
    soft = -(length - (max_len - cache_len)) / cache_len
    window = (length > max_len - cache_len) & (length <= max_len)  # in [-1, 0): the spec's L_max - L_c < |y| <= L_max
    penalty = torch.where(window, soft, torch.zeros_like(soft))
    return torch.where(truncated, torch.full_like(penalty, -1.0), penalty)


AUTO_ACTIVATION_BYTES = 700 * 2**20
"""`learner.micro_batch_tokens=0`: the activation bytes a micro-batch may save for backward (estimated per token by
`activation_bytes_per_token`). SmolLM2-135M: about 510 tokens (the bench's SmolLM row, shared prompts: two groups per
micro-batch, MFU 0.63 and peak RSS 2.8 GB; one group, 280 tokens: 0.56 and 2.8 GB); the built-in tiny model: about
16,000 tokens, the whole batch in one micro-batch (each micro-batch costs a forward's and a backward's fixed overhead,
most of the step on a model that small)."""
FALLBACK_MICRO_BATCH_TOKENS = 512
"""The budget of `learner.micro_batch_tokens=0` for a model without a Llama-style config (no layer count or sizes)."""
PARAM_ACTIVATION_FACTOR = 4
"""`learner.micro_batch_tokens=0` in an update after the first (its weights packed, AdamW's state in place): the
activation bytes a micro-batch may save grow to this many times the model's parameter bytes, within
`AVAILABLE_ACTIVATION_SHARE` of the available memory. Each micro-batch streams every weight through the cores three
times (the forward's GEMM, the input gradient's, and the weight gradient written and added): on the ~100M decode
shape of `asyncrl bench e2e` (406 MB of weights) 948-token micro-batches (5 a step) took 15.27-15.71 s a step in the
loop and 2,200-token ones (2 a step) 14.73-15.00 (Zen 4, 2026-12-05). The first update keeps `AUTO_ACTIVATION_BYTES`:
its peak is what `learner_peak_rss_gb_smol` (issue 26, at most 3 GB) measures."""
AVAILABLE_ACTIVATION_SHARE = 0.125
"""The share of the available memory (`learner.memory.available_memory_bytes`) a micro-batch's activations may take
in an update after the first."""


def layer_activation_bytes_per_token(config: object) -> int:
    """Estimated fp32 bytes one decoder layer saves for backward per token: about 10 hidden-size tensors (norms,
    q/k/v, attention output, residuals) and 4 intermediate-size ones (gate, up, their activation and product)."""
    hidden, inter = int(config.hidden_size), int(config.intermediate_size)  # type: ignore[attr-defined]
    return 4 * (10 * hidden + 4 * inter)


def activation_bytes_per_token(config: object) -> int:
    """Estimated fp32 bytes a decoder saves for backward per token: every layer's `layer_activation_bytes_per_token`."""
    return int(config.num_hidden_layers) * layer_activation_bytes_per_token(config)  # type: ignore[attr-defined]


def checkpointed_bytes_per_token(config: object) -> int:
    """The same with every layer checkpointed (`learner.recompute`): each layer's fp32 input, and one layer's full set
    while its backward runs."""
    layers, hidden = int(config.num_hidden_layers), int(config.hidden_size)  # type: ignore[attr-defined]
    return 4 * layers * hidden + layer_activation_bytes_per_token(config)


def micro_batch_budget(token_budget: int, model: torch.nn.Module, available_bytes: int | None = None) -> int:
    """`learner.micro_batch_tokens` resolved: itself when > 0, else the activation bytes a micro-batch may save over
    the model's `activation_bytes_per_token` (`checkpointed_bytes_per_token` when its layers are checkpointed,
    `learner.gradient_checkpointing`; at least 64 tokens): `AUTO_ACTIVATION_BYTES`, or with `available_bytes`
    (an update after the first) up to `PARAM_ACTIVATION_FACTOR` x its parameter bytes within
    `AVAILABLE_ACTIVATION_SHARE` of that memory."""
    if token_budget > 0:
        return token_budget
    config = getattr(model, "config", None)
    try:
        per_token = (checkpointed_bytes_per_token if is_checkpointed(model) else activation_bytes_per_token)(config)
    except (AttributeError, TypeError):
        return FALLBACK_MICRO_BATCH_TOKENS
    allowance = AUTO_ACTIVATION_BYTES
    if available_bytes is not None:
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        allowance = max(allowance, min(PARAM_ACTIVATION_FACTOR * param_bytes,
                                       int(AVAILABLE_ACTIVATION_SHARE * available_bytes)))  # fmt: skip
    return max(64, allowance // max(per_token, 1))


def micro_batches(
    batch: Batch, lo: int, hi: int, token_budget: int, share_prefix: bool = False, rows_layout: bool = False
) -> list[tuple[int, int]]:
    """Split rows lo..hi-1 into consecutive ranges whose padded size (rows x longest sequence) fits the budget; with
    `share_prefix`, where sharing pays, ranges of whole groups whose packed size fits it (`learner.packing`), or with
    `rows_layout` (the model's attention packs tokens: `learner.packing.row_layout`) ranges of rows whose packed
    tokens fit it.

    A single row longer than the budget still forms its own micro-batch (it cannot be split). A budget <= 0 (the
    unresolved `learner.micro_batch_tokens=0`) is `FALLBACK_MICRO_BATCH_TOKENS`: `micro_batch_budget` resolves it.
    """
    token_budget = token_budget if token_budget > 0 else FALLBACK_MICRO_BATCH_TOKENS
    if share_prefix:
        packed = packed_micro_batches(batch.input_ids, batch.attention_mask, batch.group_index, lo, hi, token_budget,
                                      rows_layout)  # fmt: skip
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
