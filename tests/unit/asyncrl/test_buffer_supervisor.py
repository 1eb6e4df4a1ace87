"""`BufferSupervisor` with a real buffer process: a SIGKILLed buffer is restarted on its run directory and port (a
`buffer_restarted` event says how it died and what was replayed); past `buffer.max_restarts` the run fails with a
one-line reason."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from asyncrl.supervise import BufferSupervisor, SupervisionError
from buffer.client import BufferClient
from common.config import Config, to_dict


def _values(max_restarts: int) -> dict[str, Any]:
    values = to_dict(Config())
    values["train"].update(groups_per_step=2, group_size=2)
    values["data"].update(task="arith", digits=2)
    values["buffer"].update(max_restarts=max_restarts, reserve_mb=0)
    return values


def test_a_killed_buffer_is_restarted_on_its_endpoint_until_max_restarts(tmp_path: Path) -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    lines: list[str] = []
    supervisor = BufferSupervisor(_values(1), tmp_path, lambda kind, **f: events.append((kind, f)), lines.append)
    endpoint = supervisor.start()
    try:
        with BufferClient(endpoint, "w0", timeout_s=10.0) as client:
            assert len(client.lease(2)[0]) == 2
            first = supervisor.pid
            supervisor.proc.send_signal(signal.SIGKILL)
            supervisor.proc.wait()
            supervisor.poll()
            assert supervisor.pid != first and supervisor.endpoint == endpoint
            kind, fields = events[-1]
            assert kind == "buffer_restarted" and fields["exit"] == "killed by SIGKILL" and fields["restarts"] == 1
            assert fields["replayed_leases"] == 2 and fields["downtime_s"] >= 0
            assert client.stats()["returned_groups"] == 2  # the same client, on the same endpoint

            supervisor.proc.send_signal(signal.SIGKILL)
            supervisor.proc.wait()
            with pytest.raises(SupervisionError) as failed:
                supervisor.poll()
        message = str(failed.value)
        assert "\n" not in message and "killed by SIGKILL" in message and "`buffer.max_restarts` (1)" in message
        assert events[-1][0] == "buffer_crashed"
    finally:
        supervisor.stop()


def test_a_buffer_whose_journal_cannot_be_written_is_not_restarted(tmp_path: Path) -> None:
    """It was restarted `buffer.max_restarts` times within a second, each failing the same way on the full disk."""
    import subprocess
    import sys

    from buffer.launcher import EXIT_JOURNAL_UNWRITABLE, stop_service

    events: list[tuple[str, dict[str, Any]]] = []
    supervisor = BufferSupervisor(_values(3), tmp_path, lambda kind, **f: events.append((kind, f)), lambda line: None)
    supervisor.start()
    try:
        stop_service(supervisor.proc)
        supervisor.proc = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({EXIT_JOURNAL_UNWRITABLE})"])
        supervisor.proc.wait()
        with pytest.raises(SupervisionError, match="its journal in .* cannot be written"):
            supervisor.poll()
        assert events[-1][0] == "buffer_crashed" and events[-1][1]["restart"] is False
        assert not [kind for kind, _ in events if kind == "buffer_restarted"]
    finally:
        supervisor.stop()
