"""Log-probs with the LM head at loss positions only, in chunks = the whole-sequence computation, to 1e-6.

`whole_sequence_logp` is the learner's computation before issue 26 (the model's forward, fp32 logits at every
position, then the response positions), kept here as the reference.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_learner import VOCAB, tiny_batch, tiny_config, tiny_model, with_behavior

import learner.logprobs as logprobs
import learner.update as update
from learner.acrl import AcrlReference
from learner.aligned import make_rollout_aligned
from learner.batch import Batch, rank_rows, token_logp
from learner.losses import mismatch_metrics
from learner.precision import LossScaler, autocast
from learner.update import train_on_batch

TOL = {"rtol": 1e-6, "atol": 1e-6}  # a few fp32 ulps: chunked and whole-sequence GEMMs block differently


def whole_sequence_logp(
    model: torch.nn.Module, batch: Batch, temperature: float, share_prefix: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row by row whatever `share_prefix` says (the learner's signature)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    pos = (batch.response_pos - 1).clamp_min(0)  # logits at position p predict token p + 1
    picked = logits.gather(1, pos[..., None].expand(-1, -1, logits.shape[-1])) / temperature  # (B, T, V)
    logp_all = torch.log_softmax(picked, dim=-1)
    logp = logp_all.gather(-1, batch.response_ids[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy.detach()


def tied_model(seed: int = 0) -> torch.nn.Module:
    """tiny_model with the head tied to the embeddings (as SmolLM's)."""
    model = tiny_model(seed)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _compare(model: torch.nn.Module, batch: Batch, temperature: float, precision: str = "fp32") -> None:
    """Values at the loss positions, zeros elsewhere, and the gradients of a weighted sum of log-probs."""
    weights = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(4)) * batch.mask
    results = {}
    for name, fn in (("old", whole_sequence_logp), ("new", token_logp)):
        with autocast(precision):
            logp, entropy = fn(model, batch, temperature)
        (logp * weights).sum().backward()
        results[name] = (logp.detach(), entropy, _grads(model))
    (old_logp, old_entropy, old_grads), (new_logp, new_entropy, new_grads) = results["old"], results["new"]
    m = batch.mask.bool()
    torch.testing.assert_close(new_logp[m], old_logp[m], **TOL)
    torch.testing.assert_close(new_entropy[m], old_entropy[m], **TOL)
    assert not new_logp[~m].any() and not new_entropy[~m].any() and not new_entropy.requires_grad
    head = next(name for name, p in model.named_parameters() if p is model.lm_head.weight)  # tied: the embeddings
    assert old_grads.keys() == new_grads.keys() and head in new_grads
    # Summation order differs where the head's GEMM sees fewer rows: rounding, at the precision's resolution.
    resolution = 1e-6 if precision == "fp32" else 2**-6  # bf16 gradients come out of bf16 GEMMs
    for key, grad in old_grads.items():
        torch.testing.assert_close(new_grads[key], grad, rtol=0.0, atol=resolution * float(grad.abs().max()))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("make", [tiny_model, tied_model])
def test_loss_positions_match_the_whole_sequence_with_gradients(make, temperature, monkeypatch):
    monkeypatch.setattr(logprobs, "LOGITS_CHUNK_ELEMENTS", 5 * VOCAB)  # several chunks of 5 rows
    model, batch = make(), tiny_batch(groups=3, group_size=4)
    _compare(model, batch, temperature)
    if make is tied_model:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_bf16_autocast_matches_the_whole_sequence(monkeypatch):
    monkeypatch.setattr(logprobs, "LOGITS_CHUNK_ELEMENTS", 7 * VOCAB)
    _compare(tiny_model(seed=2), tiny_batch(seed=2), 1.0, precision="bf16")


def test_rollout_aligned_forward_matches_the_whole_sequence():
    model = tiny_model(seed=3)
    make_rollout_aligned(model, "int8")
    _compare(model, tiny_batch(seed=3), 1.0)


def test_the_head_sees_only_loss_positions_in_chunks(monkeypatch):
    monkeypatch.setattr(logprobs, "LOGITS_CHUNK_ELEMENTS", 4 * VOCAB)
    model, batch = tiny_model(), tiny_batch()
    rows_per_call: list[int] = []
    model.lm_head.register_forward_hook(lambda _m, args, _out: rows_per_call.append(args[0].shape[0]))
    logp, _ = token_logp(model, batch, 1.0)
    assert sum(rows_per_call) == int(batch.mask.sum()) and max(rows_per_call) == 4  # forward: each position once
    logp.sum().backward()
    assert sum(rows_per_call) == 2 * int(batch.mask.sum())  # backward recomputes each chunk's logits once
    with torch.no_grad():
        token_logp(model, batch, 1.0)
    assert sum(rows_per_call) == 3 * int(batch.mask.sum())
    monkeypatch.setattr(logprobs, "LOGITS_CHUNK_ELEMENTS", 1000 * VOCAB)  # one chunk: kept for backward instead
    rows_per_call.clear()
    token_logp(model, batch, 1.0)[0].sum().backward()
    assert rows_per_call == [int(batch.mask.sum())]


