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
- With `return_logprob`, prompt log-probs from `logprob_start_len` on are scored before the request joins
  (`EmbeddedEngine.prompt_logprobs`, one forward over the prompt; none for the default -1), top-k ones with
  `top_logprobs_num`. `stop` strings end a request once its decoded output holds one (checked after every step);
  a stream's client going away aborts its requests (`abort_requests`, streaming.py).
- A request with `sampling_params.sampling_seed = s` draws sample i exactly as `EmbeddedEngine.generate` with seed
  s draws the i-th copy of its prompt, so the two can be compared token for token.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty, Queue
from typing import TYPE_CHECKING, Any

from rollout_workers.sglang_api import protocol
from rollout_workers.sglang_api.logprobs import logprob_meta, score_prompt
from rollout_workers.sglang_api.protocol import BadRequest
from rollout_workers.sglang_api.schemas import GenerateRequest, SamplingParams

if TYPE_CHECKING:
    from rollout_workers.engine import SamplingParams as EngineSamplingParams

HEALTH_TIMEOUT_S = 20.0
"""How long `/health_generate` waits for its one-token request."""


@dataclass(eq=False)
class _Request:
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

    def settle(self) -> None:
        if not self.done.done():
            self.done.set_result(None)


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
    ):
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
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)  # a model dir is data
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

    # ---- called from the HTTP side -------------------------------------------------------------------------------
    @property
    def weight_version(self) -> str:
        return self._labels.get(self.engine.version, str(self.engine.version))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request: GenerateRequest) -> list[_Request]:
        """Tokenize and check a `/generate` request and queue it; returns its requests in SGLang's response order."""
        groups: list[list[_Request]] = []
        order: list[_Request] = []
        n = request.sampling[0].n
        for b, (prompt, sampling) in enumerate(zip(request.prompts, request.sampling)):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self._check(ids, sampling)
            start = request.logprob_start_len[b] if request.logprob_start_len else -1
            if request.return_logprob and start >= len(ids):
                raise BadRequest(
                    f"logprob_start_len ({start}) is larger than the number of input tokens ({len(ids)}). "
                    "Request with a lower logprob_start_len."
                )
            keys = self._keys(sampling.sampling_seed, n)
            group = [
                _Request(
                    self._rid(request, b, i, len(request.prompts)),
                    ids,
                    sampling,
                    key,
                    return_logprob=request.return_logprob,
                    logprob_start_len=start,
                    top_logprobs_num=request.top_logprobs_num[b] if request.top_logprobs_num else 0,
                )
                for i, key in enumerate(keys)
            ]
            groups.append(group)
        for i in range(n):  # SGLang's order: the batch repeated n times
            order.extend(group[i] for group in groups)
        self._call(lambda: self._waiting.extend(groups), wait=False)
        return order

    async def wait(self, order: list[_Request]) -> None:
        """Until every request of `order` has finished (or was aborted), without holding a thread."""
        pending = {asyncio.wrap_future(req.done) for req in order}
        while pending:
            _, pending = await asyncio.wait(pending, timeout=1.0)
            if pending and not self.alive:
                raise RuntimeError("the scheduler thread died; see the server log")

    def responses(self, request: GenerateRequest, order: list[_Request]) -> Any:
        """The `/generate` answer for finished requests: one object, or a list in `order`."""
        outs = [self._response(req, request.return_logprob, request.return_text_in_logprobs) for req in order]
        return outs[0] if request.single else outs

    def progress(self, req: _Request) -> int:
        """Output tokens `req` has so far (read from the HTTP side while the scheduler appends)."""
        seq = req.seq
        return len(seq.versions) if seq is not None else 0

    def response(self, request: GenerateRequest, req: _Request) -> dict[str, Any]:
        """One request's `/generate` answer as it stands: the final one once it finished, else a partial one
        (finish_reason None) for a stream."""
        return self._response(req, request.return_logprob, request.return_text_in_logprobs)

    def abort_requests(self, order: list[_Request]) -> None:
        """Abort these requests (a stream whose client went away): their slots are freed between two steps. Returns
        at once (the scheduler runs it), so a cancelled stream can call it without awaiting."""
        targets = set(order)
        self._call(lambda: self._abort(lambda req: req in targets, "Abort: the client disconnected"), wait=False)

    def load(self) -> dict[str, Any]:
        """SGLang's `/get_load` for our one scheduler: requests running and waiting, tokens in the KV cache."""

        def count() -> dict[str, Any]:
            running = list(self._by_seq.values())
            return {
                "dp_rank": 0,
                "num_reqs": len(running) + sum(len(group) for group in self._waiting),
                "num_waiting_reqs": sum(len(group) for group in self._waiting),
                "num_tokens": sum(len(req.seq.tokens) for req in running if req.seq is not None),
            }

        return self._call(count)

    def pause(self, mode: str) -> dict[str, Any]:
        self._call(lambda: self._pause(mode))
        return {"message": "Generation paused successfully.", "status": "ok"}

    def resume(self) -> dict[str, Any]:
        self._call(self._resume)
        return {"message": "Generation continued successfully.", "status": "ok"}

    def update_from_disk(self, model_path: str, label: str | None, abort_all: bool) -> tuple[int, dict[str, Any]]:
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
        self._call(lambda: self._update(tensors, label, abort_all, future), wait=False)
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
        """Abort the requests whose id starts with `rid` (none when it is empty), or all of them."""
        self._call(lambda: self._abort(lambda req: abort_all or (bool(rid) and req.rid.startswith(rid)), "Aborted"))

    def flush_cache(self) -> bool:
        return self._call(lambda: not (self.engine.busy or self._waiting))

    def health_generate(self) -> bool:
        if not self.alive:
            return False
        if self.paused_mode is not None or self.engine.busy:
            return True  # SGLang: a busy server answering other requests is healthy
        prompt = [self.engine.arch.eos_token_ids[0] if self.engine.arch.eos_token_ids else 0]
        req = _Request(f"HEALTH_CHECK_{time.time()}", prompt, SamplingParams(max_new_tokens=1, top_k=1), 0)
        self._call(lambda: self._waiting.append([req]), wait=False)
        done, _ = futures_wait([req.done], timeout=HEALTH_TIMEOUT_S)
        return bool(done)

    def set_label(self, label: str, abort_all: bool) -> dict[str, Any]:
        if abort_all:
            self.abort("", abort_all=True)
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

    def _rid(self, request: GenerateRequest, b: int, i: int, batch: int) -> str:
        if request.rids is None:
            return uuid.uuid4().hex
        return request.rids[b if len(request.rids) == batch else i * batch + b]

    def _keys(self, seed: int | None, n: int) -> list[int]:
        import torch

        from rollout_workers.embedded.engine import _splitmix64  # the engine's own sample-key derivation

        generator = torch.Generator().manual_seed(seed) if seed is not None else self._random
        base = int(torch.randint(0, 1 << 62, (1,), generator=generator))
        return [_splitmix64(base ^ _splitmix64(i + 1)) for i in range(n)]

    def _check(self, ids: list[int], sampling: SamplingParams) -> None:
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

    def _engine_params(self, sampling: SamplingParams) -> EngineSamplingParams:
        from rollout_workers.engine import SamplingParams as EngineSamplingParams

        greedy = sampling.temperature < 1e-6  # SGLang: temperature 0 is top_k=1 at temperature 1
        stops = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(self.engine.arch.eos_token_ids))
        return EngineSamplingParams(
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
        previous = self._labels.get(self.engine.version)  # SGLang keeps the served label when an update gives none
        version = self.engine.version + 1
        if label is not None and label.lstrip("-").isdigit() and int(label) > self.engine.version:
            version = int(label)
        update.version = version
        self.engine.stage_weights(update)
        self.engine.swap_now(recompute_kv=recompute_kv)
        self._labels[version] = label if label is not None else (previous or str(version))
        self.updates += 1
        return version

    def _response(self, req: _Request, return_logprob: bool, text_in_logprobs: bool) -> dict[str, Any]:
        completion = req.seq.completion if req.seq is not None else None
        tokens = list(completion.response_ids) if completion else []
        logps = list(completion.behav_logp) if completion else []
        versions = list(completion.versions) if completion else []
        finish = req.finish
        if completion is None and req.seq is not None and finish is None:  # still running: what it has (a stream)
            seq = req.seq
            count = len(seq.versions)  # appended last of the three per token (engine._sample)
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
            "num_retractions": req.retractions,
            "completion_tokens": len(tokens),
            "cached_tokens": 0,
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
                    req.settle()
            self._stop_on_strings()
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
            try:
                score_prompt(self.engine, group)
            except Exception as err:  # a failed scoring fails its request, not the scheduler
                traceback.print_exc()
                for req in group:
                    req.finish = protocol.finish_abort(f"prompt scoring failed: {err}", 500)
                    req.settle()
                continue
            if first.sampling.max_new_tokens == 0:
                for req in group:
                    req.finish = protocol.finish_length(0)
                    req.settle()
                continue
            seqs = self.engine.submit(
                first.prompt,
                self._engine_params(first.sampling),
                [req.key for req in group],
                top_logprobs_num=first.top_logprobs_num if first.return_logprob else 0,
                min_new_tokens=first.sampling.min_new_tokens,
            )
            for req, seq in zip(group, seqs):
                req.seq = seq
                self._by_seq[id(seq)] = req

    def _stop_on_strings(self) -> None:
        """End the running requests whose output text now holds one of their `stop` strings (SGLang's stop strings:
        finish_reason `{"type": "stop", "matched": <the string>}`; the text is trimmed in `_response`)."""
        ended = []
        for req in self._by_seq.values():
            stops = req.sampling.stop_strings
            if not stops or req.seq is None or req.seq.completion is not None:
                continue
            text = self.tokenizer.decode(req.seq.response, skip_special_tokens=req.sampling.skip_special_tokens)
            hits = [(text.find(stop), stop) for stop in stops if stop in text]
            if hits:
                req.finish = protocol.finish_stop(min(hits)[1])
                ended.append(req)
        if ended:
            self.engine.abort([req.seq for req in ended])
            for req in ended:
                self._by_seq.pop(id(req.seq), None)
                req.settle()

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
            req.settle()
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
