"""One sample of a `/generate` request inside `asyncrl serve` (service.py), and how its SGLang sampling parameters
become the embedded engine's.

- `ServeRequest` is what the scheduler thread tracks per sample: its prompt, parameters, random key, engine
  sequence, finish reason and prompt log-probs.
- `sample_keys` derives a request's per-sample random keys exactly as `EmbeddedEngine.generate` derives them for
  the copies of a prompt, so a `sampling_seed` request and an engine `generate` with that seed draw the same tokens.
- `check_prompt` holds the checks that need the model (vocabulary, context length, `logit_bias` ids); the rest of
  SGLang's `verify()` is in schemas.py. `check_text_fits` refuses a text prompt before it is tokenized when it is
  too long to fit whatever its tokens: no token stands for more than `max_token_chars(tokenizer)` characters, so a
  text of more than `max_seq_len` times that many cannot fit (tokenizing a 50 MB prompt only to refuse it would take
  gigabytes and minutes of a core). Every text of a batch is checked before the first is tokenized, after the
  request's size (schemas.check_request_size: samples, characters together); tokenizing runs in the app's thread
  pool (`service.submit`), off the event loop.
- `engine_params` maps SGLang's parameters onto `rollout_workers.engine.SamplingParams`: temperature 0 is top-k 1
  at temperature 1 (SGLang's greedy), stop tokens are the request's plus EOS unless `ignore_eos`, and the penalties
  and `logit_bias` pass through (applied by rollout_workers/embedded/penalties.py, SGLang's formulas).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollout_workers.sglang_api import protocol
from rollout_workers.sglang_api.protocol import BadRequest
from rollout_workers.sglang_api.schemas import GenerateRequest, SamplingParams

if TYPE_CHECKING:
    import torch

    from rollout_workers.engine import SamplingParams as EngineSamplingParams


@dataclass(eq=False)
class ServeRequest:
    rid: str
    prompt: list[int]
    sampling: SamplingParams
    key: int
    """The sample's random key (the engine's per-sample derivation)."""
    started: float = field(default_factory=time.time)
    seq: Any = None
    done: Future = field(default_factory=Future)
    """Resolved by the scheduler thread when the request finishes or is aborted."""
    finish: dict[str, Any] | None = None
    retractions: int = 0
    return_logprob: bool = False
    logprob_start_len: int = -1
    """The first prompt position given an input log-prob (-1: the last one), with `return_logprob`."""
    top_logprobs_num: int = 0
    input_logprobs: list[float | None] = field(default_factory=list)
    """Per prompt token from `logprob_start_len` on (SGLang's: the first one is always None)."""
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    adapter: Any = None
    """The request's LoRA adapter (lora_serve.py), None for the base model."""
    checked: int = 0
    """Output tokens whose text `stop_string_hits` has looked at (with stop strings, a stream shows no more)."""

    def settle(self) -> None:
        if not self.done.done():
            self.done.set_result(None)


def request_groups(
    request: GenerateRequest,
    tokenizer: Any,
    vocab_size: int,
    max_seq_len: int,
    generator: torch.Generator,
    token_chars: int,
) -> list[list[ServeRequest]]:
    """A checked `/generate` request -> one group per prompt: its `n` samples (tokenized, checked, keyed, named).
    `token_chars`: `max_token_chars(tokenizer)`, the bound on a text prompt that can fit (`check_text_fits`)."""
    groups = []
    n = request.sampling[0].n
    for prompt, sampling in zip(request.prompts, request.sampling):  # every text before any is tokenized
        if isinstance(prompt, str):
            asked = sampling.max_new_tokens if sampling.max_new_tokens_given else 0
            check_text_fits(prompt, asked or 0, token_chars, max_seq_len)
    for b, (prompt, sampling) in enumerate(zip(request.prompts, request.sampling)):
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        sampling = fit_to_context(ids, sampling, max_seq_len)
        check_prompt(ids, sampling, vocab_size, max_seq_len)
        start = request.logprob_start_len[b] if request.logprob_start_len else -1
        wants_logprob = request.logprob_of[b] if request.logprob_of is not None else request.return_logprob
        if wants_logprob and start >= len(ids):
            raise BadRequest(
                f"logprob_start_len ({start}) is larger than the number of input tokens ({len(ids)}). "
                "Request with a lower logprob_start_len."
            )
        keys = sample_keys(sampling.sampling_seed, n, generator)
        top = request.top_logprobs_num[b] if request.top_logprobs_num else 0
        extra = {"return_logprob": wants_logprob, "logprob_start_len": start, "top_logprobs_num": top}
        groups.append([ServeRequest(_rid(request, b, i), ids, sampling, key, **extra) for i, key in enumerate(keys)])
    return groups


def _rid(request: GenerateRequest, b: int, i: int) -> str:
    """Sample i of prompt b: the id the request gave (per prompt, or per response in SGLang's order, prompt by
    prompt), or a new one."""
    if request.rids is None:
        return uuid.uuid4().hex
    batch, n = len(request.prompts), len(request.rids) // max(len(request.prompts), 1)
    return request.rids[b if len(request.rids) == batch else b * n + i]


def sample_keys(seed: int | None, n: int, generator: torch.Generator) -> list[int]:
    """The random keys of a request's n samples: from `seed` when given, else from the server's `generator`."""
    import torch

    from rollout_workers.embedded.sampling import sample_key  # the engine's own sample-key derivation

    source = torch.Generator().manual_seed(seed) if seed is not None else generator
    base = int(torch.randint(0, 1 << 62, (1,), generator=source))
    return [sample_key(base, i) for i in range(n)]


def fit_to_context(ids: list[int], sampling: SamplingParams, max_seq_len: int) -> SamplingParams:
    """SGLang's scheduler (`init_req_max_new_tokens`): a max_new_tokens the request did not give (the default 128,
    or null: no limit) is cut to what the context leaves after the prompt; a given one is checked (`check_prompt`).
    A prompt that fills the context is refused with SGLang's words."""
    if sampling.max_new_tokens_given:
        return sampling
    if ids and len(ids) >= max_seq_len:
        raise BadRequest(
            f"The input ({len(ids)} tokens) is longer than the model's context length ({max_seq_len} tokens)."
        )
    left = max_seq_len - len(ids)
    wanted = sampling.max_new_tokens if sampling.max_new_tokens is not None else left
    return sampling.model_copy(update={"max_new_tokens": min(wanted, left)})


def check_prompt(ids: list[int], sampling: SamplingParams, vocab_size: int, max_seq_len: int) -> None:
    """SGLang's checks of a tokenized prompt against the model (BadRequest, answered 400, names what is wrong)."""
    if not ids:
        raise BadRequest("input_ids cannot be empty.")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise BadRequest(f"input_ids must lie in [0, {vocab_size}) (the model's vocab_size)")
    if len(ids) + sampling.max_new_tokens > max_seq_len:
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of {max_seq_len} tokens. "
            f"You requested a total of {len(ids) + sampling.max_new_tokens} tokens: {len(ids)} "
            f"tokens from the input messages and {sampling.max_new_tokens} tokens for the completion."
        )
    for token in sampling.logit_bias_ids:
        if not 0 <= token < vocab_size:
            raise BadRequest(f"logit_bias must has keys in [0, {vocab_size - 1}], got {token}.")  # SGLang's words


