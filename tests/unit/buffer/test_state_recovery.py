"""BufferState across restarts of a compacted journal: a resume's rewind, max_lag from the config, and the bound on
tracked workers. In-process (the state and a real journal file); the service around it is tested in test_service."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_service import make_group

from buffer import ingest, recovery
from buffer import state as state_module
from buffer.journal import Journal, read_records
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
