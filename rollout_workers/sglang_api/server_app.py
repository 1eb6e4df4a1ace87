"""The FastAPI app of `asyncrl serve` and its uvicorn listener: SGLang 0.5.x's native HTTP routes over the engine
adapter (service.py), on the stack SGLang itself serves with, and the OpenAI-compatible `/v1` routes
(openai_routes.py); `stream: true` answers server-sent events (streaming.py).

`make_app(service)` is the one factory. Request bodies are the pydantic models of schemas.py, so FastAPI validates
them; the exception handlers below answer every failure in the shape SGLang's own server gives (protocol.error_body;
V: the validation shape `{"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}`,
E: the ValueError shape `{"error": {"message"}}`):

| failure                                                       | status  | body                              |
|---------------------------------------------------------------|---------|-----------------------------------|
| a body that fails validation, or is not JSON                  | 400     | V                                 |
| a body sent with a Content-Type other than JSON               | 400     | V, saying to send JSON            |
| a value SGLang refuses (`BadRequest`)                         | 400     | E                                 |
| more samples or text than a request may hold (schemas.py)     | 400     | E, before anything is tokenized   |
| more messages / characters than a chat may hold (schemas.py)  | 400     | E, before the template renders    |
| more token lists / tokens than a detokenize may hold          | 400     | E, before anything is decoded     |
| a body over MAX_BODY_BYTES; a Content-Length h11 cannot parse | 400     | E, and the connection closes      |
| an unknown path / a method the path does not take             | 404/405 | FastAPI's `{"detail": "Not Found"}` |
| anything else raised while answering                          | 500     | E (the traceback in the log)      |
| a request pending when the scheduler thread died              | 500     | E (its traceback logged once)     |
| a failure inside a stream, once its headers went out          | 200     | an error event, then [DONE]       |

Threads: blocking calls into the adapter (tokenizing, pause, weight updates, ...) run in Starlette's thread pool
(`run_in_threadpool`), and a `/generate` awaits its requests on the event loop without holding a thread, so any
number of requests can wait (while paused, say) and `/continue_generation` or `/abort_request` still get through.
Bodies are read as JSON when their Content-Type is JSON or absent; a form or text body (`curl -d` sends a form) is
refused, as SGLang does, saying the body must be JSON with `Content-Type: application/json`.
When the scheduler thread dies (service.py), `serve` stops the server, so that server.py exits non-zero.
A body a route does not read (an unknown path's, say) is still framed by h11, so the connection stays usable.
"""

from __future__ import annotations

import json
import secrets
import socket
import sys
import threading
from typing import Annotated, Any

import h11
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from rollout_workers.sglang_api import lora_serve, server_state
from rollout_workers.sglang_api.openai_routes import openai_routes
from rollout_workers.sglang_api.protocol import BadRequest, QueueFull, error_body
from rollout_workers.sglang_api.schemas import (
    AbortReq,
    DetokenizeReqInput,
    GenerateReqInput,
    GetWeightsByNameReqInput,
    MemoryOccupationReqInput,
    PauseGenerationReqInput,
    SlowDownReqInput,
    TokenizeReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightVersionReqInput,
    check_detokenize_size,
    check_request_size,
)
from rollout_workers.sglang_api.serve_requests import check_text_fits
from rollout_workers.sglang_api.service import ModelService, SchedulerDied
from rollout_workers.sglang_api.streaming import event_stream, generate_stream

MAX_BODY_BYTES = 64 << 20
"""Largest request body accepted (a batch of prompts as token ids fits many times over)."""
SHUTDOWN_GRACE_S = 1.0
"""On SIGTERM, how long running requests may finish before they are cancelled (launchers wait 10 s, then kill)."""


