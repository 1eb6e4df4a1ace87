"""Rollout weight export: a learner state dict -> the tensors an embedded engine loads for one version.

Linear layers of the decoder blocks are quantized with `quant.scheme` and travel as `<name>` (int8 or
float8_e4m3fn) plus `<name>_scale` (float32: one per output channel for the W8A8 schemes, one per output channel
and group of 128 input columns for the weight-only `w8a16` / `w4a16`). Embeddings and norms stay in float32. The
LM head stays in float32 too (as SGLang serves it) unless `quantize_head` (`quant.lm_head`, resolved by
`common.config_rules.head_quantized`): then `lm_head.weight` travels quantized like a decoder linear, made from the
embedding matrix when the two are tied (the embedding itself still travels in float32, for the lookup). With
`scheme == "none"` everything is float32. LoRA adapters (learner/lora.py) travel beside their linear as
`<linear>.lora_A`, `.lora_B` and `.lora_scaling` in float32 (`LORA_A`, `LORA_B`, `LORA_SCALING`); a peft model's
names are mapped to the base model's by `base_weight_name`.
"""

from __future__ import annotations

import torch

from quant_sync.quantizers import WEIGHT_ONLY_BITS, quantize_weight, quantize_weight_only

QUANTIZED_LINEARS = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)  # fmt: skip


HEAD_WEIGHT = "lm_head.weight"
EMBED_WEIGHT = "model.embed_tokens.weight"
LORA_A, LORA_B, LORA_SCALING = ".lora_A", ".lora_B", ".lora_scaling"
"""Suffixes of a LoRA adapter's published tensors after its linear's module name (`model.layers.0.mlp.up_proj`):
A (r, in) and B (out, r) in float32, and the scaling alpha / r as a (1,) float32 tensor (learner/lora.py)."""
_PEFT_PREFIX = "base_model.model."


def base_weight_name(name: str) -> str:
    """A peft-wrapped model's parameter or module name -> the base model's (`base_model.model.` and `.base_layer`
    dropped): `base_model.model.model.layers.0.mlp.up_proj.base_layer.weight` -> `model.layers.0.mlp.up_proj.weight`.
    Other names come back unchanged."""
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX) :]
    name = name.replace(".base_layer.", ".")
    return name[: -len(".base_layer")] if name.endswith(".base_layer") else name


def is_quantized_linear(name: str, head: bool = False) -> bool:
    """Whether the weight `name` travels quantized: the decoder blocks' linears, and the LM head when `head`."""
    return (name.startswith("model.layers.") and name.endswith(QUANTIZED_LINEARS)) or (head and name == HEAD_WEIGHT)


def export_rollout_tensors(
    state_dict: dict[str, torch.Tensor], scheme: str, quantize_head: bool = False
) -> dict[str, torch.Tensor]:
    """Quantize (or copy) a full state dict into the published tensor set of one version."""
    tensors: dict[str, torch.Tensor] = {}
    embed = state_dict.get(EMBED_WEIGHT)
    head = quantize_head and scheme != "none"
    if head and HEAD_WEIGHT not in state_dict and embed is not None:
        state_dict = {**state_dict, HEAD_WEIGHT: embed}  # tied weights listed once: the head is the embedding
    for name, value in state_dict.items():
        value = value.detach()
        tied = name == HEAD_WEIGHT and embed is not None and value.data_ptr() == embed.data_ptr()
        if tied and not head:
            continue  # tied: the engine falls back to the embedding
        if scheme in WEIGHT_ONLY_BITS and is_quantized_linear(name, head):
            q, scale = quantize_weight_only(value, scheme)
            tensors[name], tensors[name + "_scale"] = q, scale.contiguous()
        elif scheme != "none" and is_quantized_linear(name, head):
            quantized = quantize_weight(value, scheme)
            tensors[name] = quantized.q.contiguous()
            tensors[name + "_scale"] = quantized.scale.contiguous()
        else:
            tensors[name] = value.to(torch.float32).contiguous().clone()
    return tensors
