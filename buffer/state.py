"""The buffer's bookkeeping, without sockets: prompt leases, group admission, staleness, batches. Journal recovery
(snapshot, replay, rewind) is in buffer/recovery.py.

Life of a group (its id is `g<index>` of the problem it was leased for, the same id if the lease is reissued):

    cursor ──lease──▶ leased ──push ok──▶ queued ──fetch──▶ consumed
      │                 │  ▲                 └──too stale at fetch──▶ dropped (counted)
      │      deadline   ▼  │ reissued first
      │               returned            push: filtered (all rewards equal) or already stale ──▶ resolved, counted
      └──zero-variance streak, not drawn (algo.skip_zero_variance, buffer/selective.py)──▶ skipped, counted
    leased ──empty push (algo.skip_predicted, rollout_workers/screening.py)──▶ screened, counted

A push of a returned (expired) lease is still accepted; whichever push of a group id comes first is admitted and
any later one is answered `duplicate`, so a group is trained at most once. Live groups for the throttle
(`staleness.may_lease`) are leased + queued + consumed.

Resolved groups need no set: group ids are `g<index>` and indices are handed out in order, so a group below the
cursor that is neither leased, returned nor queued has been resolved (admitted, consumed, filtered, dropped or
skipped).

Selective rollout (`history`, buffer/selective.py): every group a push resolves updates its prompt's zero-variance
streak (journaled as a `streak` record when it changes), and a new problem whose prompt has a streak is leased only
with a probability that falls with it; a skipped problem is passed over by the cursor (journaled in the `lease`
record's `x`) and never generated.
That keeps the state (and a compacted journal, see `buffer.recovery.snapshot`) proportional to what is in flight,
not to the run.

Workers: every LeaseRequest or PushGroup is a heartbeat of the worker it names (`LeaseRequest(max_groups=0)` is a
pure heartbeat). A worker silent for `worker_timeout_s` (0: never) is declared dead and its leases return at once,
without waiting for their deadlines. A worker that stops says so (`WorkerLeaving`, `leave`): its leases return then,
and it is counted as `left_workers`, never as dead.

Queued groups are kept as the validated PushGroup bytes of `CheckedPush` (the received frame itself, not
copied; no decoded objects are kept): they are journaled as they are and the learner's BatchReply copies in their
trajectory arrays without decoding or re-encoding them.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from buffer import ingest, staleness
from buffer.ingest import CheckedPush
from buffer.journal import Journal
from buffer.selective import MAX_SKIPS_PER_LEASE, PromptHistory, history_key, is_zero_variance
from common import wire
from common.tasks import Problem, PromptSource
from common.wire import LeaseReply, PromptLease, PushReply

RETRY_AFTER_S = 0.1
"""What an empty LeaseReply tells workers to wait before asking again."""
MAX_TRACKED_WORKERS = 4096
"""Most workers whose heartbeats are tracked for `worker_timeout_s` (a bound on what request ids can make us hold)."""


@dataclass(slots=True)
class Lease:
    """A problem leased to `worker` as group `group` until `deadline` (unix seconds)."""

    group: str
    index: int
    prompt: str
    answer: str
    worker: str
    deadline: float


@dataclass(slots=True)
class Queued:
    """An admitted group waiting for the learner."""

    group: str
    worker: str
    payload: bytes | memoryview  # CheckedPush.payload: the validated PushGroup
    trajectories_at: int  # where its msgpack array of trajectories starts (it runs to the end)
    oldest_version: int
    newest_version: int

    @classmethod
    def of(cls, msg: CheckedPush) -> Queued:
        return cls(msg.group, msg.worker, msg.payload, msg.trajectories_at, msg.oldest_version, msg.newest_version)


def group_id(index: int) -> str:
    return f"g{index}"


def group_index(group: str) -> int | None:
    """The problem index of a group id `g<index>`, or None for anything else."""
    digits = group[1:]
    if group[:1] != "g" or not digits.isdigit() or not digits.isascii() or len(digits) > 18:
        return None
    return int(digits)


class BufferState:
    """Everything the buffer knows. Single-threaded: the service calls one method per request."""

    def __init__(
        self,
        *,
        source: PromptSource,
        group_size: int,
        groups_per_step: int,
        max_lag: int,
        filter_groups: bool,
        lease_timeout_s: float,
        max_queued_groups: int,
        journal: Journal | None = None,
        worker_timeout_s: float = 0.0,
        seed: int = 0,
        history: PromptHistory | None = None,
        vocab_size: int = 0,
    ) -> None:
        self.source = source
        self.vocab_size = vocab_size  # the model's: a token id at or past it is refused (`token_range`); 0: unchecked
        self.group_size = group_size
        self.groups_per_step = groups_per_step
        self.max_lag = max_lag
        self.filter_groups = filter_groups
        self.lease_timeout_s = lease_timeout_s
        self.max_queued_groups = max_queued_groups
        self.journal = journal
        self.worker_timeout_s = worker_timeout_s
        self.seed = seed  # of the prompt source: with the cursor, it fixes the dataset order (epoch shuffles too)
        self.history = history  # zero-variance streaks by prompt (selective rollout); None: every problem is leased
        self.last_seen: dict[str, float] = {}  # worker id -> time.time() of its last request
        self.step = 0  # the learner's current train step (last FetchBatch.step)
        self.cursor = 0  # next problem index of the training stream
        self.leased: dict[str, Lease] = {}
        self.returned: OrderedDict[str, Lease] = OrderedDict()  # expired, not reissued yet
        self.queue: deque[Queued] = deque()
        self.consumed_groups = 0
        self.counters: Counter[str] = Counter()
        # Journal recovery (buffer/recovery.py) keeps these:
        self.replayed: tuple[dict[str, Queued], dict[str, int]] | None = None  # for `rewind`: admits, consumes
        self.compacted_step: int | None = None  # consume records of steps <= this were compacted away (`rewind`)
        # (train step, group, payload bytes) of every consumed group a resume could train again, in consumption
        # order: what a compaction keeps (buffer/recovery.py `keep_from`); pruned below the oldest checkpoint's step
        self.consumed_log: deque[tuple[int, str, int]] = deque()
        self.max_lag_set_live = False  # SetMaxLag was used: max_lag outlives restarts (else the config's applies)

    # -- throttle -----------------------------------------------------------------------------------------------

    def live_groups(self) -> int:
        return len(self.leased) + len(self.queue) + self.consumed_groups

    def may_lease(self) -> int:
        if len(self.queue) >= self.max_queued_groups:
            return 0
        return staleness.may_lease(self.step, self.max_lag, self.groups_per_step, self.live_groups())

    # -- requests -----------------------------------------------------------------------------------------------

    def lease(self, worker: str, max_groups: int, now: float | None = None) -> LeaseReply:
        """Up to `max_groups` leases: expired ones first, then new problems from the cursor (passing over those that
        selective rollout skips, at most MAX_SKIPS_PER_LEASE of them a request)."""
        now = time.time() if now is None else now
        self.heartbeat(worker, now)
        budget = min(max_groups, self.may_lease(), wire.MAX_GROUP)
        granted: list[Lease] = []
        while len(granted) < budget and self.returned:
            _, lease = self.returned.popitem(last=False)
            granted.append(lease)
            self.counters["reissued_leases"] += 1
        new_indices: list[int] = []
        skipped: list[int] = []
        while len(granted) < budget and len(skipped) < MAX_SKIPS_PER_LEASE:
            try:
                problem = self.source.train(self.cursor)
            except IndexError:  # a finite stream is exhausted
                break
            if self.history is not None and not self.history.should_lease(
                history_key(self.source, problem), self.cursor
            ):
                skipped.append(self.cursor)
                self.cursor += 1
                continue
            granted.append(Lease(group_id(self.cursor), self.cursor, problem.prompt, problem.answer, worker, 0.0))
            new_indices.append(self.cursor)
            self.cursor += 1
        if skipped:
            self.log_record({"k": "lease", "i": new_indices, "x": skipped})
            self.counters["skipped_prompts"] += len(skipped)
        elif new_indices:
            self.log_record({"k": "lease", "i": new_indices})
        for lease in granted:
            lease.worker, lease.deadline = worker, now + self.lease_timeout_s
            self.leased[lease.group] = lease
        self.counters["leased_total"] += len(granted)
        if not granted and max_groups > 0:
            self.counters["lease_throttled"] += 1
        return LeaseReply(
            leases=[PromptLease(x.group, x.index, x.prompt, x.answer, x.deadline) for x in granted],
            retry_after_s=0.0 if granted else RETRY_AFTER_S,
        )

    def push(self, msg: CheckedPush, now: float | None = None) -> PushReply:
        """Admit a finished group, or say why not (the reason is counted as `rejected_<reason>`).

        An admitted group's `msg.payload` is queued and journaled as it is.
        """
        now = time.time() if now is None else now
        self.heartbeat(msg.worker, now)
        group = msg.group
        lease = self.leased.get(group) or self.returned.get(group)
        if lease is None:
            if self.is_resolved(group):
                self.counters["duplicate_groups"] += 1
                return PushReply(True, "duplicate")
            return self._reject("unknown_group")
        if not msg.uids:
            return self._screen(group)
        reason = self._check_group(msg, lease)
        if reason:
            return self._reject(reason)
        outcome = ""
        if not staleness.is_admissible(self.step, msg.oldest_version, self.max_lag):
            outcome = "stale"
        elif self.filter_groups and is_zero_variance(msg.rewards):
            outcome = "filtered"
        elif len(self.queue) >= self.max_queued_groups:
            if group in self.leased:  # the worker holds the group and will retry: keep its lease alive
                lease.deadline = now + self.lease_timeout_s
            return self._reject("backpressure")
        self.leased.pop(group, None)
        self.returned.pop(group, None)
        self.counters["completed_groups"] += 1
        self._record_outcome(lease, msg.rewards)
        if outcome:
            self.counters["dropped_stale" if outcome == "stale" else "filtered_groups"] += 1
            self.log_record({"k": "done", "g": [group], "why": outcome})
            return PushReply(True, outcome)
        self.queue.append(Queued.of(msg))
        self.counters["admitted_groups"] += 1
        self.counters["admitted_trajectories"] += len(msg.uids)
        if self.journal is not None:
            self.journal.append_admit(msg.payload)
        return PushReply(True, "")

    def _screen(self, group: str) -> PushReply:
        """An empty push: the worker resolved the lease without generating it (`algo.skip_predicted`,
        rollout_workers/screening.py), which only dynamic sampling makes a saving (else it is refused: `empty_group`).
        Counted as `screened_groups`, not as completed; the prompt's streak is left as it is."""
        if not self.filter_groups:
            return self._reject("empty_group")
        self.leased.pop(group, None)
        self.returned.pop(group, None)
        self.counters["screened_groups"] += 1
        self.log_record({"k": "done", "g": [group], "why": "screened"})
        return PushReply(True, "screened")

    def queued_bytes(self) -> int:
        """Bytes of the queued groups' payloads: what a journal snapshot would have to copy."""
        return sum(memoryview(queued.payload).nbytes for queued in self.queue)

    def kept_bytes(self) -> int:
        """Bytes of the consumed groups a compaction keeps (`consumed_log`, pruned by `prune_consumed`)."""
        return sum(entry[2] for entry in self.consumed_log)

    def prune_consumed(self, from_step: int) -> None:
        """Forget the consumed groups of steps before `from_step`: no resume can train them again."""
        while self.consumed_log and self.consumed_log[0][0] < from_step:
            self.consumed_log.popleft()

    def take_batch(self, step: int, num_groups: int) -> tuple[list[Queued] | None, int]:
        """Record `step`, drop queued groups too stale for it; (the oldest `num_groups` groups or None, dropped)."""
        self.step = step
        dropped = self.drop_stale()
        if num_groups < 1 or len(self.queue) < num_groups:
            return None, dropped
        taken = [self.queue.popleft() for _ in range(num_groups)]
        self.consumed_log.extend((step, q.group, memoryview(q.payload).nbytes) for q in taken)
        self.consumed_groups += num_groups
        self.counters["consumed_groups"] += num_groups
        self.log_record({"k": "consume", "g": [q.group for q in taken], "s": step})
        return taken, dropped

    def requeue(self, taken: list[Queued]) -> None:
        """Put back a batch whose reply could not be delivered, at the head of the queue."""
        for queued in reversed(taken):
            self.queue.appendleft(queued)
        back = {q.group for q in taken}
        self.consumed_log = deque(entry for entry in self.consumed_log if entry[1] not in back)
        self.consumed_groups -= len(taken)
        self.counters["consumed_groups"] -= len(taken)
        self.counters["requeued_groups"] += len(taken)
        self.log_record({"k": "requeue", "g": [q.group for q in taken]})

    def set_max_lag(self, max_lag: int) -> None:
        """Change staleness.max_lag live; journaled, so a restarted buffer keeps it."""
        self.max_lag, self.max_lag_set_live = max_lag, True
        self.log_record({"k": "max_lag", "v": max_lag})

    def drop_stale(self) -> int:
        """Drop and count queued groups too old for the current step."""
        kept: deque[Queued] = deque()
        dropped: list[str] = []
        for queued in self.queue:
            if staleness.is_admissible(self.step, queued.oldest_version, self.max_lag):
                kept.append(queued)
            else:
                dropped.append(queued.group)
        if dropped:
            self.queue = kept
            self.counters["dropped_stale"] += len(dropped)
            self.log_record({"k": "done", "g": dropped, "why": "stale"})
        return len(dropped)

    def heartbeat(self, worker: str, now: float) -> None:
        """Record a sign of life of `worker`; at most MAX_TRACKED_WORKERS are tracked (a new one past that is counted
        as `untracked_workers` and never declared dead: its leases still expire at their deadlines)."""
        if self.worker_timeout_s > 0:
            if len(self.last_seen) >= MAX_TRACKED_WORKERS and worker not in self.last_seen:
                self.counters["untracked_workers"] += 1
                return
            self.last_seen[worker] = now

    def leave(self, worker: str) -> int:
        """`worker` stops: return its leases to the pool now (reissued before new problems) and stop tracking it, so
        it is not declared dead after `worker_timeout_s`; returns how many leases came back."""
        self.last_seen.pop(worker, None)
        mine = [lease for lease in self.leased.values() if lease.worker == worker]
        for lease in mine:
            del self.leased[lease.group]
            self.returned[lease.group] = lease
        self.counters["left_workers"] += 1
        self.counters["left_worker_leases"] += len(mine)
        return len(mine)

    def expire_leases(self, now: float | None = None) -> int:
        """Return leases past their deadline, and every lease of a worker silent for `worker_timeout_s`, to the pool
        (reissued before new problems)."""
        now = time.time() if now is None else now
        dead: set[str] = set()
        if self.worker_timeout_s > 0:
            dead = {w for w, seen in self.last_seen.items() if now - seen > self.worker_timeout_s}
            for worker in dead:
                del self.last_seen[worker]
            self.counters["dead_workers"] += len(dead)
        expired = [lease for lease in self.leased.values() if lease.deadline <= now or lease.worker in dead]
        for lease in expired:
            del self.leased[lease.group]
            self.returned[lease.group] = lease
            self.counters["expired_leases" if lease.deadline <= now else "dead_worker_leases"] += 1
        return len(expired)

    def next_deadline(self) -> float | None:
        return min((lease.deadline for lease in self.leased.values()), default=None)

    def is_resolved(self, group: str) -> bool:
        """Whether `group` was leased once and is now admitted, consumed, filtered or dropped (see module doc)."""
        index = group_index(group)
        return not (index is None or index >= self.cursor or group in self.leased or group in self.returned)

    def cursor_state(self) -> dict[str, int | None]:
        """The dataset cursor, checkpointable: next index of the stream, its epoch and position, the source seed."""
        size = self.source.epoch_size()
        return {
            "index": self.cursor,
            "epoch": self.cursor // size if size else 0,
            "position": self.cursor % size if size else self.cursor,
            "epoch_size": size,
            "seed": self.seed,
        }

    def stats(self) -> dict[str, float | int]:
        out: dict[str, float | int] = dict(self.counters)
        for key in (
            "admitted_groups",
            "consumed_groups",
            "dropped_stale",
            "filtered_groups",
            "completed_groups",
            "skipped_prompts",
            "screened_groups",
            "expired_leases",
            "dead_workers",
            "dead_worker_leases",
            "left_workers",
            "left_worker_leases",
        ):
            out.setdefault(key, 0)
        cursor = self.cursor_state()
        out.update(
            queued_groups=len(self.queue),
            leased_groups=len(self.leased),
            returned_groups=len(self.returned),
            live_groups=self.live_groups(),
            may_lease=self.may_lease(),
            current_step=self.step,
            max_lag=self.max_lag,
            groups_per_step=self.groups_per_step,
            group_size=self.group_size,
            cursor=self.cursor,
            cursor_epoch=cursor["epoch"] or 0,
            cursor_position=cursor["position"] or 0,
            live_workers=len(self.last_seen),
            skip_tracked_prompts=len(self.history.streaks) if self.history is not None else 0,
            skip_forgotten_prompts=self.history.forgotten if self.history is not None else 0,
        )
        if self.journal is not None:
            out["journal_bytes"] = self.journal.size_bytes()
        return out

    # -- helpers ------------------------------------------------------------------------------------------------

    def _check_group(self, msg: CheckedPush, lease: Lease) -> str:
        count = len(msg.uids)
        if count != self.group_size:
            return "group_size"
        if msg.trajectory_groups.count(msg.group) != count:
            return "group_mismatch"
        if len(set(msg.uids)) != count:
            return "duplicate_uid"
        if msg.prompt_indices.count(lease.index) != count:
            return "prompt_index"
        if msg.newest_version > self.step + 1:
            return "future_version"
        if self.vocab_size and msg.max_token_id >= self.vocab_size:  # the learner's embedding would fail on it
            return "token_range"
        return ""

    def _record_outcome(self, lease: Lease, rewards: tuple[float, ...]) -> None:
        """Update the prompt's zero-variance streak with a resolved group's rewards; journal it if it changed."""
        if self.history is None:
            return
        key = history_key(self.source, Problem(lease.index, lease.prompt, lease.answer))
        streak = self.history.record(key, is_zero_variance(rewards))
        if streak is not None:
            self.log_record({"k": "streak", "p": key, "n": streak})

    def _reject(self, reason: str) -> PushReply:
        self.counters[f"rejected_{reason}"] += 1
        return PushReply(False, reason)

    def log_record(self, record: dict[str, Any]) -> None:
        """Append `record` to the journal, if there is one."""
        if self.journal is not None:
            self.journal.append(record)


def batch_reply(step: int, taken: list[Queued] | None, dropped: int) -> bytes:
    """The encoded BatchReply for a take_batch result (ready iff groups were taken)."""
    groups = [memoryview(q.payload)[q.trajectories_at :] for q in taken] if taken is not None else []
    return ingest.encode_batch_reply(step, groups, dropped, taken is not None)
