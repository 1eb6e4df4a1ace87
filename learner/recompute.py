"""Activation checkpointing (`learner.gradient_checkpointing`): keep only each decoder layer's input for backward and
run the layer's forward again there, trading a forward of every layer for activation memory.

A decoder saves for backward, per token and layer, about 10 hidden-size and 4 intermediate-size tensors
(`learner.batch.activation_bytes_per_token`); checkpointed, only the layer's input stays, plus one layer's full set
while that layer's backward runs (`learner.batch.checkpointed_bytes_per_token`). That is what lets a long response
(a DAPO recipe's 4,096 tokens on a 7B model) train in one micro-batch at all. Transformers' own mechanism does the work
(`activation_checkpointing_enable`, before 5.2x `gradient_checkpointing_enable`: torch's non-reentrant checkpoint
around each layer's `forward`, so FSDP2's hooks stay outside it); the learner's fused kernels and packed attention
run inside the recomputation as in the forward, with the same values. The LM head's chunks are checkpointed already
(`learner.logprobs.head_logp`). Measured: docs/algorithms.md, "Minibatches, micro-batches and non-finite steps".
"""

from __future__ import annotations

from typing import Any


class CheckpointingUnsupported(ValueError):
    """`learner.gradient_checkpointing` on a model whose Transformers class does not support it (one line)."""


def _transformers_model(model: Any) -> Any:
    """`model` itself, or the Transformers model inside peft's wrapper."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def enable_gradient_checkpointing(model: Any) -> None:
    """Turn on checkpointing of every decoder layer of `model` (a Transformers model, or peft's wrapper of one)."""
    base = _transformers_model(model)
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise CheckpointingUnsupported(
            f"learner.gradient_checkpointing: {type(base).__name__} does not support it (Transformers' "
            "`supports_gradient_checkpointing` is false for it); set learner.gradient_checkpointing=false"
        )
    if hasattr(base, "activation_checkpointing_enable"):  # Transformers 5.2x's name; the older one is deprecated
        base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def is_checkpointed(model: Any) -> bool:
    """Whether `model`'s decoder layers recompute their forward in backward."""
    base = _transformers_model(model)
    name = (
        "is_activation_checkpointing"
        if hasattr(type(base), "is_activation_checkpointing")
        else "is_gradient_checkpointing"
    )
    return bool(getattr(base, name, False))
