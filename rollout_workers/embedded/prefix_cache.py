"""The embedded engine's prefix cache: K/V of retired sequences kept for prompts that begin with their tokens.

    retire (tokens[:-1] of a sequence, its K/V) --retain--> entries (LRU, a token budget) --match--> a new prompt
    joins: its longest cached prefix is copied into its slot(s), only the rest is prefilled (from that position)

- An entry holds the K/V of positions 0..L-1 of one sequence (its tokens but the last sampled one, which was never
  fed), copied out of the engine's KV cache into tensors of its own (layers, kv_heads, L, head_dim): entries never
  hold a slot, so they cannot block admission; they cost their K/V's memory, bounded by `budget_tokens` (least
  recently used entries go first).
- Lookup is by block-aligned prefix: every entry registers a chained hash of its first k * BLOCK tokens for each
  k; a prompt walks its own chain as deep as some entry follows it, then the candidates there are compared token by
  token to extend the match into the next block. A match shorter than one block is not used (not worth a copy).
  A match never covers a prompt's last token: its logits are needed, so at least one token is prefilled.
- Entries are valid only for the weights that computed them: the engine clears the cache on every swap and keeps
  only sequences whose whole K/V was computed by the running version.
- An entry that is a prefix of a newly retained sequence is dropped (a multi-turn episode's earlier turns).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

BLOCK = 8
"""Tokens per block of the prefix index: the granularity of a match's hashed part (the rest is compared)."""


@dataclass(slots=True, eq=False)
class Entry:
    tokens: tuple[int, ...]  # the positions 0..L-1 whose K/V it holds
    keys: torch.Tensor  # (layers, kv_heads, L, head_dim)
    values: torch.Tensor
    hashes: list[int]  # its chain: hashes[k - 1] keys its first k * BLOCK tokens


def _chain(tokens: tuple[int, ...] | list[int], blocks: int) -> list[int]:
    """Chained hashes of the first `blocks` full blocks of `tokens`: h_k = hash((h_{k-1}, block k))."""
    out, h = [], 0
    for k in range(blocks):
        h = hash((h, tuple(tokens[k * BLOCK : (k + 1) * BLOCK])))
        out.append(h)
    return out


class PrefixCache:
    """Retired sequences' K/V by token prefix, LRU within `budget_tokens` positions (see the module docstring)."""

    def __init__(self, budget_tokens: int):
        if budget_tokens < BLOCK:
            raise ValueError(f"prefix cache budget ({budget_tokens} tokens) is below one block ({BLOCK} tokens)")
        self.budget_tokens = budget_tokens
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # id(entry) -> entry, least recently used first
        self._index: dict[int, dict[int, Entry]] = {}  # chain hash -> the entries whose prefix it keys
        self.tokens = 0
        """Positions held now (sum of the entries' lengths)."""
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._index.clear()
        self.tokens = 0

    def match(self, prompt: list[int]) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with `prompt` (at least one block, at most len(prompt) - 1 tokens)
        and that length; (None, 0) when none does. A hit makes the entry the most recently used."""
        limit = len(prompt) - 1
        if limit < BLOCK or not self._entries:
            return None, 0
        candidates: dict[int, Entry] | None = None
        depth, h = 0, 0
        while (depth + 1) * BLOCK <= limit:
            h = hash((h, tuple(prompt[depth * BLOCK : (depth + 1) * BLOCK])))
            found = self._index.get(h)
            if not found:
                break
            candidates, depth = found, depth + 1
        if candidates is None:
            return None, 0
        best, best_len = None, 0
        base = depth * BLOCK
        for entry in reversed(candidates.values()):  # hash collisions are checked: the hashed part is compared too
            if entry.tokens[:base] != tuple(prompt[:base]):
                continue
            length, end = base, min(len(entry.tokens), limit)
            while length < end and entry.tokens[length] == prompt[length]:
                length += 1
            if length > best_len:
                best, best_len = entry, length
        if best is not None:
            self._entries.move_to_end(id(best))
        return best, best_len

    def retain(self, tokens: list[int], keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Keep a copy of K/V `keys`/`values` (layers, kv_heads, >= len(tokens), head_dim) of positions
        0..len(tokens)-1; returns whether it was kept (not when shorter than a block, or over the whole budget, or
        already covered by an entry). Entries it covers are dropped; then the least recently used go until the
        budget holds."""
        length = len(tokens)
        if length < BLOCK or length > self.budget_tokens:
            return False
        covering, matched = self.match(list(tokens) + [-1])  # a sentinel: the match may cover every token
        if covering is not None and matched == length:
            return False  # already held (the match made it the most recently used)
        if covering is not None and matched == len(covering.tokens):
            self._drop(covering)  # a prefix of this one: superseded
        entry = Entry(
            tuple(tokens), keys[:, :, :length].clone(), values[:, :, :length].clone(), _chain(tokens, length // BLOCK)
        )
        self._entries[id(entry)] = entry
        for h in entry.hashes:
            self._index.setdefault(h, {})[id(entry)] = entry
        self.tokens += length
        while self.tokens > self.budget_tokens:
            self._drop(next(iter(self._entries.values())))
            self.evictions += 1
        return True

    def _drop(self, entry: Entry) -> None:
        del self._entries[id(entry)]
        for h in entry.hashes:
            holders = self._index.get(h)
            if holders is not None:
                holders.pop(id(entry), None)
                if not holders:
                    del self._index[h]
        self.tokens -= len(entry.tokens)
