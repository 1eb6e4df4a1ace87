"""`asyncrl bench wire`: encode+decode throughput of 512-token trajectories through our codec.

Baseline, measured in the same run: raw `msgpack.packb` / `unpackb` of a dict with the same fields and the same
arrays as raw bytes, without any validation (and without turning bytes back into arrays). The ratio
`codec_vs_raw_msgpack` is therefore the price of the schema: typed fields, dtype and length checks, finite
log-probs, zero-copy arrays. Contenders alternate in short rounds and each reports its median round, so a noisy
neighbour slows both rather than one.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import msgpack
import numpy as np

from asyncrl.bench import BenchResult
from common.wire import Trajectory, decode, encode

RESPONSE_TOKENS = 512
PROMPT_TOKENS = 128


def _trajectory() -> Trajectory:
    rng = np.random.default_rng(0)
    return Trajectory(
        uid="g123/4",
        group="g123",
        prompt_index=123,
        prompt_ids=rng.integers(0, 32000, PROMPT_TOKENS).astype(np.int32),
        response_ids=rng.integers(0, 32000, RESPONSE_TOKENS).astype(np.int32),
        behav_logp=-rng.exponential(1.0, RESPONSE_TOKENS).astype(np.float32),
        versions=np.repeat(np.arange(4, dtype=np.int32), RESPONSE_TOKENS // 4),
        reward=1.0,
        correct=True,
        finish="stop",
        worker="rollout-0",
        t_start=1.7e9,
        t_end=1.7e9 + 3.5,
    )


def _raw_dict(traj: Trajectory) -> dict[str, object]:
    return {
        "uid": traj.uid,
        "group": traj.group,
        "prompt_index": traj.prompt_index,
        "prompt_ids": traj.prompt_ids.tobytes(),
        "response_ids": traj.response_ids.tobytes(),
        "behav_logp": traj.behav_logp.tobytes(),
        "versions": traj.versions.tobytes(),
        "reward": traj.reward,
        "correct": traj.correct,
        "finish": traj.finish,
        "worker": traj.worker,
        "t_start": traj.t_start,
        "t_end": traj.t_end,
    }


def _rate(fn: Callable[[], object], round_s: float) -> float:
    """Calls per second of `fn` over about `round_s` seconds."""
    calls, start = 0, time.perf_counter()
    deadline = start + round_s
    while True:
        for _ in range(50):
            fn()
        calls += 50
        now = time.perf_counter()
        if now >= deadline:
            return calls / (now - start)


def run(quick: bool) -> BenchResult:
    traj = _trajectory()
    raw = _raw_dict(traj)
    data = encode(traj)
    contenders: dict[str, Callable[[], object]] = {
        "codec_traj_per_s": lambda: decode(encode(traj)),
        "raw_msgpack_traj_per_s": lambda: msgpack.unpackb(msgpack.packb(raw)),
        "codec_encode_traj_per_s": lambda: encode(traj),
        "codec_decode_traj_per_s": lambda: decode(data),
    }
    rounds, round_s = (3, 0.07) if quick else (9, 0.3)
    for fn in contenders.values():  # warm-up
        _rate(fn, 0.01)
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            samples[name].append(_rate(fn, round_s))
    metrics = {name: statistics.median(values) for name, values in samples.items()}
    metrics["bytes_per_traj"] = float(len(data))
    metrics["response_tokens"] = float(RESPONSE_TOKENS)
    ratios = {"codec_vs_raw_msgpack": metrics["codec_traj_per_s"] / metrics["raw_msgpack_traj_per_s"]}
    return BenchResult(name="wire", metrics=metrics, ratios=ratios)
