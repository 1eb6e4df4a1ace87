"""Journal recovery: the records of a buffer's state alone (`snapshot`, what a compacted journal holds), the state
rebuilt from a journal at start-up (`replay`), and the return to a learner checkpoint on resume (`rewind`).

Functions of a `BufferState`, called by the service: `snapshot` when it compacts the journal, `replay` then `rewind`
(with `--resume-step`) or `redelivery` (a restart after a crash, the learner still running) before it serves. The
record kinds are listed in buffer/journal.py; `replay` leaves in `state.replayed` what `rewind` and `redelivery`
need (the admitted groups and the train step that consumed each).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgpack

from buffer import ingest
from buffer.ingest import CheckedPush
from buffer.state import BufferState, Lease, Queued, group_id, group_index


def keep_from(checkpoint_steps: list[int], checkpoint_every: int, step: int) -> int:
    """The first train step whose consumed groups a compaction keeps: the oldest checkpoint on disk (a resume from it
    trains them again); without one, step 0 when checkpoints are being written (a learner restarted before the first
    one starts from the initial model), else none (`step + 1`: with `checkpoint.every=0` only `down` saves one, and a
    restart from the initial model counts the groups compacted away as `rewind_lost_groups`)."""
    if checkpoint_steps:
        return min(checkpoint_steps)
    return 0 if checkpoint_every > 0 else step + 1


def kept_payloads(
    records: Iterable[dict[str, Any]], wanted: list[tuple[int, str, int]], from_step: int
) -> tuple[int, list[tuple[int, bytes]]]:
    """(from_step, the (step, payload) of each consumed group in `wanted`, in its order): `wanted` is
    `BufferState.consumed_log` from `from_step` on, the payloads are read from the journal's `records` (the `admit`
    record before the group's consume record at that step, or the `kept` record of an earlier compaction). A group
    not found there (damage, or a bug) moves `from_step` past its step, so that what is kept is a whole run of steps
    and a resume before it counts its groups lost instead of training part of a batch again."""
    steps = {group: step for step, group, _ in wanted}
    admitted: dict[str, bytes] = {}
    found: dict[str, bytes] = {}
    for record in records:
        kind = record.get("k")
        if kind in ("admit", "kept"):
            group = _group_of(record["m"])
            if group not in steps:
                continue
            if kind == "admit":
                admitted[group] = record["m"]
            elif steps[group] == record.get("s"):
                found[group] = record["m"]
        elif kind == "consume":
            for group in record.get("g", []):
                if group in admitted and steps.get(group) == record.get("s"):
                    found[group] = admitted[group]
    missing = [step for step, group, _ in wanted if group not in found]
    if missing:
        from_step = max(from_step, max(missing) + 1)
    return from_step, [(step, found[group]) for step, group, _ in wanted if step >= from_step]


def _group_of(payload: bytes) -> str | None:
    """The `group` field of a journaled PushGroup (validated when it was admitted), read without decoding its
    trajectories: 1 us against 40 for `ingest.decode_request`, for a compaction that reads every admit record."""
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(payload)
    try:
        for _ in range(unpacker.read_map_header()):
            if unpacker.unpack() == "group":
                group = unpacker.unpack()
                return group if isinstance(group, str) else None
            unpacker.skip()
    except (ValueError, msgpack.UnpackException, msgpack.OutOfData):
        return None
    return None


def snapshot(
    state: BufferState, kept: list[tuple[int, bytes]] | None = None, kept_from: int | None = None
) -> list[dict[str, Any]]:
    """The journal records of the current state alone: what a compacted journal holds (see buffer/journal.py).

    A `state` record (cursor, step, consumed count, max_lag, the indices still leased or returned, the first step
    whose consumed groups it keeps, and with selective rollout the prompts' zero-variance streaks), then a `kept`
    record per consumed group a resume could train again (`kept`: (step, payload), from `kept_payloads`), then one
    `admit` record per queued group in queue order. Everything else resolved is implied by the cursor.
    """
    pending = sorted(lease.index for lease in [*state.leased.values(), *state.returned.values()])
    head = {
        "k": "state",
        "cursor": state.cursor,
        "step": state.step,
        "consumed": state.consumed_groups,
        "admitted": state.counters["admitted_groups"] - len(state.queue),  # admits not in the snapshot
        # the run's counters, less what the snapshot's admit records count again (each queued group a completed one)
        "counts": {
            key: state.counters[key] - (len(state.queue) if key == "completed_groups" else 0) for key in RUN_COUNTS
        },  # fmt: skip
        "max_lag": state.max_lag if state.max_lag_set_live else None,  # else the config's value applies
        "pending": pending,
    }
    if kept_from is not None:
        head["kept_from"] = kept_from
    if state.history is not None:
        head["streaks"] = state.history.snapshot()
    kept_records = ({"k": "kept", "s": step, "m": payload} for step, payload in kept or [])
    return [head, *kept_records, *({"k": "admit", "m": q.payload} for q in state.queue)]


RUN_COUNTS = ("completed_groups", "filtered_groups", "dropped_stale", "screened_groups", "skipped_prompts")
"""Counters of the run's groups and prompts that a resume continues (rebuilt from the journal by `replay`, carried by a
compaction's `state` record), as `admitted_groups` and `consumed_groups` are."""


def _count_done(counts: dict[str, int], why: str | None, pushed: list[bool]) -> None:
    """Count a `done` record's groups in the run's counters; `pushed`: whether each was resolved at its push (a
    completed group) rather than dropped from the queue after its admit."""
    key = {"filtered": "filtered_groups", "stale": "dropped_stale", "screened": "screened_groups"}.get(why or "")
    if key is not None:
        counts[key] += len(pushed)
    if why in ("filtered", "stale"):
        counts["completed_groups"] += sum(pushed)


def replay(state: BufferState, records: list[dict[str, Any]], now: float | None = None) -> None:
    """Rebuild the state from journal records: unconsumed groups queued again in order, the cursor, step, max_lag
    and the prompts' zero-variance streaks restored, and leases that were never resolved returned to the pool (a live
    worker may push them). Streaks are restored only when selective rollout is on (`state.history`). The run's
    counters (`RUN_COUNTS`, admitted and consumed groups) continue from the journal's."""
    now = time.time() if now is None else now
    admitted: dict[str, Queued] = {}
    pending: dict[str, Queued] = {}  # admitted, not consumed nor dropped, in admission order
    unresolved: set[int] = set()  # indices leased and not yet admitted or dropped
    admitted_count = 0
    counts = dict.fromkeys(RUN_COUNTS, 0)
    consumed_at: dict[str, int] = {}  # group -> train step, in consumption order (for `rewind`)
    for record in records:
        kind, groups = record.get("k"), record.get("g", [])
        if kind == "state":  # the head of a compacted journal
            state.cursor, state.step = int(record["cursor"]), int(record["step"])
            state.consumed_groups = int(record["consumed"])
            if record.get("max_lag") is not None:  # set live (SetMaxLag) before the compaction
                state.max_lag, state.max_lag_set_live = int(record["max_lag"]), True
            unresolved = set(record["pending"])
            # consume records of the steps before `kept_from` are gone (older journals: every step up to this one)
            state.compacted_step = int(record["kept_from"]) - 1 if record.get("kept_from") is not None else state.step
            admitted_count = int(record.get("admitted", 0))  # admits compacted away (older journals: unknown)
            counts.update({key: int(value) for key, value in record.get("counts", {}).items() if key in counts})
            if state.history is not None:
                state.history.restore(record.get("streaks", []))
        elif kind == "lease":
            counts["skipped_prompts"] += len(record.get("x", []))
            unresolved.update(record["i"])  # the skipped indices ("x") are resolved: only the cursor passes them
            state.cursor = max(state.cursor, max([*record["i"], *record.get("x", [])], default=-1) + 1)
        elif kind == "streak":
            if state.history is not None:
                state.history.set(int(record["p"]), int(record["n"]))
        elif kind == "kept":  # a group consumed at step `s` that a compaction kept for a resume from before it
            msg = ingest.decode_request(ingest.upgrade_push(record["m"]))
            assert isinstance(msg, CheckedPush)
            admitted[msg.group] = Queued.of(msg)
            consumed_at[msg.group] = int(record["s"])
        elif kind == "admit":
            msg = ingest.decode_request(ingest.upgrade_push(record["m"]))
            assert isinstance(msg, CheckedPush)
            queued = Queued.of(msg)
            admitted[msg.group] = pending[msg.group] = queued
            admitted_count += 1
            counts["completed_groups"] += 1
            index = group_index(msg.group)
            unresolved.discard(-1 if index is None else index)
        elif kind in ("done", "consume"):
            for group in groups:
                pending.pop(group, None)
                index = group_index(group)
                unresolved.discard(-1 if index is None else index)
            if kind == "consume":
                state.step = int(record["s"])
                state.consumed_groups += len(groups)
                consumed_at.update((group, state.step) for group in groups)
            else:  # resolved without a queue place: at the push (filtered, stale, screened), or stale in the queue
                _count_done(counts, record.get("why"), [group not in admitted for group in groups])
        elif kind in ("requeue", "rewind"):
            state.consumed_groups -= len(groups)
            requeued = {group: admitted[group] for group in groups}
            pending = {**requeued, **pending}
            for group in groups:
                consumed_at.pop(group, None)
            for group in record.get("d", []):
                pending.pop(group, None)
            if kind == "rewind":
                state.step = max(int(record["s"]) - 1, 0)
                state.consumed_groups = int(record.get("c", state.consumed_groups))  # older journals: no "c"
        elif kind == "max_lag":
            state.max_lag, state.max_lag_set_live = int(record["v"]), True
    state.queue = deque(pending.values())
    for index in sorted(unresolved):
        group = group_id(index)
        problem = state.source.train(index)
        state.returned[group] = Lease(group, index, problem.prompt, problem.answer, "", now)
    state.counters["admitted_groups"] = admitted_count
    state.counters["consumed_groups"] = state.consumed_groups
    for key, value in counts.items():
        state.counters[key] = value
    state.counters["replayed_groups"] = len(state.queue)
    state.consumed_log = deque(
        (step, group, memoryview(admitted[group].payload).nbytes)
        for group, step in sorted(consumed_at.items(), key=lambda item: item[1])  # stable: consumption order
        if group in admitted
    )
    state.replayed = (admitted, consumed_at)


class JournalBehind(RuntimeError):
    """The journal records less consumption than the checkpoint a run resumes from has trained on."""


def check_covers(state: BufferState, next_step: int, path: Path, checkpoint_steps: list[int]) -> None:
    """After `replay`: JournalBehind unless the journal at `path` records a batch consumed for every step the learner
    trained before `next_step`, that is up to step `next_step - 1` (a consume record is committed before its batch is
    sent, so a whole journal always does). One that does not was cut short, damaged or replaced: resuming on it would
    train its prompts again and lose what was queued. `checkpoint_steps`: the run's `step_<k>` checkpoints, for the
    advice (which to move aside, and where the resume then starts)."""
    last = state.step if state.consumed_groups > 0 else -1  # the last step the journal saw a batch consumed for
    if last >= next_step - 1:
        return
    beyond = [f"step_{k}" for k in checkpoint_steps if k > last + 1]
    covered = [k for k in checkpoint_steps if k <= last + 1]
    start = f"its checkpoint step_{max(covered)}" if covered else "the initial model (no checkpoint the journal covers)"
    move = (
        f"{', '.join(beyond)} (the checkpoints after step_{last + 1})"
        if beyond
        else f"the checkpoints after step_{last + 1}"
    )
    raise JournalBehind(
        f"the journal {path} records batches up to train step {last}, but the checkpoint the run resumes from trained "
        f"up to step {next_step - 1}: its records are missing (cut short, damaged or replaced), and resuming on it "
        f"would train prompts again. To resume from what it holds, move {move} out of its checkpoints/ directory: "
        f"the resume then starts from {start}"
    )


def rewind(state: BufferState, next_step: int) -> dict[str, int]:
    """After `replay`: go back to a learner checkpoint whose next train step is `next_step` (resume).

    Groups consumed at steps >= next_step were trained by a learner whose updates are lost: they return to the
    head of the queue in their consumption order, to be trained again at the same steps (so the staleness
    bound holds as it did). Then every queued group with a token newer than version `next_step` is dropped:
    those versions belong to the lost updates, not to the resumed learner. Journaled as one `rewind` record.
    Groups consumed after the checkpoint whose records a journal compaction removed cannot return (counted
    as `rewind_lost_groups`). Returns {"requeued", "dropped", "lost"}.
    """
    admitted, consumed_at = state.replayed or ({}, {})
    state.replayed = None
    back = [group for group, step in consumed_at.items() if step >= next_step and group in admitted]
    compacted_step = state.compacted_step if state.compacted_step is not None else -1
    lost = max(0, compacted_step - next_step + 1) * state.groups_per_step
    for group in reversed(back):
        state.queue.appendleft(admitted[group])
    # Steps 0 .. next_step - 1 consumed groups_per_step groups each. Lost groups (their consume records were
    # compacted away) cannot be subtracted one by one: without the bound the throttle would count them as live
    # forever and lease nothing, and the resumed learner would wait for a batch that never comes.
    state.consumed_groups = min(state.consumed_groups - len(back), next_step * state.groups_per_step)
    dropped = [q.group for q in state.queue if q.newest_version > next_step]
    state.queue = deque(q for q in state.queue if q.newest_version <= next_step)
    state.consumed_log = deque(entry for entry in state.consumed_log if entry[0] < next_step)
    state.step = max(next_step - 1, 0)
    state.counters["consumed_groups"] = state.consumed_groups
    state.counters["rewound_groups"] += len(back)
    state.counters["rewind_dropped_groups"] += len(dropped)
    state.counters["rewind_lost_groups"] += lost
    state.log_record({"k": "rewind", "s": next_step, "g": back, "d": dropped, "c": state.consumed_groups})
    return {"requeued": len(back), "dropped": len(dropped), "lost": lost}


def redelivery(state: BufferState) -> tuple[int, list[Queued]] | None:
    """After `replay` of a service restarted under a running learner (no rewind): the last train step the journal
    shows a batch consumed for, and that batch, in order; None if there is none (or a compaction removed it).

    The consume record is committed before the BatchReply is sent, so the dead service may have consumed a batch the
    learner never received: the learner then asks for that step again and is given the same groups
    (`BufferService`), which are trained once. A learner that did receive it asks for a later step instead.
    """
    admitted, consumed_at = state.replayed or ({}, {})
    state.replayed = None  # the admitted groups are not needed any more (a resume's `rewind` runs instead of this)
    if not consumed_at:
        return None
    last_step = max(consumed_at.values())
    groups = [group for group, step in consumed_at.items() if step == last_step]
    if any(group not in admitted for group in groups):
        return None
    return last_step, [admitted[group] for group in groups]
