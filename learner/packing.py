"""Shared-prompt packing: each group's common prefix runs through the decoder once, not once per response.

The responses of a group (GRPO: G samples of one prompt) begin with the same prompt tokens, and under the causal
mask a position's hidden state depends only on the tokens up to it: the prompt's hidden states are the same in every
row of the group. Packing computes them once per packed row:

    rows of group g (shared prefix P)          packed row of group g
      P r_1 . .                                  P r_1 r_2 ... r_G      position ids: P at 0..|P|-1, each r_i
      P r_2 .           ------------------->                            from |P| on (its positions in its own row)
      ...                                        mask: r_i's tokens see P and r_i's earlier tokens (causal in the
      P r_G . . .                                packed order), nothing of the other r_j

The shared prefix is the longest common prefix of the group's rows (the prompt, and more when every response starts
alike); each row keeps the rest of its tokens (its suffix). A packed token attends to exactly the keys it attends to
in its own row, at the same positions (RoPE reads the position ids), so every hidden state is the unpacked one up to
the summation order inside the attention (rounding). The decoder body runs on sum_g (|P_g| + sum_i |suffix_i|)
tokens instead of rows x longest row: 2.2x fewer on the built-in task (7-token prompts, ~3-token responses, groups of
8), 2.9x fewer on SmolLM-shaped GRPO (47 + 16 tokens, groups of 8). A packed row's attention grows with its length
squared, so a group's suffixes are split over several packed rows (each with the prefix) past `MAX_ROW_TOKENS` (or
the longest row, if longer). Backward: the gather of the loss positions' hidden states adds the gradients of every row
that reads a shared position into it, the sum over rows of the unpacked gradients.

Responses vary in length (a long tail: most stop early, a few run to the limit), so one group's packed row can be
several times another's, and padding every packed row to the widest would run mostly padding. The rows are filled
first fit instead (`packed_rows`): the largest groups first and each group's longest rows first, a row going where its
group's prefix already is, else where its prefix and suffix fit (the prefix once more in that packed row), else into a
new one, at the width of the fewest tokens among the longest row doubled while under the widest group's packed size,
and that size. A token sees its own piece's prefix and its own row's earlier tokens, as before, and no packed row is
wider than the widest group's own. On a batch of the e2e tail workload's shape (4 groups of 8, responses of mean 26
and at most 128 tokens after 6-token prompts: 843 real tokens) the decoder runs 7 packed rows of 133, 931 tokens,
where the padded rows ran 2,879 and one group per packed row 1,560: the fp32 learner step on 2 threads went from
7.5 s to 2.6 s (Xeon with AMX).

On the learner's fused attention (`learner.fused_attention`) long responses behind short prompts pack as tokens,
with no packed row and no mask: the packed tokens are one sequence, each group's prefix once and then every row's
own tokens, with no padding, and the attention gathers them back into their rows (a `RowLayout`), attends causally
row by row on the fused kernels and gives each token its own row position's output. Only the attention sees rows;
the linear layers, norms and MLP, nearly all of a step, see each prefix once. The gathers cost about 1% of a token's
work, so the layout pays from `MIN_ROWS_SAVING` of the padded tokens (the e2e decode workload's 6-token prompts
before 128-token responses: 3.4%), up to `ROWS_MAX_EXPANSION` padded tokens per packed one; past that (long
prompts, short responses) the attention's row-sized tensors cost more than masked packed rows.

Packing pays where groups share a prefix or rows differ in length: `pack_groups` returns None (the caller runs the
rows as they are) when the packed rows would be fewer than the padded tokens by less than `MIN_SAVING`, or when the
model's attention is not `eager`, `sdpa` or the fused attention (a packed row needs a dense 4-D mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from learner.fused_attention import IMPLEMENTATION as FUSED_ATTENTION
from learner.fused_attention import ROWS_KWARG, RowLayout

MAX_ROW_TOKENS = 512
"""A packed row's length past which a group's suffixes go on in another packed row (its attention is length^2)."""
MIN_SAVING = 0.1
"""The share of the padded tokens (rows x longest row) that sharing must save for `pack_groups` to pack."""
MIN_ROWS_SAVING = 0.01
"""On the fused attention (a `RowLayout`), the share of the padded tokens (rows x longest row) that the packed tokens
(each prefix once, no padding) must save."""
ROWS_MAX_EXPANSION = 1.5
"""The most padded tokens (rows x longest row) per packed token for a `RowLayout`: its attention holds the rows'
positions (the gathered q, k and v, their output and softmax rows, saved for backward), the rest of the layer the
packed tokens. Past it, packed rows with a mask hold less: SmolLM2-135M's 47-token prompts before 16-token
responses (2.9 padded tokens per packed one) peaked at 3.24 GB in the first step on the row layout against 2.71-2.91
GB on masked packed rows (target 3), at the same speed within the noise (13.76 s a step against 13.81-14.10;
`python -m asyncrl.bench.learner_bench --rows smol`, Zen 4, 2026-12-05)."""
DENSE_MASK_ATTENTION = ("eager", "sdpa", FUSED_ATTENTION)
"""Attention implementations that take a dense 4-D mask: bool for sdpa and the fused attention (which passes a mask
to SDPA), additive float (0 / dtype min) for eager."""


@dataclass(slots=True)
class PackedRows:
    """The packed layout of a batch's rows (P packed rows of L tokens) and where each row's positions went."""

    input_ids: torch.Tensor  # (P, L) long, 0 past a packed row's end
    position_ids: torch.Tensor  # (P, L) long: each token's position in its own row
    attention_mask: torch.Tensor  # (P, 1, L, L): bool (True: attend), or additive float for eager attention; (1, N)
    # ones with a row layout (no padding: transformers builds no mask)
    flat_index: torch.Tensor  # (B, S) long: index of row b's position s in the packed tokens flattened to (P * L,)
    rows: RowLayout | None = None  # the fused attention's layout (P = 1, L = N), which the decoder call passes on

    @property
    def tokens(self) -> int:
        """Tokens the decoder runs on, padding included: P x L."""
        return int(self.input_ids.numel())

    def call_kwargs(self) -> dict[str, RowLayout]:
        """The decoder call's keywords besides the inputs: the row layout, where there is one."""
        return {} if self.rows is None else {ROWS_KWARG: self.rows}

    def to(self, device: torch.device) -> PackedRows:
        """The same layout with its tensors on `device` (a GPU learner's: `learner.devices`); itself when there. The
        row layout stays: it serves the CPU's fused attention only."""
        if self.position_ids.device == device:
            return self
        move = (self.input_ids, self.position_ids, self.attention_mask, self.flat_index)
        return PackedRows(*(tensor.to(device) for tensor in move), rows=self.rows)


