"""Prompts prefilled from a position other than 0 (a prefix-cache hit): their RoPE positions, where their K/V goes,
and attention over the K/V their slots already hold (`model.forward_step` with `Prompts.starts`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from rollout_workers.embedded.model import KVCache, Prompts


@dataclass(frozen=True, slots=True)
class OffsetPrompts:
    """What prompts with start offsets need, computed once per forward: RoPE tables of their positions, where each
    real token's K/V goes, and each row's attention mask over its slot's positions 0..span-1."""

    cos: torch.Tensor  # (M, 1, S, D)
    sin_rotate: torch.Tensor
    write_slots: torch.Tensor  # (P,) for each real token of each slot: the slot, its position, its (row, column)
    write_positions: torch.Tensor
    source_rows: torch.Tensor
    source_columns: torch.Tensor
    read_slots: torch.Tensor  # (M,) a slot holding row m's K/V
    span: int
    mask: torch.Tensor  # (M, 1, S, span) bool: key position <= the query's position

    @classmethod
    def of(cls, prompts: Prompts, cache: KVCache) -> OffsetPrompts:
        starts, lengths = prompts.starts, prompts.lengths
        assert starts is not None
        seq = prompts.tokens.shape[1]
        positions = (starts[:, None] + torch.arange(seq)).clamp_max(cache.max_len - 1)  # (M, S); pads clamped
        per_slot = lengths[prompts.slot_rows]
        source_rows = torch.repeat_interleave(prompts.slot_rows, per_slot)
        first = torch.cumsum(per_slot, 0) - per_slot
        source_columns = torch.arange(int(per_slot.sum())) - torch.repeat_interleave(first, per_slot)
        read_slots = torch.empty_like(starts)
        read_slots[prompts.slot_rows.flip(0)] = prompts.slots.flip(0)  # any of a row's slots
        span = int((starts + lengths).max())
        return cls(
            cache.cos[positions][:, None], cache.sin_rotate[positions][:, None],
            torch.repeat_interleave(prompts.slots, per_slot), starts[source_rows] + source_columns,
            source_rows, source_columns, read_slots, span,
            (torch.arange(span)[None, None, :] <= positions[:, :, None])[:, None],
        )  # fmt: skip

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int, gqa: bool
    ) -> torch.Tensor:
        """Write the rows' K/V (M, KV, S, D) at their positions, then attend q over each row's slot 0..span-1."""
        keys, values = cache.keys[layer], cache.values[layer]
        keys[self.write_slots, :, self.write_positions] = k[self.source_rows, :, self.source_columns]
        values[self.write_slots, :, self.write_positions] = v[self.source_rows, :, self.source_columns]
        span_keys = keys[self.read_slots, :, : self.span]
        span_values = values[self.read_slots, :, : self.span]
        return F.scaled_dot_product_attention(q, span_keys, span_values, attn_mask=self.mask, enable_gqa=gqa)
