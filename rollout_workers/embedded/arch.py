"""A Hugging Face `config.json` read into the embedded engine's architecture (`ArchConfig`); torch-free, so the
driver checks a model directory before it imports torch.

Llama incl. llama3 RoPE scaling, Qwen2 (q/k/v biases), Qwen3 (q/k norms), Mistral, SmolLM: `SUPPORTED_MODEL_TYPES`.
A directory outside them is refused with `ModelDirError`, naming what is missing or unsupported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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
    rope_scaling: tuple[tuple[str, float | str], ...] = ()
    """HF `rope_parameters` / `rope_scaling` items other than rope_theta (e.g. rope_type llama3 and its factors)."""

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
            rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
            rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ModelDirError(
                    f"{path}: rope_type {rope_type!r} is not supported by the embedded engine "
                    f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
                )
            rope_theta = float(raw.get("rope_theta") or rope.pop("rope_theta", None) or 10000.0)
            rope.pop("rope_theta", None)
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
                rope_theta=rope_theta,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                eos_token_ids=eos_ids,
                max_positions=int(raw.get("max_position_embeddings", 4096)),
                rope_scaling=(("rope_type", rope_type), *sorted(rope.items())) if rope_type != "default" else (),
            )
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, ModelDirError):
                raise
            raise ModelDirError(f"{path}: missing or invalid field: {err}") from err