def _runs(group_index: list[int]) -> list[tuple[int, int]]:
    """Consecutive rows of equal group id, as (lo, hi) ranges."""
    runs, start = [], 0
    for row in range(1, len(group_index) + 1):
        if row == len(group_index) or group_index[row] != group_index[start]:
            runs.append((start, row))
            start = row
    return runs


def _common_prefix(input_ids: torch.Tensor, lo: int, hi: int, shortest: int) -> int:
    """Length of the longest common prefix of rows lo..hi-1 (at most `shortest`, the shortest row's length)."""
    head = input_ids[lo:hi, :shortest]
    same = (head == head[:1]).all(0)  # (shortest,) positions where every row agrees
    return int(same.long().cumprod(0).sum())


def shared_prefixes(
    input_ids: torch.Tensor, lengths: list[int], group_index: torch.Tensor
) -> tuple[list[tuple[int, int]], list[int]]:
    """The runs of consecutive rows of one group (lo, hi) and each run's shared prefix length (0 for a single row)."""
    runs = _runs(group_index.tolist())
    prefixes = []
    for lo, hi in runs:
        shortest = int(min(lengths[lo:hi]))
        prefixes.append(_common_prefix(input_ids, lo, hi, shortest) if hi - lo > 1 else 0)
    return runs, prefixes


@dataclass(frozen=True, slots=True)
class Piece:
    """Rows of one group in a masked packed row: their shared prefix once (the first member's tokens), then each
    member's suffix."""

    members: tuple[int, ...]
    prefix: int


def _group_sizes(runs: list[tuple[int, int]], prefixes: list[int], lengths: list[int]) -> list[int]:
    """Each group's packed size: its prefix once, then its rows' suffixes."""
    return [prefix + sum(lengths[row] - prefix for row in range(lo, hi)) for (lo, hi), prefix in zip(runs, prefixes)]


