"""The request bodies of `asyncrl serve`, one pydantic model per route, with SGLang 0.5.x's field names and defaults.

SGLang declares them in `managers/io_struct.py` (`GenerateReqInput`, `PauseGenerationReqInput`,
`UpdateWeightFromDiskReqInput`, `UpdateWeightVersionReqInput`, `AbortReq`, `SlowDownReqInput`, `TokenizeReqInput`,
`DetokenizeReqInput`, `GetWeightsByNameReqInput`, `ReleaseMemoryOccupationReqInput`) and
`sampling/sampling_params.py` (`SamplingParams`). Two kinds of bad request, two error shapes (protocol.error_body):

- a field of the wrong type (a string for `top_k`, `["a"]` for `input_ids`, a 20-digit integer, `mode: "later"`) fails
  pydantic's validation here; FastAPI raises RequestValidationError and the app answers SGLang's validation shape.
- a value of the right type that SGLang refuses (`top_p = 2`, an empty prompt, a `logprob_start_len` past it) fails
  `verify()` / `normalize()` with `BadRequest`, answered with SGLang's ValueError shape `{"error": {"message": ...}}`.

A request is refused, before any prompt is tokenized, when it asks for more than MAX_SAMPLES_PER_REQUEST samples
(prompts x n) or its text prompts hold more than MAX_TEXT_CHARS_PER_REQUEST characters (`check_request_size`: limits
of ours; SGLang checks each prompt's length only, once tokenized). A chat request is refused before its messages are
rendered when it holds more than MAX_MESSAGES_PER_REQUEST messages or MAX_TEXT_CHARS_PER_REQUEST characters
(`check_chat_size`), a `/detokenize` before anything is decoded when it holds more than MAX_SAMPLES_PER_REQUEST token
lists or MAX_TOKENS_PER_REQUEST tokens (`check_detokenize_size`).

Integers are strict (no `true`, no `1.0`, no `"1"`) and bounded to int64 where torch takes them; numbers accept JSON
integers and floats but not booleans or strings. Unknown top-level keys are ignored, as SGLang's dataclass does;
unknown sampling keys are refused by name. A `null` sampling value means its default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictInt, model_validator

from rollout_workers.sglang_api.protocol import TOP_K_ALL, BadRequest, PauseMode

Int64 = Annotated[StrictInt, Field(ge=-(2**63), lt=2**63)]
"""An integer torch can hold (a larger one is a validation error, not an overflow in the engine)."""
Number = Annotated[float, Strict()]
"""A JSON number (integer or float), never a boolean or a string."""

UNSUPPORTED_FEATURES = ("stop_regex", "json_schema", "regex", "ebnf", "structural_tag")
"""Sampling keys `asyncrl serve` accepts only empty (constrained decoding)."""
MAX_SAMPLES_PER_REQUEST = 1 << 15
"""The most samples (prompts x n) one `/generate` or `/v1` request may ask for, and the most texts one `/tokenize`
takes: a 64 MiB body holds millions of short prompts, each of which would be tokenized, checked and queued
before anything was refused. An RL batch (512 prompts x 16 samples, say) fits four times over; more go in several
requests."""
MAX_TEXT_CHARS_PER_REQUEST = 8 << 20
"""The most characters the text prompts of one request may hold together (8 MiB of text: a few seconds of one core's
tokenizing). Each text must also fit the context on its own (serve_requests.check_text_fits)."""
MAX_MESSAGES_PER_REQUEST = 1 << 15
"""The most messages one `/v1/chat/completions` request may hold: the chat template renders each (a 64 MiB body holds
millions of empty ones); a conversation of this many messages is already longer than most models' context."""
MAX_TOKENS_PER_REQUEST = 8 << 20
"""The most token ids the lists of one `/detokenize` may hold together (8M tokens: a second or two of one core's
decoding, tens of MB of text answered); at most MAX_SAMPLES_PER_REQUEST lists, as many as `/generate` answers."""


