"""Shared-prompt packing (`learner.share_prefix`): each group's common prefix once, the same log-probs and gradients.

The packed forward differs from the row-by-row one only in the summation order of the attention and the GEMMs' row
blocking: values agree to a few fp32 ulps (2e-6 on log-probs of about -3), gradients to 5e-6 of their largest entry.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_learner import VOCAB, tiny_batch, tiny_config, tiny_model, with_behavior

import learner.fused_attention as fused_attention
import learner.packing as packing
from learner.acrl import AcrlReference
from learner.batch import Batch, micro_batch_budget, micro_batches, token_logp
from learner.losses import mismatch_metrics
from learner.packing import FUSED_ATTENTION, MAX_ROW_TOKENS, pack_groups
from learner.precision import LossScaler
from learner.update import train_on_batch

LOGP_TOL = {"rtol": 0.0, "atol": 2e-6}
GRAD_TOL = 5e-6
"""Of a gradient's largest entry: the shared prefix's gradient is a sum over the group's rows, in another order."""


def shared_batch(seed: int = 0, groups: int = 3, group_size: int = 4, same_start: bool = False) -> Batch:
    """tiny_batch with one prompt per group (each row keeps its own prompt length: the shared prefix is the shortest
    prompt); `same_start`: every response of a group also starts with the same token (a prefix past the prompt)."""
    batch = tiny_batch(seed=seed, groups=groups, group_size=group_size)
    for g in range(groups):
        lo, hi = g * group_size, (g + 1) * group_size
        first = int(batch.response_pos[lo, 0])
        for row in range(lo + 1, hi):
            shared = min(int(batch.response_pos[row, 0]), first)
            batch.input_ids[row, :shared] = batch.input_ids[lo, :shared]
        if same_start:
            for row in range(lo, hi):
                start = int(batch.response_pos[row, 0])
                batch.input_ids[row, start] = 7
    batch.response_ids = torch.gather(batch.input_ids, 1, batch.response_pos) * batch.mask.long()
    return batch


def _logp_and_grads(model: torch.nn.Module, batch: Batch, share: bool, temperature: float = 0.7):
    weights = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(3)) * batch.mask
    logp, entropy = token_logp(model, batch, temperature, share_prefix=share)
    (logp * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return logp.detach(), entropy, grads


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("same_start", [False, True])
def test_packed_log_probs_entropies_and_gradients_match_row_by_row(attention, same_start):
    model = tiny_model(seed=1)
    model.config._attn_implementation = attention
    batch = shared_batch(seed=1, same_start=same_start)
    packed = pack_groups(batch.input_ids, batch.attention_mask, batch.group_index, attention)
    assert packed is not None and packed.tokens < batch.input_ids.numel()
    rows_logp, rows_entropy, rows_grads = _logp_and_grads(model, batch, share=False)
    packed_logp, packed_entropy, packed_grads = _logp_and_grads(model, batch, share=True)
    m = batch.mask.bool()
    torch.testing.assert_close(packed_logp[m], rows_logp[m], **LOGP_TOL)
    torch.testing.assert_close(packed_entropy[m], rows_entropy[m], **LOGP_TOL)
    assert not packed_logp[~m].any() and not packed_entropy[~m].any()
    for name, grad in rows_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=0.0, atol=GRAD_TOL * float(grad.abs().max()))


