"""The embedded engine behind `asyncrl serve`: a scheduler thread that batches SGLang requests continuously.

    HTTP side (server_app.py, event loop + thread pool)     scheduler thread (owns the engine)
    /generate -- check, tokenize --submit-->  loop: run commands; admit new requests; engine.step();
        awaits its requests' futures <--settle--         settle finished requests
    /pause_generation, /update_weights_from_disk, /abort_request, ... -> commands run between two steps

- One scheduler thread steps the engine continuously; requests join mid-flight (continuous batching). Everything
  that touches the engine runs on it: the HTTP side queues commands (`_call`) and waits on futures.
- `/pause_generation` returns once no step is running: `abort` ends every request (finish_reason abort, with the
  tokens it has), `in_place` and `retract` keep them; new requests wait until `/continue_generation`.
- `/update_weights_from_disk` loads a checkpoint directory (safetensors in SGLang's layout, checkpoint.py), brings
  it to the served scheme (`--quant`) and swaps it in: while paused at once (`retract`: the in-flight K/V is
  recomputed with the new weights, `in_place`: kept), otherwise after the running requests finish (new ones wait),
  as SGLang does. Each update gets a new integer version; `weight_version` labels are kept as given.
- Every output token carries the version that computed it: `meta_info.weight_versions` (our extension).
- With `return_logprob`, prompt log-probs from `logprob_start_len` on are scored by the prefill that admits the
  request (`EmbeddedEngine.submit(prompt_logprobs_from=...)`, no forward of their own; none for the default -1),
  top-k ones with `top_logprobs_num`; `max_new_tokens=0` requests are that prefill alone. `stop` strings end a
  request once its decoded output holds one (checked after every step);
  a stream's client going away aborts its requests (`abort_requests`, streaming.py), and so does a non-streaming
  client's (checked every second while it waits, as SGLang 0.5.9 does: `wait`).
- The scheduler thread dying of an unexpected exception (a bug: a step's own failure only fails its requests) must
  not leave a server that answers 503 and hangs: its traceback is printed once, every request and command still
  pending is failed (`SchedulerDied`, answered 500; a stream's samples end on a `finish_reason` abort, then the
  stream sends an error event and `[DONE]`, streaming.py), and `died` is set,
  which ends the server and its process with a non-zero status (server_app.serve, server.py), as SGLang's scheduler
  brings its whole process tree down (SIGQUIT to the parent, which kills the tree), so a supervisor restarts it.
- A request with `sampling_params.sampling_seed = s` draws sample i exactly as `EmbeddedEngine.generate` with seed
  s draws the i-th copy of its prompt, so the two can be compared token for token.
- Split out: serve_requests.py (a request's samples and their engine sampling parameters, penalties included),
  server_state.py (`/server_info`, `/model_info`, `/get_load`, `/get_weights_by_name`, memory occupation).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from pathlib import Path
from queue import Empty, Queue
from typing import Any

from rollout_workers.sglang_api import protocol
from rollout_workers.sglang_api.logprobs import logprob_meta, scored_from
from rollout_workers.sglang_api.lora_serve import LoraAdapters, resolve_adapters
from rollout_workers.sglang_api.schemas import GenerateRequest, SamplingParams
from rollout_workers.sglang_api.serve_requests import (
    ServeRequest,
    engine_params,
    request_groups,
    shown_while_running,
    stop_string_hits,
)
from rollout_workers.sglang_api.server_state import MemoryOccupation, Throughput, load_report
from rollout_workers.token_chars import max_token_chars

HEALTH_TIMEOUT_S = 20.0
"""How long `/health_generate` waits for its one-token request."""


class ServerCrash(BaseException):
    """What ends SGLang's scheduler process (an assertion in it): not caught by the command loop, so the scheduler
    thread dies and the server exits, as SGLang's does (`_die`)."""


class SchedulerDied(RuntimeError):
    """The scheduler thread died: what was waiting on it fails with this (answered 500) and the server exits."""


