"""`asyncrl bench sync`: weight publication latency, and what republishing costs workers that keep generating.

For the built-in model and a random ~100M-parameter Llama (hidden 1024), with INT8 rollout weights and 2 worker
processes (`asyncrl.bench.sync_worker`: an embedded engine decoding nonstop, subscribed to the publisher):

1. steady phase: workers decode, nothing is published;
2. sync phase: versions are published back to back (the next as soon as every worker runs the previous one).

- `publish_vs_memcpy`: `max(0, latency - 0.05 s) / memcpy_time` on the ~100M config, where latency (median over
  the sync phase) runs from the hand-off of already-quantized tensors to `WeightPublisher.publish` until every
  worker runs the version, and memcpy_time copies the same bytes into a warm buffer in the same run.
- `tok_s_during_sync_vs_steady`: decode tokens/s during the sync phase over the steady phase (worst worker, worst
  model).
- `max_gap_over_median`: largest gap between two decode steps during the sync phase over the median gap (worst).
- `lora_sync_bytes_vs_full` (~100M config): the bytes of an adapter-only version (rank-16 LoRA on every decoder
  linear in `LORA_SYNC_DTYPE`, as learner/lora.py publishes it with that `model.lora.sync_dtype`:
  `engine_bench.lora_adapter_tensors`, packed into one buffer by `quant_sync.export.pack_adapters`) over the
  full INT8 version the main job publishes (LM head quantized), both built in this run; metrics
  `big_lora16_<dtype>_version_bytes` give every sync dtype's bytes.
- `lora_publish_s`, `lora_tok_s_during_sync_vs_steady` (~100M config): the two phases again with LoRA, the workers
  decoding with rank-16 adapters on every decoder linear: the INT8 base is pinned once, then only adapter versions
  are published, two adapter sets alternating. `lora_publish_s` is the latency above (hand-off until every worker
  runs the version, median), not less 0.05 s; the other as `tok_s_during_sync_vs_steady`. Metrics
  `big_full_publish_call_s` and `big_lora16_publish_call_s`: the `WeightPublisher.publish` call alone (hashing,
  /dev/shm write; median of 5, no workers) for a full INT8 version and for an adapter version on its pinned base.
  The latency's split (medians over every worker's swap, `<phase>_latency_*_s`): `to_staged` from the hand-off to
  the subscriber's handing the version to the engine (publish call, long-poll wake-up, /dev/shm map, checksums,
  decoding, `stage_weights`), `to_step` from there to the start of the decode step that swaps it in (waiting for the
  running step; earlier build slices), `first_step` that step (the rest of the build, then the step itself).
  In CPU seconds, which a loaded machine does not inflate (medians over every worker's swap):
  `<phase>_worker_fetch_cpu_median_s` and `..._stage_cpu_median_s` (the subscriber thread: fetch and decode, then
  `stage_weights`), `..._swap_step_cpu_median_s` (the decode step that swapped the version in, its build included)
  against `..._steady_step_cpu_median_s`; `<phase>_tok_per_cpu_s_ratio_worst_worker` is tokens per CPU second of
  the worker process during sync over steady (the ratio above without the other processes' share of the cores).
  `<phase>_decode_s_lost_per_version`: the worst worker's lost share of the sync window (1 - its ratio above) times
  the window over the versions published: what one version costs it in decoding time (the next version is published
  as soon as every worker runs this one, so a cheaper version also comes sooner and the ratio alone hides it).
  Where a worker's extra CPU goes, per version (means over the workers): `<phase>_decode_thread_cpu_per_version_s`,
  the decode thread's CPU during sync beyond what the same tokens took it in the steady phase (builds, swaps, and
  steps slowed by them), and `<phase>_other_threads_cpu_per_version_s`, the same for the process's other threads
  (the subscriber's fetch, decode and stage, ZMQ's I/O thread); `<phase>_publisher_cpu_per_version_s`, the bench
  process's CPU over the sync phase per version (the publish calls, the publisher's serving thread answering both
  workers, reading their reports), which the two workers' decoding shares the cores with.

`details` name the CPU's ISA (`cpu_isa`) and the kernels the workers ran (`kernel_by_scheme`, `lora_kernel`).

Both phases run on the same shared 2-core machine: the publisher (hashing, /dev/shm write) competes with the two
workers for the cores, which is part of what is measured.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import msgpack
import torch
import zmq

from asyncrl.bench import BenchResult

LATENCY_ALLOWANCE_S = 0.05
SCHEME = "int8"
LORA_PUBLISHES = 5
LORA_SYNC_DTYPE = "int8"
"""`model.lora.sync_dtype` of the LoRA rows (`lora_sync_bytes_vs_full`, `lora_publish_s`, ...)."""


def _memcpy_seconds(tensors: dict[str, torch.Tensor]) -> float:
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    source = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors.values()])
    target = torch.empty(total, dtype=torch.uint8)
    target.copy_(source)  # warm the destination pages
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return best


def _versions(model: torch.nn.Module) -> list[dict[str, torch.Tensor]]:
    """Two different quantized tensor sets, alternated under increasing version numbers."""
    from quant_sync.export import export_rollout_tensors

    state = model.state_dict()
    nudged = {name: value + 1e-3 * torch.randn_like(value) for name, value in state.items()}
    return [export_rollout_tensors(state, SCHEME), export_rollout_tensors(nudged, SCHEME)]


def _measure(
    name: str,
    model: torch.nn.Module,
    model_dir: str,
    quick: bool,
    adapters: list[dict[str, torch.Tensor]] | None = None,
) -> dict[str, float]:
    """The steady and sync phases; with `adapters` (two LoRA adapter sets), the model's INT8 export is the pinned
    version 0, the workers start on version 1 (its first adapters) and every later version holds adapters only."""
    from quant_sync.export import export_rollout_tensors
    from quant_sync.transport import WeightPublisher

    versions = _versions(model) if adapters is None else adapters
    nbytes = sum(t.numel() * t.element_size() for t in versions[0].values())
    memcpy_s = _memcpy_seconds(versions[0])
    steady_s, sync_s = (3.0, 6.0) if quick else (8.0, 16.0)
    publisher = WeightPublisher()
    context = zmq.Context.instance()
    inbox = context.socket(zmq.PULL)
    inbox.setsockopt(zmq.LINGER, 0)
    inbox.setsockopt(zmq.RCVTIMEO, 500)  # `_next` blocks in recv: no poller made per report (the bench's own CPU)
    report = f"tcp://127.0.0.1:{inbox.bind_to_random_port('tcp://127.0.0.1')}"
    base = None if adapters is None else 0
    if adapters is None:
        publisher.publish(0, versions[0], SCHEME)
    else:
        publisher.publish(0, export_rollout_tensors(model.state_dict(), SCHEME), SCHEME, pin=True)
        publisher.publish(1, versions[1], SCHEME, base=base)
    big = name.startswith("big")
    spec = {"report": report, "weights": publisher.endpoint, "model_dir": model_dir, "batch": 8 if big else 32,
            "max_new_tokens": 48, "seconds": 0.0, "first_version": publisher.version}  # fmt: skip
    workers, events = [], []
    try:
        for worker in range(2):
            spec.update(worker=worker, seconds=steady_s + sync_s + 120.0)  # a backstop: the bench stops them
            args = [sys.executable, "-m", "asyncrl.bench.sync_worker", json.dumps(spec)]
            workers.append(subprocess.Popen(args, env={**os.environ, "OMP_NUM_THREADS": "1"}))
        ready = 0
        while ready < 2:
            ready += _next(inbox, events, workers)["event"] == "ready"
        time.sleep(1.0)  # let both settle into steady decoding
        steady_start = time.monotonic()
        time.sleep(steady_s)
        sync_start = time.monotonic()
        sync_cpu_start = time.process_time()
        latencies, fetch_s, build_s, version = [], [], [], publisher.version
        cpu_s: dict[str, list[float]] = {"fetch": [], "stage": [], "swap_step": []}
        split: dict[str, list[float]] = {"to_staged": [], "to_step": [], "first_step": []}
        while time.monotonic() - sync_start < sync_s:
            version += 1
            handed_off = time.monotonic()
            publisher.publish(version, versions[version % 2], SCHEME, base=base)
            running = set()
            while len(running) < 2:
                event = _next(inbox, events, workers)
                if event["event"] == "swap" and event["version"] == version:
                    running.add(event["worker"])
                    last = event["t"]
                    fetch_s.append(event["fetch_s"])
                    build_s.append(event["build_s"])
                    for key in cpu_s:
                        cpu_s[key].append(event[f"{key.removeprefix('swap_')}_cpu_s"])
                    split["to_staged"].append(event["staged_t"] - handed_off)
                    split["to_step"].append(event["step_start_t"] - event["staged_t"])
                    split["first_step"].append(event["t"] - event["step_start_t"])
            latencies.append(last - handed_off)
        sync_end = time.monotonic()
        publisher_cpu = time.process_time() - sync_cpu_start
        for process in workers:
            process.terminate()  # the worker finishes its step and reports its stamps
        stamps = _collect_stamps(inbox, events, workers)
        for process in workers:
            process.wait(timeout=30)
    finally:
        for process in workers:
            if process.poll() is None:
                process.kill()
        publisher.close()
        inbox.close(0)
    steady_rate, sync_rate, gap_ratio, steady_gap_ratio, cpu_ratio, steady_step_cpu = [], [], [], [], [], []
    extra_cpu = [
        _extra_cpu_per_version(*worker, (steady_start, steady_start + steady_s), (sync_start, sync_end), len(latencies))
        for worker in stamps
    ]
    for worker_stamps, worker_tokens, worker_cpu, _ in stamps:
        steady_cpu = _per_cpu_second(worker_stamps, worker_tokens, worker_cpu, steady_start, steady_start + steady_s)
        sync_cpu = _per_cpu_second(worker_stamps, worker_tokens, worker_cpu, sync_start, sync_end)
        cpu_ratio.append(sync_cpu / max(steady_cpu, 1e-9))
        steady_step_cpu.append(_median_step_cpu(worker_stamps, worker_cpu, steady_start, steady_start + steady_s))
        steady_rate.append(_rate(worker_stamps, worker_tokens, steady_start, steady_start + steady_s))
        sync_rate.append(_rate(worker_stamps, worker_tokens, sync_start, sync_end))
        gap_ratio.append(_gap_ratio(worker_stamps, sync_start, sync_end))
        steady_gap_ratio.append(_gap_ratio(worker_stamps, steady_start, steady_start + steady_s))
    latency = statistics.median(latencies)
    worst = min(s / max(b, 1e-9) for s, b in zip(sync_rate, steady_rate))
    return {
        f"{name}_published_bytes": float(nbytes),
        f"{name}_memcpy_s": memcpy_s,
        f"{name}_publish_latency_median_s": latency,
        f"{name}_publish_latency_max_s": max(latencies),
        f"{name}_publish_call_s": publisher.last_publish_s,
        f"{name}_worker_fetch_median_s": statistics.median(fetch_s),  # header to verified tensors (subscriber)
        f"{name}_worker_build_median_s": statistics.median(build_s),  # decode-thread build time, all slices
        f"{name}_versions_published": float(len(latencies)),
        f"{name}_steady_tok_per_s": sum(steady_rate),
        f"{name}_sync_tok_per_s": sum(sync_rate),
        f"{name}_tok_s_ratio_worst_worker": worst,
        # what a version costs the worst worker in decoding time: its lost share of the sync window, per version
        # (the bench publishes as fast as the workers take versions, so a cheaper version also comes sooner)
        f"{name}_decode_s_lost_per_version": (1.0 - worst) * (sync_end - sync_start) / len(latencies),
        f"{name}_max_gap_over_median": max(gap_ratio),
        f"{name}_steady_max_gap_over_median": max(steady_gap_ratio),  # the same statistic with nothing published
        f"{name}_publish_vs_memcpy": max(0.0, latency - LATENCY_ALLOWANCE_S) / memcpy_s,
        **{f"{name}_latency_{phase}_s": statistics.median(values) for phase, values in split.items()},
        # CPU seconds (thread time; load on the machine does not inflate them): the subscriber's fetch and
        # stage_weights, the decode step that swapped a version in (its build included) against a steady step
        **{f"{name}_worker_{key}_cpu_median_s": statistics.median(values) for key, values in cpu_s.items()},
        f"{name}_worker_steady_step_cpu_median_s": statistics.median(steady_step_cpu),
        # tokens per CPU second of the worker process (all its threads) during sync over steady (worst worker)
        f"{name}_tok_per_cpu_s_ratio_worst_worker": min(cpu_ratio),
        f"{name}_decode_thread_cpu_per_version_s": statistics.fmean(decode for decode, _ in extra_cpu),
        f"{name}_other_threads_cpu_per_version_s": statistics.fmean(other for _, other in extra_cpu),
        f"{name}_publisher_cpu_per_version_s": publisher_cpu / len(latencies),
    }


def _lora_sync(model: torch.nn.Module) -> dict[str, float]:
    """Bytes and publish-call seconds of an adapter-only LoRA version against the full INT8 one (no workers)."""
    from asyncrl.bench.engine_bench import LORA_RANK, lora_adapter_tensors
    from common.config_schema import LORA_SYNC_DTYPES
    from quant_sync.export import export_rollout_tensors, pack_adapters
    from quant_sync.transport import WeightPublisher

    state = {name: value.detach().cpu() for name, value in model.state_dict().items()}
    full = export_rollout_tensors(state, SCHEME, quantize_head=True)
    dtype_bytes = {
        dtype: float(sum(t.nbytes for t in pack_adapters(lora_adapter_tensors(state, sync_dtype=dtype)).values()))
        for dtype in LORA_SYNC_DTYPES
    }
    adapters = pack_adapters(lora_adapter_tensors(state, sync_dtype=LORA_SYNC_DTYPE))  # as learner/lora.py sends
    full_bytes = sum(t.numel() * t.element_size() for t in full.values())
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapters.values())
    publisher = WeightPublisher()
    try:
        full_s = []
        for version in range(3):
            publisher.publish(version, full, SCHEME, pin=version == 2)
            full_s.append(publisher.last_publish_s)
        lora_s = []
        for version in range(3, 3 + LORA_PUBLISHES):
            publisher.publish(version, adapters, SCHEME, base=2)
            lora_s.append(publisher.last_publish_s)
    finally:
        publisher.close()
    return {
        "big_full_version_bytes": float(full_bytes),
        f"big_lora{LORA_RANK}_version_bytes": float(adapter_bytes),
        **{f"big_lora{LORA_RANK}_{dtype}_version_bytes": value for dtype, value in dtype_bytes.items()},
        "big_full_publish_call_s": statistics.median(full_s),
        f"big_lora{LORA_RANK}_publish_call_s": statistics.median(lora_s),
    }


def _next(inbox: zmq.Socket, events: list[dict], workers: list[subprocess.Popen]) -> dict:
    deadline = time.monotonic() + 180
    while True:
        try:
            message = inbox.recv()
            break
        except zmq.Again:  # nothing for RCVTIMEO: is a worker gone?
            failed = [p.returncode for p in workers if p.poll() not in (None, 0, -15)]
            if failed or time.monotonic() > deadline:
                raise RuntimeError(
                    f"bench sync: a worker stopped reporting (exit codes {failed}; its stderr is above)"
                ) from None
    event = msgpack.unpackb(message)
    events.append(event)
    return event


def _collect_stamps(
    inbox: zmq.Socket, events: list[dict], workers: list[subprocess.Popen]
) -> list[tuple[list[float], list[int], list[float], list[float]]]:
    """Each worker's step stamps, tokens, process CPU seconds and decode-thread CPU seconds, from the `done` report
    it sends when terminated."""
    done = {e["worker"]: e for e in events if e["event"] == "done"}
    while len(done) < 2:
        event = _next(inbox, events, workers)
        if event["event"] == "done":
            done[event["worker"]] = event
    return [(done[w]["stamps"], done[w]["tokens"], done[w]["cpu"], done[w]["decode_cpu"]) for w in sorted(done)]


def _extra_cpu_per_version(
    stamps: list[float],
    tokens: list[int],
    cpu: list[float],
    decode_cpu: list[float],
    steady: tuple[float, float],
    sync: tuple[float, float],
    versions: int,
) -> tuple[float, float]:
    """(decode thread, other threads): CPU seconds per version the sync window took beyond the steady window's CPU
    per token for the same tokens."""

    def window(start: float, end: float) -> tuple[int, float, float]:
        inside = _steps_in(stamps, start, end)
        if not inside:
            return 0, 0.0, 0.0
        first, last = inside[0] - 1, inside[-1]
        process, decode = cpu[last] - cpu[first], decode_cpu[last] - decode_cpu[first]
        return sum(tokens[i] for i in inside), decode, process - decode

    steady_tokens, steady_decode, steady_other = window(*steady)
    sync_tokens, sync_decode, sync_other = window(*sync)
    scale = sync_tokens / max(steady_tokens, 1)
    per = max(versions, 1)
    return (sync_decode - steady_decode * scale) / per, (sync_other - steady_other * scale) / per


def _steps_in(stamps: list[float], start: float, end: float) -> list[int]:
    """The steps (after the first) ending in [start, end]: step i ran from stamps[i - 1] to stamps[i]."""
    return [i for i, t in enumerate(stamps) if start <= t <= end and i > 0]


def _per_cpu_second(stamps: list[float], tokens: list[int], cpu: list[float], start: float, end: float) -> float:
    """Tokens decoded by the steps ending in [start, end] per CPU second the worker process spent on them."""
    inside = _steps_in(stamps, start, end)
    if not inside:
        return 0.0
    return sum(tokens[i] for i in inside) / max(cpu[inside[-1]] - cpu[inside[0] - 1], 1e-9)


def _median_step_cpu(stamps: list[float], cpu: list[float], start: float, end: float) -> float:
    steps = [cpu[i] - cpu[i - 1] for i in _steps_in(stamps, start, end)]
    return statistics.median(steps) if steps else 0.0


def _gap_ratio(stamps: list[float], start: float, end: float) -> float:
    gaps = [b - a for a, b in zip(stamps, stamps[1:]) if start <= a and b <= end]
    return max(gaps) / statistics.median(gaps)


def _rate(stamps: list[float], tokens: list[int], start: float, end: float) -> float:
    inside = [n for t, n in zip(stamps, tokens) if start <= t <= end]
    return sum(inside) / (end - start)


def run(quick: bool) -> BenchResult:
    from asyncrl.bench.engine_bench import BIG_SHAPE, LORA_RANK, _random_llama, _tiny_model, lora_adapter_tensors
    from quant_sync.export import pack_adapters

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    metrics: dict[str, float] = {}
    try:
        tiny, tiny_dir = _tiny_model()
        metrics.update(_measure("tiny", tiny, str(tiny_dir), quick))
        with tempfile.TemporaryDirectory() as big_dir:
            big = _random_llama(big_dir, BIG_SHAPE)
            metrics.update(_lora_sync(big))
            metrics.update(_measure("big", big, big_dir, quick))
            state = big.state_dict()
            adapters = [pack_adapters(lora_adapter_tensors(state, seed=seed, sync_dtype=LORA_SYNC_DTYPE))
                        for seed in (0, 1)]  # fmt: skip
            metrics.update(_measure(f"big_lora{LORA_RANK}", big, big_dir, quick, adapters=adapters))
    finally:
        torch.set_num_threads(threads)
    lora = f"big_lora{LORA_RANK}"
    ratios = {
        "publish_vs_memcpy": metrics["big_publish_vs_memcpy"],
        "tok_s_during_sync_vs_steady": min(metrics[f"{m}_tok_s_ratio_worst_worker"] for m in ("tiny", "big")),
        "max_gap_over_median": max(metrics[f"{m}_max_gap_over_median"] for m in ("tiny", "big")),
        "lora_sync_bytes_vs_full": metrics[f"{lora}_version_bytes"] / metrics["big_full_version_bytes"],
        "lora_publish_s": metrics[f"{lora}_publish_latency_median_s"],
        "lora_tok_s_during_sync_vs_steady": metrics[f"{lora}_tok_s_ratio_worst_worker"],
    }
    return BenchResult(name="sync", metrics=metrics, ratios=ratios, details=_details())


def _details() -> dict[str, object]:
    """The CPU's ISA and the kernels the workers' engines ran: the figures mean nothing without them."""
    from asyncrl.bench.engine_bench import platform_details
    from rollout_workers.embedded.low_rank import _native_lora

    return {
        **platform_details(),
        "lora_kernel": f"csrc/lora_gemm.cpp lr_apply_q8 ({LORA_SYNC_DTYPE} adapters as published)"
        if _native_lora() is not None
        else f"torch GEMMs on the float32 values of {LORA_SYNC_DTYPE} adapters",
    }
