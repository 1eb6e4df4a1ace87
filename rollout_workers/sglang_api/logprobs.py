"""SGLang's log-prob fields for `asyncrl serve`: prompt log-probs (`input_token_logprobs`, `input_top_logprobs`, which
the engine's prefill scores, `EmbeddedEngine.submit(prompt_logprobs_from=...)`) and
the `[logprob, token_id, text or None]` triples of `meta_info` (SGLang's `convert_logprob_style`).

SGLang's shapes (`managers/scheduler_output_processor_mixin.py`): input entries cover `input_ids[start:]`, the first
one's log-prob always None (start -1 means the last prompt token: one None entry, no forward needed); entry i > 0 is
the log-prob of `input_ids[start + i]` given the tokens before it. Top log-probs are given only when
`top_logprobs_num > 0`, per position, the first input position None.
"""

from __future__ import annotations

from typing import Any, Protocol


class _LogprobRequest(Protocol):
    prompt: list[int]
    sampling: Any
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    input_logprobs: list[float | None]
    input_top_logprobs: list[list[tuple[float, int]] | None]


def start_position(req: _LogprobRequest) -> int:
    """The first prompt position given an input log-prob (-1: the last one)."""
    return req.logprob_start_len if req.logprob_start_len >= 0 else len(req.prompt) - 1


def scored_from(req: _LogprobRequest) -> int:
    """The prompt position the engine's prefill scores from for this request (`EmbeddedEngine.submit`'s
    `prompt_logprobs_from`), -1 when it needs no scoring (no `return_logprob`, or only the always-None entry)."""
    if not req.return_logprob:
        return -1
    start = start_position(req)
    return start if start + 1 < len(req.prompt) else -1


def input_logprobs(req: _LogprobRequest) -> tuple[list[float | None], list[list[tuple[float, int]] | None]]:
    """The request's input log-probs and top ones: the first entry None, then those its sequence's prefill scored
    (`Sequence.prompt_logp`); what `req.input_logprobs` holds when it never reached the engine."""
    seq = getattr(req, "seq", None)
    if seq is None:
        return req.input_logprobs, req.input_top_logprobs
    return [None, *seq.prompt_logp], [None, *seq.prompt_top_logprobs]


def logprob_meta(
    tokenizer: Any,
    req: _LogprobRequest,
    tokens: list[int],
    logps: list[float],
    output_top: list[list[tuple[float, int]]],
    with_text: bool,
) -> dict[str, Any]:
    """The `meta_info` log-prob fields of one answer: input and output triples, and the top ones when asked for."""

    def entry(logp: float | None, token: int) -> list[Any]:
        return [logp, token, tokenizer.decode([token]) if with_text else None]

    def top(pairs: list[tuple[float, int]] | None) -> list[list[Any]] | None:
        return None if pairs is None else [entry(logp, token) for logp, token in pairs]

    start = start_position(req)
    values, tops = input_logprobs(req)
    meta: dict[str, Any] = {
        "input_token_logprobs": [entry(lp, t) for lp, t in zip(values, req.prompt[start:])],
        "output_token_logprobs": [entry(lp, t) for lp, t in zip(logps, tokens)],
    }
    if req.top_logprobs_num > 0:
        meta["input_top_logprobs"] = [top(pairs) for pairs in tops]
        meta["output_top_logprobs"] = [top(pairs) for pairs in output_top[: len(tokens)]]
    return meta
