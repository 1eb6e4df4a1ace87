"""`asyncrl bench sync`: weight publication latency, and what republishing costs workers that keep generating.

For the built-in model and a random ~100M-parameter Llama (hidden 1024), with INT8 rollout weights and 2 worker
processes (`asyncrl.bench.sync_worker`: an embedded engine decoding nonstop, subscribed to the publisher):

1. steady phase: workers decode, nothing is published;
2. sync phase: versions are published back to back (the next as soon as every worker runs the previous one).

The two phases are interleaved: `ROUNDS` rounds (2 with --quick) of a steady block, then a sync block twice as long
(8 s and 16 s in all; 3 s and 6 s with --quick). A machine whose speed drifts over the run (a neighbour's load,
clocks) then weighs on both phases alike: with nothing published in either, a steady 8 s followed by 16 s gave a
worst-worker ratio of 0.94-1.02, four interleaved rounds 0.98-1.01 (Zen 5, 2026-11-25). Every figure below is over
all the blocks of its phase; `<phase>_tok_s_ratio_round_min` / `_max` give the ratio round by round.

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

`asyncrl bench sync_control` (`run_control`) is the control: the LoRA phase with nothing published in either phase,
4 runs, its ratio measured interleaved and sequentially; how far the machine alone moves it from 1.

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgpack
import torch
import zmq

from asyncrl.bench import BenchResult

if TYPE_CHECKING:
    from quant_sync.transport import WeightPublisher

LATENCY_ALLOWANCE_S = 0.05
SCHEME = "int8"
LORA_PUBLISHES = 5
ROUNDS = 4
"""Steady and sync blocks alternate this many times (`QUICK_ROUNDS` with --quick): a machine that slows down or
speeds up during the run then weighs on both phases alike."""
QUICK_ROUNDS = 2
CONTROL_RUNS = 4
"""Runs of `asyncrl bench sync_control` (the LoRA phase with nothing published)."""
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


Window = tuple[float, float]


@dataclass
class _SyncLog:
    """What the sync blocks of one phase saw: per version the latency and every worker's swap report."""

    latencies: list[float] = field(default_factory=list)
    fetch_s: list[float] = field(default_factory=list)
    build_s: list[float] = field(default_factory=list)
    cpu_s: dict[str, list[float]] = field(default_factory=lambda: {"fetch": [], "stage": [], "swap_step": []})
    split: dict[str, list[float]] = field(default_factory=lambda: {"to_staged": [], "to_step": [], "first_step": []})
    publisher_cpu_s: float = 0.0


def _sync_block(
    publisher: WeightPublisher,
    versions: list[dict[str, torch.Tensor]],
    base: int | None,
    seconds: float,
    inbox: zmq.Socket,
    events: list[dict],
    workers: list[subprocess.Popen],
    log: _SyncLog,
) -> Window:
    """Publish versions back to back for `seconds` (the next as soon as every worker runs the previous one); the
    block ends when every worker runs its last version."""
    start, cpu_start = time.monotonic(), time.process_time()
    version = publisher.version
    while time.monotonic() - start < seconds:
        version += 1
        handed_off = time.monotonic()
        publisher.publish(version, versions[version % 2], SCHEME, base=base)
        running = set()
        while len(running) < len(workers):
            event = _next(inbox, events, workers)
            if event["event"] == "swap" and event["version"] == version:
                running.add(event["worker"])
                last = event["t"]
                log.fetch_s.append(event["fetch_s"])
                log.build_s.append(event["build_s"])
                for key in log.cpu_s:
                    log.cpu_s[key].append(event[f"{key.removeprefix('swap_')}_cpu_s"])
                log.split["to_staged"].append(event["staged_t"] - handed_off)
                log.split["to_step"].append(event["step_start_t"] - event["staged_t"])
                log.split["first_step"].append(event["t"] - event["step_start_t"])
        log.latencies.append(last - handed_off)
    log.publisher_cpu_s += time.process_time() - cpu_start
    return start, time.monotonic()


