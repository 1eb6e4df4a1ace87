"""BufferState across restarts of a compacted journal: a resume's rewind, max_lag from the config, and the bound on
tracked workers. In-process (the state and a real journal file); the service around it is tested in test_service."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_service import make_group

from buffer import ingest, recovery
from buffer import state as state_module
from buffer.journal import Journal, intact_records, read_records
from buffer.state import BufferState
from common import wire
from common.config import DataConfig
from common.tasks import make_source
from common.wire import PushGroup

GROUPS_PER_STEP = 2


def _state(path: Path, max_lag: int = 1, worker_timeout_s: float = 0.0) -> BufferState:
    """A buffer as `python -m buffer` builds it: replay the journal at `path`, then append to it."""
    state = BufferState(
        source=make_source(DataConfig(task="arith", digits=2)), group_size=2, groups_per_step=GROUPS_PER_STEP,
        max_lag=max_lag, filter_groups=False, lease_timeout_s=30.0, max_queued_groups=1000,
        worker_timeout_s=worker_timeout_s,
    )  # fmt: skip
    recovery.replay(state, read_records(path))
    state.journal = Journal(path, "batch")
    return state


def _fill(state: BufferState, version: int) -> None:
    """Lease what the throttle allows and push every group (2 trajectories on `version`)."""
    for lease in state.lease("w0", state.may_lease()).leases:
        data = wire.encode(PushGroup("w0", lease.group, make_group(lease, version)))
        checked = ingest.decode_request(memoryview(data))
        assert isinstance(checked, ingest.CheckedPush)
        assert state.push(checked).reason == ""
    assert state.journal is not None
    state.journal.commit()


def test_a_resume_past_a_compaction_leases_again_and_serves_the_next_step(tmp_path: Path) -> None:
    """Steps 0-5 trained, the journal compacted at step 5, the learner resumed from its checkpoint before step 2.
    The consume records of steps 2-5 are gone, so those groups are lost (counted); the throttle must still count
    only steps 0-1 as consumed, or it leases nothing and step 2 waits forever."""
    path = tmp_path / "buffer.journal"
    state = _state(path)
    for step in range(6):
        while len(state.queue) < GROUPS_PER_STEP:
            _fill(state, version=step)
        taken, _ = state.take_batch(step, GROUPS_PER_STEP)
        assert taken is not None
    assert state.journal is not None
    state.journal.rewrite(recovery.snapshot(state))
    state.journal.close()

    state = _state(path)
    rewound = recovery.rewind(state, 2)
    assert state.journal is not None
    state.journal.commit()
    assert rewound["lost"] == 4 * GROUPS_PER_STEP
    assert state.consumed_groups == 2 * GROUPS_PER_STEP
    assert state.may_lease() > 0
    _fill(state, version=2)
    taken, _ = state.take_batch(2, GROUPS_PER_STEP)
    assert taken is not None and len(taken) == GROUPS_PER_STEP
    state.journal.close()

    replayed = _state(path)  # the rewind record carries the bounded count: a plain restart agrees
    assert replayed.consumed_groups == state.consumed_groups
    assert replayed.journal is not None
    replayed.journal.close()


def _compact(state: BufferState, kept_from: int) -> int:
    """What the service's compaction does (buffer/service.py `_maybe_compact`); returns the kept_from it wrote."""
    assert state.journal is not None
    state.journal.commit()
    state.prune_consumed(kept_from)
    kept_from, kept = recovery.kept_payloads(intact_records(state.journal.path), list(state.consumed_log), kept_from)
    state.journal.rewrite(recovery.snapshot(state, kept, kept_from))
    return kept_from


def test_two_compactions_keep_what_a_resume_from_the_oldest_checkpoint_trains_again(tmp_path: Path) -> None:
    """Steps 0-7 trained; compacted at step 5 and again at step 7, both keeping from step 2 (the oldest checkpoint);
    a resume at step 2 gets back the groups of steps 2-7 in their order, none lost; a plain restart agrees."""
    path = tmp_path / "buffer.journal"
    state = _state(path, max_lag=100)
    batches: list[list[str]] = []
    for step in range(8):
        while len(state.queue) < GROUPS_PER_STEP:
            _fill(state, version=0)
        taken, _ = state.take_batch(step, GROUPS_PER_STEP)
        assert taken is not None
        batches.append([q.group for q in taken])
        if step in (5, 7):
            assert _compact(state, kept_from=2) == 2
    assert state.journal is not None
    state.journal.close()
    records = read_records(path)
    assert [r["k"] for r in records[: 1 + 6 * GROUPS_PER_STEP]] == ["state"] + ["kept"] * 6 * GROUPS_PER_STEP
    assert records[0]["kept_from"] == 2

    state = _state(path, max_lag=100)
    assert state.consumed_groups == 8 * GROUPS_PER_STEP
    rewound = recovery.rewind(state, 2)
    assert rewound == {"requeued": 6 * GROUPS_PER_STEP, "dropped": 0, "lost": 0}
    again = [g for batch in batches[2:] for g in batch]
    assert [q.group for q in state.queue][: len(again)] == again  # at the head, then the groups never consumed
    assert state.consumed_groups == 2 * GROUPS_PER_STEP
    assert state.journal is not None
    state.journal.close()


