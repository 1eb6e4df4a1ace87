"""The supervised warm-up every built-in model recipe shares: a fresh Llama-family model of a recipe's shape, then
AdamW on (prompt, answer) examples with a linear ramp and a cosine decay of the learning rate.

What an example is (a plain answer, a noisy one, a calculator call) is the recipe's own (`common.builtin_model`,
`common.builtin_tool`); torch and transformers are imported inside the functions (`common` stays torch-free).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any, Protocol

Example = tuple[list[int], list[int]]
"""Token ids of one example and its labels (-100 where no loss is: the prompt, a tool's output)."""


class ModelShape(Protocol):
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_positions: int
    seed: int
    warmup_steps: int
    batch_size: int
    lr: float


def new_model(recipe: ModelShape, tokenizer: Any) -> Any:
    """A randomly initialised LlamaForCausalLM of the recipe's shape (tied embeddings), seeded by `recipe.seed`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(recipe.seed)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        max_position_embeddings=recipe.max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rms_norm_eps=1e-5,
    )
    return LlamaForCausalLM(config)


def warm_up(model: Any, recipe: ModelShape, pad_id: int, example: Callable[[int], Example], ramp_steps: int) -> float:
    """`recipe.warmup_steps` AdamW steps of `recipe.batch_size` examples (`example(index)` for index 0, 1, ...),
    learning rate `recipe.lr` ramped over `ramp_steps` then cosine-decayed, gradients clipped to norm 1. Leaves the
    model in eval mode; returns the last step's loss."""
    import torch

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.01, betas=(0.9, 0.98))
    index = 0
    loss = torch.tensor(float("nan"))
    for step in range(recipe.warmup_steps):
        rows, labels = [], []
        for _ in range(recipe.batch_size):
            row, label = example(index)
            index += 1
            rows.append(row)
            labels.append(label)
        width = max(len(r) for r in rows)
        input_ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows])
        label_ids = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
        attention = (torch.arange(width)[None, :] < torch.tensor([len(r) for r in rows])[:, None]).long()
        lr_scale = min(1.0, (step + 1) / ramp_steps) * 0.5 * (1 + math.cos(math.pi * step / recipe.warmup_steps))
        for group in optimizer.param_groups:
            group["lr"] = recipe.lr * lr_scale
        loss = model(input_ids=input_ids, attention_mask=attention, labels=label_ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    model.eval()
    return float(loss.detach())
