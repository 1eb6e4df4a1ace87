"""Suite-wide settings: tests marked `slow` run first and get a larger pytest-timeout limit than the default in
pyproject.toml.

The default (`timeout` in `[tool.pytest.ini_options]`, 300 s) catches a hung unit test: the slowest take tens of
seconds on 2 cores. End-to-end runs marked `slow` start Ray, the buffer process and rollout workers, and the first may
build the built-in model (minutes on 2 cores): they get SLOW_TEST_TIMEOUT_S, small enough that a hung run fails with
its stack before the whole suite's 15-minute budget is spent (at 900 s it never could).
"""

from __future__ import annotations

import pytest

SLOW_TEST_TIMEOUT_S = 600
"""pytest-timeout limit of a test marked `slow`, in seconds (unless it carries its own `timeout` mark)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Slow tests first (a stable sort: file order otherwise). pytest-xdist (`-n 2 --dist loadfile` in pyproject)
    # hands out whole files in the order their first test appears: the files with end-to-end runs, which mostly wait
    # on Ray and subprocesses, start first on both workers and the unit-test files fill the gaps at the end, instead
    # of one long run finishing alone after everything else.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if not config.pluginmanager.hasplugin("timeout"):  # `-p no:timeout`: the marker is not even registered
        return
    for item in items:
        if item.get_closest_marker("slow") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_TEST_TIMEOUT_S))
