"""Predictive selective rollout on the buffer's side (`algo.skip_predicted`, rollout_workers/screening.py): a lease
that a worker resolves without generating it (an empty push) is counted `screened`, not completed, never leased again,
kept resolved across a restart from the journal, refused without dynamic sampling, and reported per step."""

from __future__ import annotations

from pathlib import Path

from test_service import make_group

from buffer import ingest, recovery
from buffer.journal import Journal, read_records
from buffer.selective import rollout_metrics
from buffer.state import BufferState
from common import wire
from common.tasks.arith import ArithSource
from common.wire import PushGroup, PushReply


def _state(path: Path, *, filter_groups: bool = True) -> BufferState:
    state = BufferState(
        source=ArithSource(seed=0, digits=2, ops="+", eval_size=0), group_size=2, groups_per_step=4, max_lag=4,
        filter_groups=filter_groups, lease_timeout_s=30.0, max_queued_groups=100,
    )  # fmt: skip
    recovery.replay(state, read_records(path))
    state.journal = Journal(path, "batch")
    return state


def _push(state: BufferState, group: str, trajectories: list[wire.Trajectory]) -> PushReply:
    checked = ingest.decode_request(memoryview(wire.encode(PushGroup("w0", group, trajectories))))
    assert isinstance(checked, ingest.CheckedPush)
    return state.push(checked)


def test_an_empty_push_resolves_the_lease_as_screened(tmp_path: Path) -> None:
    state = _state(tmp_path / "journal")
    screened, generated = state.lease("w0", 2).leases
    live = state.live_groups()
    assert _push(state, screened.group, []) == PushReply(True, "screened")
    assert state.live_groups() == live - 1  # no longer holds the staleness throttle
    assert _push(state, generated.group, make_group(generated, 0, (1.0, 0.0))) == PushReply(True, "")
    stats = state.stats()
    assert stats["screened_groups"] == 1 and stats["completed_groups"] == 1 and stats["admitted_groups"] == 1
    assert _push(state, screened.group, make_group(screened, 0, (1.0, 0.0))) == PushReply(True, "duplicate")
    state.expire_leases(now=1e12)  # a screened lease is not returned to the pool
    assert [lease.index for lease in state.lease("w0", 1).leases] == [2]
    state.journal.close()

    restarted = _state(tmp_path / "journal")  # replayed: problem 0 stays resolved, the cursor past it
    assert restarted.is_resolved(screened.group) and restarted.cursor == 3
    assert {record.get("why") for record in read_records(tmp_path / "journal") if record["k"] == "done"} == {"screened"}


def test_an_empty_push_is_refused_without_dynamic_sampling(tmp_path: Path) -> None:
    state = _state(tmp_path / "journal", filter_groups=False)
    (lease,) = state.lease("w0", 1).leases
    assert _push(state, lease.group, []) == PushReply(False, "empty_group")
    assert lease.group in state.leased and state.stats()["rejected_empty_group"] == 1


def test_rollout_metrics_report_screened_prompts_per_step() -> None:
    last: dict[str, float] = {}
    first = rollout_metrics({"filtered_groups": 1, "completed_groups": 4, "screened_groups": 5}, last)
    second = rollout_metrics({"filtered_groups": 1, "completed_groups": 4, "screened_groups": 7}, last)
    assert first["rollout/screened_prompts"] == 5 and second["rollout/screened_prompts"] == 2
