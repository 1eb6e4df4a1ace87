"""The OpenAI-compatible bodies of `asyncrl serve` (`/v1/models`, `/v1/completions`, `/v1/chat/completions`) as
pydantic models, with the field names and defaults of SGLang 0.5.x's `entrypoints/openai/protocol.py` (which
follows OpenAI's API reference): requests are validated by FastAPI, responses are built from these models rather
than from dicts.

SGLang's extensions kept here: `top_k`, `min_p`, `min_tokens`, `ignore_eos`, `no_stop_trim`, `stop_token_ids`,
`skip_special_tokens` and `regex` / `json_schema` / `ebnf` (refused with SGLang's error shape by the sampling
checks) on requests; `metadata.weight_version` on every response.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Sampling(BaseModel):
    """The sampling fields both request kinds share (OpenAI's, then SGLang's extensions)."""

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    """`{"include_usage": true}`: a last chunk with no choices and the usage, as OpenAI and SGLang send it."""
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    no_stop_trim: bool | None = None
    skip_special_tokens: bool | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    lora_path: str | list[str | None] | None = None
    """SGLang's: the LoRA adapter(s) to run; `model: "base:adapter"` takes precedence (lora_serve.py)."""

    def sampling_params(self, max_new_tokens: int | None) -> dict[str, Any]:
        """SGLang's `sampling_params` for this request: the fields given, under SGLang's names."""
        names = {
            "temperature": "temperature",
            "top_p": "top_p",
            "n": "n",
            "stop": "stop",
            "seed": "sampling_seed",
            "frequency_penalty": "frequency_penalty",
            "presence_penalty": "presence_penalty",
            "logit_bias": "logit_bias",
            "top_k": "top_k",
            "min_p": "min_p",
            "min_tokens": "min_new_tokens",
            "repetition_penalty": "repetition_penalty",
            "stop_token_ids": "stop_token_ids",
            "ignore_eos": "ignore_eos",
            "no_stop_trim": "no_stop_trim",
            "skip_special_tokens": "skip_special_tokens",
            "regex": "regex",
            "json_schema": "json_schema",
            "ebnf": "ebnf",
        }
        params = {ours: getattr(self, theirs) for theirs, ours in names.items() if getattr(self, theirs) is not None}
        params["max_new_tokens"] = max_new_tokens  # null: up to the context, as SGLang's to_sampling_params sends it
        return params


class CompletionRequest(_Sampling):
    """`POST /v1/completions`: a prompt as text, texts, token ids or lists of token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens_positive(cls, value: int | None) -> int | None:
        if value is not None and value <= 0:  # SGLang's CompletionRequest.validate_max_tokens_positive
            raise ValueError("max_tokens must be positive")
        return value

    logprobs: int | None = None
    """The most likely tokens per position besides the chosen one (0: the chosen one's log-prob only)."""
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    """One message of a chat: its content a string or OpenAI's list of text parts."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(str(part.get("text", "")) for part in self.content if part.get("type", "text") == "text")
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions`: messages rendered with the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    """Given to the chat template (`tools=`), as SGLang's serving_chat does; no tool-call parser runs on the answer
    (SGLang's default without `--tool-call-parser`): the model's text comes back as the content."""
    chat_template_kwargs: dict[str, Any] | None = None
    """More variables for the chat template (e.g. `enable_thinking`), as SGLang passes them."""
    response_format: dict[str, Any] | None = None
    """Only `{"type": "text"}`: constrained decoding (json_object, json_schema) is not implemented (400)."""


# ---- responses ---------------------------------------------------------------------------------------------------
def _completion_id() -> str:
    return uuid.uuid4().hex


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ResponseMetadata(BaseModel):
    weight_version: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "sglang"
    root: str | None = None
    parent: str | None = None
    """A LoRA adapter's card: the served model it sits on (`asyncrl serve --enable-lora`)."""
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=_completion_id)
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    metadata: ResponseMetadata


class TopLogprob(BaseModel):
    token: str
    bytes: list[int]
    logprob: float


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=_completion_id)
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    metadata: ResponseMetadata
