"""`rollout.backend: sglang`: an Engine (rollout_workers/engine.py) backed by one SGLang server per worker.

    worker loop ── generate(prompts) ──> one /generate per sample, in parallel ──> Completions (tokens, behav_logp,
                                         (return_logprob: meta_info.output_token_logprobs)      per-token versions)
    subscriber ── stage_weights(v) ──> checkpoint dir v in SGLang's layout (checkpoint.py) ──> sync thread
    sync thread ── pause(mode) -> [begin_weight_update] -> update_weights_from_disk(v) -> [end] -> continue
               └─ supervises the server process: relaunches it (from the newest checkpoint) when it dies

| who | waits for | unblocked by |
|---|---|---|
| generate | the server up with weights of version >= 0 | the sync thread (launch, first update) |
| a sample | its /generate; in `abort` pause mode it returns aborted and is resubmitted with its tokens | the server |
| sync thread | a newer staged version, or a dead server (polled every 0.5 s) | stage_weights, the poll |

Per-token versions come from `meta_info.weight_versions` when the server sends them (`asyncrl serve`). Real SGLang
sends only `weight_version` (the version when the response is built): a response that no update overlapped is
tagged with it; one that an `in_place` / `retract` update overlapped is tagged, conservatively, with the version
it started under (staleness is never underestimated). With `pause_mode: abort` every segment is one version.

The launcher (`rollout.sglang.launcher`) is `sglang` (`python -m sglang.launch_server`, GPUs) or `asyncrl`
(`asyncrl serve`, the embedded engine behind the same API: what runs on CPU and in tests). Weights travel as a
checkpoint for `/update_weights_from_disk`, or over NCCL with `/update_weights_from_distributed`
(`weight_sync: distributed`; written to SGLang's API, not run in this project's CI: no GPU).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from quant_sync.update import WeightUpdate
from rollout_workers.engine import Completion, SamplingParams
from rollout_workers.sections import EngineSections
from rollout_workers.sglang_api.client import RequestTimedOut, ServerError, ServerUnavailable, SGLangClient
from rollout_workers.sglang_api.lora_sync import AdapterVersions, lora_server_flags
from rollout_workers.sglang_api.protocol import WEIGHT_VERSIONS_KEY, expand_spans

SGLANG_QUANTIZATION = {"int8": "w8a8_int8", "fp8": "fp8"}
POLL_S = 0.5


class LaunchError(RuntimeError):
    """A server that exited or never became healthy; the message has its command and the tail of its log."""


def free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


class ServerProcess:
    """One server subprocess in its own process group, its log in `log_path`."""

    def __init__(self, command: list[str], host: str, log_path: Path, env: dict[str, str] | None = None,
                 api_key: str = "") -> None:  # fmt: skip
        self.command = command
        self.api_key = api_key
        self.env = env
        self.connect_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float, request_timeout_s: float, port: int) -> SGLangClient:
        with open(self.log_path, "ab") as log:
            log.write(f"\n$ {' '.join(self.command)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=self.env,
            )
        client = SGLangClient(f"http://{self.connect_host}:{port}", request_timeout_s, self.api_key)
        deadline = time.monotonic() + timeout_s
        while not client.healthy(timeout_s=5.0):
            if not self.alive:
                raise LaunchError(f"server exited with code {self.proc.returncode} during startup: {self._tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise LaunchError(f"server not healthy after {timeout_s:.0f} s: {self._tail()}")
            time.sleep(0.2)
        return client

    def _tail(self, chars: int = 2000) -> str:
        try:
            return f"command: {' '.join(self.command)}\nlog {self.log_path}:\n" + self.log_path.read_text()[-chars:]
        except OSError:
            return f"command: {' '.join(self.command)}"

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


class SGLangEngine:
    """The Engine protocol over an SGLang server this object launches, feeds with weights and keeps alive."""

    def __init__(self, sections: EngineSections, model_dir: str, worker_id: str = "worker-0", seed: int = 0):
        from rollout_workers.embedded.model import DTYPES, ArchConfig

        self.sections = sections
        self.sg = sections.rollout.sglang
        self.scheme = sections.quant.scheme
        self.model_dir = str(model_dir)
        self.arch = ArchConfig.from_model_dir(model_dir)
        self.float_dtype = DTYPES[sections.precision.rollout]
        self.seed = seed
        tail = worker_id.rsplit("-", 1)[-1]
        self.worker_index = int(tail) if tail.isdigit() else 0  # worker-i listens on base_port + i
        parent = Path(self.sg.ckpt_dir) if self.sg.ckpt_dir else _default_ckpt_parent()
        self.root = parent / f"asyncrl-sglang-{worker_id}-{os.getpid()}-{time.monotonic_ns() % 10**9}"
        self.root.mkdir(parents=True)
        # the server's API key (every route but /health and /metrics): any local process could otherwise pause
        # generation, relabel its weight version or load other weights; passed by 0600 files, never on a command line
        self._api_key = secrets.token_hex(32)
        self._api_key_file = _private_file(self.root / "api_key", self._api_key)
        _private_file(self.root / "api_key.yaml", json.dumps({"api-key": self._api_key}))  # SGLang's --config (YAML)
        lora = sections.model.lora  # LoRA: the base loaded once, adapters through SGLang's LoRA API (lora_sync.py)
        self._lora = AdapterVersions(self.root, self.model_dir, sections.staleness.max_lag) if lora.rank else None
        self.metrics: dict[str, float] = {
            "pause_s_last": 0.0,
            "pause_s_max": 0.0,
            "pause_s_total": 0.0,
            "weight_updates": 0,
            "weight_update_errors": 0,
            "server_restarts": 0,
            "resubmitted": 0,
            "aborted_samples": 0,
            "timed_out_requests": 0,
        }
        self.last_error = ""
        self.swaps = 0
        self._cond = threading.Condition()
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._fatal = ""
        self._client: SGLangClient | None = None
        self._server: ServerProcess | None = None
        self._applied = -1
        self._epoch = 0  # applied updates: a response overlapped one if the epoch moved while it ran
        self._pause_aborts = 0  # pauses in `abort` mode: their aborted samples are resubmitted for free
        self._rid_prefix = f"{worker_id}-{secrets.token_hex(4)}"  # each /generate's rid: prefix-sample-segment
        self._segments = itertools.count()
        self._staged: tuple[int, Path | None] | None = None
        self._staged_update: WeightUpdate | None = None
        self._launch_dir, self._launch_label = self._initial_dir(), "-1"
        self._session: bool | None = None  # whether the server has begin/end_weight_update (probed once)
        self._nccl_ready = False
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, min(sections.rollout.max_batch, 512)), thread_name_prefix="gen"
        )
        self._thread = threading.Thread(target=self._sync_loop, name=f"{worker_id}-sglang-sync", daemon=True)
        self._thread.start()

    # ---- the Engine protocol --------------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._applied

    @property
    def build_errors(self) -> int:
        """Always 0: a version the server fails to load is retried, not dropped (`sglang_weight_update_errors`)."""
        return 0

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The model's EOS ids (`eos_token_id` of its config.json)."""
        return tuple(self.arch.eos_token_ids)

    @property
    def max_seq_len(self) -> int | None:
        """The most prompt + max_new_tokens tokens the server takes, so that the worker skips (and counts) a prompt
        that cannot fit instead of sending it: SGLang 0.5.9 refuses a request with input + max_new_tokens >= its
        context length (`tokenizer_manager.py`: a 400 that failed the worker's whole batch), the model's
        `max_position_embeddings` unless `--context-length` is in `extra_args`; `asyncrl serve` takes up to its
        `--max-seq-len` (rollout.max_seq_len, within the model's positions and sliding window) as the embedded
        engine does."""
        arch = self.arch
        if self.sg.launcher == "asyncrl":
            limit = self.sections.rollout.max_seq_len
            return min(limit, arch.max_positions, arch.sliding_window or limit)
        context = arch.max_positions
        args = list(self.sg.extra_args)
        for i, arg in enumerate(args):
            if arg == "--context-length" and i + 1 < len(args) and args[i + 1].isdigit():
                context = int(args[i + 1])
            elif arg.startswith("--context-length=") and arg.split("=", 1)[1].isdigit():
                context = int(arg.split("=", 1)[1])
        return context - 1

    def stage_weights(self, update: WeightUpdate) -> None:
        """Write version `update.version` as a checkpoint (or keep it for NCCL); the sync thread applies it."""
        path = None
        if self._lora is not None:  # the adapters as a peft directory; the base only when it is not loaded yet
            base = self._lora.stage(update)
            if base is None:
                with self._cond:
                    self._cond.notify_all()
                return
            update = base
        if self.sg.weight_sync == "disk":
            from rollout_workers.sglang_api.checkpoint import sglang_tensors, write_version_dir

            tensors = sglang_tensors(update, self.float_dtype)
            path = write_version_dir(self.root, f"v{update.version}", tensors, self.model_dir, self.scheme)
        with self._cond:
            if self._staged is None or update.version > self._staged[0]:
                self._staged, self._staged_update = (update.version, path), update
            self._cond.notify_all()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        self._wait_ready()
        futures = [self._pool.submit(self._sample, list(prompt), params, i) for i, prompt in enumerate(prompts)]
        return [future.result() for future in futures]

    @property
    def fatal(self) -> str:
        """Why this engine can no longer generate (its server failed past `rollout.sglang.max_restarts`), else ""."""
        return self._fatal

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=30)
        if self._server is not None:
            self._server.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
        shutil.rmtree(self.root, ignore_errors=True)

    @property
    def server_pid(self) -> int | None:
        return self._server.proc.pid if self._server is not None and self._server.proc is not None else None

    def stats(self) -> dict[str, Any]:
        """Counters for the worker's stats, prefixed `sglang_` (pause_s_*: seconds generation was paused per update)."""
        alive = bool(self._server and self._server.alive)
        values = {**self.metrics, "server_alive": alive, "last_error": self.last_error}
        values.update(self._lora.stats() if self._lora is not None else {})
        return {f"sglang_{key}": value for key, value in values.items()}

    # ---- sampling -------------------------------------------------------------------------------------------------
    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.sg.startup_timeout_s
        while not self._ready.wait(0.2):
            if self._fatal:
                raise RuntimeError(self._fatal)
            if time.monotonic() > deadline:
                raise TimeoutError(f"no SGLang server with weights after {self.sg.startup_timeout_s} s: {self._fatal}")

    def _sample(self, prompt: list[int], params: SamplingParams, index: int) -> Completion:
        tokens: list[int] = []
        logps: list[float] = []
        versions: list[int] = []
        retries = 0
        while True:
            self._wait_ready()
            client, epoch, applied, aborts = self._client, self._epoch, self._applied, self._pause_aborts
            assert client is not None
            body = {
                "rid": f"{self._rid_prefix}-{index}-{next(self._segments)}",  # unique: SGLang refuses a rid it runs
                "input_ids": prompt + tokens,
                "return_logprob": True,
                "sampling_params": self._sampling(params, params.max_new_tokens - len(tokens), index, tokens),
            }
            adapter = self._lora.acquire() if self._lora is not None else None
            if adapter is not None:  # LoRA: this segment runs the newest adapter; its tokens carry its version
                body["lora_path"] = adapter.name
            elif self._lora is not None:  # no adapter on a relaunched server yet: wait for the sync thread
                time.sleep(POLL_S)
                continue
            try:
                out = client.generate(body)
            except RequestTimedOut as err:  # the server may still run it: abort it, count it as an abort
                self.last_error = str(err)
                self.metrics["timed_out_requests"] += 1
                with contextlib.suppress(ServerUnavailable, ServerError):
                    client.abort(body["rid"])
                retries += 1
                if not self._resubmit(retries):  # a request that always outlasts the timeout ends the sample
                    return Completion(tokens, logps, versions, finish="abort")
                continue
            except ServerUnavailable as err:  # died or restarting: the sync thread relaunches it (bounded by
                self.last_error = str(err)  # max_restarts and startup_timeout_s); the lost segment is sampled again
                if self._fatal:  # no relaunch left: fail the batch (the worker is restarted by its supervisor)
                    raise RuntimeError(self._fatal) from err
                time.sleep(POLL_S)
                continue
            finally:
                if adapter is not None:
                    self._lora.release(adapter)  # type: ignore[union-attr]
            meta = out["meta_info"]
            new = [int(t) for t in out["output_ids"]]
            new_logps = [float(entry[0]) for entry in meta["output_token_logprobs"]]
            if len(new_logps) != len(new):
                raise ValueError(f"{len(new)} output ids but {len(new_logps)} output_token_logprobs")
            tokens += new
            logps += new_logps
            if adapter is not None:
                versions += [adapter.version] * len(new)
            else:
                versions += self._versions(meta, len(new), epoch, applied)
            kind = (meta.get("finish_reason") or {}).get("type")
            if kind in ("stop", "length"):
                return Completion(tokens, logps, versions, finish=kind)
            if len(tokens) >= params.max_new_tokens:
                return Completion(tokens, logps, versions, finish="length")
            if self._pause_aborts == aborts:  # an abort we did not ask for (ours are resubmitted for free)
                retries += 1
            if not self._resubmit(retries):
                return Completion(tokens, logps, versions, finish="abort")

    def _resubmit(self, retries: int) -> bool:
        """Whether a sample goes on after its `retries`-th abort it did not ask for (or timed-out request), counted;
        past `rollout.sglang.max_retries` it ends as an aborted sample."""
        if retries > self.sg.max_retries:
            self.metrics["aborted_samples"] += 1
            return False
        self.metrics["resubmitted"] += 1
        return True

    def _sampling(self, params: SamplingParams, remaining: int, index: int, tokens: list[int]) -> dict[str, Any]:
        values: dict[str, Any] = {
            "max_new_tokens": remaining,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "min_p": params.min_p,
            # the Engine protocol: stop_token_ids when given ((-1,): none), else EOS. SGLang 0.5.9's ignore_eos turns
            # off every token stop, stop_token_ids too (schedule_batch.py `_check_token_based_finish`): set only for
            # "none"; given ids stop besides the model's EOS (the workers' ids are the EOS ids, and a turn's)
            "stop_token_ids": [token for token in params.stop_token_ids if token >= 0],
            "ignore_eos": bool(params.stop_token_ids) and all(token < 0 for token in params.stop_token_ids),
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        if params.stop:  # stop strings (a multi-turn environment's): the turn ends server-side, the string kept
            values["stop"] = list(params.stop)
        if params.seed is not None:
            values["sampling_seed"] = (params.seed + index + 7919 * len(tokens)) % (1 << 31)
        return values

    def _versions(self, meta: dict[str, Any], n: int, epoch: int, applied: int) -> list[int]:
        spans = meta.get(WEIGHT_VERSIONS_KEY)
        if spans is not None:
            return expand_spans(spans, n)
        if self._epoch == epoch:
            try:
                return [int(meta.get("weight_version"))] * n
            except (TypeError, ValueError):
                return [applied] * n
        return [applied] * n  # an update overlapped this response: the version it started under, conservatively

    # ---- weights and supervision (the sync thread) ------------------------------------------------------------------
    def _initial_dir(self) -> Path:
        """What the server launches from: the model dir (asyncrl serve quantizes at load), or for SGLang with a
        quantized scheme, a checkpoint in its layout (w8a8_int8 and block FP8 must be on disk in that form)."""
        if self.sg.launcher != "sglang" or self.scheme == "none":
            return Path(self.model_dir)
        from quant_sync.sglang_formats import export_sglang
        from rollout_workers.sglang_api.checkpoint import read_tensors, write_version_dir

        tensors = export_sglang(read_tensors(self.model_dir), self.scheme)
        return write_version_dir(self.root, "base", tensors, self.model_dir, self.scheme)

    def _launch(self) -> None:
        """(Re)start the server from the newest checkpoint it can start from; marks ready when it has weights."""
        self._ready.clear()
        if self._server is not None:
            self._server.stop()
        model_dir, label = self._launch_dir, self._launch_label
        port = self.sg.base_port + self.worker_index if self.sg.base_port else free_port(self.sg.host)
        command = server_command(self.sections, model_dir, port, label, self.seed, self._api_key_file)
        env = None
        if self.sg.gpus_per_server:  # disjoint GPUs per worker on a node (Ray does not place the servers)
            first = self.worker_index * self.sg.gpus_per_server
            gpus = ",".join(str(first + i) for i in range(self.sg.gpus_per_server))
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus}
        self._server = ServerProcess(command, self.sg.host, self.root / "server.log", env, self._api_key)
        self._client = self._server.start(self.sg.startup_timeout_s, self.sg.request_timeout_s, port)
        self._session = None
        self._nccl_ready = False
        self._applied = int(label)
        if self._lora is not None:
            self._lora.forget_loaded()  # a fresh server holds no adapter: ready once the sync thread loaded one
        elif self._applied >= 0:
            self._ready.set()

    def _sync_loop(self) -> None:
        """The sync thread: relaunch the server while it may, apply staged versions. Any failure it does not handle
        ends it as a failed engine (`fatal`): generation raises it and the worker is restarted, instead of samplers
        retrying for ever a server nobody relaunches."""
        try:
            self._sync_until_stopped()
        except Exception as err:  # reported through `fatal`, which every sampler checks
            self.last_error = f"{type(err).__name__}: {err}"
            self._fail(f"the SGLang sync thread failed ({self.last_error}): the worker is restarted")

    def _fail(self, message: str) -> None:
        """End the engine as failed (`fatal`); the sync thread then returns. generate() waits for readiness: it must
        see the failure instead."""
        self._fatal = message
        self._ready.clear()

    def _sync_until_stopped(self) -> None:
        launches = 0
        while not self._stop.is_set():
            if self._server is None or not self._server.alive:
                launches += 1
                if launches > 1:
                    self.metrics["server_restarts"] += 1
                if launches > self.sg.max_restarts + 1:
                    failed = f"SGLang server failed {launches - 1} times (rollout.sglang.max_restarts)"
                    self._fail(f"{failed}: {self.last_error}")
                    return
                if launches > 1 and self.sg.weight_sync == "distributed":  # this process's NCCL group holds the
                    self._fail(  # dead server's ranks and cannot be joined again: a fresh worker process can
                        "SGLang server died and `rollout.sglang.weight_sync=distributed` cannot rejoin it to this "
                        f"worker's NCCL group: the worker is restarted ({self.last_error})"
                    )
                    return
                try:
                    self._launch()
                except (LaunchError, OSError) as err:
                    self.last_error = str(err)
                    self._stop.wait(1.0)
                continue
            with self._cond:
                staged = self._staged
                if staged is None or staged[0] <= self._applied:
                    if self._lora is None or self._applied < 0 or not self._lora.has_work():
                        self._cond.wait(POLL_S)
                        continue
                    staged = None  # LoRA: an adapter to load or unload, no base
            try:
                if staged is None:
                    self._sync_adapters()
                else:
                    self._apply(*staged)
            except ServerUnavailable as err:
                self.last_error = str(err)  # the liveness check above relaunches it
                self._stop.wait(POLL_S)
            except (ServerError, RuntimeError) as err:
                self.metrics["weight_update_errors"] += 1
                self.last_error = str(err)
                self._stop.wait(1.0)

    def _apply(self, version: int, path: Path | None) -> None:
        client = self._client
        assert client is not None
        mode = self.sg.pause_mode
        started = time.monotonic()
        if mode == "abort":
            self._pause_aborts += 1
        with self._cond:  # before the pause as well as after the resume: a response that finishes in between (the
            self._epoch += 1  # server resumes before it answers /continue_generation) sees a changed epoch
        client.pause(mode)
        try:
            if self._session is None:
                self._session = client.begin_weight_update()
            elif self._session:
                client.begin_weight_update()
            try:
                # `in_place` keeps the running requests in SGLang's batch, whose cache flush then fails, and 0.5.9
                # asserts on that and ends the server (scheduler_update_weights_mixin.py): its KV is kept instead
                flush = mode != "in_place"
                if path is not None:
                    client.update_weights_from_disk(str(path), weight_version=str(version), flush_cache=flush)
                else:
                    self._update_distributed(client, version, flush)
            finally:
                if self._session:
                    client.end_weight_update()
        finally:
            with contextlib.suppress(ServerUnavailable):
                client.resume()
        if self._lora is not None:  # LoRA: the base is in; its adapters load before any sample runs on it
            loaded = self._lora.sync(client, min_version=version)
            if loaded is None:
                raise RuntimeError(f"version {version}: no LoRA adapter directory written for the base")
            version = loaded
        pause_s = time.monotonic() - started
        with self._cond:
            self._applied = version
            self._epoch += 1
            self.swaps += 1
            if path is not None:
                self._launch_dir, self._launch_label = path, str(version)
        self._ready.set()
        self.metrics["pause_s_last"] = pause_s
        self.metrics["pause_s_max"] = max(self.metrics["pause_s_max"], pause_s)
        self.metrics["pause_s_total"] += pause_s
        self.metrics["weight_updates"] += 1
        self._prune(keep={path, self._staged[1] if self._staged else None})

    def _sync_adapters(self) -> None:
        """LoRA: load the newest adapter and unload unused old ones (lora_sync.py); no pause: requests in flight
        keep their adapter."""
        assert self._lora is not None and self._client is not None
        newest = self._lora.sync(self._client)
        if newest is None:
            return
        with self._cond:
            if newest > self._applied or not self._ready.is_set():
                self._applied = newest
                self.swaps += 1
        self._ready.set()

    def _prune(self, keep: set[Path | None]) -> None:
        for old in self.root.glob("v*"):
            if old not in keep:
                shutil.rmtree(old, ignore_errors=True)

    def _update_distributed(self, client: SGLangClient, version: int, flush_cache: bool = True) -> None:
        """NCCL broadcast of every tensor from this process (rank 0) to the server's ranks 1..tp (SGLang's
        /init_weights_update_group + /update_weights_from_distributed). Written to SGLang's API; untested here."""
        import torch
        import torch.distributed as dist

        from rollout_workers.sglang_api.checkpoint import sglang_tensors

        update = self._staged_update
        assert update is not None and update.version == version
        group = "asyncrl-weights"
        if not self._nccl_ready:
            port = free_port(self.sg.host)
            host = self._server.connect_host if self._server else "127.0.0.1"
            joined = self._pool.submit(client.init_weights_update_group, host, port, 1, 1 + self.sg.tp, group)
            if not dist.is_initialized():
                dist.init_process_group("nccl", init_method=f"tcp://{host}:{port}", world_size=1 + self.sg.tp, rank=0)
            joined.result()
            self._nccl_ready = True
        tensors = sglang_tensors(update, self.float_dtype)
        names = list(tensors)
        dtypes = [str(tensors[name].dtype).replace("torch.", "") for name in names]
        shapes = [list(tensors[name].shape) for name in names]
        answer = self._pool.submit(
            client.update_weights_from_distributed, names, dtypes, shapes, group, str(version), flush_cache
        )
        for name in names:
            dist.broadcast(tensors[name].to("cuda"), src=0)
        torch.cuda.synchronize()
        answer.result()


