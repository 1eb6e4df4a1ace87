"""The embedded engine's Llama-family forward: RMSNorm, RoPE, grouped-query attention, SwiGLU, with a KV cache.

Reads a Hugging Face `config.json` (Llama, Qwen2 with q/k/v biases, Qwen3 with q/k norms, SmolLM) and runs on a
name -> tensor weight map whose linear weights are either float tensors or `QuantizedWeight`s (W8A8). The weight
map is swapped as a whole object between decode steps, so a step never mixes two versions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from quant_sync.quantizers import QuantizedWeight, quantized_linear

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
LINEAR_SUFFIXES = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip


class ModelDirError(ValueError):
    """A model directory that cannot be served: missing files, unsupported architecture, bad config."""


@dataclass(frozen=True, slots=True)
class ArchConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    max_positions: int

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ArchConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelDirError(f"{model_dir}: no config.json (is this a Hugging Face model directory?)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ModelDirError(f"{path}: invalid JSON: {err}") from err
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelDirError(
                f"{path}: model_type {model_type!r} is not supported by the embedded engine "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            rope = raw.get("rope_parameters") or {}
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
            return cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                eos_token_ids=eos_ids,
                max_positions=int(raw.get("max_position_embeddings", 4096)),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ModelDirError(f"{path}: missing or invalid field: {err}") from err


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(weight, QuantizedWeight):
        return quantized_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def rope_tables(arch: ArchConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape positions.shape + (head_dim,), HF's rotate-half layout."""
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, arch.head_dim, 2, dtype=torch.float32) / arch.head_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, S, D); cos/sin (B, S, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class KVCache:
    """Preallocated keys and values: (layers, batch, kv_heads, max_len, head_dim)."""

    def __init__(self, arch: ArchConfig, batch: int, max_len: int, dtype: torch.dtype = torch.float32):
        shape = (arch.num_layers, batch, arch.num_kv_heads, max_len, arch.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype)
        self.values = torch.zeros(shape, dtype=dtype)


def forward(
    arch: ArchConfig,
    weights: dict[str, torch.Tensor | QuantizedWeight],
    tokens: torch.Tensor,  # (B, S) int64
    positions: torch.Tensor,  # (B, S) int64
    cache: KVCache,
    cache_start: int,  # slot of tokens[:, 0] in the cache
    attn_mask: torch.Tensor,  # (B, 1, S, cache_start + S) bool, True = attend
) -> torch.Tensor:
    """Run S new tokens through the model, writing their K/V into the cache; returns last-position logits (B, V)."""
    x = weights["model.embed_tokens.weight"][tokens]
    cos, sin = rope_tables(arch, positions)
    batch, seq = tokens.shape
    end = cache_start + seq
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        h = rms_norm(x, weights[p + "input_layernorm.weight"], arch.rms_norm_eps)
        q = linear(h, weights[p + "self_attn.q_proj.weight"], weights.get(p + "self_attn.q_proj.bias"))
        k = linear(h, weights[p + "self_attn.k_proj.weight"], weights.get(p + "self_attn.k_proj.bias"))
        v = linear(h, weights[p + "self_attn.v_proj.weight"], weights.get(p + "self_attn.v_proj.bias"))
        q = q.view(batch, seq, arch.num_heads, arch.head_dim).transpose(1, 2)
        k = k.view(batch, seq, arch.num_kv_heads, arch.head_dim).transpose(1, 2)
        v = v.view(batch, seq, arch.num_kv_heads, arch.head_dim).transpose(1, 2)
        if p + "self_attn.q_norm.weight" in weights:  # Qwen3
            q = rms_norm(q, weights[p + "self_attn.q_norm.weight"], arch.rms_norm_eps)
            k = rms_norm(k, weights[p + "self_attn.k_norm.weight"], arch.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.keys[i, :, :, cache_start:end] = k
        cache.values[i, :, :, cache_start:end] = v
        attn = F.scaled_dot_product_attention(
            q, cache.keys[i, :, :, :end], cache.values[i, :, :, :end], attn_mask=attn_mask,
            enable_gqa=arch.num_kv_heads != arch.num_heads,
        )  # fmt: skip
        attn = attn.transpose(1, 2).reshape(batch, seq, arch.num_heads * arch.head_dim)
        x = x + linear(attn, weights[p + "self_attn.o_proj.weight"], None)
        h = rms_norm(x, weights[p + "post_attention_layernorm.weight"], arch.rms_norm_eps)
        gate = linear(h, weights[p + "mlp.gate_proj.weight"], None)
        up = linear(h, weights[p + "mlp.up_proj.weight"], None)
        x = x + linear(F.silu(gate) * up, weights[p + "mlp.down_proj.weight"], None)
    last = rms_norm(x[:, -1], weights["model.norm.weight"], arch.rms_norm_eps)
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    return linear(last, head, None).to(torch.float32)
