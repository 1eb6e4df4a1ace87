"""Shared by the learner tests (and their spawned ranks): a tiny seeded Llama, a seeded batch, update sections.

The weights are written from our own seeded generator, not by transformers' initialisers, so the golden numbers
depend only on the Llama forward and on our loss math.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common.config import load_config
from common.wire import Trajectory
from learner.batch import Batch
from learner.device_check import seeded_
from learner.sections import UpdateSections

VOCAB = 24


def tiny_model(seed: int = 0, hidden: int = 32, layers: int = 2) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    return seeded_(LlamaForCausalLM(config), seed, scale=0.15).train()


def tiny_batch(seed: int = 0, groups: int = 3, group_size: int = 4, one_length: bool = False) -> Batch:
    """Responses of 3..8 tokens after prompts of 3..5 tokens (`one_length`: every row 5 + 8, no padding); behavior
    log-probs set by `with_behavior`."""
    gen = torch.Generator().manual_seed(seed)
    n = groups * group_size
    prompt_len = torch.randint(3, 6, (n,), generator=gen)
    resp_len = torch.randint(3, 9, (n,), generator=gen)
    if one_length:
        prompt_len, resp_len = torch.full((n,), 5), torch.full((n,), 8)
    seq_len, t_len = int((prompt_len + resp_len).max()), int(resp_len.max())
    input_ids = torch.zeros((n, seq_len), dtype=torch.long)
    attention = torch.zeros((n, seq_len), dtype=torch.long)
    response_pos = torch.zeros((n, t_len), dtype=torch.long)
    response_ids = torch.zeros((n, t_len), dtype=torch.long)
    mask = torch.zeros((n, t_len))
    for i in range(n):
        p, r = int(prompt_len[i]), int(resp_len[i])
        input_ids[i, : p + r] = torch.randint(1, VOCAB, (p + r,), generator=gen)
        attention[i, : p + r] = 1
        response_pos[i, :r] = torch.arange(p, p + r)
        response_ids[i, :r] = input_ids[i, p : p + r]
        mask[i, :r] = 1.0
    rewards = torch.randint(0, 2, (n,), generator=gen).double()  # float64, as `learner.batch.collate` gives them
    return Batch(
        input_ids=input_ids,
        attention_mask=attention,
        response_pos=response_pos,
        response_ids=response_ids,
        mask=mask,
        behav_logp=torch.zeros((n, t_len)),
        versions=torch.zeros((n, t_len), dtype=torch.long),
        rewards=rewards,
        correct=rewards.float(),
        group_index=torch.arange(groups).repeat_interleave(group_size),
        truncated=resp_len == 8,
    )


@torch.no_grad()
def with_behavior(batch: Batch, model: torch.nn.Module, seed: int = 1, noise: float = 0.3) -> Batch:
    """Behavior log-probs = the model's log-probs plus seeded noise (a quantized, stale rollout), kept <= 0."""
    from learner.batch import token_logp

    logp, _ = token_logp(model, batch, temperature=1.0)
    gen = torch.Generator().manual_seed(seed)
    batch.behav_logp = ((logp + noise * torch.randn(logp.shape, generator=gen)).clamp_max(0.0)) * batch.mask
    return batch


def tiny_config(*overrides: str) -> UpdateSections:
    """The sections an update reads, of a config validated with `overrides` (`key=value`) on a few test defaults."""
    base = ("rollout.max_new_tokens=8", "rollout.temperature=1.0", "algo.overlong.len=2", "optim.lr=1e-3")
    return UpdateSections.pick(load_config(None, [*base, *overrides]))


def random_groups(
    vocab: int, versions: list[int] | tuple[int, ...] = (0,), n_groups: int = 2, size: int = 4
) -> list[list[Trajectory]]:
    """Groups of random responses; response i of a group was generated at `versions[i % len(versions)]`."""
    rng = np.random.default_rng(0)
    groups = []
    for g in range(n_groups):
        group = []
        for i in range(size):
            r = int(rng.integers(2, 6))
            group.append(
                Trajectory(
                    uid=f"g{g}/{i}",
                    group=f"g{g}",
                    prompt_index=g,
                    prompt_ids=rng.integers(3, vocab, 4).astype(np.int32),
                    response_ids=rng.integers(3, vocab, r).astype(np.int32),
                    behav_logp=-rng.uniform(0.5, 3.0, r).astype(np.float32),
                    versions=np.full(r, versions[i % len(versions)], dtype=np.int32),
                    reward=float(i % 2),
                    correct=bool(i % 2),
                    finish="stop",
                    worker="w",
                    t_start=0.0,
                    t_end=1.0,
                )  # fmt: skip
            )
        groups.append(group)
    return groups