def check_text_fits(text: str, max_new_tokens: int, token_chars: int, max_seq_len: int) -> None:
    """Refuse a text prompt that cannot fit the context with `max_new_tokens` more whatever its tokens, before
    tokenizing it: it is at least len(text) / token_chars tokens (`max_token_chars`). The refusal opens as the
    context-length one of `check_prompt` does."""
    least = -(-len(text) // token_chars)
    if least + max_new_tokens > max_seq_len:
        completion = f", and {max_new_tokens} tokens were requested for the completion" if max_new_tokens else ""
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of {max_seq_len} tokens. "
            f"The input messages are at least {least} tokens ({len(text)} characters, no token of the tokenizer "
            f"stands for more than {token_chars}){completion}."
        )


def engine_params(sampling: SamplingParams, eos_token_ids: tuple[int, ...]) -> EngineSamplingParams:
    """The engine's parameters for one SGLang request (see the module docstring)."""
    from rollout_workers.engine import SamplingParams as EngineSamplingParams

    greedy = sampling.temperature < 1e-6  # SGLang: temperature 0 is top_k=1 at temperature 1
    # SGLang 0.5.9: ignore_eos turns off every token stop, stop_token_ids too (`_check_token_based_finish`)
    stops = set() if sampling.ignore_eos else set(sampling.stop_token_ids) | set(eos_token_ids)
    return EngineSamplingParams(
        max_new_tokens=sampling.max_new_tokens,
        temperature=1.0 if greedy else sampling.temperature,
        top_p=sampling.top_p,
        top_k=1 if greedy else max(sampling.top_k, 0),
        min_p=0.0 if greedy else sampling.min_p,
        stop_token_ids=tuple(sorted(stops)) or (-1,),  # (-1,): stop on nothing (the engine reads () as EOS)
        frequency_penalty=sampling.frequency_penalty,
        presence_penalty=sampling.presence_penalty,
        repetition_penalty=sampling.repetition_penalty,
        logit_bias=sampling.logit_bias_ids,
    )


def stop_string_hits(requests: Iterable[ServeRequest], tokenizer: Any) -> list[ServeRequest]:
    """The running requests whose decoded output now holds one of their `stop` strings, their finish reason set to
    SGLang's `{"type": "stop", "matched": <the first string in the text>}` (the text is trimmed when answered)."""
    ended = []
    for req in requests:
        stops = req.sampling.stop_strings
        if not stops or req.seq is None or req.seq.completion is not None:
            continue
        count = len(req.seq.versions)  # appended last of a token's three lists (engine._sample)
        text = tokenizer.decode(req.seq.response[:count], skip_special_tokens=req.sampling.skip_special_tokens)
        hits = [(text.find(stop), stop) for stop in stops if stop in text]
        if hits:
            req.finish = protocol.finish_stop(min(hits)[1])
            ended.append(req)
        else:
            req.checked = count
    return ended


def shown_while_running(text: str, stop_strings: Sequence[str]) -> str:
    """What a running request's stream shows of its output `text`: without a trailing incomplete character (a
    byte-level token that ends mid-character decodes to U+FFFD; SGLang's detokenizer holds such text back) nor a
    trailing start of a stop string (the next token may complete it, and the final text is trimmed before it), so
    that every later text, the final one included, extends what was shown."""
    text = text.rstrip("\ufffd")
    cut = max((k for stop in stop_strings for k in range(len(stop) - 1, 0, -1) if text.endswith(stop[:k])), default=0)
    return text[: len(text) - cut]