class SamplingParams(BaseModel):
    """SGLang's SamplingParams: the fields and defaults; `verify()` holds its value checks."""

    @property
    def max_new_tokens_given(self) -> bool:
        """Whether the request set a number (SGLang checks prompt + it against the context only then)."""
        return "max_new_tokens" in self.model_fields_set and self.max_new_tokens is not None

    model_config = ConfigDict(extra="allow")  # unknown keys reach verify(), which names them

    max_new_tokens: Int64 | None = 128
    """As SGLang: given, prompt + it must fit the context; absent (128) or null (no limit), it is cut to what the
    context leaves (`max_new_tokens_given`, serve_requests.request_groups)."""
    temperature: Number = 1.0
    """Below 1e-6 means greedy (top_k = 1 at temperature 1), as in SGLang."""
    top_p: Number = 1.0
    top_k: Int64 = TOP_K_ALL
    min_p: Number = 0.0
    n: Int64 = 1
    """Samples per prompt; a batch's entries must agree on it."""
    stop_token_ids: list[StrictInt] = Field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: Int64 | None = None
    """Sample i of a request with seed s draws exactly as `EmbeddedEngine.generate` with seed s draws copy i."""
    min_new_tokens: Int64 = 0
    frequency_penalty: Number = 0.0
    presence_penalty: Number = 0.0
    repetition_penalty: Number = 1.0
    stream_interval: Int64 | None = None
    stop: str | list[str] | None = None
    stop_regex: str | list[str] | None = None
    logit_bias: dict[str, Number] | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    custom_params: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, values: Any) -> Any:
        if isinstance(values, dict):
            return {key: value for key, value in values.items() if value is not None or key not in cls.model_fields}
        return values

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        """`logit_bias` with integer token ids (its JSON keys are strings)."""
        return {int(key): float(value) for key, value in (self.logit_bias or {}).items()}

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def verify(self) -> None:
        """SGLang's `SamplingParams.verify` for what `asyncrl serve` runs; what it does not run is refused by name."""
        if self.model_extra:
            raise BadRequest(f"unknown sampling_params: {', '.join(sorted(self.model_extra))}")
        for key in UNSUPPORTED_FEATURES:
            if getattr(self, key):
                raise BadRequest(f"sampling_params.{key} is not supported by asyncrl serve (use stop_token_ids)")
        for key in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, key) <= 2.0:
                raise BadRequest(f"{key} must be in [-2, 2], got {getattr(self, key)}.")
        if not 0.0 < self.repetition_penalty <= 2.0:  # SGLang takes 0 too (and ignores the key): 0 divides by zero
            raise BadRequest(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}.")
        if any(not key.lstrip("-").isdigit() for key in self.logit_bias or {}):
            raise BadRequest(f"logit_bias keys must be token ids, got {sorted(self.logit_bias or {})[:5]}.")
        if any(math.isnan(bias) or bias == math.inf for bias in (self.logit_bias or {}).values()):
            raise BadRequest("logit_bias values must be finite numbers (or -inf, which bans a token).")
        if self.sampling_seed is not None and self.sampling_seed < 0:
            raise BadRequest(f"sampling_seed must be at least 0, got {self.sampling_seed}.")
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise BadRequest(f"temperature must be a non-negative finite number, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise BadRequest(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise BadRequest(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.top_k < 1 and self.top_k != TOP_K_ALL:
            raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:  # before min_new_tokens, as SGLang says it
            raise BadRequest(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        most = self.max_new_tokens if self.max_new_tokens is not None else math.inf
        if self.min_new_tokens < 0 or self.min_new_tokens > most:
            raise BadRequest(
                f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}."
            )
        if isinstance(self.stop, list) and any(not stop for stop in self.stop) or self.stop == "":
            raise BadRequest("stop strings must not be empty.")
        if self.n < 1:
            raise BadRequest(f"n must be at least 1, got {self.n}.")


@dataclass(slots=True)
class GenerateRequest:
    """A checked `/generate` body: one entry per prompt (before `n` expands it)."""

    prompts: list[list[int] | str]
    sampling: list[SamplingParams]
    rids: list[str] | None
    """Per prompt (n = 1) or per response in response order (prompt by prompt, its n samples); None: fresh ids."""
    single: bool
    """Answer one object rather than a list (one prompt, n = 1)."""
    return_logprob: bool = False
    """Whether any prompt asked for log-probs (`logprob_of` says which)."""
    return_text_in_logprobs: bool = False
    logprob_of: list[bool] | None = None
    """Per prompt, from a list `return_logprob` (SGLang applies it prompt by prompt); None: `return_logprob` for all."""
    logprob_start_len: list[int] | None = None
    """Per prompt: the first prompt position whose token gets an input log-prob (-1: the last one only)."""
    top_logprobs_num: list[int] | None = None
    """Per prompt: the most likely tokens returned per position (0: none)."""
    stream: bool = False
    lora_path: str | list[str | None] | None = None
    """LoRA adapter name(s), for all prompts or one (or null) per prompt (`asyncrl serve --enable-lora`)."""


class GenerateReqInput(BaseModel):
    """`POST|PUT /generate`: one prompt or a batch, as `text` or `input_ids`; `normalize()` checks and expands it."""

    text: str | Annotated[list[str], Field(min_length=1)] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: SamplingParams | list[SamplingParams | None] | None = None
    """One set for every prompt, or one per prompt."""
    rid: str | list[str] | None = None
    """Request id(s); with `n > 1` a string becomes `rid_0, rid_1, ...` in the response order."""
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: StrictInt | list[StrictInt] | None = None
    """With `return_logprob`, the first prompt position given an input log-prob (-1: the last prompt token only)."""
    top_logprobs_num: StrictInt | list[StrictInt] | None = None
    """With `return_logprob`, the most likely tokens returned for every input and output position."""
    return_text_in_logprobs: bool = False
    stream: bool = False
    lora_path: str | list[str | None] | None = None
    """The LoRA adapter (its `lora_name`) of every prompt, or one per prompt (null: the base); lora_serve.py."""
    return_hidden_states: bool = False
    custom_logit_processor: str | None = None
    token_ids_logprob: list[Any] | None = None
    """These three are refused (`normalize`), as SGLang refuses the first two without their server flags: they were
    dropped silently."""

    def normalize(self) -> GenerateRequest:
        """SGLang's `GenerateReqInput.normalize_batch_and_arguments` for what `asyncrl serve` runs."""
        if self.return_hidden_states:  # SGLang's words without --enable-return-hidden-states (tokenizer_manager.py)
            raise BadRequest("The server is not configured to return the hidden states. Please set "
                             "`--enable-return-hidden-states` to enable this feature.")  # fmt: skip
        if self.custom_logit_processor:
            raise BadRequest("The server is not configured to enable custom logit processor. Please set "
                             "`--enable-custom-logit-processor` to enable this feature.")  # fmt: skip
        if self.token_ids_logprob:
            raise BadRequest("token_ids_logprob is not supported by asyncrl serve (top_logprobs_num is)")
        if (self.text is None) == (self.input_ids is None):
            raise BadRequest("Either text, input_ids or input_embeds should be provided.")
        prompts: list[list[int] | str]
        if self.text is not None:
            single = isinstance(self.text, str)
            prompts = [self.text] if isinstance(self.text, str) else list(self.text)
        else:
            if len(self.input_ids) == 0:
                raise BadRequest("input_ids cannot be empty.")
            single = isinstance(self.input_ids[0], int)
            prompts = [self.input_ids] if single else self.input_ids  # type: ignore[list-item]
        raw = self.sampling_params
        per_prompt = raw if isinstance(raw, list) else [raw] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise BadRequest("The length of sampling_params should be equal to the batch size.")
        sampling = [params or SamplingParams() for params in per_prompt]
        check_request_size(prompts, max(sampling[0].n, 1))  # before anything costs per prompt or per sample
        for params in sampling:
            params.verify()
        n = sampling[0].n
        if any(params.n != n for params in sampling):
            raise BadRequest("The parallel_sample_num should be the same for all samples in sample params.")
        logprob = self.return_logprob
        return GenerateRequest(
            prompts=prompts,
            sampling=sampling,
            rids=self._rids(single, len(prompts), n),
            single=single and n == 1,
            return_logprob=any(logprob) if isinstance(logprob, list) else bool(logprob),
            logprob_of=_logprob_of(logprob, len(prompts)),
            return_text_in_logprobs=self.return_text_in_logprobs,
            logprob_start_len=_per_prompt("logprob_start_len", self.logprob_start_len, len(prompts), -1, -1),
            top_logprobs_num=_per_prompt("top_logprobs_num", self.top_logprobs_num, len(prompts), 0, 0),
            stream=self.stream,
            lora_path=self.lora_path,
        )

    def _rids(self, single: bool, batch: int, n: int) -> list[str] | None:
        if isinstance(self.rid, str):
            return [self.rid] if single and n == 1 else [f"{self.rid}_{i}" for i in range(batch * n)]
        if isinstance(self.rid, list):
            if len(self.rid) != batch:
                raise BadRequest("The specified rids length mismatch with the batch_size for batch processing.")
            return list(self.rid) if n == 1 else None
        return None


def check_request_size(prompts: list[list[int] | str] | list[str], n: int = 1) -> None:
    """Refuse, before any prompt is tokenized or queued, a request of more than MAX_SAMPLES_PER_REQUEST samples
    (prompts x n) or of text prompts over MAX_TEXT_CHARS_PER_REQUEST characters together (BadRequest, answered 400)."""
    samples = len(prompts) * n
    if samples > MAX_SAMPLES_PER_REQUEST:
        raise BadRequest(
            f"A request may ask for at most {MAX_SAMPLES_PER_REQUEST} samples (prompts x n); this one asks for "
            f"{samples} ({len(prompts)} prompt{'s' if len(prompts) != 1 else ''} x n={n}). Send them in several "
            "requests."
        )
    chars = sum(len(prompt) for prompt in prompts if isinstance(prompt, str))
    if chars > MAX_TEXT_CHARS_PER_REQUEST:
        raise BadRequest(
            f"The text prompts of a request may hold at most {MAX_TEXT_CHARS_PER_REQUEST} characters together; "
            f"this one's {_holding(len(prompts), 'prompt')} {chars}. Send them in several requests."
        )


def _holding(count: int, noun: str) -> str:
    """'1 prompt holds', '3 prompts hold': the subject of a size refusal."""
    return f"{count} {noun} holds" if count == 1 else f"{count} {noun}s hold"


def check_chat_size(messages: list[dict[str, str]]) -> None:
    """Refuse, before the chat template renders them, more than MAX_MESSAGES_PER_REQUEST messages, or messages whose
    roles and contents hold more than MAX_TEXT_CHARS_PER_REQUEST characters together (BadRequest, answered 400)."""
    if len(messages) > MAX_MESSAGES_PER_REQUEST:
        raise BadRequest(
            f"A chat request may hold at most {MAX_MESSAGES_PER_REQUEST} messages; this one holds {len(messages)}."
        )
    chars = sum(len(message["role"]) + len(message["content"]) for message in messages)
    if chars > MAX_TEXT_CHARS_PER_REQUEST:
        raise BadRequest(
            f"The messages of a chat request may hold at most {MAX_TEXT_CHARS_PER_REQUEST} characters together "
            f"(roles and contents); this one's {_holding(len(messages), 'message')} {chars}."
        )


def check_detokenize_size(token_lists: list[list[int]]) -> None:
    """Refuse, before anything is decoded, a `/detokenize` of more than MAX_SAMPLES_PER_REQUEST token lists or of
    more than MAX_TOKENS_PER_REQUEST tokens together (BadRequest, answered 400)."""
    if len(token_lists) > MAX_SAMPLES_PER_REQUEST:
        raise BadRequest(
            f"A detokenize request may hold at most {MAX_SAMPLES_PER_REQUEST} token lists; this one holds "
            f"{len(token_lists)}. Send them in several requests."
        )
    tokens = sum(len(ids) for ids in token_lists)
    if tokens > MAX_TOKENS_PER_REQUEST:
        raise BadRequest(
            f"The token lists of a detokenize request may hold at most {MAX_TOKENS_PER_REQUEST} tokens together; "
            f"this one's {_holding(len(token_lists), 'list')} {tokens}. Send them in several requests."
        )


def _logprob_of(value: bool | list[bool] | None, batch: int) -> list[bool] | None:
    """A list `return_logprob`, one flag per prompt (SGLang's length check); None for one flag for all."""
    if not isinstance(value, list):
        return None
    if len(value) != batch:
        raise BadRequest("The length of return_logprob should be equal to the batch size.")
    return [bool(flag) for flag in value]


def _per_prompt(name: str, value: int | list[int] | None, batch: int, default: int, least: int) -> list[int]:
    """One value per prompt (a single value for all of them), each at least `least`."""
    values = [default if value is None else value] * batch if not isinstance(value, list) else list(value)
    if len(values) != batch:
        raise BadRequest(f"The length of {name} should be equal to the batch size.")
    for item in values:
        if item < least:
            raise BadRequest(f"{name} must be at least {least}, got {item}.")
    return values


class PauseGenerationReqInput(BaseModel):
    """`POST /pause_generation`: `abort` ends the running requests, `retract` / `in_place` keep them."""

    mode: PauseMode = "abort"


class UpdateWeightFromDiskReqInput(BaseModel):
    """`POST /update_weights_from_disk`: a checkpoint directory in SGLang's layout (checkpoint.py)."""

    model_config = ConfigDict(coerce_numbers_to_str=True)

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    """The new weights' label; an integer above the current version becomes the engine's version too."""
    flush_cache: bool = True
    """SGLang's: flush the cache after the update; with requests kept running (`in_place`) the flush fails and SGLang
    0.5.9 asserts and ends the server, as this one does (service.py `_swap`)."""


class UpdateWeightVersionReqInput(BaseModel):
    """`POST /update_weight_version`: relabel the served weights."""

    model_config = ConfigDict(coerce_numbers_to_str=True)

    new_version: str
    abort_all_requests: bool = True


class AbortReq(BaseModel):
    """`POST /abort_request`: the requests whose id starts with `rid`, or all of them."""

    model_config = ConfigDict(coerce_numbers_to_str=True)

    rid: str | None = ""
    abort_all: bool = False


MAX_FORWARD_SLEEP_S = 3600.0
"""The longest `/slow_down` sleep per engine step. SGLang takes any float (a sleep of 1e308 s kills its scheduler
with an OverflowError); testing scripts use up to 90 s. The sleep ends early on a new `/slow_down`."""


class SlowDownReqInput(BaseModel):
    """`GET|POST /slow_down`: SGLang's testing knob, seconds slept after every engine step (null, 0 or less: none,
    as in SGLang); `seconds()` checks it."""

    forward_sleep_time: Number | None = None

    def seconds(self) -> float:
        """The sleep per step; BadRequest over MAX_FORWARD_SLEEP_S (or not a finite number)."""
        value = self.forward_sleep_time
        if value is None or value <= 0:
            return 0.0
        if not value <= MAX_FORWARD_SLEEP_S:  # NaN and infinity too
            raise BadRequest(
                f"forward_sleep_time must be at most {MAX_FORWARD_SLEEP_S:g} seconds per forward, got {value:g}."
            )
        return float(value)


class TokenizeReqInput(BaseModel):
    """`POST /tokenize`: one text or several."""

    prompt: str | list[str]
    add_special_tokens: bool = True


class DetokenizeReqInput(BaseModel):
    """`POST /detokenize`: one list of token ids or several."""

    tokens: list[StrictInt] | list[list[StrictInt]]
    skip_special_tokens: bool = True


class GetWeightsByNameReqInput(BaseModel):
    """`GET|POST /get_weights_by_name`: a weight by its Hugging Face name, its first `truncate_size` rows."""

    name: str
    truncate_size: Annotated[StrictInt, Field(ge=0)] = 100


class MemoryOccupationReqInput(BaseModel):
    """`/release_memory_occupation`, `/resume_memory_occupation`: the memory tags (none: all of them)."""

    tags: list[str] | None = None
