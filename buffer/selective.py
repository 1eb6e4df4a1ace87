"""Selective rollout (GRESO, "Act Only When It Pays", 2025): do not generate groups that dynamic sampling would filter.

The buffer keeps, for every prompt text, its zero-variance streak: how many of its most recent groups had all
rewards equal (a group with differing rewards resets it to 0). When the cursor reaches a problem whose prompt has a
streak `z > 0`, the problem is leased only with probability

    p(z) = max(skip_min_prob, skip_base ** z)        (z = 0: p = 1)

and otherwise skipped: the cursor moves on, nothing is generated for it, `skipped_prompts` counts it. p falls with
the streak and never reaches 0, so a solved (or hopeless) prompt stops costing generation while one that becomes
informative again is still drawn now and then, and its first mixed group brings it back for good (streak 0). GRESO
skips with probability `1 - p_e ** z`; we keep its `p_e` fixed (`algo.skip_base`) instead of adapting it to a
target zero-variance share, and floor the lease probability at `algo.skip_min_prob`.

Determinism: the draw for problem `index` is a pure function of (seed, index), a blake2b digest (a counter-based
generator), so a replayed or resumed buffer takes the same decision for the same problem and streak, and nothing but
the streaks needs journaling. A prompt is keyed by a 64-bit digest of its text, so the same prompt met again (a
dataset's next epoch, or a generated stream that repeats it) shares its history; a prompt source may key its
problems otherwise with a `history_key(problem) -> str` method (`history_key` below).

The streaks live in the journal as `streak` records (one per change) and in a compacted journal's `state` record
(buffer/journal.py), so a restarted or resumed buffer keeps them. At most `MAX_TRACKED_PROMPTS` prompts are tracked
(the least recently updated one is forgotten first: it is then leased as a fresh prompt).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from common.tasks import Problem, PromptSource

MAX_TRACKED_PROMPTS = 1 << 18
"""Most prompts whose streak is kept; past it the least recently updated is forgotten (`skip_forgotten_prompts`)."""
MAX_SKIPS_PER_LEASE = 4096
"""Most problems one LeaseRequest may skip: the request is answered with what it got (the worker asks again)."""


@dataclass(frozen=True, slots=True)
class SkipRule:
    """The lease probability of a prompt by its zero-variance streak (module doc)."""

    base: float
    """`algo.skip_base`: p(z) = base ** z before the floor (GRESO's exploration probability p_e)."""
    min_prob: float
    """`algo.skip_min_prob`: the floor, > 0, so no prompt is skipped for ever."""

    def __post_init__(self) -> None:
        if not 0.0 < self.min_prob <= 1.0 or not 0.0 <= self.base <= 1.0:
            raise ValueError(f"skip rule needs 0 < min_prob <= 1 and 0 <= base <= 1, got {self.min_prob}, {self.base}")

    def lease_probability(self, streak: int) -> float:
        """p(z) = max(min_prob, base ** z); 1 for a prompt without a zero-variance streak."""
        if streak <= 0:
            return 1.0
        return max(self.min_prob, self.base**streak)


def prompt_key(prompt: str) -> int:
    """The 64-bit key of a prompt's history: a blake2b digest of its text (stable across processes and runs)."""
    return int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "little")


def history_key(source: PromptSource, problem: Problem) -> int:
    """The key of `problem`'s history: its prompt's, or, for a source with a `history_key(problem) -> str` method,
    the key of the text that method returns (a generated task whose prompts seldom repeat may group them by the
    generator's settings)."""
    custom = getattr(source, "history_key", None)
    return prompt_key(custom(problem) if custom is not None else problem.prompt)


def uniform_draw(seed: int, index: int) -> float:
    """A uniform number in [0, 1) for problem `index` of the stream of `seed`: a pure function of both."""
    digest = hashlib.blake2b(f"asyncrl-skip/{seed}/{index}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) * 2.0**-53


def is_zero_variance(rewards: Sequence[float]) -> bool:
    """Whether a group carries no signal: every reward equal (the test of `algo.filter_groups`)."""
    return len(set(rewards)) == 1


class PromptHistory:
    """Zero-variance streaks by prompt key, and the lease decision they drive (module doc)."""

    def __init__(self, rule: SkipRule, seed: int) -> None:
        self.rule = rule
        self.seed = seed
        self.streaks: dict[int, int] = {}  # prompt key -> streak > 0, least recently updated first
        self.forgotten = 0

    def streak(self, key: int) -> int:
        return self.streaks.get(key, 0)

    def should_lease(self, key: int, index: int) -> bool:
        """Whether problem `index` (prompt `key`) is leased: always for streak 0, else with probability p(streak)."""
        streak = self.streaks.get(key, 0)
        return streak == 0 or uniform_draw(self.seed, index) < self.rule.lease_probability(streak)

    def record(self, key: int, zero_variance: bool) -> int | None:
        """A finished group of prompt `key`: its streak grows by one, or resets to 0. The new streak if it changed
        (to journal), else None."""
        old = self.streaks.pop(key, 0)
        new = old + 1 if zero_variance else 0
        self.set(key, new)
        return None if new == old else new

    def set(self, key: int, streak: int) -> None:
        """Set a streak (0 removes the prompt); forgets the least recently updated prompt past MAX_TRACKED_PROMPTS."""
        self.streaks.pop(key, None)
        if streak <= 0:
            return
        self.streaks[key] = streak
        while len(self.streaks) > MAX_TRACKED_PROMPTS:
            del self.streaks[next(iter(self.streaks))]
            self.forgotten += 1

    def snapshot(self) -> list[list[int]]:
        """[[key, streak], ...] in update order: what a compacted journal's `state` record keeps."""
        return [[key, streak] for key, streak in self.streaks.items()]

    def restore(self, pairs: list[Any]) -> None:
        """Replace the streaks with a snapshot's pairs (in their order)."""
        self.streaks.clear()
        for key, streak in pairs:
            self.set(int(key), int(streak))


def rollout_metrics(stats: dict[str, Any], last: dict[str, float]) -> dict[str, float]:
    """Per-step selective-rollout metrics from two buffer `stats()` snapshots; `last` holds (and is updated to) the
    totals of the previous call (empty at first: the totals so far count as this interval).

    `rollout/filtered_share`: groups filtered for zero variance / groups completed (pushed and resolved: admitted,
    filtered or dropped as stale) over the interval (NaN when none completed); `rollout/skipped_prompts`: problems
    skipped at lease time over the interval; `rollout/screened_prompts`: leases that workers resolved ungenerated
    over the interval (`algo.skip_predicted`, rollout_workers/screening.py); `rollout/skip_tracked_prompts`: prompts
    with a streak now; `staleness/dropped`: groups dropped as too stale over the interval, both those refused when
    pushed and those dropped from the queue when the learner fetched (the learner's own figure counts only the latter).
    """
    keys = ("filtered_groups", "completed_groups", "skipped_prompts", "screened_groups", "dropped_stale")
    totals = {key: float(stats.get(key, 0)) for key in keys}
    delta = {key: totals[key] - last.get(key, 0.0) for key in keys}
    last.update(totals)
    completed = delta["completed_groups"]
    return {
        "rollout/filtered_share": delta["filtered_groups"] / completed if completed > 0 else math.nan,
        "rollout/skipped_prompts": delta["skipped_prompts"],
        "rollout/screened_prompts": delta["screened_groups"],
        "rollout/skip_tracked_prompts": float(stats.get("skip_tracked_prompts", 0)),
        "staleness/dropped": delta["dropped_stale"],
    }
