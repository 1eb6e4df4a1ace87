"""Server-sent events for `stream: true` (SGLang 0.5.x's `/generate` and OpenAI streams): `data: <json>\\n\\n` chunks
ending with `data: [DONE]\\n\\n`.

`progress_events` watches a submitted request's samples from the event loop (without a thread: it polls the token
counts the scheduler thread appends to) and yields `(position, answer)` whenever one has new tokens or finishes;
the answer is the native `/generate` one as it stands (cumulative text, `output_ids`, `meta_info`; finish_reason
null until the end), as SGLang streams it. When the client goes away, Starlette cancels the stream: the requests
still running are aborted, which frees their KV slots between two engine steps.

A failure once the headers went out (the scheduler thread died: `SchedulerDied`, after the abort chunks of the
samples it failed; or anything raised while building a chunk) ends the stream with one error event naming the cause,
then `data: [DONE]`, as SGLang 0.5.x ends its streams on an error (`entrypoints/http_server.py` `generate_request`:
`data: {"error": {"message"}}`; `entrypoints/openai/serving_chat.py`, `serving_completions.py`:
`create_streaming_error_response`, OpenAI's `{"error": {"object", "message", "type", "param", "code"}}`, which
the `openai` client raises as an APIError). An unexpected error's traceback goes to the server log.
"""

from __future__ import annotations

import asyncio
import json
import sys
import traceback
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from rollout_workers.sglang_api.schemas import GenerateRequest
from rollout_workers.sglang_api.service import ModelService, SchedulerDied

POLL_S = 0.01
"""How often a stream looks for new tokens (an engine step of a small model takes a few ms)."""
DONE = "data: [DONE]\n\n"


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def progress_events(
    service: ModelService, request: GenerateRequest, order: list
) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """`(position in order, answer)` on every change of a sample, its final answer last; aborts what still runs
    when cancelled (the client went away)."""
    seen = [0] * len(order)
    finished = [False] * len(order)
    dead_pass = False  # a pass over the samples made after the scheduler thread was seen gone
    try:
        while not all(finished):
            dead_pass = not service.alive  # it settles every request it fails before it ends: this pass sees them
            for i, req in enumerate(order):
                if finished[i]:
                    continue
                done = req.done.done()
                count = service.progress(req)
                if done or count > seen[i]:
                    answer = await run_in_threadpool(service.response, request, req)
                    seen[i] = count
                    # settled while its answer was built: that answer is its final one (a finish reason only then)
                    finished[i] = done or answer["meta_info"]["finish_reason"] is not None
                    yield i, answer
            if not all(finished):
                if dead_pass:  # what is still unfinished after that pass never will be
                    service.raise_if_died(order, running=True)
                await asyncio.sleep(POLL_S)
        service.raise_if_died(order, running=False)  # their final chunks were abort ones: now say why
    finally:
        if not all(finished):
            service.abort_requests([req for req, over in zip(order, finished) if not over])  # no await: cancelled


def event_stream(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream")


def failure_message(err: Exception) -> str:
    """What an error event says of a failure inside a stream; an unexpected one's traceback goes to the log (the
    scheduler's death was logged once by the service)."""
    if isinstance(err, SchedulerDied):
        return str(err)
    trace = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    print(f"asyncrl serve: a stream failed:\n{trace}", file=sys.stderr, end="", flush=True)
    return f"{type(err).__name__}: {err}"


def native_error(err: Exception) -> dict[str, Any]:
    """SGLang's `/generate` error event (http_server.py: `{"error": {"message": str(e)}}`)."""
    return {"error": {"message": failure_message(err)}}


def openai_error(err: Exception) -> dict[str, Any]:
    """SGLang's OpenAI error event (`create_streaming_error_response`), a server error here: type and code say so."""
    error = {"object": "error", "message": failure_message(err), "type": "InternalServerError", "param": None}
    return {"error": {**error, "code": 500}}


async def generate_stream(service: ModelService, request: GenerateRequest, order: list) -> AsyncIterator[str]:
    """The `/generate` stream: each sample's answer so far (with `index` when the request is a batch or n > 1)."""
    try:
        async with aclosing(progress_events(service, request, order)) as events:  # closed (aborts) on any error
            async for position, answer in events:
                if not request.single:
                    answer["index"] = position
                yield sse(answer)
    except Exception as err:  # the headers went out: the stream says why it ends (module docstring)
        yield sse(native_error(err))
    yield DONE


async def delta_stream(
    service: ModelService,
    request: GenerateRequest,
    order: list,
    chunk: Callable[[int, dict[str, Any], str, int], dict[str, Any] | None],
    final: Callable[[list[dict[str, Any]]], dict[str, Any] | None] | None = None,
) -> AsyncIterator[str]:
    """An OpenAI stream: `chunk(index, answer, new_text, new_token_start)` builds each event from the text and
    tokens a sample added since its last event; a position in `order` (prompt by prompt) is the choice index.
    `final(last answers)`, when given and not None, is the event sent once every sample finished (the usage)."""
    texts = [""] * len(order)
    tokens = [0] * len(order)
    last: list[dict[str, Any]] = [{} for _ in order]
    try:
        async with aclosing(progress_events(service, request, order)) as events:  # closed (aborts) on any error
            async for position, answer in events:
                text = answer["text"]  # extends the text sent before (`shown_while_running`); were it ever to differ,
                new_text = text[len(texts[position]) :]  # what was sent stays sent: a client appends the deltas
                payload = chunk(position, answer, new_text, tokens[position])
                texts[position], tokens[position], last[position] = text, len(answer["output_ids"]), answer
                if payload is not None:
                    yield sse(payload)
        closing = final(last) if final is not None else None
        if closing is not None:
            yield sse(closing)
    except Exception as err:  # the headers went out: the stream says why it ends (module docstring)
        yield sse(openai_error(err))
    yield DONE