@pytest.mark.parametrize("weighting", ["tis", "acrl"])
def test_a_train_step_keeps_its_log_probs_metrics_and_update(weighting, monkeypatch):
    """The whole step (proximal pass or not, micro-batches, AdamW) and the mismatch metrics, old against new."""
    outcomes = {}
    for name, fn in (("old", whole_sequence_logp), ("new", token_logp)):
        monkeypatch.setattr(update, "token_logp", fn)
        model = tiny_model(seed=1)
        batch = with_behavior(tiny_batch(seed=1), copy.deepcopy(model), seed=2)
        cfg = tiny_config(f"loss.weighting={weighting}", "learner.micro_batch_tokens=20", "loss.cap=2.0")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        result = train_on_batch(model, optimizer, LossScaler(enabled=False), batch, cfg, AcrlReference(cfg.loss.acrl))
        mismatch = mismatch_metrics(batch.behav_logp, result.prox_logp, batch.mask, cfg.loss.cap)
        outcomes[name] = (result, mismatch, [p.detach().clone() for p in model.parameters()])
    (old, old_mismatch, old_weights), (new, new_mismatch, new_weights) = outcomes["old"], outcomes["new"]
    m = batch.mask.bool()
    torch.testing.assert_close(new.prox_logp[m], old.prox_logp[m], **TOL)
    torch.testing.assert_close(new.entropy[m], old.entropy[m], **TOL)
    assert new_mismatch.keys() == old_mismatch.keys() and new.metrics.keys() == old.metrics.keys()
    for key, value in old_mismatch.items():
        assert new_mismatch[key] == pytest.approx(value, abs=1e-6), key
    for key, value in old.metrics.items():
        assert new.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for a, b in zip(new_weights, old_weights):
        torch.testing.assert_close(a, b, **TOL)


def test_models_without_a_plain_head_take_the_whole_sequence_path():
    model, batch = tiny_model(), tiny_batch()
    expected, _ = whole_sequence_logp(model, batch, 1.0)
    model.config.model_type = "gemma2"  # soft-capped logits: the head is not lm_head(hidden) alone
    calls: list[int] = []
    model.register_forward_hook(lambda *_: calls.append(1))
    logp, _ = token_logp(model, batch, 1.0)
    assert calls == [1]
    torch.testing.assert_close(logp, expected * batch.mask, rtol=0, atol=0)


def _fsdp_rank(rank: int, world: int, address: str, out_path: str) -> None:
    """A rank of the FSDP2 test: its rows' log-probs and the full gradients of a weighted log-prob sum."""
    from learner.distributed import close, init_distributed, shard_model

    torch.set_num_threads(1)
    ranks = init_distributed(rank, world, address)
    model, batch = tied_model(seed=6), tiny_batch(seed=6)
    shard_model(model)
    lo, hi = rank_rows(0, batch.rows, rank, world)
    logp, entropy = token_logp(model, batch.select(lo, hi), 0.7)
    (logp * _fsdp_weights(batch)[lo:hi]).sum().mul(world).backward()  # FSDP2 averages over ranks
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    registered = logprobs._FSDP_METHOD in model.__dict__
    torch.save({"logp": logp.detach(), "entropy": entropy, "grads": grads, "registered": registered}, out_path % rank)
    close(ranks)


def _fsdp_weights(batch: Batch) -> torch.Tensor:
    return torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(9)) * batch.mask


def test_fsdp2_ranks_give_the_single_process_log_probs_and_gradients(tmp_path):
    """Tied embeddings in the FSDP2 root: the loss-positions pass runs as a registered forward of the root."""
    import multiprocessing

    import torch.multiprocessing as mp

    from learner.distributed import local_rendezvous

    multiprocessing.get_context("forkserver").set_forkserver_preload([__name__])
    out_path = str(tmp_path / "rank%d.pt")
    mp.start_processes(_fsdp_rank, args=(2, local_rendezvous(str(tmp_path)), out_path), nprocs=2, join=True,
                       start_method="forkserver")  # fmt: skip
    shards = [torch.load(out_path % rank, weights_only=False) for rank in range(2)]
    assert all(shard["registered"] for shard in shards)
    model, batch = tied_model(seed=6), tiny_batch(seed=6)
    weights = _fsdp_weights(batch)
    for rank, shard in enumerate(shards):  # the reference sees each rank's rows (trimmed alike)
        lo, hi = rank_rows(0, batch.rows, rank, 2)
        rows = batch.select(lo, hi)
        logp, entropy = whole_sequence_logp(model, rows, 0.7)
        (logp * weights[lo:hi]).sum().backward()
        m = rows.mask.bool()
        torch.testing.assert_close(shard["logp"][m], logp.detach()[m], **TOL)
        torch.testing.assert_close(shard["entropy"][m], entropy[m], **TOL)
    for name, param in model.named_parameters():
        for shard in shards:
            tolerance = 1e-6 * float(param.grad.abs().max())
            torch.testing.assert_close(shard["grads"][name], param.grad, rtol=0.0, atol=tolerance)


def test_the_decoder_runs_without_each_rows_last_token_and_the_log_probs_are_unchanged():
    batch = tiny_batch(seed=6)
    ids, mask = logprobs.inputs_read(batch.input_ids, batch.attention_mask)
    lengths = batch.attention_mask.sum(-1)
    assert mask.sum(-1).tolist() == (lengths - 1).tolist() and ids.shape[1] == int(lengths.max()) - 1
    assert torch.equal(ids, batch.input_ids[:, : ids.shape[1]])
    one = torch.tensor([[5, 0], [5, 6]]), torch.tensor([[1, 0], [1, 1]])  # a row of one token keeps it
    assert logprobs.inputs_read(*one)[1].tolist() == [[1], [1]]
    model = tiny_model(seed=6)
    for share_prefix in (False, True):
        logp, entropy = token_logp(model, batch, 1.0, share_prefix)
        ref_logp, ref_entropy = whole_sequence_logp(model, batch, 1.0)
        m = batch.mask.bool()
        torch.testing.assert_close(logp[m], ref_logp[m], **TOL)
        torch.testing.assert_close(entropy[m], ref_entropy[m], **TOL)
