"""The staleness rule, table-driven, plus a simulated run that checks the bound it promises."""

from __future__ import annotations

import pytest

from buffer.staleness import is_admissible, may_lease, requested_limit, staleness


@pytest.mark.parametrize(
    ("step", "max_lag", "groups_per_step", "live", "expected"),
    [
        (0, 0, 4, 0, 4),  # synchronous: one batch worth
        (0, 0, 4, 4, 0),
        (1, 0, 4, 4, 4),  # step 0 consumed: the next batch may start
        (0, 1, 4, 0, 8),  # the docstring's worked example
        (0, 1, 4, 8, 0),
        (1, 1, 4, 8, 4),
        (1, 1, 4, 12, 0),
        (1, 1, 4, 10, 2),
        (5, 2, 3, 0, 24),
        (5, 2, 3, 30, 0),  # more live than allowed (max_lag lowered live): never negative
        (0, 3, 1, 2, 2),
    ],
)
def test_may_lease(step: int, max_lag: int, groups_per_step: int, live: int, expected: int) -> None:
    assert may_lease(step, max_lag, groups_per_step, live) == expected


@pytest.mark.parametrize(
    ("step", "oldest_version", "max_lag", "expected"),
    [
        (0, 0, 0, True),
        (1, 0, 0, False),  # synchronous: only the current version
        (1, 1, 0, True),
        (2, 0, 1, False),  # worked example
        (2, 1, 1, True),
        (10, 7, 3, True),
        (10, 6, 3, False),
        (3, 4, 0, True),  # a version from the future is not stale (admission checks the future separately)
    ],
)
def test_is_admissible(step: int, oldest_version: int, max_lag: int, expected: bool) -> None:
    assert is_admissible(step, oldest_version, max_lag) is expected


def test_helpers() -> None:
    assert requested_limit(2, 1, 4) == 16
    assert staleness(5, 3) == 2


@pytest.mark.parametrize("max_lag", [0, 1, 2, 4])
def test_throttle_bounds_staleness_in_a_simulated_run(max_lag: int) -> None:
    """Workers generate as fast as allowed with the latest published version; nothing is ever too stale."""
    batch = 3
    published, consumed = 0, 0
    queue: list[int] = []  # oldest version of each queued group
    for step in range(20):
        grant = may_lease(step, max_lag, batch, live_groups=len(queue) + consumed)
        queue.extend([published] * grant)
        assert len(queue) >= batch
        taken, queue = queue[:batch], queue[batch:]
        assert all(is_admissible(step, version, max_lag) for version in taken)
        assert max(staleness(step, version) for version in taken) <= max_lag
        consumed += batch
        published = step + 1  # train step k publishes version k + 1
