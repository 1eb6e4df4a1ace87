"""SGLang's log-prob fields for `asyncrl serve`: prompt scoring (`input_token_logprobs`, `input_top_logprobs`) and
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


def score_prompt(engine: Any, group: list[Any]) -> None:
    """Set the input log-probs of a group of samples of one prompt (on the scheduler thread, before it joins): the
    first entry None, then every later prompt token's log-prob under the sampling temperature (1 when greedy)."""
    import torch

    first = group[0]
    if not first.return_logprob:
        return
    prompt = first.prompt
    start = start_position(first)
    values: list[float | None] = [None]
    tops: list[list[tuple[float, int]] | None] = [None]
    if start + 1 < len(prompt):
        greedy = first.sampling.temperature < 1e-6
        logp = engine.prompt_logprobs(prompt, 1.0 if greedy else first.sampling.temperature)
        rows = logp[start : len(prompt) - 1]  # row p scores token p + 1
        targets = torch.tensor(prompt[start + 1 :])
        values += rows.gather(1, targets[:, None]).squeeze(1).tolist()
        if first.top_logprobs_num > 0:
            k = min(first.top_logprobs_num, rows.shape[-1])
            top_values, top_ids = torch.topk(rows, k, dim=-1)
            tops += [list(zip(v, i)) for v, i in zip(top_values.tolist(), top_ids.tolist())]
    for req in group:
        req.input_logprobs, req.input_top_logprobs = values, tops


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
    meta: dict[str, Any] = {
        "input_token_logprobs": [entry(lp, t) for lp, t in zip(req.input_logprobs, req.prompt[start:])],
        "output_token_logprobs": [entry(lp, t) for lp, t in zip(logps, tokens)],
    }
    if req.top_logprobs_num > 0:
        meta["input_top_logprobs"] = [top(pairs) for pairs in req.input_top_logprobs]
        meta["output_top_logprobs"] = [top(pairs) for pairs in output_top[: len(tokens)]]
    return meta
