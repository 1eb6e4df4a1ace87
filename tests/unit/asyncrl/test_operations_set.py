"""The driver's Operations with real validation (`live_update`) and a real buffer socket: `asyncrl set` between two
step boundaries (a key named again replaces its pending value; set back to the applied value, it cancels it), and
`status` when the buffer does not answer."""

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


def test_status_answers_without_the_buffer_s_counters_when_the_buffer_does_not_answer() -> None:
    """A stopped buffer (`kill -STOP`) held `status` for the buffer client's 10 s, the driver's loop with it, and the
    CLI gave up first calling the driver busy; it waits STATUS_BUFFER_S and says the buffer is unavailable."""
    import zmq

    from asyncrl.control import format_status
    from asyncrl.operations import STATUS_BUFFER_S
    from buffer.client import BufferClient

    silent = zmq.Context.instance().socket(zmq.ROUTER)  # takes requests, answers none
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    ops = _operations()
    ops.status_buffer = BufferClient(f"tcp://127.0.0.1:{port}", identity="driver-status", timeout_s=STATUS_BUFFER_S)
    try:
        stats = ops._buffer_stats()  # returns once its own client gives up (STATUS_BUFFER_S), not the driver's 10 s
        assert stats == {"unavailable": f"no answer within {STATUS_BUFFER_S:g} s (BufferUnavailable)"}
        assert "buffer: unavailable (no answer within" in format_status(
            {"run": "r", "step": 1, "steps": 2, "version": 1, "workers": [], "buffer": stats}
        )
    finally:
        ops.status_buffer.close()
        silent.close(0)