def _fill(
    runs: list[tuple[int, int]], prefixes: list[int], lengths: list[int], sizes: list[int], width: int
) -> tuple[list[list[Piece]], int]:
    """Rows first fit into packed rows of `width` tokens, the largest groups (`sizes`) first and each group's longest
    rows first: a row goes where its group's prefix already is and its suffix fits, else where prefix and suffix fit
    (the prefix once more), else into a new packed row. The packed rows and the most tokens one holds."""
    rows: list[dict[int, list[int]]] = []  # per packed row: group -> its member rows
    used: list[int] = []
    for group in sorted(range(len(runs)), key=lambda group: -sizes[group]):
        (lo, hi), prefix = runs[group], prefixes[group]
        for row in sorted(range(lo, hi), key=lambda row: -lengths[row]):
            suffix = lengths[row] - prefix
            at = next((at for at, held in enumerate(rows) if group in held and used[at] + suffix <= width), None)
            if at is None:
                at = next((at for at, tokens in enumerate(used) if tokens + prefix + suffix <= width), len(rows))
                if at == len(rows):
                    rows.append({})
                    used.append(0)
                rows[at][group] = []
                used[at] += prefix
            rows[at][group].append(row)
            used[at] += suffix
    pieces = [[Piece(tuple(members), prefixes[group]) for group, members in held.items()] for held in rows]
    return pieces, max(used, default=0)


def packed_rows(runs: list[tuple[int, int]], prefixes: list[int], lengths: list[int]) -> tuple[list[list[Piece]], int]:
    """The masked layout: its packed rows, each the pieces it holds (a group's rows, `Piece`), and their width.

    Rows are filled first fit (`_fill`) at the width of the fewest tokens in all (packed rows x width) among the
    longest row doubled while under the widest group's packed size, and that size (at most `MAX_ROW_TOKENS`, or the
    longest row if longer): no packed row is wider than the widest group's own, so no token attends over more keys
    than it would there, and a batch of varied lengths leaves out the padding that its short groups' own rows would
    hold."""
    lengths = [int(length) for length in lengths]
    sizes = _group_sizes(runs, prefixes, lengths)
    longest = max(lengths[row] for lo, hi in runs for row in range(lo, hi))
    widest = max(longest, min(max(sizes), MAX_ROW_TOKENS))
    best = _fill(runs, prefixes, lengths, sizes, widest)
    for width in [longest << k for k in range(32) if longest << k < widest]:
        if _fewest_tokens(prefixes, sizes, width) < len(best[0]) * best[1]:  # else it cannot do better
            layout = _fill(runs, prefixes, lengths, sizes, width)
            best = layout if len(layout[0]) * layout[1] < len(best[0]) * best[1] else best
    return best