def test_the_layout_computes_each_prefix_once_and_keeps_every_position():
    batch = shared_batch(seed=2, same_start=True)
    lengths = batch.attention_mask.sum(-1)
    packed = pack_groups(batch.input_ids, batch.attention_mask, batch.group_index, "sdpa")
    assert packed is not None
    assert packed.attention_mask[:, 0].diagonal(dim1=-2, dim2=-1).all()  # every token (padding too) sees itself
    flat_ids, flat_pos = packed.input_ids.reshape(-1), packed.position_ids.reshape(-1)
    for row in range(batch.rows):  # each position of each row is the same token at the same position
        n = int(lengths[row])
        index = packed.flat_index[row, :n]
        assert torch.equal(flat_ids[index], batch.input_ids[row, :n])
        assert torch.equal(flat_pos[index], torch.arange(n))
    group_size, width, unique = 4, packed.input_ids.shape[1], 0
    for g in range(3):  # the group's rows in one packed row share their prefix's packed tokens
        rows = range(g * group_size, (g + 1) * group_size)
        shortest = int(min(lengths[r] for r in rows))
        prefix = packing._common_prefix(batch.input_ids, rows[0], rows[-1] + 1, shortest)
        assert prefix >= min(int(batch.response_pos[r, 0]) for r in rows)  # at least the shortest prompt
        pieces: dict[int, list[int]] = {}
        for r in rows:
            pieces.setdefault(int(packed.flat_index[r, 0]) // width, []).append(r)
        for members in pieces.values():
            assert all(
                torch.equal(packed.flat_index[r, :prefix], packed.flat_index[members[0], :prefix]) for r in members
            )
            unique += prefix + sum(int(lengths[r]) - prefix for r in members)
    assert int((packed.input_ids != 0).sum()) <= unique <= packed.tokens


def test_no_shared_prefix_runs_row_by_row_bit_for_bit():
    model, batch = tiny_model(), tiny_batch(one_length=True)  # random prompts, one length: nothing to leave out
    assert pack_groups(batch.input_ids, batch.attention_mask, batch.group_index, "eager") is None
    with torch.no_grad():
        assert torch.equal(token_logp(model, batch, 1.0, share_prefix=True)[0], token_logp(model, batch, 1.0)[0])
    assert pack_groups(shared_batch().input_ids, shared_batch().attention_mask, batch.group_index, "flex") is None


def test_long_groups_split_over_packed_rows_and_identical_rows_share_everything(monkeypatch):
    model = tiny_model(seed=4)
    batch = shared_batch(seed=4, groups=2, group_size=6)
    batch.input_ids[1] = batch.input_ids[0]  # a duplicate response (common with small vocabularies)
    batch.attention_mask[1], batch.response_pos[1] = batch.attention_mask[0], batch.response_pos[0]
    batch.response_ids[1], batch.mask[1] = batch.response_ids[0], batch.mask[0]
    monkeypatch.setattr(packing, "MAX_ROW_TOKENS", 1)  # at most the longest row per packed row: several per group
    monkeypatch.setattr(packing, "MIN_SAVING", 0.0)  # then few tokens are left out: packed all the same
    packed = pack_groups(batch.input_ids, batch.attention_mask, batch.group_index, "eager")
    lengths = batch.attention_mask.sum(-1).tolist()
    runs, prefixes = packing.shared_prefixes(batch.input_ids, lengths, batch.group_index)
    pieces = sum(len(row) for row in packing.packed_rows(runs, prefixes, lengths)[0])
    assert packed is not None and pieces > 2  # each group in several pieces
    assert packed.input_ids.shape[1] <= int(batch.attention_mask.sum(-1).max())
    rows_logp, _, rows_grads = _logp_and_grads(model, batch, share=False)
    packed_logp, _, packed_grads = _logp_and_grads(model, batch, share=True)
    m = batch.mask.bool()
    torch.testing.assert_close(packed_logp[m], rows_logp[m], **LOGP_TOL)
    for name, grad in rows_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=0.0, atol=GRAD_TOL * float(grad.abs().max()))


