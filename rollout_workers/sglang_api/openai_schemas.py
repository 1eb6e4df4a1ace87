"""The OpenAI-compatible bodies of `asyncrl serve` (`/v1/models`, `/v1/completions`, `/v1/chat/completions`) as
pydantic models, with the field names and defaults of SGLang 0.5.x's `entrypoints/openai/protocol.py` (which
follows OpenAI's API reference): requests are validated by FastAPI, responses are built from these models rather
than from dicts.

SGLang's extensions kept here: `top_k`, `min_p`, `min_tokens`, `ignore_eos`, `no_stop_trim`, `stop_token_ids`,
`skip_special_tokens` and `regex` / `json_schema` / `ebnf` / `stop_regex`, `return_hidden_states`,
`custom_logit_processor` (refused with SGLang's error shape by the native checks) on requests; `metadata.weight_version`
on every response.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rollout_workers.sglang_api.protocol import BadRequest


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
    stop_regex: str | list[str] | None = None
    return_hidden_states: bool = False
    custom_logit_processor: str | list[str | None] | None = None
    """These three go to the native request, which refuses them by name (`schemas.py`): SGLang's routes take them,
    and a route that dropped them answered as if they had run."""
    response_format: dict[str, Any] | None = None
    """Only `{"type": "text"}`: constrained decoding (json_object, json_schema, structural_tag) is not implemented."""

    def check_supported(self) -> None:
        """Refuse, naming it, a field SGLang's route runs and `asyncrl serve` does not (BadRequest, 400)."""
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise BadRequest(f"response_format {self.response_format.get('type')!r} is not supported by asyncrl "
                             "serve (constrained decoding is not implemented)")  # fmt: skip
        if self.stream_options and self.stream_options.get("continuous_usage_stats"):
            raise BadRequest("stream_options.continuous_usage_stats is not supported by asyncrl serve (include_usage "
                             "is: the usage in a last chunk)")  # fmt: skip

    def native_fields(self) -> dict[str, Any]:
        """The request-level fields passed on to the native `/generate` request as they are."""
        return {
            "return_hidden_states": self.return_hidden_states,
            "custom_logit_processor": self.custom_logit_processor,
        }

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
            "stop_regex": "stop_regex",
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
    tool_choice: Literal["auto", "required", "none"] | dict[str, Any] = "auto"
    """`none`: the tools are not given to the template; `required` or a named tool would constrain decoding to a
    tool call (SGLang's json_schema): refused (400) after SGLang's own checks (`template_tools`)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """More variables for the chat template (e.g. `enable_thinking`), as SGLang passes them."""

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template gets under `tool_choice` (serving_chat.py's `_validate_request` and
        `_process_messages`); BadRequest for what SGLang refuses and for a choice that needs constrained decoding."""
        choice = self.tool_choice
        if choice == "required" and not self.tools:
            raise BadRequest("Tools cannot be empty if tool choice is set to required.")
        if isinstance(choice, dict):
            if not self.tools:
                raise BadRequest("Tools cannot be empty if tool choice is set to a specific tool.")
            name = (choice.get("function") or {}).get("name")
            if not any((tool.get("function") or {}).get("name") == name for tool in self.tools):
                raise BadRequest(f"Tool '{name}' not found in tools list.")
        if choice == "required" or isinstance(choice, dict):
            raise BadRequest("tool_choice 'required' or a named tool is not supported by asyncrl serve: SGLang "
                             "constrains decoding to a tool call there, and constrained decoding is not implemented "
                             "(use 'auto')")  # fmt: skip
        return None if choice == "none" else self.tools

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template gets them (serving_chat.py `_process_messages`): every field of each
        message, its content as text, and the JSON-string `arguments` of an assistant's `tool_calls` as objects."""
        messages = []
        for message in self.messages:
            rendered = {**message.model_dump(), "content": message.text()}
            calls = rendered.get("tool_calls")
            if rendered["role"] == "assistant" and isinstance(calls, list):
                rendered["tool_calls"] = [_parsed_arguments(call, i) for i, call in enumerate(calls)]
            messages.append(rendered)
        return messages


def _parsed_arguments(call: Any, index: int) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError as err:
        raise BadRequest(f"tool_calls[{index}].function.arguments is not JSON: {err}") from None
    return {**call, "function": {**function, "arguments": arguments}}


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