def _fewest_tokens(prefixes: list[int], sizes: list[int], width: int) -> int:
    """A lower bound on `_fill`'s packed rows x width at `width`: each group in as few pieces as its suffixes need
    (each with the prefix), the rows full."""
    tokens = 0
    for prefix, size in zip(prefixes, sizes):
        if prefix >= width:
            return 1 << 62
        tokens += size + prefix * (-(-(size - prefix) // (width - prefix)) - 1)
    return -(-tokens // width) * width


def pays(runs: list[tuple[int, int]], prefixes: list[int], lengths: list[int], padded_tokens: int) -> bool:
    """Whether the masked packed rows (`packed_rows`: packed rows x their width) are at least `MIN_SAVING` of
    `padded_tokens` (rows x longest row) fewer: what sharing the prefixes saves and the rows' padding that packing
    leaves out (a batch of varied lengths, whose short rows the unpacked layout pads to its longest)."""
    return _saves(_layout_tokens(runs, prefixes, lengths), padded_tokens)


def _saves(tokens: int, padded_tokens: int) -> bool:
    """Whether a layout of `tokens` (some) is at least `MIN_SAVING` of `padded_tokens` fewer."""
    return tokens > 0 and padded_tokens - tokens >= MIN_SAVING * padded_tokens


def _layout_tokens(runs: list[tuple[int, int]], prefixes: list[int], lengths: list[int]) -> int:
    """The masked layout's tokens, padding included: packed rows x width (`packed_rows`)."""
    rows, width = packed_rows(runs, prefixes, lengths)
    return len(rows) * width


def _tokens_pay(runs: list[tuple[int, int]], prefixes: list[int], lengths: list[int], rows: int) -> bool:
    """Whether packed tokens (each prefix once, no padding) are at least `MIN_ROWS_SAVING` fewer than the padded
    rows' (rows x longest row), and at most `ROWS_MAX_EXPANSION` times fewer."""
    padded = rows * int(max(lengths))
    packed = sum(_group_sizes(runs, prefixes, lengths))
    return packed > 0 and MIN_ROWS_SAVING * padded <= padded - packed and padded <= ROWS_MAX_EXPANSION * packed


def row_layout(attn_implementation: str | None) -> bool:
    """Whether `pack_groups` packs for this attention implementation with a `RowLayout` (the fused attention)."""
    return attn_implementation == FUSED_ATTENTION


def model_row_layout(model: torch.nn.Module) -> bool:
    """`row_layout` of a model's configured attention."""
    return row_layout(getattr(getattr(model, "config", None), "_attn_implementation", None))


def _token_ranges(
    runs: list[tuple[int, int]], prefixes: list[int], lengths: list[int], budget: int
) -> list[tuple[int, int]]:
    """Consecutive row ranges whose packed tokens (each group's prefix once per range, each row's suffix) fit
    `budget`; a row over it alone takes a range of its own."""
    ranges: list[tuple[int, int]] = []
    start, size = 0, 0
    for (run_lo, run_hi), prefix in zip(runs, prefixes):
        for row in range(run_lo, run_hi):
            shares = row > max(start, run_lo)  # the group's prefix is already in this range
            cost = int(lengths[row]) - (prefix if shares else 0)
            if row > start and size + cost > budget:
                ranges.append((start, row))
                start, size, cost = row, 0, int(lengths[row])
            size += cost
    ranges.append((start, runs[-1][1]))
    return ranges


def packed_micro_batches(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    group_index: torch.Tensor,
    lo: int,
    hi: int,
    budget: int,
    rows_layout: bool = False,
) -> list[tuple[int, int]] | None:
    """Rows lo..hi-1 in consecutive ranges of whole groups whose masked layout (`packed_rows`: packed rows x their
    width) fits `budget` tokens; a group over the budget alone is split into ranges of prefix + suffixes within it.
    None where packing does not pay on these rows (`pays`): the caller plans them unpacked.

    `rows_layout` (`row_layout`: the fused attention packs tokens, not rows), where the rows' packed tokens pay
    (`pack_tokens`): ranges of consecutive rows whose packed tokens fit the budget, a group's prefix counted once in
    each range that holds its rows."""
    if hi - lo < 2:
        return None
    lengths = attention_mask[lo:hi].sum(-1).tolist()
    runs, prefixes = shared_prefixes(input_ids[lo:hi], lengths, group_index[lo:hi])
    if rows_layout and _tokens_pay(runs, prefixes, lengths, hi - lo):
        return [(lo + a, lo + b) for a, b in _token_ranges(runs, prefixes, lengths, budget)]
    if not pays(runs, prefixes, lengths, (hi - lo) * int(max(lengths))):
        return None
    ranges: list[tuple[int, int]] = []
    start, first, widest = lo, 0, 0  # the open range: its first row, first group (it holds runs[first:index])
    sizes = _group_sizes(runs, prefixes, lengths)
    for index, ((run_lo, run_hi), prefix, size) in enumerate(zip(runs, prefixes, sizes)):
        widest = max(widest, size)
        bounded = widest <= MAX_ROW_TOKENS and (index - first + 1) * widest <= budget  # one packed row a group fits
        if index > first and not bounded and _layout_tokens(runs[first : index + 1], prefixes[first : index + 1],
                                                            lengths) > budget:  # fmt: skip
            ranges.append((start, lo + run_lo))
            start, first, widest = lo + run_lo, index, size
        if size <= budget or index > first:
            continue
        piece_lo, piece = run_lo, prefix  # one group over the budget: split it by rows
        for row in range(run_lo, run_hi):
            suffix = int(lengths[row]) - prefix
            if row > piece_lo and piece + suffix > budget:
                ranges.append((lo + piece_lo, lo + row))
                piece_lo, piece = row, prefix
            piece += suffix
        ranges.append((lo + piece_lo, lo + run_hi))
        start, first, widest = lo + run_hi, index + 1, 0
    if hi > start:
        ranges.append((start, hi))
    return ranges


def pack_groups(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    group_index: torch.Tensor,
    attn_implementation: str | None,
    mask_dtype: torch.dtype = torch.float32,
) -> PackedRows | None:
    """The packed layout of right-padded rows `input_ids`, `attention_mask` (B, S) of groups `group_index` (B,), or
    None where packing would save less than `MIN_SAVING` of B x S or the attention takes no dense mask. On the fused
    attention (`row_layout`): packed tokens with a `RowLayout` (`pack_tokens`).

    `mask_dtype`: the dtype of eager attention's additive mask (the attention scores' dtype).
    """
    if row_layout(attn_implementation):
        tokens = pack_tokens(input_ids, attention_mask, group_index)
        if tokens is not None:
            return tokens
    if attn_implementation not in DENSE_MASK_ATTENTION or input_ids.shape[0] < 2:
        return None
    rows, seq_len = input_ids.shape
    lengths = attention_mask.sum(-1).tolist()
    runs, prefixes = shared_prefixes(input_ids, lengths, group_index)
    packed, width = packed_rows(runs, prefixes, lengths)
    if not _saves(len(packed) * width, rows * seq_len):  # `pays`, on the layout built once
        return None
    source = [0] * (len(packed) * width)  # each packed token's index in input_ids flattened to (B * S,)
    positions = [0] * len(source)
    segments = [-1] * len(source)  # a piece's prefix or one row's suffix (numbered over the layout); -1: padding
    owners = [-1] * len(source)  # the segment of the token's piece's prefix, which it sees besides its own
    flat_index = [0] * (rows * seq_len)  # each row position's index in the packed tokens flattened to (P * L,)
    segment = 0
    for p, pieces in enumerate(packed):
        at = p * width
        for piece in pieces:
            prefix, own = piece.prefix, segment
            for q in range(prefix):  # the prefix's tokens are the piece's first row's
                source[at + q], positions[at + q], segments[at + q], owners[at + q] = (
                    piece.members[0] * seq_len + q, q, own, own
                )  # fmt: skip
            for row in piece.members:
                flat_index[row * seq_len : row * seq_len + prefix] = range(at, at + prefix)
            at += prefix
            for row in piece.members:
                segment += 1
                for q in range(prefix, int(lengths[row])):
                    source[at], positions[at], segments[at], owners[at] = row * seq_len + q, q, segment, own
                    flat_index[row * seq_len + q] = at
                    at += 1
            segment += 1
    shape = (len(packed), width)
    segment_ids = torch.tensor(segments).view(shape)
    allowed = _mask(segment_ids, torch.tensor(owners).view(shape))
    if attn_implementation == "eager":
        mask = torch.zeros(allowed.shape, dtype=mask_dtype).masked_fill_(~allowed, torch.finfo(mask_dtype).min)
    else:
        mask = allowed
    ids = input_ids.reshape(-1)[torch.tensor(source).view(shape)] * (segment_ids >= 0)
    return PackedRows(
        input_ids=ids,
        position_ids=torch.tensor(positions).view(shape),
        attention_mask=mask[:, None],
        flat_index=torch.tensor(flat_index).view(rows, seq_len),
    )


def _mask(segment: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """(P, L, L) bool: query j attends key k iff k <= j and k is in j's own segment or in its piece's prefix
    (`owner`). Padding (-1) sees earlier padding only, itself at least: no row of the mask is empty."""
    width = segment.shape[1]
    causal = torch.ones((width, width), dtype=torch.bool).tril()
    key = segment[:, None, :]
    return causal & ((key == owner[:, :, None]) | (key == segment[:, :, None]))


def pack_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, group_index: torch.Tensor) -> PackedRows | None:
    """Right-padded rows (B, S) of groups (B,) as one sequence of N packed tokens (each group's shared prefix once,
    then each row's suffix; no padding) with the `RowLayout` that gathers them back into their rows, or None where
    that saves less than `MIN_ROWS_SAVING` of B x S or B x S is over `ROWS_MAX_EXPANSION` x N."""
    rows, seq_len = input_ids.shape
    if rows < 2:
        return None
    lengths = attention_mask.sum(-1).tolist()
    runs, prefixes = shared_prefixes(input_ids, lengths, group_index)
    if not _tokens_pay(runs, prefixes, lengths, rows):
        return None
    source: list[int] = []  # each packed token's row position (b * S + s): where it comes from and what it takes
    positions: list[int] = []
    gather = [0] * (rows * seq_len)  # each row position's packed token (token 0 past a row's end)
    for (lo, hi), prefix in zip(runs, prefixes):
        shared = len(source)
        source.extend(range(lo * seq_len, lo * seq_len + prefix))
        positions.extend(range(prefix))
        for row in range(lo, hi):
            at, end = row * seq_len, int(lengths[row])
            gather[at : at + prefix] = range(shared, shared + prefix)
            gather[at + prefix : at + end] = range(len(source), len(source) + end - prefix)
            source.extend(range(at + prefix, at + end))
            positions.extend(range(prefix, end))
    take = torch.tensor(source)
    gathered = torch.tensor(gather)
    return PackedRows(
        input_ids=input_ids.reshape(-1)[take][None],
        position_ids=torch.tensor(positions)[None],
        attention_mask=torch.ones((1, len(source)), dtype=torch.long),
        flat_index=gathered.view(rows, seq_len),
        rows=RowLayout(gather=gathered, take=take, rows=rows, width=seq_len),
    )
