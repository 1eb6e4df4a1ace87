"""Checkpoint directories that an SGLang server launches from or loads with `/update_weights_from_disk`.

A version directory is a Hugging Face model directory:

    config.json          the base model's, with the `quantization_config` that makes SGLang read the layout below
    tokenizer files      copied from the base model directory
    model.safetensors    decoder linears in SGLang's layout for the served scheme, everything else in float

| scheme | linear `X.weight` | its scale | `quantization_config` |
|---|---|---|---|
| `int8` (w8a8_int8) | int8 (out, in) | `X.weight_scale` float32 (out, 1) | `quant_method: w8a8_int8` |
| `fp8` (block) | e4m3 (out, in) | `X.weight_scale_inv` float32 (out/128, in/128) | `quant_method: fp8` + block |
| `none` | float | - | (removed) |

The writer converts a published version (`quant_sync.export.export_rollout_tensors`: `X.weight` + `X.weight_scale`
per output row) without requantizing INT8 (same values, the scale reshaped to (out, 1)); published FP8 rows are
dequantized and requantized into 128x128 blocks (SGLang reloads FP8 only in block layout, docs/sglang.md). The
reader does the reverse for `asyncrl serve`. Directories appear atomically (written under a temporary name).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quant_sync.export import export_rollout_tensors, is_quantized_linear
from quant_sync.sglang_formats import (
    FP8_BLOCK,
    dequantize_fp8_blocks,
    quantize_fp8_blocks,
    sglang_quantization_config,
)
from quant_sync.update import WeightUpdate
from rollout_workers.sglang_api.protocol import SERVED_SCHEMES

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
    "chat_template.jinja",
    "added_tokens.json",
)
SCALE = "weight_scale"
SCALE_INV = "weight_scale_inv"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded: the message names the file or tensor."""


def sglang_tensors(update: WeightUpdate, float_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A published version (rollout layout) -> SGLang's layout for its scheme (`int8`, `fp8` or `none`)."""
    if update.scheme not in SERVED_SCHEMES:
        raise ValueError(f"SGLang serves quant.scheme none, int8 or fp8, not {update.scheme!r}")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in update.tensors.items():
        if name.endswith("_scale") and name[: -len("_scale")] in update.tensors:
            continue
        scale = update.tensors.get(name + "_scale")
        if scale is None:
            out[name] = tensor.to(float_dtype).contiguous()
        elif update.scheme == "int8":
            out[name], out[name + "_scale"] = tensor.contiguous(), scale.to(torch.float32).reshape(-1, 1).contiguous()
        else:  # fp8 rows -> fp8 128x128 blocks
            rows = tensor.to(torch.float32) * scale.to(torch.float32)[:, None]
            out[name], out[name[: -len("weight")] + SCALE_INV] = quantize_fp8_blocks(rows)
    return out


def write_version_dir(
    root: str | Path, name: str, tensors: dict[str, torch.Tensor], base_dir: str | Path, scheme: str
) -> Path:
    """Write `root/name` (config, tokenizer, weights) atomically; replaces an older directory of that name."""
    root, base_dir = Path(root), Path(base_dir)
    target, temporary = root / name, root / f".{name}.tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    config = json.loads((base_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    if scheme != "none":
        config["quantization_config"] = sglang_quantization_config(scheme)
    (temporary / "config.json").write_text(json.dumps(config, indent=2))
    for file in TOKENIZER_FILES:
        if (base_dir / file).is_file():
            shutil.copy2(base_dir / file, temporary / file)
    save_file(
        {key: value.contiguous() for key, value in tensors.items()},
        str(temporary / "model.safetensors"),
        metadata={"format": "pt"},
    )
    shutil.rmtree(target, ignore_errors=True)
    temporary.rename(target)
    return target


def read_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every `*.safetensors` file in a model directory."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as reader:
            for key in reader.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[key] = reader.get_tensor(key)
    return tensors


def checkpoint_scheme(model_dir: str | Path) -> tuple[str, tuple[int, int]]:
    """(scheme, FP8 block) of a model directory from its config.json `quantization_config` (none if absent)."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: cannot read: {err}") from err
    quant = config.get("quantization_config") or {}
    method = quant.get("quant_method")
    if method is None:
        return "none", FP8_BLOCK
    if method == "w8a8_int8":
        return "int8", FP8_BLOCK
    if method == "fp8":
        block = quant.get("weight_block_size")
        if not block:
            raise CheckpointError(f"{path}: FP8 without `weight_block_size` (only block FP8 reloads in SGLang)")
        return "fp8", (int(block[0]), int(block[1]))
    raise CheckpointError(f"{path}: quant_method {method!r} is not served here (w8a8_int8, fp8 block, or none)")


def rollout_tensors(tensors: dict[str, torch.Tensor], served: str, block: tuple[int, int] = FP8_BLOCK):
    """SGLang-layout tensors -> the embedded engine's published layout for the served scheme.

    INT8 linears stay as they are when the server serves int8; everything else is brought to float and quantized
    with the served scheme (`quant_sync.export.export_rollout_tensors`).
    """
    kept: dict[str, torch.Tensor] = {}
    floats: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith((SCALE, SCALE_INV)):
            continue
        stem = name[: -len("weight")] if name.endswith("weight") else name
        if stem + SCALE_INV in tensors:
            floats[name] = dequantize_fp8_blocks(tensor, tensors[stem + SCALE_INV].to(torch.float32), block)
        elif name + "_scale" in tensors:
            scale = tensors[name + "_scale"].to(torch.float32).reshape(-1)
            if tensor.dtype != torch.int8 or scale.numel() != tensor.shape[0]:
                raise CheckpointError(f"{name}: expected int8 (out, in) with a per-row weight_scale (out, 1)")
            if served == "int8" and is_quantized_linear(name):
                kept[name], kept[name + "_scale"] = tensor, scale
            else:
                floats[name] = tensor.to(torch.float32) * scale[:, None]
        else:
            floats[name] = tensor.to(torch.float32)
    return {**export_rollout_tensors(floats, served), **kept}
