"""`EnvMetrics`: the multi-turn episode metrics of a step from the supervisor's counter totals."""

from __future__ import annotations

import math

from asyncrl.metrics import EnvMetrics


def test_episode_metrics_are_per_interval_and_errors_are_run_totals():
    view = EnvMetrics()
    assert view.update({"tokens": 100.0, "env_episodes": 0.0}) == {}  # single-turn run: no env/ metrics
    totals = {"env_episodes": 10.0, "env_turns": 15.0, "env_tool_calls": 5.0, "env_masked_tokens": 25.0,
              "tokens": 75.0, "env_errors": 1.0, "env_timeouts": 0.0, "env_groups_dropped": 0.0}  # fmt: skip
    first = view.update(totals)
    assert first["env/episodes"] == 10 and first["env/turns_mean"] == 1.5 and first["env/tool_calls"] == 0.5
    assert first["env/masked_share"] == 0.25 and first["env/errors"] == 1.0
    totals.update(env_episodes=20.0, env_turns=35.0, env_tool_calls=15.0, env_masked_tokens=25.0, tokens=125.0,
                  env_errors=3.0)  # fmt: skip
    second = view.update(totals)
    assert second["env/turns_mean"] == 2.0 and second["env/tool_calls"] == 1.0
    assert second["env/masked_share"] == 0.0 and second["env/errors"] == 3.0
    assert math.isnan(view.update(totals)["env/turns_mean"])  # no episode in this interval