def test_a_group_the_journal_lacks_moves_kept_from_past_its_step(tmp_path: Path) -> None:
    """A consumed group whose admit record is not in the journal (damage) cannot be kept: the steps up to its own are
    then not kept at all (a resume before them counts them lost) rather than a batch coming back short."""
    path = tmp_path / "buffer.journal"
    state = _state(path, max_lag=100)
    for step in range(4):
        while len(state.queue) < GROUPS_PER_STEP:
            _fill(state, version=0)
        assert state.take_batch(step, GROUPS_PER_STEP)[0] is not None
    assert state.journal is not None
    state.journal.commit()
    wanted = list(state.consumed_log)
    wanted[2] = (wanted[2][0], "g999", wanted[2][2])  # a group of step 1 that no record holds
    kept_from, kept = recovery.kept_payloads(intact_records(path), wanted, 0)
    assert kept_from == 2 and [step for step, _ in kept] == [2, 2, 3, 3]
    state.journal.close()


def test_a_requeued_batch_leaves_the_consumed_log_and_keep_from_follows_the_checkpoints(tmp_path: Path) -> None:
    state = _state(tmp_path / "buffer.journal")
    _fill(state, version=0)
    taken, _ = state.take_batch(0, GROUPS_PER_STEP)
    assert taken is not None and [entry[1] for entry in state.consumed_log] == [q.group for q in taken]
    state.requeue(taken)
    assert not state.consumed_log and state.kept_bytes() == 0
    assert recovery.keep_from([9, 12], checkpoint_every=3, step=13) == 9
    assert recovery.keep_from([], checkpoint_every=3, step=13) == 0  # a restart goes back to the initial model
    assert recovery.keep_from([], checkpoint_every=0, step=13) == 14  # no checkpoint will be written: keep none
    assert state.journal is not None
    state.journal.close()


def test_compaction_keeps_max_lag_only_if_it_was_set_live(tmp_path: Path) -> None:
    for set_live in (False, True):
        path = tmp_path / f"journal-{set_live}"
        state = _state(path, max_lag=1)
        if set_live:
            state.set_max_lag(3)
        _fill(state, version=0)
        state.take_batch(0, GROUPS_PER_STEP)
        assert state.journal is not None
        state.journal.rewrite(recovery.snapshot(state))
        state.journal.close()
        restarted = _state(path, max_lag=4)  # the run resumed with staleness.max_lag=4 in its config
        assert restarted.max_lag == (3 if set_live else 4), set_live
        assert restarted.journal is not None
        restarted.journal.close()


def test_heartbeats_track_a_bounded_number_of_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state_module, "MAX_TRACKED_WORKERS", 3)
    state = _state(tmp_path / "buffer.journal", worker_timeout_s=30.0)
    for i in range(5):
        state.heartbeat(f"w{i}", now=100.0)
    state.heartbeat("w0", now=101.0)  # a tracked worker stays tracked
    assert state.last_seen == {"w0": 101.0, "w1": 100.0, "w2": 100.0}
    assert state.counters["untracked_workers"] == 2
    assert state.journal is not None
    state.journal.close()


def test_the_run_s_counters_continue_across_a_replay_and_a_compaction(tmp_path: Path) -> None:
    """A resume restored admitted and consumed groups only: completed, filtered, stale, screened groups and skipped
    prompts restarted from 0 (completed 189 beside admitted 646 after a 30-step resume)."""
    path = tmp_path / "buffer.journal"

    def buffer() -> BufferState:
        state = BufferState(
            source=make_source(DataConfig(task="arith", digits=2)), group_size=2, groups_per_step=GROUPS_PER_STEP,
            max_lag=1, filter_groups=True, lease_timeout_s=30.0, max_queued_groups=1000,
        )  # fmt: skip
        recovery.replay(state, read_records(path))
        state.journal = Journal(path, "batch")
        return state

    def counts(state: BufferState) -> dict[str, int]:
        return {key: state.counters[key] for key in (*recovery.RUN_COUNTS, "admitted_groups", "consumed_groups")}

    state = buffer()
    for step in range(5):
        for i, lease in enumerate(state.lease("w0", state.may_lease()).leases):
            rewards = (1.0, 1.0) if i % 3 == 0 else (1.0, 0.0)  # every third group all correct: filtered
            version = 0 if step >= 3 and i % 3 == 1 else step  # too old for max_lag 1 from step 3: stale at the push
            checked = ingest.decode_request(
                memoryview(wire.encode(PushGroup("w0", lease.group, make_group(lease, version, rewards))))
            )
            assert isinstance(checked, ingest.CheckedPush)
            state.push(checked)
        state.take_batch(step, GROUPS_PER_STEP)
    assert state.journal is not None
    state.journal.commit()
    before = counts(state)
    assert min(before["filtered_groups"], before["dropped_stale"], before["consumed_groups"]) > 0, before
    state.journal.close()
    replayed = buffer()
    assert counts(replayed) == before
    _compact(replayed, replayed.step + 1)
    assert replayed.journal is not None
    replayed.journal.close()
    assert counts(buffer()) == before