def _measure(
    name: str,
    model: torch.nn.Module,
    model_dir: str,
    quick: bool,
    adapters: list[dict[str, torch.Tensor]] | None = None,
    publish: bool = True,
) -> dict[str, float]:
    """The steady and sync phases, interleaved (`ROUNDS` rounds of a steady block, then a sync block twice as long);
    with `adapters` (two LoRA adapter sets), the model's INT8 export is the pinned version 0, the workers start on
    version 1 (its first adapters) and every later version holds adapters only. `publish=False`: the control, the
    sync blocks publish nothing (`_control_figures`)."""
    from quant_sync.export import export_rollout_tensors
    from quant_sync.transport import WeightPublisher

    versions = _versions(model) if adapters is None else adapters
    nbytes = sum(t.numel() * t.element_size() for t in versions[0].values())
    memcpy_s = _memcpy_seconds(versions[0])
    steady_s, sync_s = (3.0, 6.0) if quick else (8.0, 16.0)
    rounds = QUICK_ROUNDS if quick else ROUNDS
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
    log = _SyncLog()
    steady: list[Window] = []
    sync: list[Window] = []
    try:
        for worker in range(2):
            spec.update(worker=worker, seconds=steady_s + sync_s + 120.0)  # a backstop: the bench stops them
            args = [sys.executable, "-m", "asyncrl.bench.sync_worker", json.dumps(spec)]
            workers.append(subprocess.Popen(args, env={**os.environ, "OMP_NUM_THREADS": "1"}))
        ready = 0
        while ready < 2:
            ready += _next(inbox, events, workers)["event"] == "ready"
        time.sleep(1.0)  # let both settle into steady decoding
        for _ in range(rounds):
            start = time.monotonic()
            time.sleep(steady_s / rounds)
            steady.append((start, time.monotonic()))
            if publish:
                sync.append(_sync_block(publisher, versions, base, sync_s / rounds, inbox, events, workers, log))
            else:
                start = time.monotonic()
                time.sleep(sync_s / rounds)
                sync.append((start, time.monotonic()))
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
    if not publish:
        return _control_figures(name, stamps, steady, sync)
    published = len(log.latencies)
    sync_seconds = sum(end - start for start, end in sync)
    steady_rate, sync_rate, gap_ratio, steady_gap_ratio, cpu_ratio, steady_step_cpu = [], [], [], [], [], []
    round_ratios = []
    extra_cpu = [_extra_cpu_per_version(*worker, steady, sync, published) for worker in stamps]
    for worker_stamps, worker_tokens, worker_cpu, _ in stamps:
        steady_cpu = _per_cpu_second(worker_stamps, worker_tokens, worker_cpu, steady)
        sync_cpu = _per_cpu_second(worker_stamps, worker_tokens, worker_cpu, sync)
        cpu_ratio.append(sync_cpu / max(steady_cpu, 1e-9))
        steady_step_cpu.append(_median_step_cpu(worker_stamps, worker_cpu, steady))
        steady_rate.append(_rate(worker_stamps, worker_tokens, steady))
        sync_rate.append(_rate(worker_stamps, worker_tokens, sync))
        gap_ratio.append(_gap_ratio(worker_stamps, sync))
        steady_gap_ratio.append(_gap_ratio(worker_stamps, steady))
        round_ratios.append(
            [_rate(worker_stamps, worker_tokens, [b]) / max(_rate(worker_stamps, worker_tokens, [a]), 1e-9)
             for a, b in zip(steady, sync)]
        )  # fmt: skip
    latency = statistics.median(log.latencies)
    worst = min(s / max(b, 1e-9) for s, b in zip(sync_rate, steady_rate))
    worst_by_round = [min(worker[r] for worker in round_ratios) for r in range(rounds)]
    return {
        f"{name}_published_bytes": float(nbytes),
        f"{name}_memcpy_s": memcpy_s,
        f"{name}_publish_latency_median_s": latency,
        f"{name}_publish_latency_max_s": max(log.latencies),
        f"{name}_publish_call_s": publisher.last_publish_s,
        f"{name}_worker_fetch_median_s": statistics.median(log.fetch_s),  # header to verified tensors (subscriber)
        f"{name}_worker_build_median_s": statistics.median(log.build_s),  # decode-thread build time, all slices
        f"{name}_versions_published": float(published),
        f"{name}_rounds": float(rounds),
        f"{name}_steady_tok_per_s": sum(steady_rate),
        f"{name}_sync_tok_per_s": sum(sync_rate),
        f"{name}_tok_s_ratio_worst_worker": worst,
        # the same ratio round by round (each round's sync block over its own steady block; worst worker): the
        # spread the interleaving averages out
        f"{name}_tok_s_ratio_round_min": min(worst_by_round),
        f"{name}_tok_s_ratio_round_max": max(worst_by_round),
        # what a version costs the worst worker in decoding time: its lost share of the sync windows, per version
        # (the bench publishes as fast as the workers take versions, so a cheaper version also comes sooner)
        f"{name}_decode_s_lost_per_version": (1.0 - worst) * sync_seconds / published,
        f"{name}_max_gap_over_median": max(gap_ratio),
        f"{name}_steady_max_gap_over_median": max(steady_gap_ratio),  # the same statistic with nothing published
        f"{name}_publish_vs_memcpy": max(0.0, latency - LATENCY_ALLOWANCE_S) / memcpy_s,
        **{f"{name}_latency_{phase}_s": statistics.median(values) for phase, values in log.split.items()},
        # CPU seconds (thread time; load on the machine does not inflate them): the subscriber's fetch and
        # stage_weights, the decode step that swapped a version in (its build included) against a steady step
        **{f"{name}_worker_{key}_cpu_median_s": statistics.median(values) for key, values in log.cpu_s.items()},
        f"{name}_worker_steady_step_cpu_median_s": statistics.median(steady_step_cpu),
        # tokens per CPU second of the worker process (all its threads) during sync over steady (worst worker)
        f"{name}_tok_per_cpu_s_ratio_worst_worker": min(cpu_ratio),
        f"{name}_decode_thread_cpu_per_version_s": statistics.fmean(decode for decode, _ in extra_cpu),
        f"{name}_other_threads_cpu_per_version_s": statistics.fmean(other for _, other in extra_cpu),
        f"{name}_publisher_cpu_per_version_s": log.publisher_cpu_s / published,
    }


