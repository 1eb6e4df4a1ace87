"""Continuous rollout (`rollout.continuous`): the embedded engine's batch kept full across leases.

The batch loop (worker.py `_loop`) leases `rollout.groups_per_lease` prompts, generates all their samples in one
`generate` call, then scores and pushes them: the call lasts as long as its longest sample, and as samples finish the
batch shrinks, while a decode step of a few rows costs nearly what a full one does (every weight is read each step).
Here the worker keeps `groups_per_lease` groups in flight on the engine's scheduler (`submit` / `step`): a group is
scored and pushed as soon as its last sample ends, and prompts leased at once take the freed slots, as far as the
buffer's staleness throttle lets them (a refused lease is asked again after the buffer's `retry_after` while the groups
in flight keep decoding). A synchronous run (`staleness.max_lag=0`) cannot lease ahead: its batch's tail stays.

Predictive selective rollout (`algo.skip_predicted`) screens each lease before its groups are submitted (its scoring
prefills run on the same scheduler; the generating rows keep decoding meanwhile); a screened prompt is resolved with an
empty push at once. Multi-turn episodes run on the scheduler already (episodes.py); the SGLang backend has no
`submit` / `step` (config rule).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from buffer.client import BufferClient, BufferRequestError, BufferUnavailable
from common.wire import PromptLease

if TYPE_CHECKING:
    from rollout_workers.worker import RolloutWorker

IDLE_WAIT_S = 0.005
"""Shortest wait of a loop with nothing in flight before it asks the buffer again."""


@dataclass(slots=True)
class Flight:
    """One leased prompt's group on the engine: its samples' sequences, in sample order."""

    lease: PromptLease
    prompt_ids: list[int]
    samples: list[Any]
    started: float

    @property
    def done(self) -> bool:
        return all(sample.completion is not None for sample in self.samples)


def run_continuous(worker: RolloutWorker, client: BufferClient, seed: int) -> None:
    """The worker's loop with `rollout.continuous` (module docstring); returns when the worker stops or its engine
    has failed for good (then it has told the buffer it leaves)."""
    from rollout_workers.embedded.sampling import sample_key

    engine: Any = worker.engine  # an EmbeddedEngine (the config rule)
    group_size = worker.sections.train.group_size
    keep = worker.sections.rollout.groups_per_lease
    keys = random.Random(seed)  # each group's sampling stream
    flights: list[Flight] = []
    lease_after = 0.0
    try:
        while not worker._stop.is_set():
            if len(flights) < keep and time.monotonic() >= lease_after:
                leases, retry_after = _lease(worker, client, keep - len(flights))
                if not leases:
                    lease_after = time.monotonic() + retry_after
                for lease in _screened(worker, client, leases):
                    flight = _submit(worker, engine, lease, [sample_key(keys.getrandbits(62), i) for i in
                                                             range(group_size)])  # fmt: skip
                    if flight is not None:
                        flights.append(flight)
            if not flights:
                worker._stop.wait(max(lease_after - time.monotonic(), IDLE_WAIT_S))
                continue
            started = time.time()
            try:
                engine.step()
            except Exception:  # the groups in flight are lost: their leases expire and return to the pool
                worker._note_error()
                engine.abort([sample for flight in flights for sample in flight.samples])
                flights.clear()
                if worker._engine_failed():
                    return
                continue
            finally:
                worker.counters["gen_seconds"] += time.time() - started
            done = [flight for flight in flights if flight.done]
            if done:
                flights = [flight for flight in flights if not flight.done]
                _push_groups(worker, client, done)
    finally:
        if flights:  # stopping: the unfinished groups' leases return with the worker's WorkerLeaving
            engine.abort([sample for flight in flights for sample in flight.samples])


def _lease(worker: RolloutWorker, client: BufferClient, count: int) -> tuple[list[PromptLease], float]:
    """Up to `count` leases and the buffer's retry_after; none (and a pause) when the buffer refused or is away."""
    try:
        return client.lease(count)
    except BufferUnavailable:
        return [], IDLE_WAIT_S
    except BufferRequestError as err:  # the buffer refused the request itself: say so, back off
        worker.counters["errors"] += 1
        worker.last_error = f"lease refused: {err}"
        return [], 1.0


def _screened(worker: RolloutWorker, client: BufferClient, leases: list[PromptLease]) -> list[PromptLease]:
    """The leases to generate; those `algo.skip_predicted` screened out are resolved with an empty push now."""
    if not leases or worker.screen is None:
        return leases
    try:
        decided = worker.rollout_screen(leases)
    except Exception:  # as a failed batch: the leases expire and return to the pool
        worker._note_error()
        return []
    for lease, trajectories in decided:
        if trajectories is not None:
            worker._push(client, lease, trajectories)
    return [lease for lease, trajectories in decided if trajectories is None]


def _submit(worker: RolloutWorker, engine: Any, lease: PromptLease, keys: list[int]) -> Flight | None:
    """Queue the lease's group on the engine; None for a prompt that cannot be generated (counted; its lease
    expires) or that the engine refused (an error, as a failed batch)."""
    try:
        prompt_ids = worker.encode_prompt(lease.prompt)
        if not worker._prompt_fits(lease, prompt_ids):
            return None
        return Flight(lease, prompt_ids, engine.submit(list(prompt_ids), worker.params, keys), time.time())
    except Exception:
        worker._note_error()
        return None


def _push_groups(worker: RolloutWorker, client: BufferClient, done: list[Flight]) -> None:
    """Score the finished groups in one call to the reward step, then push each."""
    group_size = worker.sections.train.group_size
    completions = [sample.completion for flight in done for sample in flight.samples]
    try:
        rewards = worker._score([flight.lease for flight in done], completions, group_size)
    except Exception:  # as a failed batch: the leases expire and return to the pool
        worker._note_error()
        return
    ended = time.time()
    for g, flight in enumerate(done):
        span = slice(g * group_size, (g + 1) * group_size)
        trajectories = worker._trajectories(
            flight.lease, flight.prompt_ids, completions[span], rewards[span], flight.started, ended
        )
        worker._push(client, flight.lease, trajectories)