def varied_lengths_batch() -> Batch:
    """A long-tail batch: 4 groups of 4 with one long response in group 0 and short ones elsewhere (RL's responses
    vary in length: the rows' padding is most of a padded batch)."""
    batch = shared_batch(seed=6, groups=4, group_size=4)
    lengths = batch.attention_mask.sum(-1)
    long_row, width = 1, int(lengths.max()) + 24
    grown = torch.randint(1, 20, (batch.rows, width), generator=torch.Generator().manual_seed(6))
    grown[:, : batch.input_ids.shape[1]] = batch.input_ids
    attention = torch.zeros((batch.rows, width), dtype=torch.long)
    attention[:, : batch.input_ids.shape[1]] = batch.attention_mask
    attention[long_row, :width] = 1
    start, extra = int(batch.response_pos[long_row, 0]), width - int(lengths[long_row])
    positions = torch.zeros((batch.rows, batch.response_pos.shape[1] + extra), dtype=torch.long)
    positions[:, : batch.response_pos.shape[1]] = batch.response_pos
    positions[long_row] = torch.arange(start, start + positions.shape[1]).clamp_max(width - 1)
    mask = torch.zeros(positions.shape)
    mask[:, : batch.mask.shape[1]] = batch.mask
    mask[long_row] = (torch.arange(positions.shape[1]) < width - start).float()
    grown = grown * attention
    return Batch(
        input_ids=grown, attention_mask=attention, response_pos=positions,
        response_ids=torch.gather(grown, 1, positions) * mask.long(), mask=mask,
        behav_logp=torch.zeros(mask.shape), versions=torch.zeros(mask.shape, dtype=torch.long), rewards=batch.rewards,
        correct=batch.correct, group_index=batch.group_index, truncated=batch.truncated,
    )  # fmt: skip


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_groups_of_short_responses_share_a_packed_row_beside_a_long_one(attention):
    model = tiny_model(seed=6)
    model.config._attn_implementation = attention
    batch = varied_lengths_batch()
    lengths = batch.attention_mask.sum(-1).tolist()
    packed = pack_groups(batch.input_ids, batch.attention_mask, batch.group_index, attention)
    assert packed is not None
    width = packed.input_ids.shape[1]  # the widest group's packed size: no row is wider, no token attends further
    assert width < MAX_ROW_TOKENS
    assert packed.tokens < 0.5 * batch.rows * max(lengths)
    packed_row = {g: {int(i) // width for i in packed.flat_index[g * 4, : int(lengths[g * 4])]} for g in range(4)}
    assert len(set().union(*packed_row.values())) < 4  # two groups in one packed row (each group in one)
    rows_logp, rows_entropy, rows_grads = _logp_and_grads(model, batch, share=False)
    packed_logp, packed_entropy, packed_grads = _logp_and_grads(model, batch, share=True)
    m = batch.mask.bool()
    torch.testing.assert_close(packed_logp[m], rows_logp[m], **LOGP_TOL)
    torch.testing.assert_close(packed_entropy[m], rows_entropy[m], **LOGP_TOL)
    for name, grad in rows_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=0.0, atol=GRAD_TOL * float(grad.abs().max()))
    plan = micro_batches(batch, 0, batch.rows, packed.tokens, share_prefix=True)
    assert plan == [(0, batch.rows)]  # planned as the layout packs them: one micro-batch of its tokens


def test_a_long_tail_packs_at_the_longest_rows_width_with_its_groups_rows_spread_over_packed_rows():
    """The e2e tail workload's shape: 6-token prompts, one response at the 128-token limit, the rest short. Rows as
    wide as the longest row, a group's rows spread over them (each packed row with the prefix), hold fewer tokens than
    rows as wide as the widest group with whole groups in them (first fit)."""
    lengths = [134, 26, 21, 16, 14, 36, 18, 15] + [20, 31, 12, 40, 9, 17, 22, 25] + [11, 8, 27, 33, 19, 16, 14, 30]
    lengths += [45, 12, 10, 24, 18, 15, 21, 13]
    runs, prefixes = [(g * 8, g * 8 + 8) for g in range(4)], [6] * 4
    rows, width = packing.packed_rows(runs, prefixes, lengths)
    sizes = packing._group_sizes(runs, prefixes, lengths)
    whole_groups, widest = packing._fill(runs, prefixes, lengths, sizes, max(sizes))
    assert width == max(lengths) and len(rows) * width < len(whole_groups) * widest
    placed = sorted(row for pieces in rows for piece in pieces for row in piece.members)
    assert placed == list(range(32))  # every row once
    for pieces in rows:
        assert sum(piece.prefix + sum(lengths[r] - piece.prefix for r in piece.members) for piece in pieces) <= width
    assert len({i for i, pieces in enumerate(rows) for piece in pieces if piece.members[0] < 8}) > 1  # group 0 spread


def test_micro_batches_of_whole_groups_within_the_packed_budget():
    batch = shared_batch(seed=5, groups=4, group_size=4)
    lengths = batch.attention_mask.sum(-1).tolist()
    budget = 60
    plan = micro_batches(batch, 0, batch.rows, budget, share_prefix=True)
    assert plan[0][0] == 0 and plan[-1][1] == batch.rows and all(a[1] == b[0] for a, b in zip(plan, plan[1:]))
    for lo, hi in plan:
        packed = pack_groups(batch.input_ids[lo:hi], batch.attention_mask[lo:hi], batch.group_index[lo:hi], "sdpa")
        tokens = packed.tokens if packed is not None else (hi - lo) * max(lengths[lo:hi])
        assert tokens <= budget
        whole = lo % 4 == 0 and hi % 4 == 0
        assert whole or packed is None or packed.input_ids.shape[0] == 1  # a split group: one packed row
    assert len(plan) < len(micro_batches(batch, 0, batch.rows, budget))  # fewer than unpacked
    one_group = micro_batches(batch, 0, batch.rows, 12, share_prefix=True)  # under one group's size: split by rows
    assert len(one_group) > 4 and one_group[-1][1] == batch.rows


@pytest.fixture
def any_expansion(monkeypatch):
    """The row layout for these short rows too (their prompts are most of each row: `ROWS_MAX_EXPANSION` would pack
    them as masked rows)."""
    monkeypatch.setattr(packing, "ROWS_MAX_EXPANSION", 100.0)


def test_packed_tokens_hold_each_prefix_once_and_gather_back_every_row_position(any_expansion):
    batch = shared_batch(seed=2, same_start=True)
    batch.attention_mask[5, -3:] = 0  # a shorter row: no padding among the packed tokens
    lengths = batch.attention_mask.sum(-1)
    packed = pack_groups(batch.input_ids, batch.attention_mask, batch.group_index, FUSED_ATTENTION)
    assert packed is not None and packed.rows is not None and packed.input_ids.shape[0] == 1
    layout = packed.rows
    prefixes = [
        packing._common_prefix(batch.input_ids, lo, lo + 4, int(lengths[lo : lo + 4].min())) for lo in (0, 4, 8)
    ]
    assert packed.tokens == int(lengths.sum()) - 3 * sum(prefixes)  # the rows' tokens, each prefix once
    assert torch.equal(packed.attention_mask, torch.ones_like(packed.input_ids))  # transformers builds no mask
    flat_ids, flat_pos = packed.input_ids[0], packed.position_ids[0]
    for row in range(batch.rows):
        n = int(lengths[row])
        index = layout.gather.view(batch.rows, -1)[row, :n]
        assert torch.equal(index, packed.flat_index[row, :n])
        assert torch.equal(flat_ids[index], batch.input_ids[row, :n]) and torch.equal(flat_pos[index], torch.arange(n))
    assert torch.equal(batch.input_ids.reshape(-1)[layout.take], flat_ids)  # each token's own row position
    assert torch.equal(layout.gather[layout.take], torch.arange(packed.tokens))
    x = torch.randn(packed.tokens, 3)
    assert torch.equal(layout.from_rows(layout.to_rows(x)), x)
    assert pack_groups(batch.input_ids[:1], batch.attention_mask[:1], batch.group_index[:1], FUSED_ATTENTION) is None
    empty = torch.zeros_like(batch.attention_mask[:4])  # rows without a token: nothing to pack
    assert pack_groups(batch.input_ids[:4], empty, batch.group_index[:4], FUSED_ATTENTION) is None


def test_packed_token_micro_batches_fit_the_budget_and_split_groups_by_rows(any_expansion):
    batch = shared_batch(seed=5, groups=4, group_size=4)
    lengths = batch.attention_mask.sum(-1).tolist()
    budget = 45
    plan = micro_batches(batch, 0, batch.rows, budget, share_prefix=True, rows_layout=True)
    assert plan[0][0] == 0 and plan[-1][1] == batch.rows and all(a[1] == b[0] for a, b in zip(plan, plan[1:]))
    for lo, hi in plan:
        packed = pack_groups(batch.input_ids[lo:hi], batch.attention_mask[lo:hi], batch.group_index[lo:hi],
                             FUSED_ATTENTION)  # fmt: skip
        tokens = packed.tokens if packed is not None else (hi - lo) * max(lengths[lo:hi])
        assert tokens <= budget or hi - lo == 1
    assert any(lo % 4 or hi % 4 for lo, hi in plan)  # groups split where the budget ends, not only between groups
    assert len(plan) < len(micro_batches(batch, 0, batch.rows, budget))  # fewer than unpacked
    single = batch.take(torch.arange(0, batch.rows, 4))  # one row per group: nothing shared, no padding
    single.attention_mask[:] = 1
    assert micro_batches(single, 0, single.rows, budget, share_prefix=True, rows_layout=True) == micro_batches(
        single, 0, single.rows, budget
    )


def test_a_train_step_on_packed_tokens_matches_row_by_row(monkeypatch, any_expansion):
    layouts = []
    real = packing.pack_tokens
    monkeypatch.setattr(packing, "pack_tokens", lambda *args: layouts.append(real(*args)) or layouts[-1])
    outcomes = {}
    for share in (False, True):
        model = tiny_model(seed=6)  # 8-wide heads: the kernels do not take them, SDPA attends the gathered rows
        batch = with_behavior(shared_batch(seed=6), copy.deepcopy(model), seed=2)
        fused_attention._register()
        model.config._attn_implementation = FUSED_ATTENTION
        cfg = tiny_config("loss.weighting=tis", "loss.cap=2.0", f"learner.share_prefix={str(share).lower()}")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        result = train_on_batch(model, optimizer, LossScaler(enabled=False), batch, cfg, AcrlReference(cfg.loss.acrl))
        outcomes[share] = (result, [p.detach().clone() for p in model.parameters()])
    (rows, rows_weights), (packed, packed_weights) = outcomes[False], outcomes[True]
    assert layouts and all(layout is not None and layout.rows is not None for layout in layouts)
    m = batch.mask.bool()
    torch.testing.assert_close(packed.prox_logp[m], rows.prox_logp[m], **LOGP_TOL)
    for key, value in rows.metrics.items():
        assert packed.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for a, b in zip(packed_weights, rows_weights):
        torch.testing.assert_close(a, b, rtol=0.0, atol=1e-6)


def test_long_prompts_before_short_responses_pack_as_masked_rows_on_the_fused_attention():
    batch = shared_batch(seed=3)  # prompts of most of each row
    lengths = batch.attention_mask.sum(-1)
    packed = pack_groups(batch.input_ids, batch.attention_mask, batch.group_index, FUSED_ATTENTION)
    assert packed is not None and packed.rows is None and packed.attention_mask.dim() == 4  # SDPA with the mask
    assert batch.rows * int(lengths.max()) > packing.ROWS_MAX_EXPANSION * (packed.input_ids != 0).sum()
    plan = micro_batches(batch, 0, batch.rows, 60, share_prefix=True, rows_layout=True)
    assert plan == micro_batches(batch, 0, batch.rows, 60, share_prefix=True)  # whole groups, as masked rows
    long = batch.take(torch.arange(batch.rows))  # the same prompts before 40-token responses: packed tokens
    long.input_ids = torch.cat([long.input_ids, torch.randint(1, VOCAB, (batch.rows, 40))], dim=1)
    long.attention_mask = torch.cat([long.attention_mask, torch.ones(batch.rows, 40, dtype=torch.long)], dim=1)
    long.input_ids[:, : int(lengths.min())] = batch.input_ids[:, : int(lengths.min())]
    long.attention_mask[:] = 1
    packed = pack_groups(long.input_ids, long.attention_mask, long.group_index, FUSED_ATTENTION)
    assert packed is not None and packed.rows is not None


def test_auto_micro_batch_budget_from_the_model_shape():
    from transformers import LlamaConfig

    tiny = torch.nn.Module()
    tiny.config = LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=4)  # builtin:tiny
    smol = torch.nn.Module()
    smol.config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30)  # SmolLM2-135M
    assert micro_batch_budget(0, tiny) > 128 * 16  # the built-in task's batch in one micro-batch
    assert 480 <= micro_batch_budget(0, smol) <= 540  # two groups of 8 x 16 after a 47-token prompt
    assert micro_batch_budget(100, smol) == 100
    assert micro_batch_budget(0, torch.nn.Linear(2, 2)) == 512  # no decoder config: the fallback


