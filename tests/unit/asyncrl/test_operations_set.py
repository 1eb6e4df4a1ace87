"""`asyncrl set` between two step boundaries: a key named again replaces its pending value, and setting it back to
the applied value cancels the pending change (Operations.set with the driver's real validation, `live_update`)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

from asyncrl.operations import ControlError, Operations, OperationsSections
from common.config import live_update, load_config

ROOT = Path(__file__).resolve().parents[3]


def _operations() -> Operations:
    """Operations with what `set` reads (the sections, the validation, the pending changes, the step); its sockets
    and processes play no part in `set`."""
    cfg = load_config(str(ROOT / "configs" / "dapo_int8.yaml"))
    ops = Operations.__new__(Operations)
    ops.sections, ops.check_live, ops.pending, ops.step = OperationsSections.pick(cfg), partial(live_update, cfg), {}, 5
    return ops


def test_setting_a_key_back_before_the_boundary_cancels_the_pending_change() -> None:
    ops = _operations()
    assert ops.set(["loss.eps_low=0.3"]) == {"changes": {"loss.eps_low": 0.3}, "applies_at_step": 6}
    assert ops.set(["loss.eps_low=0.25"])["changes"] == {"loss.eps_low": 0.25}
    assert ops.pending == {"loss.eps_low": 0.25}
    assert ops.set(["loss.eps_low=0.2", "optim.lr=5e-5"])["changes"] == {"loss.eps_low": 0.2, "optim.lr": 5e-5}
    assert ops.pending == {"optim.lr": 5e-5}  # 0.2 is the applied value: nothing is left to apply for eps_low
    assert ops.set(["loss.eps_low=0.2"])["changes"] == {}  # already applied and nothing pending: no change
    with pytest.raises(ControlError, match="out of range"):
        ops.set(["loss.eps_low=2"])
    assert ops.pending == {"optim.lr": 5e-5}
