"""The buffer's bookkeeping, without sockets: prompt leases, group admission, staleness, batches, journal replay.

Life of a group (its id is `g<index>` of the problem it was leased for, the same id if the lease is reissued):

    cursor ──lease──▶ leased ──push ok──▶ queued ──fetch──▶ consumed
                        │  ▲                 └──too stale at fetch──▶ dropped (counted)
             deadline   ▼  │ reissued first
                      returned            push: filtered (all rewards equal) or already stale ──▶ resolved, counted

A push of a returned (expired) lease is still accepted; whichever push of a group id comes first is admitted and
any later one is answered `duplicate`, so a group is trained at most once. Live groups for the throttle
(`staleness.may_lease`) are leased + queued + consumed.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from asyncrl import wire
from asyncrl.tasks import PromptSource
from asyncrl.wire import BatchReply, LeaseReply, PromptLease, PushGroup, PushReply, Trajectory
from buffer import staleness
from buffer.journal import Journal

RETRY_AFTER_S = 0.1
"""What an empty LeaseReply tells workers to wait before asking again."""


@dataclass(slots=True)
class _Lease:
    group: str
    index: int
    prompt: str
    answer: str
    worker: str
    deadline: float


@dataclass(slots=True)
class _Queued:
    group: str
    trajectories: list[Trajectory]
    oldest_version: int


def group_id(index: int) -> str:
    return f"g{index}"


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
    ) -> None:
        self.source = source
        self.group_size = group_size
        self.groups_per_step = groups_per_step
        self.max_lag = max_lag
        self.filter_groups = filter_groups
        self.lease_timeout_s = lease_timeout_s
        self.max_queued_groups = max_queued_groups
        self.journal = journal
        self.step = 0  # the learner's current train step (last FetchBatch.step)
        self.cursor = 0  # next problem index of the training stream
        self.leased: dict[str, _Lease] = {}
        self.returned: OrderedDict[str, _Lease] = OrderedDict()  # expired, not reissued yet
        self.queue: deque[_Queued] = deque()
        self.resolved: set[str] = set()  # admitted, filtered or dropped: any later push is a duplicate
        self.consumed_groups = 0
        self.counters: Counter[str] = Counter()

    # -- throttle -----------------------------------------------------------------------------------------------

    def live_groups(self) -> int:
        return len(self.leased) + len(self.queue) + self.consumed_groups

    def may_lease(self) -> int:
        if len(self.queue) >= self.max_queued_groups:
            return 0
        return staleness.may_lease(self.step, self.max_lag, self.groups_per_step, self.live_groups())

    # -- requests -----------------------------------------------------------------------------------------------

    def lease(self, worker: str, max_groups: int, now: float | None = None) -> LeaseReply:
        """Up to `max_groups` leases: expired ones first, then new problems from the cursor."""
        now = time.time() if now is None else now
        budget = min(max_groups, self.may_lease(), wire.MAX_GROUP)
        granted: list[_Lease] = []
        while len(granted) < budget and self.returned:
            _, lease = self.returned.popitem(last=False)
            granted.append(lease)
            self.counters["reissued_leases"] += 1
        new_indices: list[int] = []
        while len(granted) < budget:
            try:
                problem = self.source.train(self.cursor)
            except IndexError:  # a finite stream is exhausted
                break
            granted.append(_Lease(group_id(self.cursor), self.cursor, problem.prompt, problem.answer, worker, 0.0))
            new_indices.append(self.cursor)
            self.cursor += 1
        if new_indices and self.journal is not None:
            self.journal.append({"k": "lease", "i": new_indices})
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

    def push(self, msg: PushGroup, raw: bytes | None = None, now: float | None = None) -> PushReply:
        """Admit a finished group, or say why not (the reason is counted as `rejected_<reason>`)."""
        now = time.time() if now is None else now
        group = msg.group
        if group in self.resolved:
            self.counters["duplicate_groups"] += 1
            return PushReply(True, "duplicate")
        lease = self.leased.get(group) or self.returned.get(group)
        reason = "unknown_group" if lease is None else self._check_group(msg, lease)
        if reason:
            return self._reject(reason)
        assert lease is not None
        oldest = min(int(t.versions.min()) for t in msg.trajectories)
        outcome = ""
        if not staleness.is_admissible(self.step, oldest, self.max_lag):
            outcome = "stale"
        elif self.filter_groups and len({t.reward for t in msg.trajectories}) == 1:
            outcome = "filtered"
        elif len(self.queue) >= self.max_queued_groups:
            if group in self.leased:  # the worker holds the group and will retry: keep its lease alive
                lease.deadline = now + self.lease_timeout_s
            return self._reject("backpressure")
        self.leased.pop(group, None)
        self.returned.pop(group, None)
        self.resolved.add(group)
        if outcome:
            self.counters["dropped_stale" if outcome == "stale" else "filtered_groups"] += 1
            self._log({"k": "done", "g": [group], "why": outcome})
            return PushReply(True, outcome)
        self.queue.append(_Queued(group, msg.trajectories, oldest))
        self.counters["admitted_groups"] += 1
        self._log({"k": "admit", "m": raw if raw is not None else wire.encode(msg)})
        return PushReply(True, "")

    def take_batch(self, step: int, num_groups: int) -> tuple[list[list[Trajectory]] | None, int]:
        """Record `step`, drop queued groups too stale for it; (the oldest `num_groups` groups or None, dropped)."""
        self.step = step
        dropped = self.drop_stale()
        if num_groups < 1 or len(self.queue) < num_groups:
            return None, dropped
        taken = [self.queue.popleft() for _ in range(num_groups)]
        self.consumed_groups += num_groups
        self.counters["consumed_groups"] += num_groups
        self._log({"k": "consume", "g": [q.group for q in taken], "s": step})
        return [q.trajectories for q in taken], dropped

    def requeue(self, groups: list[list[Trajectory]]) -> None:
        """Put back a batch whose reply could not be delivered, at the head of the queue."""
        for trajectories in reversed(groups):
            oldest = min(int(t.versions.min()) for t in trajectories)
            self.queue.appendleft(_Queued(trajectories[0].group, trajectories, oldest))
        self.consumed_groups -= len(groups)
        self.counters["consumed_groups"] -= len(groups)
        self.counters["requeued_groups"] += len(groups)
        self._log({"k": "requeue", "g": [g[0].group for g in groups]})

    def drop_stale(self) -> int:
        """Drop and count queued groups too old for the current step."""
        kept: deque[_Queued] = deque()
        dropped: list[str] = []
        for queued in self.queue:
            if staleness.is_admissible(self.step, queued.oldest_version, self.max_lag):
                kept.append(queued)
            else:
                dropped.append(queued.group)
        if dropped:
            self.queue = kept
            self.counters["dropped_stale"] += len(dropped)
            self._log({"k": "done", "g": dropped, "why": "stale"})
        return len(dropped)

    def expire_leases(self, now: float | None = None) -> int:
        """Move leases past their deadline to the returned queue (reissued before new problems)."""
        now = time.time() if now is None else now
        expired = [lease for lease in self.leased.values() if lease.deadline <= now]
        for lease in expired:
            del self.leased[lease.group]
            self.returned[lease.group] = lease
        self.counters["expired_leases"] += len(expired)
        return len(expired)

    def next_deadline(self) -> float | None:
        return min((lease.deadline for lease in self.leased.values()), default=None)

    def stats(self) -> dict[str, float | int]:
        out: dict[str, float | int] = dict(self.counters)
        for key in ("admitted_groups", "consumed_groups", "dropped_stale", "filtered_groups", "expired_leases"):
            out.setdefault(key, 0)
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
        )
        if self.journal is not None:
            out["journal_bytes"] = self.journal.size_bytes()
        return out

    # -- journal ------------------------------------------------------------------------------------------------

    def replay(self, records: list[dict[str, Any]], now: float | None = None) -> None:
        """Rebuild the state from journal records: unconsumed groups queued again in order, the cursor restored,
        and leases that were never resolved returned to the pool (a worker that is still alive may push them)."""
        now = time.time() if now is None else now
        admitted: dict[str, _Queued] = {}
        pending: dict[str, _Queued] = {}  # admitted, not consumed nor dropped, in admission order
        leased_indices: list[int] = []
        for record in records:
            kind, groups = record.get("k"), record.get("g", [])
            if kind == "lease":
                leased_indices.extend(record["i"])
            elif kind == "admit":
                msg = wire.decode(record["m"])
                assert isinstance(msg, PushGroup)
                oldest = min(int(t.versions.min()) for t in msg.trajectories)
                admitted[msg.group] = pending[msg.group] = _Queued(msg.group, msg.trajectories, oldest)
            elif kind in ("done", "consume"):
                self.resolved.update(groups)
                for group in groups:
                    pending.pop(group, None)
                if kind == "consume":
                    self.step = int(record["s"])
                    self.consumed_groups += len(groups)
            elif kind == "requeue":
                self.consumed_groups -= len(groups)
                pending.update((group, admitted[group]) for group in groups)
        self.resolved.update(admitted)
        self.queue = deque(pending.values())
        self.cursor = max(leased_indices, default=-1) + 1
        for index in sorted(set(leased_indices)):
            group = group_id(index)
            if group not in self.resolved:
                problem = self.source.train(index)
                self.returned[group] = _Lease(group, index, problem.prompt, problem.answer, "", now)
        self.counters["admitted_groups"] = len(admitted)
        self.counters["consumed_groups"] = self.consumed_groups
        self.counters["replayed_groups"] = len(self.queue)

    # -- helpers ------------------------------------------------------------------------------------------------

    def _check_group(self, msg: PushGroup, lease: _Lease) -> str:
        trajectories = msg.trajectories
        if len(trajectories) != self.group_size:
            return "group_size"
        if any(t.group != msg.group for t in trajectories):
            return "group_mismatch"
        if len({t.uid for t in trajectories}) != len(trajectories):
            return "duplicate_uid"
        if any(t.prompt_index != lease.index for t in trajectories):
            return "prompt_index"
        if max(int(t.versions.max()) for t in trajectories) > self.step + 1:
            return "future_version"
        return ""

    def _reject(self, reason: str) -> PushReply:
        self.counters[f"rejected_{reason}"] += 1
        return PushReply(False, reason)

    def _log(self, record: dict[str, Any]) -> None:
        if self.journal is not None:
            self.journal.append(record)


def batch_reply(step: int, groups: list[list[Trajectory]] | None, dropped: int) -> BatchReply:
    return BatchReply(step=step, groups=groups or [], dropped_stale=dropped, ready=groups is not None)