def test_updates_after_the_first_take_micro_batches_as_large_as_the_weights_and_memory_allow(monkeypatch):
    import learner.batch as batch_module
    import learner.update as update_module

    model = tiny_model(hidden=64, layers=2)
    per_token = batch_module.activation_bytes_per_token(model.config)
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    monkeypatch.setattr(batch_module, "AUTO_ACTIVATION_BYTES", 100 * per_token)  # a model this small: scaled down
    first = micro_batch_budget(0, model)
    assert first == 100
    roomy = micro_batch_budget(0, model, available_bytes=10**12)
    assert batch_module.PARAM_ACTIVATION_FACTOR * param_bytes > 100 * per_token
    assert roomy == batch_module.PARAM_ACTIVATION_FACTOR * param_bytes // per_token  # past the first update's
    tight = micro_batch_budget(0, model, available_bytes=8 * 110 * per_token)  # an eighth of it
    assert tight == 110
    assert micro_batch_budget(0, model, available_bytes=0) == first  # never below the first update's
    assert micro_batch_budget(100, model, available_bytes=10**12) == 100  # a configured budget stays
    seen = []
    real = update_module.micro_batch_budget
    monkeypatch.setattr(update_module, "micro_batch_budget", lambda *args: seen.append(args[2:]) or real(*args))
    cfg = tiny_config("loss.weighting=tis", "loss.cap=2.0")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        batch = with_behavior(shared_batch(seed=step), copy.deepcopy(model), seed=step)
        train_on_batch(model, optimizer, LossScaler(enabled=False), batch, cfg, AcrlReference(cfg.loss.acrl))
        assert seen and all((args[0] if args else None) is None for args in seen) is (step == 0), seen
        seen.clear()


