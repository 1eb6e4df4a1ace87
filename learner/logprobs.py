"""Response log-probs with the LM head only where a loss is: the decoder body, then the head in chunks of rows.

    input_ids (B, S) --decoder body--> hidden (B, S, H) --rows at positions p - 1 of the loss tokens--> (N, H)
      --chunks of `chunk_rows(V)` rows: head --> fp32 logits / temperature --> log_softmax --> the sampled token's
        log-prob, and the entropy (no grad)--> logp (B, T), entropy (B, T); 0 where the mask is 0

Inside `entropy_with_grad()` (`loss.entropy_coef > 0`) the entropy comes from the same chunk with its gradient: the
chunk returns both, checkpointed alike, so no extra full-vocabulary tensor outlives the chunk.

The logits of the whole batch, (B, S, V) in fp32 (49,152 x 63 x 64 floats for SmolLM2-135M and 64 sequences of
63 tokens), are never held: a chunk's logits live while its log-probs are computed. With gradients and several
chunks, each is checkpointed (`torch.utils.checkpoint`), so backward recomputes its logits instead of storing them
(one more head GEMM over the loss positions, against a head over every position before); a single chunk keeps its
log-softmax for backward. The arithmetic per position is unchanged (the head on the same hidden state, `.float()`,
the division by the temperature, log_softmax, gather and the entropy's sum, under the caller's autocast), so the
values agree with the whole-sequence computation to rounding (the head's GEMM sees fewer rows;
tests/unit/learner/test_logprobs.py). Liger-Kernel's fused linear cross-entropy is Triton (GPU) only; torch's
chunked `F.linear_cross_entropy` runs on CPU but gives the cross-entropy alone: no entropy, and a temperature only
by scaling an operand, which rounds differently from dividing the fp32 logits.

The decoder body is called directly, so the model's own forward (and its hooks) does not run. Under FSDP2 the root
unit (embeddings, final norm, head) gathers its parameters only around a registered forward method: the pass is
registered as one on the root (`register_fsdp_forward_method`), so the root's parameters are gathered for it,
resharded after it and gathered again for backward, as around the model's forward. Heads that are not a plain
linear map of the last hidden state (logit soft-capping, logit scaling: model types outside `PLAIN_HEAD_TYPES`)
take the whole-sequence path, as does a batch without loss positions.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from contextvars import ContextVar

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from learner.devices import model_device
from learner.packing import pack_groups

LOGITS_CHUNK_ELEMENTS = 2**24
"""Logits per chunk (rows x vocabulary): 64 MiB in fp32; backward holds a few tensors of this size at a time."""
PLAIN_HEAD_TYPES = ("llama", "qwen2", "qwen3", "mistral")
"""Model types whose causal-LM forward is `lm_head(last hidden state)` (the embedded engine's families)."""
_FSDP_METHOD = "asyncrl_response_logp"
_ENTROPY_GRAD: ContextVar[bool] = ContextVar("asyncrl_entropy_grad", default=False)


@contextlib.contextmanager
def entropy_with_grad(enabled: bool = True) -> Iterator[None]:
    """Inside this block (when `enabled`), `response_logp` under grad returns the entropies with their gradient, for
    the entropy bonus (`loss.entropy_coef`); outside it they are detached and cost no backward."""
    token = _ENTROPY_GRAD.set(enabled)
    try:
        yield
    finally:
        _ENTROPY_GRAD.reset(token)


def _entropy_grad() -> bool:
    return torch.is_grad_enabled() and _ENTROPY_GRAD.get()


def chunk_rows(vocab: int) -> int:
    """Loss positions per head chunk for a vocabulary of `vocab` tokens."""
    return max(1, LOGITS_CHUNK_ELEMENTS // vocab)


def response_logp(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_pos: torch.Tensor,
    response_ids: torch.Tensor,
    mask: torch.Tensor,
    temperature: float,
    groups: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (B, T) of `response_ids` at `response_pos` of `input_ids` under `model` at `temperature`, with
    grad, and entropies (B, T) without (with, inside `entropy_with_grad`); both 0 where `mask` is 0.

    input_ids, attention_mask: (B, S); response_pos (position of each response token), response_ids, mask: (B, T).
    `groups` (B,): the rows' group ids, to run each group's shared prefix once (`learner.packing`); None: row by row.
    """
    home, device = mask.device, model_device(model)
    if device != home:  # a GPU learner (`learner.devices`): the inputs go to the model, the results come back
        moved = [t.to(device) for t in (input_ids, attention_mask, response_pos, response_ids, mask)]
        input_ids, attention_mask, response_pos, response_ids, mask = moved  # `groups` stay: packing reads them there
    if not _plain_head(model) or not bool(mask.any()):
        args = (input_ids, attention_mask, response_pos, response_ids, mask, temperature)
        logp, entropy = full_logits_logp(model, *args)
    else:
        args = (input_ids, attention_mask, response_pos, response_ids, mask, temperature, groups)
        logp, entropy = _fsdp_method(model)(*args) if _is_fsdp(model) else _loss_positions_logp(model, *args)
    return logp.to(home), entropy.to(home)  # differentiable copies; no-ops on one device


def _loss_positions_logp(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_pos: torch.Tensor,
    response_ids: torch.Tensor,
    mask: torch.Tensor,
    temperature: float,
    groups: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder body once (each group's shared prefix once, when `groups` are given and it pays: `learner.packing`),
    the head at the N loss positions in chunks; `response_logp`'s result."""
    decoder = model.get_decoder()
    input_ids, attention_mask = inputs_read(input_ids, attention_mask)
    packed = None
    if groups is not None:
        attn = getattr(model.config, "_attn_implementation", None)
        packed = pack_groups(input_ids.cpu(), attention_mask.cpu(), groups.cpu(), attn)  # a layout built on the CPU,
        packed = None if packed is None else packed.to(input_ids.device)  # then where the model is
    rows, cols = mask.nonzero(as_tuple=True)  # (N,) each
    positions = (response_pos[rows, cols] - 1).clamp_min(0)  # the hidden state at p - 1 predicts token p
    if packed is None:
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        picked = hidden[rows, positions]  # (N, H) of hidden (B, S, H)
    else:
        hidden = decoder(
            input_ids=packed.input_ids,
            attention_mask=packed.attention_mask,
            position_ids=packed.position_ids,
            use_cache=False,
            **packed.call_kwargs(),
        ).last_hidden_state  # (P, L, H)
        picked = hidden.reshape(-1, hidden.shape[-1])[packed.flat_index[rows, positions]]  # (N, H)
    logp, entropy = head_logp(model.get_output_embeddings(), picked, response_ids[rows, cols], temperature)
    zeros = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    return zeros.index_put((rows, cols), logp), zeros.index_put((rows, cols), entropy)


def inputs_read(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens whose hidden states the loss reads: each right-padded row without its last token (of two or more),
    which is only a target (the hidden state at p - 1 predicts token p; none follows the last one). Under the causal
    mask no earlier position sees it, so the others' hidden states are unchanged; the decoder runs on B fewer tokens
    (a fifth of the built-in task's packed tokens, whose responses are ~3 tokens)."""
    lengths = attention_mask.sum(-1)
    trimmed = attention_mask.clone()
    rows = (lengths >= 2).nonzero(as_tuple=True)[0]
    trimmed[rows, lengths[rows] - 1] = 0
    width = max(int(trimmed.sum(-1).max()), 1)
    return input_ids[:, :width], trimmed[:, :width]


def head_logp(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(head(hidden) / temperature) at `targets` (N,), with grad to `hidden` (N, H) and the head, and the
    entropies (N,) without (with, inside `entropy_with_grad`); in chunks of `chunk_rows` rows. With gradients, the
    chunks are checkpointed when there are several; a single chunk keeps its log-softmax (at most
    `LOGITS_CHUNK_ELEMENTS`) for backward instead."""
    step = chunk_rows(head.weight.shape[0])
    recompute = torch.is_grad_enabled() and hidden.shape[0] > step
    with_grad = _entropy_grad()  # read once: a checkpoint's recomputation in backward runs outside the block
    logps, entropies = [], []
    for lo in range(0, hidden.shape[0], step):
        if with_grad:  # both from one chunk function, so a checkpoint recomputes the logits once for both
            pair = (head, hidden[lo : lo + step], targets[lo : lo + step], temperature)
            if recompute:
                logp, entropy = checkpoint(_chunk_logp_entropy, *pair, use_reentrant=False, preserve_rng_state=False)
            else:
                logp, entropy = _chunk_logp_entropy(*pair)
            logps.append(logp)
            entropies.append(entropy)
            continue
        sink: list[torch.Tensor] = []
        args = (head, hidden[lo : lo + step], targets[lo : lo + step], temperature, sink)
        if recompute:
            logps.append(checkpoint(_chunk_logp, *args, use_reentrant=False, preserve_rng_state=False))
        else:
            logps.append(_chunk_logp(*args))
        entropies.append(sink[0])
    return torch.cat(logps), torch.cat(entropies)


def _chunk_logp(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, sink: list[torch.Tensor]
) -> torch.Tensor:
    """One chunk: the sampled tokens' log-probs (C,); the entropies (C,) go to `sink` on the first call only (the
    recomputation in backward skips them)."""
    logits = head(hidden).float()  # (C, V)
    logp_all = torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)  # x / 1 == x
    if not sink:
        with torch.no_grad():
            sink.append(-(logp_all.exp() * logp_all).sum(-1))
    return logp_all.gather(-1, targets[:, None]).squeeze(-1)


def _chunk_logp_entropy(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk, entropy with gradient: the sampled tokens' log-probs (C,) and the entropies -sum p log p (C,)."""
    logits = head(hidden).float()  # (C, V)
    logp_all = torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


def full_logits_logp(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_pos: torch.Tensor,
    response_ids: torch.Tensor,
    mask: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole-sequence path: the model's forward, fp32 logits at every position; `response_logp`'s result."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()  # (B, S, V)
    pos = (response_pos - 1).clamp_min(0)  # logits at position p predict token p + 1
    picked = logits.gather(1, pos[..., None].expand(-1, -1, logits.shape[-1])) / temperature  # (B, T, V)
    logp_all = torch.log_softmax(picked, dim=-1)
    logp = logp_all.gather(-1, response_ids[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp * mask, entropy * mask if _entropy_grad() else (entropy * mask).detach()


def _plain_head(model: torch.nn.Module) -> bool:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) in PLAIN_HEAD_TYPES and hasattr(model, "get_decoder")


def _is_fsdp(model: torch.nn.Module) -> bool:
    if not (dist.is_available() and dist.is_initialized()):
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _fsdp_method(model: torch.nn.Module) -> types.MethodType:
    """The loss-positions pass as a forward method of the FSDP2 root (registered once per model)."""
    method = model.__dict__.get(_FSDP_METHOD)  # nn.Module keeps plain attributes in its __dict__
    if method is None:
        from torch.distributed.fsdp import register_fsdp_forward_method

        setattr(model, _FSDP_METHOD, types.MethodType(_loss_positions_logp, model))
        register_fsdp_forward_method(model, _FSDP_METHOD)
        method = getattr(model, _FSDP_METHOD)
    return method
