"""A rollout-worker stand-in for `asyncrl bench sync`: an embedded engine decoding nonstop while weights stream in.

Run as `python -m asyncrl.bench.sync_worker SPEC_JSON`. It subscribes to the publisher, decodes a steady stream of
requests (staggered lengths, so sequences finish and join one at a time, as in a rollout worker), and reports to
the bench over a ZMQ PUSH socket with msgpack messages:

    {"event": "ready", "worker"}                        once version `first_version` (default 0) runs
    {"event": "swap", "worker", "version", "t",         when a new version runs (t: time.monotonic(), system-wide,
     "fetch_s", "build_s", "staged_t", "step_start_t",   at the end of its first step; fetch: header to verified
     "fetch_cpu_s", "stage_cpu_s", "step_cpu_s"}         tensors, on the subscriber thread; build: on the decode
                                                        thread, over its slices; staged_t: when the subscriber had
                                                        handed it to the engine; step_start_t: when its first step
                                                        began, the swap being that step's first act; *_cpu_s: thread
                                                        CPU seconds of the fetch, of `stage_weights` and of that
                                                        first step, build included)
    {"event": "done", "worker", "stamps", "tokens",     on SIGTERM (or at its deadline): every step's end time
     "cpu", "decode_cpu"}                               (time.monotonic()), the tokens decoded in that step, and
                                                        the process's CPU seconds at its end (time.process_time():
                                                        every thread, the subscriber's too), and the decode
                                                        thread's alone (time.thread_time())
"""

from __future__ import annotations

import json
import signal
import sys
import time

import msgpack
import torch
import zmq


def main(argv: list[str] | None = None) -> int:
    spec = json.loads((argv or sys.argv[1:])[0])
    torch.set_num_threads(1)
    from quant_sync.transport import WeightSubscriber
    from rollout_workers.embedded.engine import EmbeddedEngine
    from rollout_workers.engine import SamplingParams

    worker = spec["worker"]
    report = zmq.Context.instance().socket(zmq.PUSH)
    report.setsockopt(zmq.LINGER, 5000)
    report.connect(spec["report"])
    engine = EmbeddedEngine(spec["model_dir"], max_batch=spec["batch"], seed=worker)
    subscriber = WeightSubscriber(
        spec["weights"], engine.stage_weights, poll_s=0.005, keep_int8_adapters=engine.runs_int8_adapters
    )
    first = spec.get("first_version", 0)  # LoRA: the first adapter version on the pinned base
    if not subscriber.wait_for(first, 120):
        raise SystemExit(f"sync worker {worker}: no version {first} from {spec['weights']}")
    engine.apply_staged()
    vocab = engine.arch.vocab_size
    generator = torch.Generator().manual_seed(worker)
    longest = spec["max_new_tokens"]

    def submit(length: int) -> None:
        prompt = torch.randint(3, vocab, (8,), generator=generator).tolist()
        engine.submit(prompt, SamplingParams(max_new_tokens=length, stop_token_ids=(-1,)), [len(stamps)])

    stamps: list[float] = []
    tokens: list[int] = []
    cpu: list[float] = []
    decode_cpu: list[float] = []
    for index in range(spec["batch"]):  # staggered lengths: one sequence finishes (and one joins) at a time
        submit(longest // 2 + (index * longest) // (2 * spec["batch"]) + 1)
    report.send(msgpack.packb({"event": "ready", "worker": worker}))
    version = engine.version
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
    deadline = time.monotonic() + spec["seconds"]
    while not stopping and time.monotonic() < deadline:
        active = engine.num_active
        step_start, step_cpu = time.monotonic(), time.thread_time()
        finished = engine.step()
        stamps.append(time.monotonic())
        tokens.append(active)
        cpu.append(time.process_time())
        decode_cpu.append(time.thread_time())
        step_cpu = decode_cpu[-1] - step_cpu
        for _ in finished:
            submit(longest)
        if engine.version != version:
            version = engine.version
            swap = {"event": "swap", "worker": worker, "version": version, "t": stamps[-1]}
            swap.update(fetch_s=subscriber.last_fetch_s, build_s=engine.last_build_s,
                        staged_t=subscriber.last_update_t, step_start_t=step_start,
                        fetch_cpu_s=subscriber.last_fetch_cpu_s, stage_cpu_s=subscriber.last_update_cpu_s,
                        step_cpu_s=step_cpu)  # fmt: skip
            report.send(msgpack.packb(swap))
    subscriber.close()
    report.send(msgpack.packb({"event": "done", "worker": worker, "stamps": stamps, "tokens": tokens, "cpu": cpu,
                                "decode_cpu": decode_cpu}))  # fmt: skip
    report.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