def test_a_train_step_with_shared_prefixes_matches_row_by_row():
    outcomes = {}
    for share in (False, True):
        model = tiny_model(seed=6)
        batch = with_behavior(shared_batch(seed=6), copy.deepcopy(model), seed=2)
        cfg = tiny_config("loss.weighting=tis", "loss.cap=2.0", f"learner.share_prefix={str(share).lower()}")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        result = train_on_batch(model, optimizer, LossScaler(enabled=False), batch, cfg, AcrlReference(cfg.loss.acrl))
        mismatch = mismatch_metrics(batch.behav_logp, result.prox_logp, batch.mask, cfg.loss.cap)
        outcomes[share] = (result, mismatch, [p.detach().clone() for p in model.parameters()])
    (rows, rows_mismatch, rows_weights), (packed, packed_mismatch, packed_weights) = outcomes[False], outcomes[True]
    m = batch.mask.bool()
    torch.testing.assert_close(packed.prox_logp[m], rows.prox_logp[m], **LOGP_TOL)
    for key, value in rows_mismatch.items():
        assert packed_mismatch[key] == pytest.approx(value, abs=2e-6), key
    for key, value in rows.metrics.items():
        assert packed.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for a, b in zip(packed_weights, rows_weights):
        torch.testing.assert_close(a, b, rtol=0.0, atol=1e-6)
    assert VOCAB > 7  # shared_batch's common first response token is in the vocabulary


