"""The OpenAI-compatible routes of `asyncrl serve`, SGLang 0.5.x's `entrypoints/openai/serving_*.py` on our engine:
each request becomes a native `/generate` request (schemas.GenerateReqInput, so the same checks and error shapes
apply) and its answer is re-shaped into the pydantic models of openai_schemas.py.

- `/v1/completions`: `prompt` as text, texts, token ids or lists of them; `echo` prepends the prompt (and its
  log-probs, the first one null); `logprobs` k gives each token's log-prob and its k most likely alternatives.
- `/v1/chat/completions`: the messages rendered by the tokenizer's chat template (`add_generation_prompt`);
  `logprobs` / `top_logprobs` as OpenAI's `choices[i].logprobs.content`.
- Choices are ordered prompt by prompt, each prompt's `n` samples together (`index` = prompt * n + sample).
- Every response carries `metadata.weight_version`, the served weights' label when it was built.
- `/v1/models/{id}` answers the served model's card, and SGLang's OpenAI-style 404 (`model_not_found`) for any
  other id.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any

import jinja2
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from rollout_workers.sglang_api.lora_serve import adapter_cards, openai_lora_path
from rollout_workers.sglang_api.openai_schemas import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    ChatTokenLogprob,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    ResponseMetadata,
    TopLogprob,
    Usage,
)
from rollout_workers.sglang_api.protocol import BadRequest
from rollout_workers.sglang_api.schemas import GenerateReqInput, GenerateRequest, check_chat_size
from rollout_workers.sglang_api.serve_requests import check_text_fits
from rollout_workers.sglang_api.service import ModelService
from rollout_workers.sglang_api.streaming import delta_stream, event_stream

openai_routes = APIRouter()


def _service(request: Request) -> ModelService:
    return request.app.state.service


Service = Annotated[ModelService, Depends(_service)]


async def _submit(service: ModelService, body: dict[str, Any]) -> tuple[GenerateRequest, list]:
    """Check and queue a native `/generate` body: the request and its samples in SGLang's order."""
    try:
        request = GenerateReqInput.model_validate(body).normalize()
    except ValidationError as err:  # a sampling field of the wrong type: SGLang's validation shape
        message = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        raise BadRequest(message[:2000], validation=True) from None
    return request, await run_in_threadpool(service.submit, request)


async def _generate(
    service: ModelService, request: GenerateRequest, order: list, http: Request
) -> list[dict[str, Any]]:
    """The finished answers in prompt-major order (prompt b's samples at b*n .. b*n+n-1), SGLang's own order; a
    client gone before them aborts them (`ModelService.wait`)."""
    await service.wait(order, http.is_disconnected)
    outs = await run_in_threadpool(service.responses, request, order)
    return [outs] if isinstance(outs, dict) else outs


def _finish(out: dict[str, Any]) -> tuple[str | None, int | str | None]:
    reason = out["meta_info"]["finish_reason"] or {}
    return reason.get("type"), reason.get("matched")


