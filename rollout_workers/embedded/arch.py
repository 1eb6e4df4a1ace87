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

    sliding_window: int = 0
    """The attention window of a config that turns one on (Mistral's `sliding_window`, Qwen's with
    `use_sliding_window`), else 0. The engine attends to every position, which is the same up to this many tokens:
    it caps its context there (`EmbeddedEngine.max_seq_len`)."""
    unsupported: tuple[str, ...] = ()
    """config.json features the embedded engine does not implement (biases Llama-family checkpoints may enable,
    another activation): with any, its log-probs would not be the learner's; `check_embedded` refuses them."""

    def check_embedded(self, model_dir: str | Path) -> None:
        """ModelDirError naming each feature of this config the embedded engine does not implement."""
        if self.unsupported:
            raise ModelDirError(
                f"{Path(model_dir) / 'config.json'}: {'; '.join(self.unsupported)}: the embedded engine does not "
                "implement this, so its log-probs would not be the learner's (rollout.backend=sglang serves it)"
            )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ArchConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelDirError(f"{model_dir}: no config.json (is this a Hugging Face model directory?)")
        raw = _read_json(path)
        if not isinstance(raw, dict):
            raise ModelDirError(f"{path}: not a JSON object (a Hugging Face config.json maps names to values)")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelDirError(
                f"{path}: model_type {model_type!r} is not supported by the embedded engine "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        try:
            heads = _positive(raw, "num_attention_heads")
            hidden = _positive(raw, "hidden_size")
            kv_heads = _positive(raw, "num_key_value_heads", heads)
            if heads % kv_heads:
                raise ValueError(f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})")
            rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
            rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ModelDirError(
                    f"{path}: rope_type {rope_type!r} is not supported by the embedded engine "
                    f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
                )
            rope_theta = float(raw.get("rope_theta") or rope.pop("rope_theta", None) or 10000.0)
            rope.pop("rope_theta", None)
            vocab = _positive(raw, "vocab_size")
            return cls(
                model_type=model_type,
                vocab_size=vocab,
                hidden_size=hidden,
                num_layers=_positive(raw, "num_hidden_layers"),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=_positive(raw, "head_dim", hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                eos_token_ids=_eos_ids(path, raw),
                max_positions=_positive(raw, "max_position_embeddings", 4096),
                rope_scaling=(("rope_type", rope_type), *sorted(rope.items())) if rope_type != "default" else (),
                sliding_window=_sliding_window(raw),
                unsupported=_unsupported(raw),
            )
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, ModelDirError):
                raise
            raise ModelDirError(f"{path}: missing or invalid field: {err}") from err


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelDirError(f"{path}: invalid JSON: {err}") from err


def _positive(raw: dict, key: str, default: int | None = None) -> int:
    """config.json's `key` as a positive integer (`default` where it is absent or null); ValueError naming it."""
    value = raw.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"no {key}")
        value = default
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) or int(value) < 1:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return int(value)


def _eos_ids(path: Path, raw: dict) -> tuple[int, ...]:
    """The end-of-sequence ids: config.json's `eos_token_id` and generation_config.json's (what Hugging Face
    `generate` stops on, so the learner's greedy evaluation and the engine stop alike), in that order."""
    found: list[int] = []
    sources = [(path, raw)]
    generation = path.with_name("generation_config.json")
    if generation.is_file():
        generation_raw = _read_json(generation)
        if isinstance(generation_raw, dict):
            sources.append((generation, generation_raw))
    for source, values in sources:
        eos = values.get("eos_token_id")
        for token in eos if isinstance(eos, list) else [] if eos is None else [eos]:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:  # one past the vocabulary is
                raise ModelDirError(f"{source}: eos_token_id must be token ids, got {eos!r}")  # never sampled: kept
            if token not in found:
                found.append(token)
    return tuple(found)


def _sliding_window(raw: dict) -> int:
    window = raw.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        return 0
    if raw.get("model_type") in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        return 0  # Qwen's configs carry a window that is off unless use_sliding_window says so
    return window


def _unsupported(raw: dict) -> tuple[str, ...]:
    out = []
    if raw.get("attention_bias"):
        out.append("attention_bias=true (biases on q, k, v and o)")
    if raw.get("mlp_bias"):
        out.append("mlp_bias=true")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        out.append(f"hidden_act={act!r} (the engine's MLP is SwiGLU with silu)")
    return tuple(out)