def _fsdp_rank(rank: int, world: int, address: str, out_path: str) -> None:
    """A rank of the FSDP2 test: its rows' packed log-probs and the full gradients of a weighted log-prob sum."""
    from learner.batch import rank_rows
    from learner.distributed import close, init_distributed, shard_model

    torch.set_num_threads(1)
    ranks = init_distributed(rank, world, address)
    model, batch = tiny_model(seed=7), shared_batch(seed=7, groups=4)
    shard_model(model)
    lo, hi = rank_rows(0, batch.rows, rank, world)
    rows = batch.select(lo, hi)
    assert pack_groups(rows.input_ids, rows.attention_mask, rows.group_index, "eager") is not None
    logp, _ = token_logp(model, rows, 0.7, share_prefix=True)
    weights = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(9)) * batch.mask
    (logp * weights[lo:hi]).sum().mul(world).backward()  # FSDP2 averages over ranks
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    torch.save({"logp": logp.detach(), "grads": grads}, out_path % rank)
    close(ranks)


def test_fsdp2_ranks_pack_their_rows_and_give_the_single_process_gradients(tmp_path):
    import multiprocessing

    import torch.multiprocessing as mp

    from learner.batch import rank_rows
    from learner.distributed import local_rendezvous

    multiprocessing.get_context("forkserver").set_forkserver_preload([__name__])
    out_path = str(tmp_path / "rank%d.pt")
    mp.start_processes(_fsdp_rank, args=(2, local_rendezvous(str(tmp_path)), out_path), nprocs=2, join=True,
                       start_method="forkserver")  # fmt: skip
    shards = [torch.load(out_path % rank, weights_only=False) for rank in range(2)]
    model, batch = tiny_model(seed=7), shared_batch(seed=7, groups=4)
    weights = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(9)) * batch.mask
    for rank, shard in enumerate(shards):  # row by row, single process
        lo, hi = rank_rows(0, batch.rows, rank, 2)
        rows = batch.select(lo, hi)
        logp, _ = token_logp(model, rows, 0.7)
        (logp * weights[lo:hi]).sum().backward()
        m = rows.mask.bool()
        torch.testing.assert_close(shard["logp"][m], logp.detach()[m], **LOGP_TOL)
    for name, param in model.named_parameters():
        for shard in shards:
            tolerance = GRAD_TOL * float(param.grad.abs().max())
            torch.testing.assert_close(shard["grads"][name], param.grad, rtol=0.0, atol=tolerance)
