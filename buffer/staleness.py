"""The staleness rule (AReaL, ALGORITHMS.md "Staleness (AReaL)"), in one place.

Version 0 is the initial model and train step `k` publishes version `k + 1`. A group whose oldest token was
produced by weight version `v` may train at step `k` only if `k - v <= max_lag`. Two consequences, used by the
buffer service:

1. Throttle (`may_lease`): by train step `k` no more than `(k + max_lag + 1) * B` groups may ever have been
   requested, `B = train.groups_per_step`. "Requested" counts the groups that are live: leased and in flight, or
   admitted (queued or already consumed by the learner). Groups that left without being trained (dropped by the
   dynamic-sampling filter, dropped as stale, leases that expired) do not count: they are replaced by new leases,
   otherwise the learner would wait forever for groups that the throttle never lets anyone generate.
2. Admission (`is_admissible`): a group that is still too old when the learner asks for step `k` is dropped and
   counted, never trained.

Worked example, `B = 4`, `max_lag = 1`:

    learner step k   allowed (k + 2) * 4   live groups   may_lease
    0 (start)        8                     0             8      workers generate 8 groups on version 0
    0                8                     8             0      throttled: 8 live (queued or in flight)
    1 (fetched 4)    12                    8             4      4 consumed at step 0 + 4 queued; 4 more may go
    1                12                    12            0      those 4 leased: throttled again
    1                12                    10            2      2 groups dropped as stale stop counting

    At step 2 a group with oldest version 0 has staleness 2 - 0 = 2 > 1: dropped. Oldest version 1: 1 <= 1: kept.

`max_lag = 0` is synchronous RL with the same code: `B` groups per step, all generated on the current version.
"""

from __future__ import annotations


def requested_limit(step: int, max_lag: int, groups_per_step: int) -> int:
    """Most groups that may ever have been requested by train step `step`: `(step + max_lag + 1) * B`."""
    return (step + max_lag + 1) * groups_per_step


def may_lease(step: int, max_lag: int, groups_per_step: int, live_groups: int) -> int:
    """How many more groups may be leased now (>= 0).

    `live_groups` = leased and in flight + admitted (queued or consumed); filtered, stale-dropped and expired
    groups are not live.
    """
    return max(0, requested_limit(step, max_lag, groups_per_step) - live_groups)


def staleness(step: int, oldest_version: int) -> int:
    """Staleness of a sample at train step `step`: `step - oldest_version` (negative for a future version)."""
    return step - oldest_version


def is_admissible(step: int, oldest_version: int, max_lag: int) -> bool:
    """Whether a group whose oldest token has version `oldest_version` may train at step `step`."""
    return staleness(step, oldest_version) <= max_lag
