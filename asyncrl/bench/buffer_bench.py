"""`asyncrl bench buffer`: trajectory ingest of the real buffer service against raw ZMQ, and learner fetch latency.

Each contender is a fresh set of producer processes sending the same pre-encoded PushGroup bytes (groups of
`GROUP_SIZE` trajectories with 512-token responses), pipelined on one socket each:

| contender | receiver | counts when |
|---|---|---|
| raw | a PULL socket in another process that only receives | the last message arrived |
| buffer, journal on | `python -m buffer` (fsync=batch), DEALER with a PushReply per group | the last reply arrived |
| buffer, journal off | the same with `buffer.journal=false` | the last reply arrived |

Ratios: `ingest_vs_raw_1p` / `ingest_vs_raw_4p` = admitted trajectories/s over raw trajectories/s, from 1 and from 4
producers; `journal_on_vs_off` = ingest with the journal over without (1 producer). Every buffer reply is checked
(`accepted` with reason ""): a group that was not admitted fails the bench. Producers lease their groups and encode
them before the clock starts. After the journal-on run the bench drains the queue as the learner does
(FetchBatch of `FETCH_GROUPS` groups) and reports the latency of each fetch, decode included.

Floors (metrics only, 1 producer): what a bare service doing only part of the buffer's work reaches on this machine,
so that the ratios can be read against a bound. A floor is a ROUTER in a fresh process, with the buffer's malloc
settings (buffer/memory.py), that keeps every frame and answers each PushGroup with an accepted PushReply after:

| floor | work per PushGroup |
|---|---|
| `floor_keep` | nothing (receive, keep, reply) |
| `floor_validate` | `ingest.decode_request`: the buffer's msgpack decode and validation, nothing else |
| `floor_validate_write` | the same, then `os.write` of the frame to a file in the service thread (no fsync) |

`floor_*_vs_raw_1p` = the floor's trajectories/s over raw's. No leases, no admission, no journal records: the buffer
itself can only be slower than `floor_validate_write`.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.bench import BenchResult
from buffer.launcher import start_service, stop_service

GROUP_SIZE = 8
FETCH_GROUPS = 16
FLOORS = ("keep", "validate", "validate_write")


def _payloads(count: int, leases: list[Any] | None, producer: int) -> list[bytes]:
    from asyncrl.bench.wire_bench import _trajectory
    from common import wire

    template = replace(_trajectory(), versions=np.zeros(512, np.int32))  # version 0: admissible at step 0
    out = []
    for k in range(count):
        group, index = (leases[k].group, leases[k].index) if leases else (f"p{producer}-{k}", k)
        trajectories = [
            replace(template, uid=f"{group}/{i}", group=group, prompt_index=index) for i in range(GROUP_SIZE)
        ]
        out.append(wire.encode(wire.PushGroup(worker=f"bench-{producer}", group=group, trajectories=trajectories)))
    return out


def _producer(mode: str, endpoint: str, count: int, producer: int, ready: Any, go: Any, results: Any) -> None:
    """Lease (buffer mode) and encode `count` groups, wait for `go`, send them all pipelined, report the times."""
    try:
        _produce(mode, endpoint, count, producer, ready, go, results)
    except BaseException:
        results.put(traceback.format_exc())
        ready.put(producer)
        raise


def _produce(mode: str, endpoint: str, count: int, producer: int, ready: Any, go: Any, results: Any) -> None:
    import zmq

    from buffer.client import BufferClient
    from common import wire

    leases = None  # a floor takes groups of made-up ids: it checks no lease
    if mode == "buffer":
        with BufferClient(endpoint, f"bench-{producer}") as client:
            leases = []
            while len(leases) < count:
                got, _ = client.lease(min(count - len(leases), wire.MAX_GROUP))
                assert got, "the bench buffer throttled leasing"
                leases += got
    payloads = _payloads(count, leases, producer)
    context = zmq.Context()
    socket = context.socket(zmq.PUSH if mode == "raw" else zmq.DEALER)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.connect(endpoint)
    ready.put(producer)
    go.wait()
    started = time.monotonic()
    for payload in payloads:
        socket.send(payload, copy=False)
    admitted = 0
    if mode != "raw":
        for _ in payloads:
            reply = wire.decode(socket.recv())
            assert isinstance(reply, wire.PushReply) and reply.accepted and reply.reason == "", reply
            admitted += GROUP_SIZE
    ended = time.monotonic()
    socket.close(linger=-1)
    context.term()
    results.put((started, ended, admitted))


def _sink(endpoint_q: Any, total: int, results: Any) -> None:
    import zmq

    context = zmq.Context()
    socket = context.socket(zmq.PULL)
    socket.setsockopt(zmq.RCVHWM, 0)
    endpoint_q.put(f"tcp://127.0.0.1:{socket.bind_to_random_port('tcp://127.0.0.1')}")
    for _ in range(total):
        socket.recv(copy=False)
    results.put(time.monotonic())
    socket.close(0)
    context.term()


def _floor(work: str, endpoint_q: Any, stop: Any, scratch: str) -> None:
    """A floor service (module docstring): receive, do `work`, keep the frame, reply accepted; until `stop`."""
    import zmq

    from buffer import ingest
    from buffer.memory import configure_malloc, reserve
    from common import wire
    from common.config import BufferConfig

    configure_malloc()  # as `python -m buffer` does
    reserve(BufferConfig().reserve_mb << 20)
    accepted = wire.encode(wire.PushReply(True, ""))
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.SNDHWM, 0)
    endpoint_q.put(f"tcp://127.0.0.1:{socket.bind_to_random_port('tcp://127.0.0.1')}")
    kept = []
    while not stop.is_set():
        if not socket.poll(50):
            continue
        while True:
            try:
                identity, frame = socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            if work != "keep":
                ingest.decode_request(frame.buffer)
            if work == "validate_write":
                os.write(fd, frame.buffer)
            kept.append(frame)
            socket.send_multipart([identity.bytes, accepted], copy=False)
    os.close(fd)
    socket.close(0)
    context.term()


def _start_buffer(run_dir: Path, journal: bool, total_groups: int) -> tuple[subprocess.Popen[bytes], str]:
    from common.config import Config, to_dict

    values = to_dict(Config())
    values["train"].update(group_size=GROUP_SIZE, groups_per_step=64)
    values["staleness"]["max_lag"] = total_groups  # never throttles the bench
    values["buffer"].update(journal=journal, max_queued_groups=total_groups + 1, lease_timeout_s=600.0)
    values["data"].update(task="arith")
    run_dir.mkdir(parents=True)
    return start_service(values, run_dir)


def _ingest(mode: str, producers: int, groups: int, run_dir: Path, fetch_ms: list[float] | None) -> float:
    """Trajectories/s from `producers` processes sending `groups` groups in all (admitted ones for the buffer)."""
    ctx = mp.get_context("fork")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    per = groups // producers
    total = per * producers
    proc, sink, floor, stop_floor = None, None, None, ctx.Event()
    if mode == "raw":
        endpoint_q, sink_results = ctx.Queue(), ctx.Queue()
        sink = ctx.Process(target=_sink, args=(endpoint_q, total, sink_results))
        sink.start()
        endpoint = endpoint_q.get(timeout=30)
    elif mode.startswith("floor_"):  # spawned: a fresh process, as the buffer is (malloc settings need one)
        spawn = mp.get_context("spawn")
        endpoint_q, stop_floor = spawn.Queue(), spawn.Event()
        run_dir.mkdir(parents=True)
        floor = spawn.Process(
            target=_floor, args=(mode[len("floor_") :], endpoint_q, stop_floor, str(run_dir / "w")), daemon=True
        )
        floor.start()
        endpoint = endpoint_q.get(timeout=60)
    else:
        proc, endpoint = _start_buffer(run_dir, mode == "journal_on", total)
    kind = "raw" if mode == "raw" else "floor" if floor is not None else "buffer"
    workers = [
        ctx.Process(target=_producer, args=(kind, endpoint, per, i, ready, go, results)) for i in range(producers)
    ]
    try:
        for worker in workers:
            worker.start()
        for _ in workers:
            ready.get(timeout=120)
        go.set()
        times = [results.get(timeout=300) for _ in workers]
        errors = [t for t in times if isinstance(t, str)]
        if errors:
            raise RuntimeError(f"bench producer failed:\n{errors[0]}")
        start = min(t[0] for t in times)
        if sink is not None:
            end = sink_results.get(timeout=300)
            count = total * GROUP_SIZE
        else:
            end = max(t[1] for t in times)
            count = sum(t[2] for t in times)
            if fetch_ms is not None:
                fetch_ms += _drain(endpoint, total)
        return count / (end - start)
    finally:
        stop_floor.set()
        for worker in [*workers, *([sink] if sink else []), *([floor] if floor else [])]:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
                worker.join()
        if proc is not None:
            stop_service(proc)


def _drain(endpoint: str, total_groups: int) -> list[float]:
    """Fetch every queued group as the learner does; the latency of each fetch in ms."""
    from buffer.client import BufferClient

    latencies = []
    with BufferClient(endpoint, "bench-learner", timeout_s=60) as client:
        for _ in range(total_groups // FETCH_GROUPS):
            started = time.perf_counter()
            reply = client.fetch_batch(step=0, num_groups=FETCH_GROUPS, wait_s=0.0)
            latencies.append((time.perf_counter() - started) * 1e3)
            assert reply.ready and len(reply.groups) == FETCH_GROUPS
    return latencies


def run(quick: bool) -> BenchResult:
    groups, rounds = (240, 1) if quick else (1200, 3)
    samples: dict[str, list[float]] = {}
    fetch_ms: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-buffer-") as tmp:
        for r in range(rounds):  # contenders alternate, so a noisy neighbour slows all of them
            contenders = [("raw", 1), ("journal_on", 1), ("journal_off", 1), *((f"floor_{f}", 1) for f in FLOORS)]
            for mode, producers in [*contenders, ("raw", 4), ("journal_on", 4)]:
                run_dir = Path(tmp) / f"{mode}-{producers}-{r}"
                drain = fetch_ms if (mode, producers) == ("journal_on", 1) else None
                rate = _ingest(mode, producers, groups, run_dir, drain)
                samples.setdefault(f"{mode}_{producers}p_traj_per_s", []).append(rate)
    metrics = {name: statistics.median(values) for name, values in samples.items()}
    fetch_ms.sort()
    metrics.update(
        fetch_latency_ms_p50=statistics.median(fetch_ms),
        fetch_latency_ms_p90=fetch_ms[int(0.9 * (len(fetch_ms) - 1))],
        fetch_latency_ms_max=fetch_ms[-1],
        fetch_groups=float(FETCH_GROUPS),
        group_size=float(GROUP_SIZE),
        groups_per_run=float(groups),
        cpu_count=float(os.cpu_count() or 0),
    )
    for floor in FLOORS:
        metrics[f"floor_{floor}_vs_raw_1p"] = metrics[f"floor_{floor}_1p_traj_per_s"] / metrics["raw_1p_traj_per_s"]
    ratios = {
        "ingest_vs_raw_1p": metrics["journal_on_1p_traj_per_s"] / metrics["raw_1p_traj_per_s"],
        "ingest_vs_raw_4p": metrics["journal_on_4p_traj_per_s"] / metrics["raw_4p_traj_per_s"],
        "journal_on_vs_off": metrics["journal_on_1p_traj_per_s"] / metrics["journal_off_1p_traj_per_s"],
    }
    return BenchResult(name="buffer", metrics=metrics, ratios=ratios)


if __name__ == "__main__":
    print(json.dumps(run("--quick" in sys.argv).to_json(), indent=2))
