"""Exporters for the quantized checkpoint layouts SGLang serves (used by the SGLang backend, issue 8).

- FP8 block (`"quant_method": "fp8"`, `"weight_block_size": [128, 128]`, DeepSeek-V3 style): each linear
  `weight` is float8_e4m3fn (out, in) and `weight_scale_inv` is float32 (ceil(out / 128), ceil(in / 128)); the
  real weight is `weight * weight_scale_inv` block by block (despite its name, the tensor holds the scale itself).
- INT8 (`w8a8_int8`): `weight` int8 (out, in), per output channel symmetric, and `weight_scale` float32 (out, 1);
  activations are quantized per token at run time by the server.

Only decoder linears are quantized; embeddings, norms and the LM head stay in the source dtype. The quantizers are
the shared ones of `quant_sync.quantizers` (FP8 rounding to nearest even, INT8 round half to even).
Written to SGLang's documented formats; not exercised against a real SGLang server in this project's CI.
"""

from __future__ import annotations

import torch

from quant_sync.export import is_quantized_linear
from quant_sync.quantizers import FP8_E4M3_MAX, nonzero_scale, quantize_int8_rows

FP8_BLOCK = (128, 128)


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) -> (e4m3 (out, in), scale_inv (ceil(out/bo), ceil(in/bi))), scale = max|block| / 448."""
    bo, bi = block
    out_features, in_features = weight.shape
    rows, cols = -(-out_features // bo), -(-in_features // bi)
    padded = torch.zeros((rows * bo, cols * bi), dtype=torch.float32)
    padded[:out_features, :in_features] = weight.detach().to(torch.float32)
    blocks = padded.view(rows, bo, cols, bi)
    scale = nonzero_scale(blocks.abs().amax(dim=(1, 3)) / FP8_E4M3_MAX)  # (rows, cols)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(rows * bo, cols * bi)[:out_features, :in_features].contiguous(), scale


def dequantize_fp8_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> torch.Tensor:
    bo, bi = block
    expanded = scale_inv.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[: q.shape[0], : q.shape[1]]
    return q.to(torch.float32) * expanded


def export_sglang(state_dict: dict[str, torch.Tensor], scheme: str) -> dict[str, torch.Tensor]:
    """A state dict in SGLang's layout for `scheme` (`fp8` block-quantized or `int8` = w8a8_int8)."""
    if scheme not in ("fp8", "int8"):
        raise ValueError(f"SGLang serves quant.scheme fp8 or int8, not {scheme!r}")
    tensors: dict[str, torch.Tensor] = {}
    for name, value in state_dict.items():
        if not is_quantized_linear(name):
            tensors[name] = value.detach().contiguous()
            continue
        stem = name[: -len("weight")]
        if scheme == "fp8":
            tensors[name], tensors[stem + "weight_scale_inv"] = quantize_fp8_blocks(value)
        else:
            q, scale = quantize_int8_rows(value)
            tensors[name], tensors[stem + "weight_scale"] = q, scale[:, None].contiguous()
    return tensors


def sglang_quantization_config(scheme: str) -> dict[str, object]:
    """The `quantization_config` entry of config.json that makes SGLang load `export_sglang(..., scheme)`."""
    if scheme == "fp8":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(FP8_BLOCK),
        }
    if scheme == "int8":
        return {"quant_method": "w8a8_int8"}
    raise ValueError(f"SGLang serves quant.scheme fp8 or int8, not {scheme!r}")