def make_app(service: ModelService, api_key: str = "") -> FastAPI:
    """The app serving `service`: SGLang's native routes, error shapes and body limit; with `api_key`, SGLang's
    `--api-key` check (`ApiKey`)."""
    # strict_content_type=False: a JSON body without a Content-Type is read as JSON, as before (recent FastAPI
    # refuses it by default; older releases read it anyway and keep the unknown keyword in `app.extra`).
    app = FastAPI(title="asyncrl serve", docs_url=None, redoc_url=None, strict_content_type=False)
    app.state.service = service
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    if api_key:
        app.add_middleware(ApiKey, api_key=api_key)  # added last: it runs first
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(BadRequest, _bad_request)
    app.add_exception_handler(SchedulerDied, _scheduler_died)
    app.add_exception_handler(QueueFull, _queue_full)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _server_error)
    app.include_router(native_routes)
    app.include_router(openai_routes)
    return app


# ---- serving -----------------------------------------------------------------------------------------------------
class SGLangH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, but a request h11 cannot parse (a Content-Length that is not a number, a broken
    request line or header) is answered in SGLang's error shape, saying what was wrong, rather than plain text.
    The connection closes after it: where the body ends is unknown."""

    def send_400_response(self, msg: str) -> None:
        parse_error = sys.exc_info()[1]  # called from the `except h11.RemoteProtocolError` of handle_events
        if isinstance(parse_error, h11.RemoteProtocolError):
            msg = f"Invalid HTTP request received: {parse_error}"
            if "Content-Length" in str(parse_error):
                msg = f"Content-Length must be a number of bytes up to {MAX_BODY_BYTES} ({parse_error})"
        if self.transport.is_closing():
            return
        payload = json.dumps(error_body(msg, validation=False)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (b"connection", b"close"),
        ]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=payload)):
            self.transport.write(self.conn.send(event))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.transport.close()


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (IPv4 or IPv6 by the address)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(1024)
    return sock


def serve(service: ModelService, sock: socket.socket, api_key: str = "") -> None:
    """Answer on `sock` until SIGTERM / SIGINT (uvicorn's handlers; the signal is re-raised once stopped), or until
    the scheduler thread died (`service.died`: the pending requests were failed; their answers go out within
    SHUTDOWN_GRACE_S)."""
    config = uvicorn.Config(
        make_app(service, api_key),
        http=SGLangH11Protocol,
        lifespan="off",
        access_log=False,
        log_level="warning",
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    server = uvicorn.Server(config)

    def stop_when_the_scheduler_dies() -> None:
        service.died.wait()
        server.should_exit = True

    threading.Thread(target=stop_when_the_scheduler_dies, name="scheduler-watch", daemon=True).start()
    server.run(sockets=[sock])


# ---- errors -------------------------------------------------------------------------------------------------------
async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    """SGLang's handler: FastAPI's 422 becomes 400 in SGLang's validation shape, one `where: what` per error. A body
    FastAPI did not read as JSON because of its Content-Type (a form, text) is told so, in the words of SGLang's
    `validate_json_request`, rather than that it "should be a valid dictionary"."""
    assert isinstance(exc, RequestValidationError)
    content_type = request.headers.get("content-type")
    if content_type and not _is_json(content_type) and any(error["loc"][:1] == ("body",) for error in exc.errors()):
        message = (
            f"header.content-type: Unsupported Media Type: Only 'application/json' is allowed, got {content_type!r} "
            "(send the body as JSON with Content-Type: application/json)"
        )
        return JSONResponse(error_body(message[:2000], validation=True), status_code=400)
    message = "; ".join(f"{'.'.join(map(str, error['loc']))}: {error['msg']}" for error in exc.errors())
    return JSONResponse(error_body(message[:2000], validation=True), status_code=400)


def _is_json(content_type: str) -> bool:
    """Whether FastAPI reads a body of this Content-Type as JSON (application/json or application/*+json)."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def _bad_request(request: Request, exc: Exception) -> JSONResponse:
    """400: SGLang's bodies on its native routes (protocol.error_body); on `/v1/...` its OpenAI serving's
    `create_error_response` ({"object": "error", ..., "type": "BadRequestError", "code": 400}), which the `openai`
    client reads `code` and `type` from."""
    assert isinstance(exc, BadRequest)
    if request.url.path.startswith("/v1/") and not exc.validation:
        body = {"object": "error", "message": str(exc), "type": "BadRequestError", "param": None, "code": 400}
        return JSONResponse(body, status_code=400)
    return JSONResponse(error_body(str(exc), exc.validation), status_code=400)


async def _http_error(request: Request, exc: Exception) -> Response:
    """FastAPI's answer ({"detail"}), except for a body FastAPI could not read: over the size limit (BodyLimit), or
    not decodable (not UTF-8, a 5,000-digit integer, nested too deep: SGLang's validation shape, as a JSON syntax
    error gets)."""
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code != 400:
        return await http_exception_handler(request, exc)
    cause = exc.__cause__
    if isinstance(cause, BadRequest):
        return await _bad_request(request, cause)
    reason = f"{type(cause).__name__}: {str(cause)[:120]}" if cause is not None else str(exc.detail)
    return JSONResponse(error_body(f"JSON decode error: {reason}", validation=True), status_code=400)


async def _queue_full(_: Request, exc: Exception) -> JSONResponse:
    """A request refused at admission (`--max-queued-requests`): 503 as SGLang answers it on every route (its
    tokenizer manager raises an HTTPException, which http_server.py's handler turns into an ErrorResponse)."""
    body = {"object": "error", "message": str(exc), "type": "503", "param": None, "code": 503}
    return JSONResponse(body, status_code=503)


async def _scheduler_died(_: Request, exc: Exception) -> JSONResponse:
    """A request pending when the scheduler thread died: 500 (its traceback was logged once by the service)."""
    return JSONResponse({"error": {"message": str(exc)}}, status_code=500)


async def _server_error(_: Request, exc: Exception) -> JSONResponse:
    """At the process boundary: answer 500 and keep serving (Starlette re-raises it, uvicorn logs the traceback)."""
    return JSONResponse({"error": {"message": f"{type(exc).__name__}: {exc}"}}, status_code=500)


class ApiKey:
    """SGLang's `--api-key` (`utils/auth.py`, 0.5.9): every request but OPTIONS and the `/health*` and `/metrics*`
    paths needs `Authorization: Bearer <key>` (compared in constant time), else 401 `{"error": "Unauthorized"}`."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or path.startswith(("/health", "/metrics")):
            await self.app(scope, receive, send)
            return
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer" or not secrets.compare_digest(token, self.expected):
            await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuses a body over `max_bytes`: by its Content-Length before reading it (answered 400, the connection
    closed, since the body is not read), or, when chunked, once the bytes received pass the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        message = f"Content-Length must be a number of bytes up to {self.max_bytes}"
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            reply = JSONResponse(
                error_body(f"{message}, got {declared[:40].decode('latin-1')!r}", validation=False),
                status_code=400,
                headers={"Connection": "close"},
            )
            await reply(scope, receive, send)
            return
        received = 0

        async def receive_limited() -> Message:
            nonlocal received
            chunk = await receive()
            received += len(chunk.get("body", b""))
            if received > self.max_bytes:
                raise BadRequest(f"the request body is over {self.max_bytes} bytes")
            return chunk

        await self.app(scope, receive_limited, send)


# ---- routes -------------------------------------------------------------------------------------------------------
def _service(request: Request) -> ModelService:
    return request.app.state.service


Service = Annotated[ModelService, Depends(_service)]
native_routes = APIRouter()
"""SGLang's native routes (`entrypoints/http_server.py`); the OpenAI `/v1/*` routes are in openai_routes.py."""


@native_routes.get("/health")
async def health(service: Service) -> Response:
    return Response(status_code=200 if service.alive else 503)


@native_routes.get("/health_generate")
async def health_generate(service: Service) -> Response:
    return Response(status_code=200 if await run_in_threadpool(service.health_generate) else 503)


@native_routes.get("/get_model_info")
@native_routes.get("/model_info")
async def model_info(service: Service) -> dict[str, Any]:
    return server_state.model_info(service)


@native_routes.get("/get_server_info")
@native_routes.get("/server_info")
async def server_info(service: Service) -> dict[str, Any]:
    return server_state.server_info(service)


@native_routes.get("/get_weight_version")
async def weight_version(service: Service) -> dict[str, Any]:
    """Served as SGLang up to 0.5.8 did (0.5.9 answers 404, "deprecated": use /model_info's `weight_version`)."""
    return {"weight_version": service.weight_version}


@native_routes.api_route("/generate", methods=["POST", "PUT"])
async def generate(service: Service, http: Request, obj: GenerateReqInput | None = None) -> Any:
    request = (obj or GenerateReqInput()).normalize()
    order = await run_in_threadpool(service.submit, request)
    if request.stream:
        return event_stream(generate_stream(service, request, order))
    await service.wait(order, http.is_disconnected)
    return await run_in_threadpool(service.responses, request, order)


@native_routes.post("/pause_generation")
async def pause_generation(service: Service, obj: PauseGenerationReqInput | None = None) -> dict[str, Any]:
    return await run_in_threadpool(service.pause, (obj or PauseGenerationReqInput()).mode)


@native_routes.post("/continue_generation")
async def continue_generation(service: Service) -> dict[str, Any]:
    return await run_in_threadpool(service.resume)


@native_routes.post("/update_weights_from_disk")
async def update_weights_from_disk(service: Service, obj: UpdateWeightFromDiskReqInput) -> JSONResponse:
    status, body = await run_in_threadpool(
        service.update_from_disk, obj.model_path, obj.weight_version, obj.abort_all_requests, obj.flush_cache
    )
    return JSONResponse(body, status_code=status)


@native_routes.post("/begin_weight_update")
async def begin_weight_update(service: Service) -> JSONResponse:
    status, body = await run_in_threadpool(service.session, True)
    return JSONResponse(body, status_code=status)


@native_routes.post("/end_weight_update")
async def end_weight_update(service: Service) -> JSONResponse:
    status, body = await run_in_threadpool(service.session, False)
    return JSONResponse(body, status_code=status)


@native_routes.post("/update_weight_version")
async def update_weight_version(service: Service, obj: UpdateWeightVersionReqInput) -> dict[str, Any]:
    return await run_in_threadpool(service.set_label, obj.new_version, obj.abort_all_requests)


@native_routes.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(service: Service) -> PlainTextResponse:
    flushed = await run_in_threadpool(service.flush_cache)
    return PlainTextResponse(
        "Cache flushed.\nPlease check backend logs for more details. (When there are "
        "running or waiting requests, the operation will not be performed.)\n",
        status_code=200 if flushed else 400,
    )


@native_routes.post("/abort_request")
async def abort_request(service: Service, obj: AbortReq | None = None) -> Response:
    obj = obj or AbortReq()
    await run_in_threadpool(service.abort, obj.rid or "", obj.abort_all)
    return Response(status_code=200)


@native_routes.api_route("/slow_down", methods=["GET", "POST"])
async def slow_down(service: Service, obj: SlowDownReqInput | None = None) -> Response:
    service.slow_down((obj or SlowDownReqInput()).seconds())  # BadRequest over MAX_FORWARD_SLEEP_S
    return Response(status_code=200)


@native_routes.api_route("/get_load", methods=["GET", "POST"])
async def get_load(service: Service) -> list[dict[str, Any]]:
    """SGLang's load report, one entry per data-parallel rank (we have one)."""
    return [await run_in_threadpool(service.load)]


@native_routes.api_route("/get_weights_by_name", methods=["GET", "POST"])
async def get_weights_by_name(service: Service, obj: GetWeightsByNameReqInput) -> Any:
    """The weight's first `truncate_size` rows as served (server_state.weights_by_name); 400 when there is none."""
    tied = service.engine.arch.tie_word_embeddings
    rows = await run_in_threadpool(
        server_state.weights_by_name, service.model_dir, service.quant, obj.name, obj.truncate_size, tied
    )
    if rows is None:
        raise BadRequest("Get parameter by name failed")
    return rows


@native_routes.api_route("/release_memory_occupation", methods=["GET", "POST"])
async def release_memory_occupation(service: Service, obj: MemoryOccupationReqInput | None = None) -> None:
    """Bookkeeping only here (server_state.MemoryOccupation); answers `null` as SGLang does."""
    await run_in_threadpool(service.release_memory, (obj or MemoryOccupationReqInput()).tags)


@native_routes.api_route("/resume_memory_occupation", methods=["GET", "POST"])
async def resume_memory_occupation(service: Service, obj: MemoryOccupationReqInput | None = None) -> None:
    await run_in_threadpool(service.resume_memory, (obj or MemoryOccupationReqInput()).tags)


@native_routes.post("/tokenize")
@native_routes.post("/v1/tokenize")
async def tokenize(service: Service, obj: TokenizeReqInput) -> dict[str, Any]:
    """SGLang's tokenization; a text too long to fit the context, or texts over the request's size limits, are
    refused untokenized (as `/generate` refuses them)."""
    texts = [obj.prompt] if isinstance(obj.prompt, str) else obj.prompt
    check_request_size(texts)
    for text in texts:
        check_text_fits(text, 0, service.token_chars, service.engine.max_seq_len)

    def encode(text: str) -> list[int]:
        return service.tokenizer.encode(text, add_special_tokens=obj.add_special_tokens)

    tokens = await run_in_threadpool(
        lambda: encode(obj.prompt) if isinstance(obj.prompt, str) else [encode(text) for text in obj.prompt]
    )
    count = len(tokens) if isinstance(obj.prompt, str) else [len(ids) for ids in tokens]
    return {"tokens": tokens, "count": count, "max_model_len": service.engine.max_seq_len}


@native_routes.post("/detokenize")
@native_routes.post("/v1/detokenize")
async def detokenize(service: Service, obj: DetokenizeReqInput) -> dict[str, Any]:
    """SGLang's detokenization; more token lists or tokens than a request may hold (schemas.check_detokenize_size),
    or an id outside the vocabulary, are refused before anything is decoded."""

    def decode(ids: list[int]) -> str:
        return service.tokenizer.decode(ids, skip_special_tokens=obj.skip_special_tokens)

    single = not obj.tokens or isinstance(obj.tokens[0], int)
    token_lists: list[list[int]] = [obj.tokens] if single else obj.tokens  # type: ignore[list-item,assignment]
    check_detokenize_size(token_lists)
    vocab_size = service.engine.arch.vocab_size
    for ids in token_lists:
        bad = [token for token in ids if not 0 <= token < vocab_size]  # type: ignore[operator]
        if bad:
            message = f"tokens must lie in [0, {vocab_size}) (the model's vocab_size), got {bad[:5]}"
            raise BadRequest(message, validation=True)
    text = await run_in_threadpool(lambda: decode(obj.tokens) if single else [decode(ids) for ids in obj.tokens])
    return {"text": text}


@native_routes.post("/load_lora_adapter")
async def load_lora_adapter(service: Service, obj: lora_serve.LoadLoRAAdapterReqInput) -> JSONResponse:
    """`--enable-lora`: read a peft directory as adapter `lora_name` (lora_serve.py); without it, SGLang's 400."""
    status, body = await run_in_threadpool(lora_serve.load_route, service, obj)
    return JSONResponse(body, status_code=status)


@native_routes.post("/unload_lora_adapter")
async def unload_lora_adapter(service: Service, obj: lora_serve.UnloadLoRAAdapterReqInput) -> JSONResponse:
    """`--enable-lora`: drop adapter `lora_name` once no request uses it (lora_serve.py); without it, SGLang's 400."""
    status, body = await run_in_threadpool(lora_serve.unload_route, service, obj)
    return JSONResponse(body, status_code=status)


@native_routes.post("/update_weights_from_distributed")
@native_routes.post("/init_weights_update_group")
@native_routes.post("/destroy_weights_update_group")
@native_routes.post("/update_weights_from_tensor")
@native_routes.post("/update_weights_from_ipc")
async def needs_nccl(request: Request) -> JSONResponse:
    """Routes that move weights over NCCL/CUDA (IPC: CUDA IPC handles): answered as SGLang answers a failed update."""
    return JSONResponse(
        {
            "success": False,
            "message": f"{request.url.path} needs NCCL/CUDA and is not supported by asyncrl serve; "
            "use /update_weights_from_disk",
        },
        status_code=400,
    )
