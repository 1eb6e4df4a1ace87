"""`asyncrl serve MODEL`: the embedded engine behind SGLang's native HTTP API (protocol.py has the shapes).

    HTTP threads (one per connection)            scheduler thread (owns the engine)
    /generate ---- parse, tokenize ----submit--> loop: run commands; admit new requests; engine.step();
        waits for its sequences <---resolve---         answer finished sequences
    /pause_generation, /update_weights_from_disk, /abort_request, ... -> commands run between two steps

- One scheduler thread steps the engine continuously; requests join mid-flight (continuous batching).
- `/pause_generation` returns once no step is running: `abort` ends every request (finish_reason abort, with the
  tokens it has), `in_place` and `retract` keep them; new requests wait until `/continue_generation`.
- `/update_weights_from_disk` loads a checkpoint directory (safetensors in SGLang's layout, checkpoint.py), brings
  it to the served scheme (`--quant`) and swaps it in: while paused at once (`retract`: the in-flight K/V is
  recomputed with the new weights, `in_place`: kept), otherwise after the running requests finish (new ones wait),
  as SGLang does. Each update gets a new integer version; `weight_version` labels are kept as given.
- Every output token carries the version that computed it: `meta_info.weight_versions` (our extension).
- A request with `sampling_params.sampling_seed = s` draws sample i exactly as `EmbeddedEngine.generate` with seed
  s draws the i-th copy of its prompt, so the two can be compared token for token.

HTTP is the standard library's threading server (HTTP/1.1 keep-alive): no dependency, and a thread per connection
suits a server whose requests mostly wait on the scheduler. Binds 127.0.0.1 unless `--host` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from queue import Empty, Queue
from typing import Any

from rollout_workers.sglang_api import protocol
from rollout_workers.sglang_api.protocol import BadRequest

HEALTH_TIMEOUT_S = 20.0
MAX_BODY_BYTES = 64 << 20
"""Largest request body accepted (a batch of prompts as token ids fits many times over)."""


@dataclass(eq=False)
class _Request:
    rid: str
    prompt: list[int]
    sampling: protocol.Sampling
    key: int
    started: float = field(default_factory=time.time)
    seq: Any = None
    done: threading.Event = field(default_factory=threading.Event)
    finish: dict[str, Any] | None = None
    retractions: int = 0


class ModelService:
    """The engine, its tokenizer and its scheduler thread. Public methods are called from HTTP threads."""

    def __init__(
        self,
        model_dir: str,
        quant: str | None = None,
        weight_version: str = "0",
        seed: int = 0,
        max_batch: int = 256,
        max_seq_len: int = 2048,
        precision: str = "fp32",
        device: str = "cpu",
    ):
        import torch
        from transformers import AutoTokenizer

        from rollout_workers.embedded.engine import EmbeddedEngine
        from rollout_workers.sglang_api.checkpoint import SERVED_SCHEMES, checkpoint_scheme

        on_disk, _ = checkpoint_scheme(model_dir)
        self.quant = quant or on_disk
        if self.quant not in SERVED_SCHEMES:
            raise ValueError(f"--quant {self.quant!r} is not one of {', '.join(SERVED_SCHEMES)}")
        self.model_dir = str(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.engine = EmbeddedEngine(
            model_dir, max_batch=max_batch, seed=seed, max_seq_len=max_seq_len, precision=precision, device=device
        )
        self._random = torch.Generator().manual_seed(seed)
        self._labels: dict[int, str] = {}
        self._commands: Queue[tuple[Callable[[], Any], Future | None]] = Queue()
        self._waiting: list[list[_Request]] = []  # groups that have not joined the engine yet
        self._by_seq: dict[int, _Request] = {}
        self._deferred: list[tuple[Any, Future]] = []  # weight updates waiting for running requests to finish
        self.paused_mode: str | None = None
        self._session = False
        self._stopped = threading.Event()
        self.updates = 0
        self.forward_sleep_s = 0.0
        """Seconds slept after every step: SGLang's testing knob `/slow_down` (forward_sleep_time)."""
        self._apply(self._load(model_dir), label=weight_version)
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self._thread.start()

    # ---- called from HTTP threads -------------------------------------------------------------------------------
    @property
    def weight_version(self) -> str:
        return self._labels.get(self.engine.version, str(self.engine.version))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def generate(self, body: Any) -> Any:
        request = protocol.parse_generate(body)
        groups: list[list[_Request]] = []
        order: list[_Request] = []
        n = request.sampling[0].n
        for b, (prompt, sampling) in enumerate(zip(request.prompts, request.sampling)):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self._check(ids, sampling)
            keys = self._keys(sampling.sampling_seed, n)
            group = [
                _Request(self._rid(request, b, i, len(request.prompts)), ids, sampling, key)
                for i, key in enumerate(keys)
            ]
            groups.append(group)
        for i in range(n):  # SGLang's order: the batch repeated n times
            order.extend(group[i] for group in groups)
        self._call(lambda: self._waiting.extend(groups), wait=False)
        for req in order:
            while not req.done.wait(1.0):
                if not self.alive:
                    raise RuntimeError("the scheduler thread died; see the server log")
        outs = [self._response(req, request.return_logprob, request.return_text_in_logprobs) for req in order]
        return outs[0] if request.single else outs

    def pause(self, body: Any) -> dict[str, Any]:
        mode = (body or {}).get("mode", "abort") if isinstance(body, dict) else None
        if mode not in protocol.PAUSE_MODES:
            raise BadRequest(f"Invalid mode: {mode!r}. Expected one of {list(protocol.PAUSE_MODES)}.", validation=True)
        self._call(lambda: self._pause(mode))
        return {"message": "Generation paused successfully.", "status": "ok"}

    def resume(self) -> dict[str, Any]:
        self._call(self._resume)
        return {"message": "Generation continued successfully.", "status": "ok"}

    def update_from_disk(self, body: Any) -> tuple[int, dict[str, Any]]:
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            raise BadRequest("model_path: Field required (a checkpoint directory)", validation=True)
        label = body.get("weight_version")
        try:
            tensors = self._load(body["model_path"])
        except Exception as err:  # a bad checkpoint must not take the server down: SGLang answers 400 and keeps serving
            return 400, {
                "success": False,
                "message": f"Failed to get weights iterator: {err}.",
                "num_paused_requests": 0,
            }
        future: Future = Future()
        abort_all = bool(body.get("abort_all_requests"))
        self._call(lambda: self._update(tensors, None if label is None else str(label), abort_all, future), wait=False)
        ok, message, paused = future.result()
        if ok and label is not None:
            message += f" Weight version updated to {label}."
        return (200 if ok else 400), {"success": ok, "message": message, "num_paused_requests": paused}

    def session(self, begin: bool) -> tuple[int, dict[str, Any]]:
        def toggle() -> tuple[bool, str]:
            if self._session == begin:
                return False, "a weight update session is already open" if begin else "no weight update session is open"
            self._session = begin
            return True, "Weight update session " + ("opened." if begin else "closed.")

        ok, message = self._call(toggle)
        return (200 if ok else 400), {"success": ok, "message": message}

    def abort(self, body: Any) -> None:
        body = body if isinstance(body, dict) else {}
        rid, abort_all = str(body.get("rid") or ""), bool(body.get("abort_all"))
        self._call(lambda: self._abort(lambda req: abort_all or (bool(rid) and req.rid.startswith(rid)), "Aborted"))

    def flush_cache(self) -> bool:
        return self._call(lambda: not (self.engine.busy or self._waiting))

    def health_generate(self) -> bool:
        if not self.alive:
            return False
        if self.paused_mode is not None or self.engine.busy:
            return True  # SGLang: a busy server answering other requests is healthy
        prompt = [self.engine.arch.eos_token_ids[0] if self.engine.arch.eos_token_ids else 0]
        req = _Request(f"HEALTH_CHECK_{time.time()}", prompt, protocol.Sampling(max_new_tokens=1, top_k=1), 0)
        self._call(lambda: self._waiting.append([req]), wait=False)
        return req.done.wait(HEALTH_TIMEOUT_S)

    def set_label(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict) or "new_version" not in body:
            raise BadRequest("new_version: Field required", validation=True)
        label = str(body["new_version"])
        if body.get("abort_all_requests", True):
            self.abort({"abort_all": True})
        self._call(lambda: self._labels.__setitem__(self.engine.version, label))
        return {"success": True, "message": f"Weight version updated to {label}", "new_version": label}

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=10)

    # ---- helpers --------------------------------------------------------------------------------------------------
    def _call(self, fn: Callable[[], Any], wait: bool = True) -> Any:
        future: Future | None = Future() if wait else None
        self._commands.put((fn, future))
        return future.result() if future is not None else None

    def _rid(self, request: protocol.GenerateRequest, b: int, i: int, batch: int) -> str:
        if request.rids is None:
            return uuid.uuid4().hex
        return request.rids[b if len(request.rids) == batch else i * batch + b]

    def _keys(self, seed: int | None, n: int) -> list[int]:
        import torch

        from rollout_workers.embedded.engine import _splitmix64  # the engine's own sample-key derivation

        generator = torch.Generator().manual_seed(seed) if seed is not None else self._random
        base = int(torch.randint(0, 1 << 62, (1,), generator=generator))
        return [_splitmix64(base ^ _splitmix64(i + 1)) for i in range(n)]

    def _check(self, ids: list[int], sampling: protocol.Sampling) -> None:
        if not ids:
            raise BadRequest("input_ids cannot be empty.")
        vocab = self.engine.arch.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise BadRequest(f"input_ids must lie in [0, {vocab}) (the model's vocab_size)")
        limit = self.engine.max_seq_len
        if len(ids) + sampling.max_new_tokens > limit:
            raise BadRequest(
                f"Requested token count exceeds the model's maximum context length of {limit} tokens. "
                f"You requested a total of {len(ids) + sampling.max_new_tokens} tokens: {len(ids)} "
                f"tokens from the input messages and {sampling.max_new_tokens} tokens for the completion."
            )

    def _engine_params(self, sampling: protocol.Sampling):
        from rollout_workers.engine import SamplingParams

        greedy = sampling.temperature < 1e-6  # SGLang: temperature 0 is top_k=1 at temperature 1
        stops = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(self.engine.arch.eos_token_ids))
        return SamplingParams(
            max_new_tokens=sampling.max_new_tokens,
            temperature=1.0 if greedy else sampling.temperature,
            top_p=sampling.top_p,
            top_k=1 if greedy else max(sampling.top_k, 0),
            stop_token_ids=tuple(sorted(stops)) or (-1,),  # (-1,): stop on nothing (the engine reads () as EOS)
        )

    def _load(self, model_dir: str):
        from quant_sync.update import WeightUpdate
        from rollout_workers.sglang_api.checkpoint import checkpoint_scheme, read_tensors, rollout_tensors

        if not Path(model_dir).is_dir():
            raise FileNotFoundError(f"{model_dir} is not a directory")
        _, block = checkpoint_scheme(model_dir)
        return WeightUpdate(-1, rollout_tensors(read_tensors(model_dir), self.quant, block), self.quant)

    def _apply(self, update, label: str | None, recompute_kv: bool = False) -> int:
        version = self.engine.version + 1
        if label is not None and label.lstrip("-").isdigit() and int(label) > self.engine.version:
            version = int(label)
        update.version = version
        self.engine.stage_weights(update)
        self.engine.swap_now(recompute_kv=recompute_kv)
        self._labels[version] = label if label is not None else str(version)
        self.updates += 1
        return version

    def _response(self, req: _Request, return_logprob: bool, text_in_logprobs: bool) -> dict[str, Any]:
        completion = req.seq.completion if req.seq is not None else None
        tokens = list(completion.response_ids) if completion else []
        logps = list(completion.behav_logp) if completion else []
        versions = list(completion.versions) if completion else []
        finish = req.finish
        if finish is None:
            finish = (
                protocol.finish_stop(tokens[-1]) if completion.finish == "stop" else protocol.finish_length(len(tokens))
            )
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": finish,
            "prompt_tokens": len(req.prompt),
            "weight_version": self.weight_version,
            "num_retractions": req.retractions,
            "completion_tokens": len(tokens),
            "cached_tokens": 0,
            "e2e_latency": time.time() - req.started,
            protocol.WEIGHT_VERSIONS_KEY: protocol.version_spans([self._labels.get(v, str(v)) for v in versions]),
        }
        if return_logprob:
            texts = [self.tokenizer.decode([t]) for t in tokens] if text_in_logprobs else [None] * len(tokens)
            meta["output_token_logprobs"] = [[lp, t, s] for lp, t, s in zip(logps, tokens, texts)]
            meta["input_token_logprobs"] = []
        text = self.tokenizer.decode(tokens, skip_special_tokens=req.sampling.skip_special_tokens)
        return {"text": text, "output_ids": tokens, "meta_info": meta}

    # ---- the scheduler thread -------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopped.is_set():
            idle = self.paused_mode is not None or not (self.engine.busy or self._waiting or self._deferred)
            self._run_commands(block=idle)
            if self._deferred and not self.engine.busy:
                for tensors, future in self._deferred:
                    future.set_result(self._swap(tensors, None))
                self._deferred.clear()
            if self.paused_mode is None and not self._deferred:
                self._admit()
            if self.paused_mode is not None or not self.engine.busy:
                continue
            try:
                finished = self.engine.step()
            except Exception:  # a broken step fails its requests; the server keeps answering
                message = traceback.format_exc(limit=4)
                print(f"asyncrl serve: step failed:\n{message}", file=sys.stderr, flush=True)
                self._abort(lambda req: True, f"engine step failed: {message.splitlines()[-1]}", status=500)
                continue
            for seq in finished:
                req = self._by_seq.pop(id(seq), None)
                if req is not None:
                    req.done.set()
            if self.forward_sleep_s:
                time.sleep(self.forward_sleep_s)

    def _run_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.2) if block else self._commands.get_nowait()
        except Empty:
            return
        while True:
            fn, future = item
            try:
                result = fn()
            except Exception as err:
                if future is None:
                    traceback.print_exc()
                else:
                    future.set_exception(err)
            else:
                if future is not None:
                    future.set_result(result)
            try:
                item = self._commands.get_nowait()
            except Empty:
                return

    def _admit(self) -> None:
        while self._waiting:
            group = self._waiting.pop(0)
            first = group[0]
            if first.sampling.max_new_tokens == 0:
                for req in group:
                    req.finish = protocol.finish_length(0)
                    req.done.set()
                continue
            seqs = self.engine.submit(first.prompt, self._engine_params(first.sampling), [req.key for req in group])
            for req, seq in zip(group, seqs):
                req.seq = seq
                self._by_seq[id(seq)] = req

    def _abort(self, match: Callable[[_Request], bool], message: str, status: int | None = None) -> int:
        reason = protocol.finish_abort(message, status)
        hits = [req for group in self._waiting for req in group if match(req)]
        self._waiting = [[req for req in group if not match(req)] for group in self._waiting]
        self._waiting = [group for group in self._waiting if group]
        running = [req for req in self._by_seq.values() if match(req)]
        self.engine.abort([req.seq for req in running])
        for req in running:
            self._by_seq.pop(id(req.seq), None)
        for req in hits + running:
            req.finish = reason
            req.done.set()
        return len(hits) + len(running)

    def _pause(self, mode: str) -> None:
        if mode == "abort":
            self._abort(lambda req: True, "Abort by pause_generation")
        self.paused_mode = mode

    def _resume(self) -> None:
        self.paused_mode = None

    def _update(self, update, label: str | None, abort_all: bool, future: Future) -> None:
        if abort_all:
            self._abort(lambda req: True, "Abort before weight update")
        if self.paused_mode is None and self.engine.busy:
            self._deferred.append(((update, label), future))  # SGLang waits for running requests to finish
            return
        future.set_result(self._swap((update, label), self.paused_mode))

    def _swap(self, pending, mode: str | None) -> tuple[bool, str, int]:
        update, label = pending
        in_flight = list(self._by_seq.values())
        try:
            self._apply(update, label, recompute_kv=mode == "retract")
        except Exception as err:  # missing tensors, wrong shapes: the old weights stay
            return False, f"Failed to update weights: {err}.\nRolling back to original weights.", len(in_flight)
        if mode == "retract":
            for req in in_flight:
                req.retractions += 1
        return True, "Succeeded to update model weights.", len(in_flight)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    service: ModelService
    server_version = "asyncrl-serve"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        pass

    def _send(self, status: int, body: Any = None, text: str | None = None) -> None:
        payload = text.encode() if text is not None else (b"" if body is None else json.dumps(body).encode())
        self.send_response(status)
        self.send_header("Content-Type", "text/plain" if text is not None else "application/json")
        self.send_header("Content-Length", str(len(payload)))
        if self.close_connection:  # tell the client, so that it does not send its next request on this connection
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(payload)

    def _body(self) -> Any:
        header = (self.headers.get("Content-Length") or "0").strip()
        if not (header.isascii() and header.isdigit()) or int(header) > MAX_BODY_BYTES:
            self.close_connection = True  # the body's end is unknown: this connection cannot carry another request
            raise BadRequest(f"Content-Length must be a number of bytes up to {MAX_BODY_BYTES}, got {header[:40]!r}")
        length = int(header)
        raw = self.rfile.read(length) if length else b""
        if not raw.strip():
            return {}
        try:
            return json.loads(raw)
        except json.JSONDecodeError as err:
            raise BadRequest(f"JSON decode error: {err}", validation=True) from None
        except (UnicodeDecodeError, ValueError, RecursionError) as err:  # not UTF-8; a 5,000-digit integer; nesting
            raise BadRequest(f"JSON decode error: {type(err).__name__}: {str(err)[:120]}", validation=True) from None

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._route("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._route("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._route("PUT")

    def _route(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        handler = ROUTES.get(path)
        if handler is None or method not in handler[0]:
            self.close_connection = True  # its body is not read: it must not be taken for the next request
            if handler is None:
                self._send(404, {"detail": "Not Found"})
            else:
                self._send(405, {"detail": "Method Not Allowed"})
            return
        methods, fn = handler
        try:
            body = self._body() if method != "GET" else {}
            fn(self, body)
        except BadRequest as err:
            self._send(400, protocol.error_body(str(err), err.validation))
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as err:  # at the process boundary: answer, count in the log, keep serving
            traceback.print_exc()
            self._send(500, {"error": {"message": f"{type(err).__name__}: {err}"}})


def _model_info(h: _Handler, _: Any) -> None:
    s = h.service
    h._send(
        200,
        {
            "model_path": s.model_dir,
            "tokenizer_path": s.model_dir,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": s.weight_version,
        },
    )


def _server_info(h: _Handler, _: Any) -> None:
    s = h.service
    h._send(
        200,
        {
            "model_path": s.model_dir,
            "quantization": {"int8": "w8a8_int8", "fp8": "fp8"}.get(s.quant),
            "weight_version": s.weight_version,
            "max_running_requests": s.engine.max_batch,
            "context_length": s.engine.max_seq_len,
            "version": "asyncrl-serve",
        },
    )


def _health(h: _Handler, _: Any) -> None:
    h._send(200 if h.service.alive else 503)


def _health_generate(h: _Handler, _: Any) -> None:
    h._send(200 if h.service.health_generate() else 503)


def _flush(h: _Handler, _: Any) -> None:
    ok = h.service.flush_cache()
    h._send(
        200 if ok else 400,
        text="Cache flushed.\nPlease check backend logs for more details. (When there are "
        "running or waiting requests, the operation will not be performed.)\n",
    )


def _abort_request(h: _Handler, body: Any) -> None:
    h.service.abort(body)
    h._send(200)


def _slow_down(h: _Handler, body: Any) -> None:
    seconds = body.get("forward_sleep_time") if isinstance(body, dict) else None
    if seconds is not None and (not isinstance(seconds, (int, float)) or seconds < 0):
        raise BadRequest(f"forward_sleep_time must be a number >= 0 or null, got {seconds!r}", validation=True)
    h.service.forward_sleep_s = float(seconds or 0.0)
    h._send(200)


def _not_here(name: str) -> Callable[[_Handler, Any], None]:
    def answer(h: _Handler, _: Any) -> None:
        h._send(
            400,
            {
                "success": False,
                "message": f"{name} needs NCCL/CUDA and is not supported by asyncrl serve; "
                "use /update_weights_from_disk",
            },
        )

    return answer


ROUTES: dict[str, tuple[tuple[str, ...], Callable[[_Handler, Any], None]]] = {
    "/health": (("GET",), _health),
    "/health_generate": (("GET",), _health_generate),
    "/get_model_info": (("GET",), _model_info),
    "/model_info": (("GET",), _model_info),
    "/get_server_info": (("GET",), _server_info),
    "/get_weight_version": (("GET",), lambda h, _: h._send(200, {"weight_version": h.service.weight_version})),
    "/generate": (("POST", "PUT"), lambda h, body: h._send(200, h.service.generate(body))),
    "/pause_generation": (("POST",), lambda h, body: h._send(200, h.service.pause(body))),
    "/continue_generation": (("POST",), lambda h, body: h._send(200, h.service.resume())),
    "/update_weights_from_disk": (("POST",), lambda h, body: h._send(*h.service.update_from_disk(body))),
    "/begin_weight_update": (("POST",), lambda h, body: h._send(*h.service.session(True))),
    "/end_weight_update": (("POST",), lambda h, body: h._send(*h.service.session(False))),
    "/update_weight_version": (("POST",), lambda h, body: h._send(200, h.service.set_label(body))),
    "/flush_cache": (("GET", "POST"), _flush),
    "/abort_request": (("POST",), _abort_request),
    "/slow_down": (("GET", "POST"), _slow_down),
    "/update_weights_from_distributed": (("POST",), _not_here("/update_weights_from_distributed")),
    "/init_weights_update_group": (("POST",), _not_here("/init_weights_update_group")),
    "/update_weights_from_tensor": (("POST",), _not_here("/update_weights_from_tensor")),
}


def make_server(service: ModelService, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    handler = type("Handler", (_Handler,), {"service": service})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncrl serve", description="The embedded engine behind SGLang's HTTP API.")
    parser.add_argument("model", help="a Hugging Face model directory (float, w8a8_int8 or FP8-block), or builtin:NAME")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=30000, help="TCP port (0 picks a free one; SGLang's default 30000)")
    parser.add_argument(
        "--quant",
        choices=("int8", "fp8", "none"),
        default=None,
        help="served weight scheme (default: the checkpoint's quantization_config, else none)",
    )
    parser.add_argument("--weight-version", default="0", help="label of the weights loaded at start")
    parser.add_argument("--seed", type=int, default=0, help="seed of requests without sampling_seed")
    parser.add_argument("--max-batch", type=int, default=256, help="sequences decoded together (KV-cache slots)")
    parser.add_argument("--max-seq-len", type=int, default=2048, help="prompt + response positions per slot")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--cache-dir", default="", help="cache of built-in models (builtin:NAME)")
    parser.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone (0: never)")
    return parser


def _exit_with(pid: int) -> None:
    """No orphaned servers: the launching worker gone (even killed), this process ends too."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(0)
        except PermissionError:
            pass


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    from common.builtin_model import resolve_model_path

    torch.set_num_threads(args.threads)
    model_dir = str(resolve_model_path(args.model, args.cache_dir, log=lambda *a: print(*a, file=sys.stderr)))
    try:
        service = ModelService(
            model_dir,
            args.quant,
            args.weight_version,
            args.seed,
            args.max_batch,
            args.max_seq_len,
            args.precision,
            args.device,
        )
    except (ValueError, OSError) as err:
        print(f"asyncrl serve: {err}", file=sys.stderr)
        return 2
    server = make_server(service, args.host, args.port)
    host, port = server.server_address[:2]
    print(f"asyncrl serve: ready on http://{host}:{port} model={model_dir} quant={service.quant}", flush=True)
    if args.parent_pid:
        threading.Thread(target=_exit_with, args=(args.parent_pid,), name="parent-watch", daemon=True).start()
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        service.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
