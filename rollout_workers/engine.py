"""The rollout engine interface: everything a worker uses of an engine (embedded PyTorch, or the SGLang backend).

An engine samples responses with per-token behavior log-probs and the weight version that produced each token,
and accepts new weight versions at any time without stopping: `stage_weights` may be called from another thread
while `generate` runs; the engine applies the staged version between two decode steps. The worker touches an
engine only through `Engine` (no probing for optional attributes): a member one engine has no use for is still
there, with the value that says so (`max_seq_len = None`, `build_errors = 0`, `fatal = ""`, `stats() = {}`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from quant_sync.update import WeightUpdate


@dataclass(slots=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    """SGLang's min-p sampling: tokens less likely than min_p times the most likely one are not drawn; 0 is none."""
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings: the SGLang backend ends a response at one, server-side (kept in it);
    # the embedded engine ignores them (rollout_workers/episodes.py cuts a turn after its stop string)
    seed: int | None = None
    frequency_penalty: float = 0.0
    """SGLang's: subtracted from a token's logit once per occurrence in the response so far, in [-2, 2]."""
    presence_penalty: float = 0.0
    """SGLang's: subtracted from the logit of every token the response already holds, in [-2, 2]."""
    repetition_penalty: float = 1.0
    """Seen response tokens' logits divided by it (multiplied when negative), in (0, 2]; 1 is none."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Added to these tokens' logits, after the penalties. Penalties and bias change the distribution a token is
    drawn from, and so its behaviour log-prob (rollout_workers/embedded/penalties.py); RL rollouts set none."""

    def __post_init__(self) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.top_p <= 1.0:  # 0 masked every token: the engine returned token 0 at every step
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not math.isfinite(self.temperature):  # NaN returned the last token id with NaN log-probs
            raise ValueError(f"temperature must be a finite number, got {self.temperature}")


@dataclass(slots=True)
class Completion:
    """One sampled response: tokens, their behavior log-probs and weight versions, and why it ended."""

    response_ids: list[int]
    behav_logp: list[float]
    """log_softmax(logits / temperature)[token] of the distribution each token was drawn from (before top-p/k)."""
    versions: list[int]
    finish: str  # "stop" | "length" | "abort"
    extra: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    @property
    def version(self) -> int:
        """The weight version decode steps currently run with (-1 before any weights)."""
        ...

    @property
    def swaps(self) -> int:
        """Weight versions applied so far."""
        ...

    @property
    def build_errors(self) -> int:
        """Staged versions dropped because they could not be built (the running version kept generating)."""
        ...

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The model's end-of-sequence token ids: where a response stops unless `SamplingParams` names others."""
        ...

    @property
    def fatal(self) -> str:
        """Why the engine can no longer generate (the SGLang backend's server failed past its restarts), else "":
        the worker's loop then ends and its supervisor restarts the worker."""
        ...

    @property
    def max_seq_len(self) -> int | None:
        """The longest prompt + response the engine can hold, in tokens; None when it does not know (a server that
        checks lengths itself)."""
        ...

    def stats(self) -> dict[str, Any]:
        """Engine-specific counters for the worker's stats, with keys prefixed by the engine's name ({} if none)."""
        ...

    def close(self) -> None:
        """Release what the engine holds (a server process, threads, files); the worker calls it once, last."""
        ...

    def stage_weights(self, update: WeightUpdate) -> None:
        """Hand over a new version; applied atomically at the next decode-step boundary."""
        ...

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Sample one completion per prompt (repeat a prompt for several samples)."""
        ...