def _adapter_sets(model: torch.nn.Module) -> list[dict[str, torch.Tensor]]:
    """The two packed rank-`LORA_RANK` adapter sets of the LoRA phase (`LORA_SYNC_DTYPE`), published alternately."""
    from asyncrl.bench.engine_bench import lora_adapter_tensors
    from quant_sync.export import pack_adapters

    state = model.state_dict()
    return [pack_adapters(lora_adapter_tensors(state, seed=seed, sync_dtype=LORA_SYNC_DTYPE)) for seed in (0, 1)]


def _control_figures(
    name: str,
    stamps: list[tuple[list[float], list[int], list[float], list[float]]],
    steady: list[Window],
    sync: list[Window],
) -> dict[str, float]:
    """The worst worker's tokens/s in the (idle) sync blocks over the steady blocks, as the bench measures it
    (interleaved), and as it did before (the first third of the same stretch, then the rest)."""
    start, end = steady[0][0], sync[-1][1]
    cut = start + (end - start) / 3
    interleaved = min(_rate(s, t, sync) / _rate(s, t, steady) for s, t, _, _ in stamps)
    sequential = min(_rate(s, t, [(cut, end)]) / _rate(s, t, [(start, cut)]) for s, t, _, _ in stamps)
    return {
        f"{name}_control_interleaved_tok_s_ratio_worst_worker": interleaved,
        f"{name}_control_sequential_tok_s_ratio_worst_worker": sequential,
    }


