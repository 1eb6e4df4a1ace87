"""Prompt log-probs of the embedded engine (SGLang's input log-probs): one forward over a prompt, every position's
next-token distribution kept; its K/V goes nowhere, so it can run between any two scheduler steps."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rollout_workers.embedded.model import (
    ArchConfig,
    ModelWeights,
    _heads,
    _mlp_block,
    linear,
    low_rank_linear,
    rms_norm,
    rope_tables,
)


@torch.inference_mode()
def prompt_logprobs(
    arch: ArchConfig, weights: ModelWeights, dtype: torch.dtype, prompt: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """Log-probs (S, V) fp32 of the next token at every position of `prompt`: row p is
    `log_softmax(logits_p / temperature)` (`EmbeddedEngine.prompt_logprobs`). Tensors are made on the default
    device (the engine's, in its device scope)."""
    seq = len(prompt)
    tokens = torch.tensor(prompt, dtype=torch.long)
    cos, sin = (table.to(dtype)[None, None] for table in rope_tables(arch, seq))
    sin = torch.cat((-sin[..., : arch.head_dim // 2], sin[..., arch.head_dim // 2 :]), -1)
    x = weights.embed[tokens]
    h = rms_norm(x, weights.layers[0].input_norm, arch.rms_norm_eps)
    for i, layer in enumerate(weights.layers):
        qkv = low_rank_linear(h, layer.qkv, layer.qkv_bias, layer.qkv_lora)
        q, k, v = _heads(arch, layer, qkv.view(1, seq, -1), cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=arch.num_kv_heads != arch.num_heads)
        attn = out.transpose(1, 2).reshape(seq, arch.num_heads * arch.head_dim)
        next_norm = weights.layers[i + 1].input_norm if i + 1 < len(weights.layers) else weights.norm
        x, h = _mlp_block(arch, layer, x, attn, next_norm, False)
    logits = linear(h, weights.head, None).to(torch.float32)
    return torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1).cpu()
