"""Selective rollout (`algo.skip_zero_variance`, buffer/selective.py): zero-variance streaks per prompt, the lease
probability they set, the skipped problems, the journal that keeps them, the config rule, and the per-step metrics.

In-process tests drive a real `BufferState` with a real journal file and real prompt sources (a small jsonl dataset,
so prompts repeat every epoch, or `arith` with one-digit sums); the service test runs `python -m buffer` on real ZMQ.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from test_service import make_group, running_buffer

from buffer import ingest, recovery
from buffer.journal import Journal, read_records
from buffer.selective import PromptHistory, SkipRule, prompt_key, rollout_metrics
from buffer.state import BufferState
from common import wire
from common.config import ConfigError, DataConfig, load_config
from common.config_rules import skip_zero_variance_on
from common.tasks import Problem, PromptSource, make_source
from common.tasks.arith import ArithSource
from common.wire import PromptLease, PushGroup

ROOT = Path(__file__).resolve().parents[3]
MIXED, SOLVED, HOPELESS = (1.0, 0.0), (1.0, 1.0), (0.0, 0.0)


def _dataset(tmp_path: Path, rows: int) -> PromptSource:
    """A jsonl dataset of `rows` sums: the training stream repeats each prompt once per epoch of `rows` problems."""
    path = tmp_path / f"sums{rows}.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(rows))
    )
    return make_source(DataConfig(task="jsonl", path=str(path)))


def _state(
    path: Path, source: PromptSource, *, base: float = 0.5, min_prob: float = 0.05, seed: int = 0
) -> BufferState:
    """A buffer with selective rollout, as `python -m buffer` builds it: replay the journal at `path`, then append."""
    state = BufferState(
        source=source, group_size=2, groups_per_step=64, max_lag=4, filter_groups=True, lease_timeout_s=30.0,
        max_queued_groups=1000, seed=seed, history=PromptHistory(SkipRule(base=base, min_prob=min_prob), seed),
    )  # fmt: skip  # room for every mixed (admitted) group of a test under the staleness throttle
    recovery.replay(state, read_records(path))
    state.journal = Journal(path, "batch")
    return state


def _lease_one(state: BufferState) -> PromptLease:
    (lease,) = state.lease("w0", 1).leases
    return lease


def _push(state: BufferState, lease: PromptLease, rewards: tuple[float, ...]) -> str:
    data = wire.encode(PushGroup("w0", lease.group, make_group(lease, 0, rewards)))
    checked = ingest.decode_request(memoryview(data))
    assert isinstance(checked, ingest.CheckedPush)
    reply = state.push(checked)
    assert reply.accepted, reply.reason
    return reply.reason


def _close(state: BufferState) -> None:
    assert state.journal is not None
    state.journal.close()
    state.journal = None


def test_the_lease_probability_falls_with_the_streak_and_never_reaches_zero() -> None:
    rule = SkipRule(base=0.5, min_prob=0.05)
    probs = [rule.lease_probability(z) for z in range(200)]
    assert probs[:4] == [1.0, 0.5, 0.25, 0.125]
    assert all(a >= b for a, b in zip(probs, probs[1:], strict=False)) and min(probs) == 0.05
    assert SkipRule(base=0.0, min_prob=0.01).lease_probability(1) == 0.01  # skip all but the floor
    assert SkipRule(base=1.0, min_prob=0.05).lease_probability(50) == 1.0  # never skip
    with pytest.raises(ValueError, match="min_prob"):
        SkipRule(base=0.5, min_prob=0.0)


def test_streaks_count_zero_variance_groups_and_a_mixed_group_resets_them(tmp_path: Path) -> None:
    path = tmp_path / "buffer.journal"
    state = _state(path, _dataset(tmp_path, rows=1), base=1.0)  # base 1: never skip, so every lease is granted
    assert state.history is not None
    key = prompt_key("What is 0 + 1?")
    streaks = []
    for rewards in (SOLVED, HOPELESS, SOLVED, MIXED, HOPELESS, MIXED, MIXED):
        _push(state, _lease_one(state), rewards)
        streaks.append(state.history.streak(key))
    assert streaks == [1, 2, 3, 0, 1, 0, 0]
    assert state.counters["filtered_groups"] == 4 and state.counters["completed_groups"] == 7
    _close(state)
    journaled = [r["n"] for r in read_records(path) if r["k"] == "streak"]
    assert journaled == [1, 2, 3, 0, 1, 0]  # one record per change: the last mixed group changed nothing


def test_a_long_streak_is_leased_at_the_floor_and_still_leased(tmp_path: Path) -> None:
    """A prompt that is always solved: its lease probability falls to min_prob and stays there, never 0; then one
    mixed group brings it back at once."""
    state = _state(tmp_path / "buffer.journal", _dataset(tmp_path, rows=1), base=0.5, min_prob=0.05)
    assert state.history is not None
    for _ in range(8):  # streak 8: 0.5 ** 8 is below the floor
        _push(state, _lease_one(state), SOLVED)
    cursor, skipped = state.cursor, state.counters["skipped_prompts"]
    for _ in range(60):
        _push(state, _lease_one(state), SOLVED)  # each lease is granted, however long the streak
    seen = state.cursor - cursor
    assert state.counters["skipped_prompts"] - skipped == seen - 60
    assert 0.03 < 60 / seen < 0.08, f"60 leases in {seen} problems: the floor is 0.05"
    assert state.history.streak(prompt_key("What is 0 + 1?")) == 68
    _push(state, _lease_one(state), MIXED)  # informative again: streak 0, leased every time from now on
    cursor, skipped = state.cursor, state.counters["skipped_prompts"]
    for _ in range(3):
        _push(state, _lease_one(state), MIXED)
    assert state.cursor - cursor == 3 and state.counters["skipped_prompts"] == skipped
    _close(state)


def test_skipped_problems_are_counted_resolved_and_journaled(tmp_path: Path) -> None:
    path = tmp_path / "buffer.journal"
    state = _state(path, _dataset(tmp_path, rows=2), base=0.0, min_prob=0.01)  # a streak: skipped 99 times in 100
    for _ in range(2):
        _push(state, _lease_one(state), SOLVED)
    lease = _lease_one(state)
    skipped = state.counters["skipped_prompts"]
    assert skipped > 0 and lease.index == 2 + skipped
    skipped_groups = [f"g{index}" for index in range(2, lease.index)]
    assert all(state.is_resolved(group) for group in skipped_groups)
    assert state.stats()["skipped_prompts"] == skipped
    _close(state)
    leases = [r for r in read_records(path) if r["k"] == "lease"]
    assert [index for r in leases for index in r.get("x", [])] == list(range(2, lease.index))
    replayed = _state(path, _dataset(tmp_path, rows=2), base=0.0, min_prob=0.01)
    assert replayed.cursor == lease.index + 1 and list(replayed.returned) == [lease.group]  # skipped: not returned
    _close(replayed)


def test_skipping_is_deterministic_given_the_seed(tmp_path: Path) -> None:
    def leased_indices(seed: int, name: str) -> list[int]:
        state = _state(tmp_path / name, _dataset(tmp_path, rows=3), seed=seed)
        indices = []
        for i in range(40):
            lease = _lease_one(state)
            indices.append(lease.index)
            _push(state, lease, MIXED if i % 7 == 6 else SOLVED)
        _close(state)
        return indices

    first = leased_indices(seed=5, name="a")
    assert leased_indices(seed=5, name="b") == first
    assert leased_indices(seed=6, name="c") != first


def _play(state: BufferState, rounds: int, offset: int = 0) -> list[int]:
    """Lease and push `rounds` groups with outcomes fixed by the round number; the indices leased."""
    indices = []
    for i in range(offset, offset + rounds):
        lease = _lease_one(state)
        indices.append(lease.index)
        _push(state, lease, (SOLVED, HOPELESS, MIXED, SOLVED, SOLVED)[i % 5])
    return indices


def test_a_buffer_restarted_from_its_journal_has_the_same_streaks_and_decisions(tmp_path: Path) -> None:
    """Streaks survive a restart (replayed `streak` records), a compaction (the snapshot's `state` record) and a
    resume's rewind; the restarted buffer then leases exactly what the one that kept running leases."""
    source = make_source(DataConfig(task="arith", digits=1, ops="+"))  # about 100 prompts: they repeat
    path = tmp_path / "buffer.journal"
    state = _state(path, source)
    assert state.history is not None
    _play(state, 150)
    streaks, cursor = dict(state.history.streaks), state.cursor
    assert state.counters["skipped_prompts"] > 0 and len(streaks) > 10
    _close(state)

    restarted = _state(path, source)
    assert restarted.history is not None
    assert restarted.history.streaks == streaks and list(restarted.history.streaks) == list(streaks)  # same order
    assert restarted.cursor == cursor
    assert _play(restarted, 60, offset=150) == _play(state, 60, offset=150)  # `state` goes on without a journal
    assert restarted.history.streaks == state.history.streaks
    assert restarted.journal is not None
    restarted.journal.rewrite(recovery.snapshot(restarted))  # compaction: the streaks move into the `state` record
    assert [r["k"] for r in read_records(path)].count("streak") == 0
    _close(restarted)

    compacted = _state(path, source)
    recovery.rewind(compacted, 0)  # a resume keeps the history: what was learnt of the prompts stays true
    assert compacted.history is not None and compacted.history.streaks == state.history.streaks
    _close(compacted)


def test_a_buffer_with_skipping_off_journals_no_streaks_and_ignores_them(tmp_path: Path) -> None:
    source = _dataset(tmp_path, rows=2)
    path = tmp_path / "buffer.journal"
    state = _state(path, source)
    _play(state, 10)
    _close(state)
    plain = BufferState(
        source=source, group_size=2, groups_per_step=64, max_lag=4, filter_groups=True, lease_timeout_s=30.0,
        max_queued_groups=1000,
    )  # fmt: skip
    recovery.replay(plain, read_records(path))
    assert plain.history is None and recovery.snapshot(plain)[0].get("streaks") is None
    plain.journal = Journal(path, "batch")
    cursor, skipped = plain.cursor, plain.counters["skipped_prompts"]  # the run's count so far, from the journal
    assert skipped > 0
    _play(plain, 10)
    assert plain.cursor == cursor + 10 and plain.counters["skipped_prompts"] == skipped  # none skipped since
    _close(plain)


def test_the_service_skips_counts_and_keeps_its_history_across_a_restart(tmp_path: Path) -> None:
    """Over ZMQ: one-digit sums (prompts repeat), every group solved; the buffer skips repeats, counts them, and a
    buffer killed and restarted from its journal tracks the same prompts."""
    run_dir = tmp_path / "run"
    sections = {"algo": {"filter_groups": True}, "data": {"digits": 1, "ops": "+"}}
    with running_buffer(tmp_path, run_dir=run_dir, **sections) as buffer:
        for _ in range(80):
            (lease,), _ = buffer.client.lease(1)
            assert buffer.client.push_group(lease.group, make_group(lease, rewards=SOLVED)).reason == "filtered"
        stats = buffer.stats()
        assert stats["completed_groups"] == 80 and stats["filtered_groups"] == 80
        assert stats["skipped_prompts"] > 0 and stats["cursor"] == 80 + stats["skipped_prompts"]
        assert 0 < stats["skip_tracked_prompts"] <= 80
        buffer.proc.kill()  # no chance to flush: every reply was sent after its records were durable
        buffer.proc.wait()
    with running_buffer(tmp_path, run_dir=run_dir, **sections) as buffer:
        restarted = buffer.stats()
        assert restarted["skip_tracked_prompts"] == stats["skip_tracked_prompts"]
        assert restarted["cursor"] == stats["cursor"]
    (tmp_path / "off").mkdir()
    with running_buffer(tmp_path / "off", algo={"filter_groups": True, "skip_zero_variance": False},
                        data={"digits": 1, "ops": "+"}) as buffer:  # fmt: skip
        for _ in range(40):
            (lease,), _ = buffer.client.lease(1)
            buffer.client.push_group(lease.group, make_group(lease, rewards=SOLVED))
        stats = buffer.stats()
        assert stats["skipped_prompts"] == 0 and stats["cursor"] == 40 and stats["skip_tracked_prompts"] == 0


def test_skip_zero_variance_follows_filter_groups_and_needs_it() -> None:
    assert not skip_zero_variance_on(load_config(None, []).algo)
    assert skip_zero_variance_on(load_config(None, ["algo.filter_groups=true"]).algo)
    assert skip_zero_variance_on(load_config(str(ROOT / "configs" / "dapo_int8.yaml"), []).algo)
    assert not skip_zero_variance_on(
        load_config(None, ["algo.filter_groups=true", "algo.skip_zero_variance=false"]).algo
    )
    with pytest.raises(ConfigError, match=r"`algo\.skip_zero_variance=true` needs `algo\.filter_groups=true`"):
        load_config(None, ["algo.skip_zero_variance=true"])
    for override, key in (("algo.skip_base=1.5", "algo.skip_base"), ("algo.skip_min_prob=0", "algo.skip_min_prob")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, ["algo.filter_groups=true", override])


def test_rollout_metrics_are_per_step_deltas_of_the_buffer_counters() -> None:
    last: dict[str, float] = {}
    first = rollout_metrics({"filtered_groups": 6, "completed_groups": 10, "skipped_prompts": 3}, last)
    assert first["rollout/filtered_share"] == 0.6 and first["rollout/skipped_prompts"] == 3
    second = rollout_metrics({"filtered_groups": 7, "completed_groups": 14, "skipped_prompts": 3}, last)
    assert second["rollout/filtered_share"] == 0.25 and second["rollout/skipped_prompts"] == 0
    idle = rollout_metrics({"filtered_groups": 7, "completed_groups": 14, "skipped_prompts": 5}, last)
    assert math.isnan(idle["rollout/filtered_share"]) and idle["rollout/skipped_prompts"] == 2


class _ByOperator(ArithSource):
    """The `arith` source with a `history_key`: its problems share one history per operator."""

    def history_key(self, problem: Problem) -> str:
        return "minus" if "-" in problem.prompt else "plus"


def test_a_source_may_key_the_history_of_its_problems(tmp_path: Path) -> None:
    source = _ByOperator(seed=3, digits=2, ops="+-", eval_size=0)
    state = _state(tmp_path / "buffer.journal", source, base=0.0, min_prob=0.01)
    assert state.history is not None
    lease = _lease_one(state)
    _push(state, lease, SOLVED)  # one solved sum or difference: every problem of that operator is now skipped ...
    solved_op = "-" if "-" in lease.prompt else "+"
    leased = [_lease_one(state) for _ in range(20)]
    assert all(solved_op not in x.prompt for x in leased)  # ... at 99 in 100: none of the next 20 leases
    assert state.counters["skipped_prompts"] > 0
    assert state.history.streaks == {prompt_key("minus" if solved_op == "-" else "plus"): 1}
    _close(state)