def _usage(outs: list[dict[str, Any]], n: int) -> Usage:
    prompt = sum(out["meta_info"]["prompt_tokens"] for out in outs[::n])  # a prompt counted once per its n samples
    completion = sum(out["meta_info"]["completion_tokens"] for out in outs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _card(service: ModelService) -> ModelCard:
    limit = service.engine.max_seq_len
    return ModelCard(id=service.served_model_name, root=service.tokenizer_path, max_model_len=limit)


@openai_routes.get("/v1/models")
async def models(service: Service) -> ModelList:
    return ModelList(data=[_card(service), *adapter_cards(service)])  # --enable-lora: one card per loaded adapter


@openai_routes.get("/v1/models/{model:path}", response_model=None)
async def model(service: Service, model: str) -> ModelCard | JSONResponse:
    """The served model's card; any other id (a LoRA adapter's too, as in SGLang 0.5.9) is SGLang's OpenAI-style
    404."""
    if model != service.served_model_name:
        error = {
            "message": f"The model '{model}' does not exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
        return JSONResponse({"error": error}, status_code=404)
    return _card(service)


@openai_routes.post("/v1/completions")
async def completions(service: Service, http: Request, obj: CompletionRequest) -> Any:
    prompt = obj.prompt
    if isinstance(prompt, list) and not prompt:
        raise BadRequest("prompt cannot be empty", validation=True)
    if not prompt or (isinstance(prompt, list) and all(not p for p in prompt)):  # serving_completions._validate_request
        raise BadRequest("Prompt cannot be empty")
    obj.check_supported()
    key = "text" if isinstance(prompt, str) or isinstance(prompt[0], str) else "input_ids"
    want_logprobs = obj.logprobs is not None
    body = {
        key: prompt,
        "sampling_params": obj.sampling_params(obj.max_tokens),
        "return_logprob": want_logprobs,
        "logprob_start_len": 0 if obj.echo else -1,  # echo with log-probs: the prompt's too
        "top_logprobs_num": obj.logprobs or 0,
        "return_text_in_logprobs": True,
        "lora_path": openai_lora_path(obj.model, obj.lora_path),
        "stream": obj.stream,  # a stream refused at admission answers 200 and ends on the abort, as SGLang's
        **obj.native_fields(),
    }
    request, order = await _submit(service, body)
    if obj.stream:
        return event_stream(_completion_stream(service, obj, request, order))
    outs = await _generate(service, request, order, http)
    n = obj.n
    prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else list(prompt)
    choices = []
    for index, out in enumerate(outs):
        meta = out["meta_info"]
        text = out["text"]
        entries = list(meta.get("output_token_logprobs", []))
        tops = list(meta.get("output_top_logprobs", [None] * len(entries)))
        if obj.echo:
            text = _echo_text(service, prompts[index // n]) + text
            if want_logprobs:
                entries = list(meta["input_token_logprobs"]) + entries
                tops = list(meta.get("input_top_logprobs", [None] * len(meta["input_token_logprobs"]))) + tops
        logprobs = _completion_logprobs(entries, tops) if want_logprobs else None
        reason, matched = _finish(out)
        choices.append(
            CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=reason, matched_stop=matched)
        )
    return CompletionResponse(
        model=obj.model or service.served_model_name,
        choices=choices,
        usage=_usage(outs, n),
        metadata=ResponseMetadata(weight_version=service.weight_version),
    )


def _echo_text(service: ModelService, source: str | list[int]) -> str:
    """The prompt as `echo` gives it back: a text as it is, token ids decoded without the special tokens (SGLang's
    `_get_echo_text`)."""
    return source if isinstance(source, str) else service.tokenizer.decode(source, skip_special_tokens=True)


def _usage_chunk(stream_id: str, kind: str, created: int, model: str, n: int) -> Any:
    """`final` for delta_stream: the `choices: []` chunk with the usage (`stream_options.include_usage`)."""

    def final(last: list[dict[str, Any]]) -> dict[str, Any]:
        usage = _usage(last, n)  # every sample has finished: each one's final answer
        return {"id": stream_id, "object": kind, "created": created, "model": model, "choices": [],
                "usage": usage.model_dump()}  # fmt: skip

    return final


def _completion_stream(service: ModelService, obj: CompletionRequest, request: GenerateRequest, order: list):
    """OpenAI's completion chunks: each the text (and log-probs) a choice added; `finish_reason` (and `matched_stop`)
    on its last; with `echo` the first chunk of each choice opens with the prompt (and its log-probs), and with
    `stream_options.include_usage` a last chunk carries the usage, as SGLang's serving_completions streams them."""
    model_name, created = obj.model or service.served_model_name, int(time.time())
    stream_id = uuid.uuid4().hex
    prompt = obj.prompt
    prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else list(prompt)
    opened: set[int] = set()

    def chunk(index: int, answer: dict[str, Any], new_text: str, first_token: int) -> dict[str, Any]:
        meta = answer["meta_info"]
        first = index not in opened
        opened.add(index)
        logprobs = None
        if obj.logprobs is not None:
            entries = meta["output_token_logprobs"][first_token:]
            tops = (meta.get("output_top_logprobs") or [None] * len(meta["output_token_logprobs"]))[first_token:]
            if first and obj.echo:
                inputs = list(meta.get("input_token_logprobs", []))
                entries = inputs + list(entries)
                tops = list(meta.get("input_top_logprobs", [None] * len(inputs))) + list(tops)
            logprobs = _completion_logprobs(entries, tops)
        if first and obj.echo:
            new_text = _echo_text(service, prompts[index // obj.n]) + new_text
        reason, matched = _finish(answer)
        choice = CompletionChoice(index=index, text=new_text, logprobs=logprobs, finish_reason=reason,
                                  matched_stop=matched)  # fmt: skip
        return {
            "id": stream_id,
            "object": "text_completion",
            "created": created,
            "model": model_name,
            "choices": [choice.model_dump()],
            "metadata": {"weight_version": meta["weight_version"]},
        }

    final = _usage_chunk(stream_id, "text_completion", created, model_name, obj.n) if obj.include_usage else None
    return delta_stream(service, request, order, chunk, final)


def _completion_logprobs(entries: list[list[Any]], tops: list[list[list[Any]] | None]) -> CompletionLogprobs:
    """`[logprob, token_id, text]` triples -> OpenAI's completion log-probs (tokens, offsets, top alternatives)."""
    result = CompletionLogprobs()
    offset = 0
    for (logp, _, text), top in zip(entries, tops):
        result.tokens.append(text or "")
        result.token_logprobs.append(logp)
        result.text_offset.append(offset)
        offset += len(text or "")
        result.top_logprobs.append(None if top is None else {entry[2] or "": entry[0] for entry in top})
    return result


def _chat_logprobs(meta: dict[str, Any], first_token: int) -> ChoiceLogprobs:
    """`output_token_logprobs` (and top ones) from `first_token` on -> OpenAI's `choices[i].logprobs`."""
    entries = meta["output_token_logprobs"]
    tops = meta.get("output_top_logprobs") or [[]] * len(entries)
    return ChoiceLogprobs(
        content=[
            ChatTokenLogprob(
                token=text or "",
                bytes=list((text or "").encode()),
                logprob=logp,
                top_logprobs=[
                    TopLogprob(token=t or "", bytes=list((t or "").encode()), logprob=lp)
                    for lp, _, t in alternatives or []
                ],
            )
            for (logp, _, text), alternatives in zip(entries[first_token:], tops[first_token:])
        ]
    )


def _chat_stream(service: ModelService, obj: ChatCompletionRequest, request: GenerateRequest, order: list):
    """OpenAI's chat chunks: the role first, then each content delta; `finish_reason` on a choice's last."""
    model_name, created = obj.model or service.served_model_name, int(time.time())
    stream_id = uuid.uuid4().hex
    started: set[int] = set()

    def chunk(index: int, answer: dict[str, Any], new_text: str, first_token: int) -> dict[str, Any]:
        meta = answer["meta_info"]
        delta: dict[str, Any] = {"content": new_text}
        if index not in started:
            started.add(index)
            delta["role"] = "assistant"
        logprobs = _chat_logprobs(meta, first_token).model_dump() if obj.logprobs else None
        reason, matched = _finish(answer)
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": reason,
            "matched_stop": matched,
        }
        return {
            "id": stream_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model_name,
            "choices": [choice],
            "metadata": {"weight_version": meta["weight_version"]},
        }

    final = _usage_chunk(stream_id, "chat.completion.chunk", created, model_name, obj.n) if obj.include_usage else None
    return delta_stream(service, request, order, chunk, final)


def _chat_prompt(service: ModelService, obj: ChatCompletionRequest) -> list[int]:
    """The messages rendered by the chat template, then tokenized as `apply_chat_template(tokenize=True)` does (no
    special tokens added): more messages or characters than a chat may hold are refused unrendered
    (schemas.check_chat_size), a rendered text too long to fit untokenized (serve_requests.check_text_fits)."""
    tokenizer = service.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise BadRequest(f"the tokenizer of {service.tokenizer_path} has no chat template", validation=True)
    messages = obj.template_messages()
    check_chat_size(messages)  # rendering costs per message and per character
    tools = obj.template_tools()
    extra = dict(obj.chat_template_kwargs or {})
    taken = sorted(set(extra) & _TEMPLATE_ARGUMENTS)
    if taken:
        raise BadRequest(f"chat_template_kwargs may not set {', '.join(taken)} (the request's own fields do)")
    final = obj.continue_final_message
    if messages[-1]["role"] == "assistant" and not final:  # serving_chat._handle_last_assistant_message
        messages[-1] = {"role": "user", "content": messages[-1]["content"]}
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=not final, continue_final_message=final, tools=tools,
            **extra,
        )  # fmt: skip
    except jinja2.TemplateError as err:  # the template refused the conversation (raise_exception): the client's
        raise BadRequest(f"the chat template refused the messages: {err}") from None  # (serving_chat.py: 400)
    check_text_fits(text, 0, service.token_chars, service.engine.max_seq_len)  # the rest is checked once tokenized
    return list(tokenizer.encode(text, add_special_tokens=False))


_TEMPLATE_ARGUMENTS = {"conversation", "messages", "tools", "tokenize", "add_generation_prompt",
                       "continue_final_message", "return_dict", "documents", "chat_template"}  # fmt: skip
"""apply_chat_template's own arguments: `chat_template_kwargs` passes template variables, not these."""


@openai_routes.post("/v1/chat/completions")
async def chat_completions(service: Service, http: Request, obj: ChatCompletionRequest) -> Any:
    obj.check_supported()
    prompt = await run_in_threadpool(_chat_prompt, service, obj)
    top = obj.top_logprobs or 0
    if top and not obj.logprobs:
        raise BadRequest("top_logprobs requires logprobs=true", validation=True)
    body = {
        "input_ids": prompt,
        # user value > the model's generation_config > the defaults, as SGLang's to_sampling_params
        "sampling_params": {
            **service.chat_sampling_defaults,
            **obj.sampling_params(obj.max_completion_tokens or obj.max_tokens),
        },
        "return_logprob": obj.logprobs,
        "top_logprobs_num": top,
        "return_text_in_logprobs": True,
        "lora_path": openai_lora_path(obj.model, obj.lora_path),
        "stream": obj.stream,
        **obj.native_fields(),
    }
    if obj.tools and obj.tool_choice != "none":  # the template got them (serving_chat.py): special tokens are kept
        body["sampling_params"]["skip_special_tokens"] = False
    request, order = await _submit(service, body)
    if obj.stream:
        return event_stream(_chat_stream(service, obj, request, order))
    outs = await _generate(service, request, order, http)
    choices = []
    for index, out in enumerate(outs):
        logprobs = _chat_logprobs(out["meta_info"], 0) if obj.logprobs else None
        reason, matched = _finish(out)
        choices.append(
            ChatChoice(
                index=index,
                message=ChatMessageOut(content=out["text"]),
                logprobs=logprobs,
                finish_reason=reason,
                matched_stop=matched,
            )
        )
    return ChatCompletionResponse(
        model=obj.model or service.served_model_name,
        choices=choices,
        usage=_usage(outs, obj.n),
        metadata=ResponseMetadata(weight_version=service.weight_version),
    )
