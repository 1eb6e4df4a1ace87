"""A sequence of the embedded engine (one sample being generated) and a group of samples sharing a prefill."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout_workers.engine import Completion, SamplingParams


@dataclass(slots=True, eq=False)
class Sequence:
    """One sample being generated; `completion` is set when it ends."""

    tokens: list[int]  # prompt + response so far; the last response token is not yet in the KV cache
    prompt_len: int
    params: SamplingParams
    stop_ids: frozenset[int]
    key: int  # sampling stream
    logp: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    completion: Completion | None = None
    top_logprobs_num: int = 0
    """With k > 0, `top_logprobs[i]` holds the k most likely (log-prob, token) of the distribution token i came from."""
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    min_new_tokens: int = 0
    """Its stop tokens cannot be drawn (their logits are -inf) before it has this many tokens (SGLang's)."""
    cached_tokens: int = 0
    """Prompt tokens whose K/V came from the prefix cache instead of its prefill (SGLang's `cached_tokens`)."""
    prompt_logprobs_from: int = -1
    """With p >= 0, the prefill that admits it scores the prompt from position p on: `prompt_logp[i]` is the
    log-prob of `tokens[p + 1 + i]` under `log_softmax(logits / prompt_logprobs_temperature)` at position p + i,
    `prompt_top_logprobs[i]` that distribution's `top_logprobs_num` most likely (log-prob, token). -1: not scored."""
    prompt_logprobs_temperature: float = 1.0
    prompt_logp: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    kv_swaps: int = -1
    """The engine's `swaps` when its K/V was computed (at admission, or a retract): kept at retirement if current."""

    @property
    def response(self) -> list[int]:
        return self.tokens[self.prompt_len :]


@dataclass(slots=True, eq=False)
class _Group:
    """Samples of one prompt that join together with one shared prefill."""

    prompt: list[int]
    samples: list[Sequence]
