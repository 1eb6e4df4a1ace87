"""The rollout engine interface: what a worker needs from any engine (embedded PyTorch, or SGLang later).

An engine samples responses with per-token behavior log-probs and the weight version that produced each token,
and accepts new weight versions at any time without stopping: `stage_weights` may be called from another thread
while `generate` runs; the engine applies the staged version between two decode steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from quant_sync.update import WeightUpdate


@dataclass(slots=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


@dataclass(slots=True)
class Completion:
    """One sampled response: tokens, their behavior log-probs and weight versions, and why it ended."""

    response_ids: list[int]
    behav_logp: list[float]
    """log_softmax(logits / temperature)[token] of the distribution each token was drawn from (before top-p/k)."""
    versions: list[int]
    finish: str  # "stop" | "length" | "abort"
    extra: dict[str, float] = field(default_factory=dict)


class Engine(Protocol):
    @property
    def version(self) -> int:
        """The weight version decode steps currently run with (-1 before any weights)."""
        ...

    def stage_weights(self, update: WeightUpdate) -> None:
        """Hand over a new version; applied atomically at the next decode-step boundary."""
        ...

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Sample one completion per prompt (repeat a prompt for several samples)."""
        ...