class ModelService:
    """The engine, its tokenizer and its scheduler thread: the adapter the HTTP app (server_app.py) calls.

    Blocking methods are called from the app's thread pool; `wait` is awaited on its event loop.
    """

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
        max_queued_requests: int | None = None,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1 (sequences decoded together), got {max_batch}")
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len must be at least 2 (a prompt token and a generated one), got {max_seq_len}")
        if max_queued_requests is not None and max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0 when set, got {max_queued_requests}")
        self.max_queued_requests = max_queued_requests
        """SGLang's `--max-queued-requests`: at most this many requests wait to join the engine; a request that would
        be one more is refused (`QueueFull`, 503; a stream's samples end on `finish_reason` abort, status 503). None:
        no limit, SGLang's default."""
        import torch
        from transformers import AutoTokenizer

        from rollout_workers.embedded.engine import EmbeddedEngine
        from rollout_workers.sglang_api.checkpoint import checkpoint_scheme
        from rollout_workers.sglang_api.protocol import SERVED_SCHEMES

        on_disk, _ = checkpoint_scheme(model_dir)
        self.quant = quant or on_disk
        if self.quant not in SERVED_SCHEMES:
            raise ValueError(f"--quant {self.quant!r} is not one of {', '.join(SERVED_SCHEMES)}")
        self.model_dir = str(model_dir)
        """The weights' directory: the last one `/update_weights_from_disk` loaded (SGLang's `model_path`)."""
        self.served_model_name = self.tokenizer_path = str(model_dir)
        self.architectures = json.loads((Path(model_dir) / "config.json").read_text()).get("architectures")
        self.chat_sampling_defaults = chat_sampling_defaults(model_dir)
        """generation_config.json's sampling values a chat request falls back on (SGLang's `--sampling-defaults
        model`, its default)."""
        self.precision, self.seed = precision, seed
        self.launch: dict[str, Any] = {}
        """How the server was started (`host`, `port`: set by server.py), for `/server_info`."""
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)  # a model dir is data
        self.token_chars = max_token_chars(self.tokenizer)
        """The most characters one token stands for: longer texts than max_seq_len times it are refused untokenized."""
        self.engine = EmbeddedEngine(
            model_dir, max_batch=max_batch, seed=seed, max_seq_len=max_seq_len, precision=precision, device=device
        )
        self._random = torch.Generator().manual_seed(seed)
        self._labels: dict[int, str] = {}
        self._commands: Queue[tuple[Callable[[], Any], Future | None]] = Queue()
        self._waiting: list[list[ServeRequest]] = []  # groups that have not joined the engine yet
        self._by_seq: dict[int, ServeRequest] = {}
        self._deferred: list[tuple[Any, Future]] = []  # weight updates waiting for running requests to finish
        self.paused_mode: str | None = None
        self._session = False
        self._stopped = threading.Event()
        self._wake = threading.Event()  # ends a `/slow_down` sleep early (a new setting, close)
        self.failure: str | None = None
        """Why the scheduler thread died (its exception, one line); None while it runs."""
        self._died_finish: dict[str, Any] | None = None  # the finish reason `_die` gave the requests it failed
        self.died = threading.Event()
        """Set once the scheduler thread died and everything pending on it was failed: the server must exit."""
        self.updates = 0
        self.forward_sleep_s = 0.0
        """Seconds slept after every step: SGLang's testing knob `/slow_down` (forward_sleep_time)."""
        self.weight_bytes = 0
        """Bytes of the served weights (as loaded, before the engine's fused layout)."""
        self.throughput = Throughput()
        self.memory = MemoryOccupation()
        self.lora: LoraAdapters | None = None
        """`--enable-lora`: the adapters and their scheduling (lora_serve.py, set by server.py); None: LoRA off."""
        self._apply(self._load(model_dir), label=weight_version)
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self._thread.start()

    # ---- called from the HTTP side -------------------------------------------------------------------------------
    @property
    def weight_version(self) -> str:
        return self._labels.get(self.engine.version, str(self.engine.version))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request: GenerateRequest) -> list[ServeRequest]:
        """Tokenize and check a `/generate` request and queue it; returns its requests in SGLang's response order."""
        arch = self.engine.arch
        max_seq_len = self.engine.max_seq_len
        groups = request_groups(request, self.tokenizer, arch.vocab_size, max_seq_len, self._random, self.token_chars)
        order: list[ServeRequest] = []
        for group, adapter in zip(groups, resolve_adapters(self.lora, request.lora_path, len(groups))):
            for req in group:
                req.adapter = adapter  # type: ignore[attr-defined]  # the request's LoRA adapter (lora_serve.py)
        for group in groups:  # SGLang 0.5.9's order (tokenizer_manager: for each prompt, its n samples)
            order.extend(group)
        if self.max_queued_requests is None:
            self._call(lambda: self._waiting.extend(groups), wait=False)
        elif not self._call(lambda: self._queue_within_limit(groups)) and not request.stream:
            raise protocol.QueueFull()
        return order

    def _queue_within_limit(self, groups: list[list[ServeRequest]]) -> bool:
        """Queue `groups` if the waiting requests stay within `max_queued_requests`, else end every one of them on
        SGLang's abort (503) unqueued: all or none, so a refused batch leaves no half of itself running."""
        assert self.max_queued_requests is not None
        waiting = sum(len(group) for group in self._waiting)
        if waiting + sum(len(group) for group in groups) <= self.max_queued_requests:
            self._waiting.extend(groups)
            return True
        refused = protocol.finish_abort(protocol.QUEUE_FULL, 503)
        for req in (req for group in groups for req in group):
            req.finish = refused
            req.settle()
        return False

    async def wait(self, order: list[ServeRequest], client_gone: Callable[[], Awaitable[bool]] | None = None) -> None:
        """Until every request of `order` has finished (or was aborted), without holding a thread. With
        `client_gone` (the HTTP request's `is_disconnected`), checked every second as SGLang 0.5.9's tokenizer
        manager does: a client gone before the answer aborts its requests (their slots free) and raises BadRequest."""
        pending = {asyncio.wrap_future(req.done) for req in order}
        while pending:
            _, pending = await asyncio.wait(pending, timeout=1.0)
            self.raise_if_died(order, running=bool(pending))
            if pending and client_gone is not None and await client_gone():
                self.abort_requests(order)
                raise protocol.BadRequest("Request is disconnected from the client side: aborted")
        self.raise_if_died(order, running=False)

    def raise_if_died(self, order: list[ServeRequest], running: bool) -> None:
        """SchedulerDied when the scheduler thread is gone while some of `order` are still `running` (they never will
        finish), or when it failed one of them as it died (`_die`: finished with its abort, not by the engine)."""
        if running and not self.alive:
            raise SchedulerDied(self._died_message())
        died = self._died_finish
        if died is not None and any(req.finish is died for req in order):
            raise SchedulerDied(self._died_message())

    def responses(self, request: GenerateRequest, order: list[ServeRequest]) -> Any:
        """The `/generate` answer for finished requests: one object, or a list in `order`."""
        outs = [self._response(req, req.return_logprob, request.return_text_in_logprobs) for req in order]
        return outs[0] if request.single else outs

    def progress(self, req: ServeRequest) -> int:
        """Output tokens of `req` a stream may show so far (read from the HTTP side while the scheduler appends):
        with stop strings, those already checked against them."""
        seq = req.seq
        count = len(seq.versions) if seq is not None else 0
        return min(count, req.checked) if req.sampling.stop_strings else count

    def response(self, request: GenerateRequest, req: ServeRequest) -> dict[str, Any]:
        """One request's `/generate` answer as it stands: the final one once it finished, else a partial one
        (finish_reason None) for a stream."""
        return self._response(req, req.return_logprob, request.return_text_in_logprobs)

    def abort_requests(self, order: list[ServeRequest]) -> None:
        """Abort these requests (a stream whose client went away): their slots are freed between two steps. Returns
        at once (the scheduler runs it), so a cancelled stream can call it without awaiting."""
        targets = set(order)
        with contextlib.suppress(SchedulerDied):  # nothing left to abort: `_die` failed every request it held
            self._call(lambda: self._abort(lambda req: req in targets, "Abort: the client disconnected"), wait=False)

    def load(self) -> dict[str, Any]:
        """SGLang's `/get_load` entry of our one scheduler (server_state.load_report)."""
        return self._call(lambda: load_report(list(self._by_seq.values()), self._waiting))

    def pause(self, mode: str) -> dict[str, Any]:
        self._call(lambda: self._pause(mode))
        return {"message": "Generation paused successfully.", "status": "ok"}

    def resume(self) -> dict[str, Any]:
        self._call(self._resume)
        return {"message": "Generation continued successfully.", "status": "ok"}

    def update_from_disk(
        self, model_path: str, label: str | None, abort_all: bool, flush_cache: bool = True
    ) -> tuple[int, dict[str, Any]]:
        """Load a checkpoint and swap it in (now while paused, else after the running requests): (status, body)."""
        try:
            tensors = self._load(model_path)
        except Exception as err:  # a bad checkpoint must not take the server down: SGLang answers 400 and keeps serving
            return 400, {
                "success": False,
                "message": f"Failed to get weights iterator: {err}.",
                "num_paused_requests": 0,
            }
        future: Future = Future()
        self._call(lambda: self._update(tensors, label, abort_all, future, flush_cache), wait=False)
        ok, message, paused = future.result()
        if ok:
            self.model_dir = str(model_path)
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

    def abort(self, rid: str, abort_all: bool) -> None:
        """Abort the request whose id is `rid` (none when it is empty), or all of them: SGLang 0.5.9's tokenizer
        manager passes an abort on only for a rid it has (`abort_request`), so a prefix aborts nothing over HTTP."""
        self._call(lambda: self._abort(lambda req: abort_all or (bool(rid) and req.rid == rid), "Aborted"))

    def release_memory(self, tags: list[str] | None) -> None:
        """SGLang's `/release_memory_occupation` (server_state.MemoryOccupation): refused unless idle; releasing
        `kv_cache` flushes the prefix cache, as SGLang flushes its radix cache."""

        def release() -> None:
            if "kv_cache" in self.memory.release(tags, busy=self.engine.busy or bool(self._waiting)):
                self.engine.flush_prefix_cache()

        self._call(release)

    def resume_memory(self, tags: list[str] | None) -> None:
        self._call(lambda: self.memory.resume(tags))

    def flush_cache(self) -> bool:
        """SGLang's `/flush_cache`: empty the prefix cache, unless requests run or wait (then False, nothing done)."""

        def flush() -> bool:
            if self.engine.busy or self._waiting:
                return False
            self.engine.flush_prefix_cache()
            return True

        return self._call(flush)

    def health_generate(self) -> bool:
        if not self.alive or self.failure is not None:
            return False
        if self.paused_mode is not None or self.engine.busy:
            return True  # SGLang: a busy server answering other requests is healthy
        prompt = [self.engine.arch.eos_token_ids[0] if self.engine.arch.eos_token_ids else 0]
        req = ServeRequest(f"HEALTH_CHECK_{time.time()}", prompt, SamplingParams(max_new_tokens=1, top_k=1), 0)
        try:
            self._call(lambda: self._waiting.append([req]), wait=False)
        except SchedulerDied:
            return False
        done, _ = futures_wait([req.done], timeout=HEALTH_TIMEOUT_S)
        return bool(done) and self.failure is None

    def set_label(self, label: str, abort_all: bool) -> dict[str, Any]:
        if abort_all:
            self.abort("", abort_all=True)
        self._call(lambda: self._labels.__setitem__(self.engine.version, label))
        return {"success": True, "message": f"Weight version updated to {label}", "new_version": label}

    def slow_down(self, seconds: float) -> None:
        """SGLang's `/slow_down`: sleep `seconds` after every step (0: not at all); a sleep under way ends now."""
        self.forward_sleep_s = seconds
        self._wake.set()

    def close(self) -> None:
        self._stopped.set()
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- helpers --------------------------------------------------------------------------------------------------
    def _call(self, fn: Callable[[], Any], wait: bool = True) -> Any:
        """Run `fn` on the scheduler thread (between two steps); with `wait`, its result. Raises SchedulerDied once
        the thread died (a command queued just before it died is failed by `_die`)."""
        future: Future | None = Future() if wait else None
        self._commands.put((fn, future))
        if self.failure is not None:
            raise SchedulerDied(self._died_message())
        return future.result() if future is not None else None

    def _died_message(self) -> str:
        return f"the scheduler thread died ({self.failure or 'see the server log'}); the server is exiting"

    def _load(self, model_dir: str):
        from quant_sync.update import WeightUpdate
        from rollout_workers.sglang_api.checkpoint import checkpoint_scheme, read_tensors, rollout_tensors

        if not Path(model_dir).is_dir():
            raise FileNotFoundError(f"{model_dir} is not a directory")
        _, block = checkpoint_scheme(model_dir)
        return WeightUpdate(-1, rollout_tensors(read_tensors(model_dir), self.quant, block), self.quant)

    def _apply(self, update, label: str | None, recompute_kv: bool = False) -> int:
        previous = self._labels.get(self.engine.version)  # SGLang keeps the served label when an update gives none
        version = self.engine.version + 1
        if label is not None and label.lstrip("-").isdigit() and int(label) > self.engine.version:
            version = int(label)
        update.version = version
        if self.lora is not None:  # --enable-lora: the engine's adapter stays on top of the new base
            update = self.lora.on_base(update)
        self.engine.stage_weights(update)
        self.weight_bytes = sum(tensor.numel() * tensor.element_size() for tensor in update.tensors.values())
        self.engine.swap_now(recompute_kv=recompute_kv)
        self._labels[version] = label if label is not None else (previous or str(version))
        self.updates += 1
        return version

    def _response(self, req: ServeRequest, return_logprob: bool, text_in_logprobs: bool) -> dict[str, Any]:
        # Final only once settled: the engine sets `completion` a moment before the scheduler settles the request
        # (and may set its finish, a matched stop string, in between), so a stream that read it then sent a final
        # chunk, and another once the request settled.
        settled = req.done.done()
        completion = req.seq.completion if req.seq is not None and settled else None
        tokens = list(completion.response_ids) if completion else []
        logps = list(completion.behav_logp) if completion else []
        versions = list(completion.versions) if completion else []
        finish = req.finish if settled else None
        running = completion is None and req.seq is not None and finish is None
        if running:  # what a stream may show (`progress`; the text is cut in `shown_while_running` below)
            seq, count = req.seq, self.progress(req)
            tokens, logps, versions = seq.response[:count], seq.logp[:count], seq.versions[:count]
        elif finish is None and completion is not None:
            finish = (
                protocol.finish_stop(tokens[-1]) if completion.finish == "stop" else protocol.finish_length(len(tokens))
            )
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": finish,
            "prompt_tokens": len(req.prompt),
            "weight_version": self.weight_version,
            "total_retractions": req.retractions,  # SGLang 0.5.9's key (tokenizer_manager.py), the version served
            "num_retractions": req.retractions,  # the same count under the name later releases give it
            "completion_tokens": len(tokens),
            "cached_tokens": req.seq.cached_tokens if req.seq is not None else 0,  # prefix-cache hits
            "e2e_latency": time.time() - req.started,
            protocol.WEIGHT_VERSIONS_KEY: protocol.version_spans([self._labels.get(v, str(v)) for v in versions]),
        }
        if return_logprob:
            output_top = req.seq.top_logprobs if req.seq is not None else []
            meta.update(logprob_meta(self.tokenizer, req, tokens, logps, output_top, text_in_logprobs))
        text = self.tokenizer.decode(tokens, skip_special_tokens=req.sampling.skip_special_tokens)
        matched = finish.get("matched") if finish else None
        if isinstance(matched, str) and not req.sampling.no_stop_trim and matched in text:
            text = text[: text.find(matched)]  # SGLang trims the stop string and what follows it
        elif running:
            text = shown_while_running(text, req.sampling.stop_strings)
        return {"text": text, "output_ids": tokens, "meta_info": meta}

    # ---- the scheduler thread -------------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._schedule()
        except BaseException as err:  # the thread's boundary: a bug; fail what waits on it, then the server exits
            self._die(err)

    def _die(self, err: BaseException) -> None:
        """Print the traceback once, fail every pending request (finish_reason abort, status 500) and command
        (SchedulerDied), then set `died`: server_app.serve stops the server, server.py exits non-zero."""
        self.failure = f"{type(err).__name__}: {err}"
        trace = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        print(f"asyncrl serve: the scheduler thread died:\n{trace}", file=sys.stderr, end="", flush=True)
        self._died_finish = protocol.finish_abort(self._died_message(), 500)
        for req in [req for group in self._waiting for req in group] + list(self._by_seq.values()):
            if not req.done.done():
                req.finish = self._died_finish
                req.settle()
        self._waiting, self._by_seq = [], {}
        for _, future in self._deferred:
            if not future.done():
                future.set_exception(SchedulerDied(self._died_message()))
        self._deferred.clear()
        while True:
            try:
                _, future = self._commands.get_nowait()
            except Empty:
                break
            if future is not None and not future.done():
                future.set_exception(SchedulerDied(self._died_message()))
        self.died.set()

    def _schedule(self) -> None:
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
            started = time.perf_counter()
            try:
                finished = self.engine.step()
            except Exception:  # a broken step fails its requests; the server keeps answering
                message = traceback.format_exc(limit=4)
                print(f"asyncrl serve: step failed:\n{message}", file=sys.stderr, flush=True)
                self._abort(lambda req: True, f"engine step failed: {message.splitlines()[-1]}", status=500)
                continue
            self.throughput.add(self.engine.num_active + len(finished), time.perf_counter() - started)
            for seq in finished:
                req = self._by_seq.pop(id(seq), None)
                if req is not None:
                    req.settle()
            self._stop_on_strings()
            self._wake.clear()  # cleared before reading the setting: a `/slow_down` from now on ends the wait
            if self.forward_sleep_s:
                self._wake.wait(self.forward_sleep_s)

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
        while self._waiting and (self.lora is None or self.lora.admit(self._waiting[0][0])):  # LoRA: one adapter a step
            group = self._waiting.pop(0)
            first = group[0]
            score_from = scored_from(first)
            if first.sampling.max_new_tokens == 0 and score_from < 0:  # nothing to compute
                for req in group:
                    req.input_logprobs, req.input_top_logprobs = [None], [None]
                    req.finish = protocol.finish_length(0)
                    req.settle()
                continue
            seqs = self.engine.submit(
                first.prompt,
                engine_params(first.sampling, self.engine.stop_token_ids),
                [req.key for req in group],
                top_logprobs_num=first.top_logprobs_num if first.return_logprob else 0,
                min_new_tokens=first.sampling.min_new_tokens,
                prompt_logprobs_from=score_from,
                prompt_logprobs_temperature=1.0 if first.sampling.temperature < 1e-6 else first.sampling.temperature,
            )
            for req, seq in zip(group, seqs):
                req.seq = seq
                self._by_seq[id(seq)] = req

    def _stop_on_strings(self) -> None:
        """End the running requests whose output text now holds one of their `stop` strings (SGLang's stop strings:
        finish_reason `{"type": "stop", "matched": <the string>}`; the text is trimmed in `_response`)."""
        ended = stop_string_hits(self._by_seq.values(), self.tokenizer)
        if ended:
            self.engine.abort([req.seq for req in ended])
            for req in ended:
                self._by_seq.pop(id(req.seq), None)
                req.settle()

    def _abort(self, match: Callable[[ServeRequest], bool], message: str, status: int | None = None) -> int:
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
            req.settle()
        return len(hits) + len(running)

    def _pause(self, mode: str) -> None:
        if mode == "abort":
            self._abort(lambda req: True, "Abort by pause_generation")
        self.paused_mode = mode

    def _resume(self) -> None:
        self.paused_mode = None

    def _update(self, update, label: str | None, abort_all: bool, future: Future, flush_cache: bool = True) -> None:
        if abort_all:
            self._abort(lambda req: True, "Abort before weight update")
        if flush_cache and self.paused_mode == "in_place" and self._by_seq:  # SGLang 0.5.9 updates, its flush fails
            self._swap((update, label), self.paused_mode)  # with the requests kept in its batch, and its assertion
            message = "Cache flush failed after updating weights"  # ends the scheduler and the server: as here
            future.set_exception(SchedulerDied(message))
            raise ServerCrash(message)
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


CHAT_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty", "min_p")
"""What SGLang's chat takes from generation_config.json when a request omits it (`model_config.py`
`get_default_sampling_params`)."""


def chat_sampling_defaults(model_dir: str | Path) -> dict[str, Any]:
    """The model's generation_config.json values of CHAT_DEFAULT_KEYS ({} without the file or with a bad one)."""
    try:
        config = json.loads((Path(model_dir) / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    return {
        key: config[key]
        for key in CHAT_DEFAULT_KEYS
        if isinstance(config.get(key), int | float) and not isinstance(config.get(key), bool)
    }