def server_command(sections: EngineSections, model_dir: Path | str, port: int, label: str, seed: int,
                   api_key_file: Path | None = None) -> list[str]:  # fmt: skip
    """The server's command line for `rollout.sglang.launcher`: SGLang's `launch_server` flags, or `asyncrl serve`.
    `api_key_file`: the server's API key, passed by file so that `ps` does not show it (SGLang reads its flags from a
    `--config` YAML, `asyncrl serve` from `--api-key-file`); not with a `--config` of the user's in `extra_args`."""
    sg, rollout, scheme = sections.rollout.sglang, sections.rollout, sections.quant.scheme
    python = sg.python or sys.executable
    if sg.launcher == "sglang":
        head = [python, "-m", "sglang.launch_server"]
        flags: dict[str, Any] = {"--model-path": model_dir, "--host": sg.host, "--port": port, "--tp": sg.tp,
                                 "--mem-fraction-static": sg.mem_fraction_static, "--weight-version": label,
                                 "--random-seed": seed}  # fmt: skip
        if scheme in SGLANG_QUANTIZATION:  # must match the checkpoint's quantization_config
            flags["--quantization"] = SGLANG_QUANTIZATION[scheme]
        if api_key_file is not None and "--config" not in sg.extra_args:
            flags["--config"] = api_key_file.with_suffix(".yaml")
    else:
        head = [python, "-m", "asyncrl.cli", "serve", str(model_dir)]
        flags = {"--host": sg.host, "--port": port, "--quant": scheme, "--weight-version": label, "--seed": seed,
                 "--max-batch": rollout.max_batch, "--max-seq-len": rollout.max_seq_len,
                 "--precision": sections.precision.rollout, "--device": rollout.device, "--threads": rollout.threads,
                 "--parent-pid": os.getpid()}  # fmt: skip
        if api_key_file is not None:
            flags["--api-key-file"] = api_key_file
    lora = lora_server_flags(sections.model.lora) if sections.model.lora.rank else []  # lora_sync.py
    return head + [str(item) for pair in flags.items() for item in pair] + lora + list(sg.extra_args)


def _private_file(path: Path, text: str) -> Path:
    """`text` in a new file readable by this user only (0600 from its creation)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    return path


def _default_ckpt_parent() -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())