def run_control(quick: bool) -> BenchResult:
    """`asyncrl bench sync_control`: the LoRA phase's statistic with nothing published in either phase, `CONTROL_RUNS`
    times (1 with --quick): how far from 1 the machine alone moves it, interleaved as the bench measures it and
    sequentially (a steady 8 s, then 16 s) as it did before. Ratios: the lowest and highest of the runs, each way."""
    from asyncrl.bench.engine_bench import BIG_SHAPE, LORA_RANK, _random_llama

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    name, metrics = f"big_lora{LORA_RANK}", {}
    runs: dict[str, list[float]] = {"interleaved": [], "sequential": []}
    try:
        with tempfile.TemporaryDirectory() as big_dir:
            big = _random_llama(big_dir, BIG_SHAPE)
            adapters = _adapter_sets(big)
            for run in range(1 if quick else CONTROL_RUNS):
                figures = _measure(name, big, big_dir, quick, adapters=adapters, publish=False)
                for way in runs:
                    value = figures[f"{name}_control_{way}_tok_s_ratio_worst_worker"]
                    runs[way].append(value)
                    metrics[f"{name}_control_{way}_run{run}"] = value
    finally:
        torch.set_num_threads(threads)
    ratios = {}
    for way, values in runs.items():
        ratios[f"control_{way}_tok_s_ratio_min"], ratios[f"control_{way}_tok_s_ratio_max"] = min(values), max(values)
    return BenchResult(name="sync_control", metrics=metrics, ratios=ratios, details=_details())


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
    steady: list[Window],
    sync: list[Window],
    versions: int,
) -> tuple[float, float]:
    """(decode thread, other threads): CPU seconds per version the sync windows took beyond the steady windows' CPU
    per token for the same tokens."""

    def windows(spans: list[Window]) -> tuple[int, float, float]:
        total_tokens, total_decode, total_other = 0, 0.0, 0.0
        for start, end in spans:
            inside = _steps_in(stamps, start, end)
            if not inside:
                continue
            first, last = inside[0] - 1, inside[-1]
            process, decode = cpu[last] - cpu[first], decode_cpu[last] - decode_cpu[first]
            total_tokens += sum(tokens[i] for i in inside)
            total_decode += decode
            total_other += process - decode
        return total_tokens, total_decode, total_other

    steady_tokens, steady_decode, steady_other = windows(steady)
    sync_tokens, sync_decode, sync_other = windows(sync)
    scale = sync_tokens / max(steady_tokens, 1)
    per = max(versions, 1)
    return (sync_decode - steady_decode * scale) / per, (sync_other - steady_other * scale) / per


def _steps_in(stamps: list[float], start: float, end: float) -> list[int]:
    """The steps (after the first) ending in [start, end]: step i ran from stamps[i - 1] to stamps[i]."""
    return [i for i, t in enumerate(stamps) if start <= t <= end and i > 0]


def _per_cpu_second(stamps: list[float], tokens: list[int], cpu: list[float], spans: list[Window]) -> float:
    """Tokens decoded by the steps ending in the windows per CPU second the worker process spent on them."""
    decoded, seconds = 0, 0.0
    for start, end in spans:
        inside = _steps_in(stamps, start, end)
        if inside:
            decoded += sum(tokens[i] for i in inside)
            seconds += cpu[inside[-1]] - cpu[inside[0] - 1]
    return decoded / max(seconds, 1e-9) if decoded else 0.0


def _median_step_cpu(stamps: list[float], cpu: list[float], spans: list[Window]) -> float:
    steps = [cpu[i] - cpu[i - 1] for start, end in spans for i in _steps_in(stamps, start, end)]
    return statistics.median(steps) if steps else 0.0


def _gap_ratio(stamps: list[float], spans: list[Window]) -> float:
    gaps = [b - a for start, end in spans for a, b in zip(stamps, stamps[1:]) if start <= a and b <= end]
    return max(gaps) / statistics.median(gaps)


def _rate(stamps: list[float], tokens: list[int], spans: list[Window]) -> float:
    """Tokens of the steps ending in the windows per second of the windows."""
    inside = [n for t, n in zip(stamps, tokens) if any(start <= t <= end for start, end in spans)]
    return sum(inside) / sum(end - start for start, end in spans)


def run(quick: bool) -> BenchResult:
    from asyncrl.bench.engine_bench import BIG_SHAPE, LORA_RANK, _random_llama, _tiny_model

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
            metrics.update(_measure(f"big_lora{LORA_RANK}", big, big_dir, quick, adapters=_adapter_sets(big)))
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
    from asyncrl.bench.engine_bench import lora_int8_kernel, platform_details

    kernel = lora_int8_kernel()
    functions = {"amx": "lr_apply_q8_amx", "avx512": "lr_apply_q8"}
    return {
        **platform_details(),
        "lora_kernel": f"csrc/lora_gemm.cpp {functions[kernel]} ({LORA_SYNC_DTYPE} adapters as published)"
        if kernel in functions
        else f"torch GEMMs on the float32 values of {LORA_SYNC_DTYPE} adapters",
    }
