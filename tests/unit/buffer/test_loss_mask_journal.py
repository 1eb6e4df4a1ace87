"""Multi-turn trajectories through a real buffer process (issue 21): the loss mask travels untouched, survives a
SIGKILL and the journal's replay, staleness counts the model tokens, and older schemas are refused on the wire but
upgraded from a journal."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import msgpack
import numpy as np
import pytest
from test_service import make_group, write_config

from buffer import ingest
from buffer.client import BufferClient
from buffer.launcher import start_service, stop_service
from common import wire

MASK = np.array([1, 1, 0, 0, 1], dtype=np.uint8)


def multi_turn_group(lease: wire.PromptLease, version: int = 0) -> list[wire.Trajectory]:
    """make_group's trajectories, the second a 5-token episode whose middle tokens are an observation appended after
    a weight swap (version + 1, as the worker tags them), and its last model token sampled on the new version."""
    group = make_group(lease, version)
    traj = group[1]
    traj.response_ids = np.arange(5, dtype=np.int32)
    traj.behav_logp = np.array([-0.5, -0.25, 0.0, 0.0, -1.0], dtype=np.float32)
    traj.versions = np.array([version, version, version + 1, version + 1, version + 1], dtype=np.int32)
    traj.loss_mask = MASK
    return group


def test_a_masked_group_is_journaled_and_replayed_with_its_mask(tmp_path: Path) -> None:
    values = json.loads(write_config(tmp_path / "config.json").read_text())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc, endpoint = start_service(values, run_dir)
    worker = BufferClient(endpoint, "w0", timeout_s=10.0)
    learner = BufferClient(endpoint, "learner", timeout_s=30.0)
    try:
        leases, _ = worker.lease(2)
        for lease in leases:
            assert worker.push_group(lease.group, multi_turn_group(lease)).reason == ""
        proc.send_signal(signal.SIGKILL)  # acknowledged means journaled: the replay must give the masks back
        proc.wait()
        port = int(endpoint.rsplit(":", 1)[1])
        proc, endpoint = start_service({**values, "buffer": {**values["buffer"], "port": port}}, run_dir)
        # staleness is the oldest model token's (version 0): at step 1, 1 - 0 = 1 <= staleness.max_lag = 1
        reply = learner.fetch_batch(1, 2, wait_s=10.0)
        assert reply.ready and len(reply.groups) == 2 and reply.dropped_stale == 0
        for group in reply.groups:
            single, multi = group
            assert single.loss_mask is None
            assert multi.loss_mask is not None and multi.loss_mask.tolist() == MASK.tolist()
            assert multi.versions.tolist() == [0, 0, 1, 1, 1]
            assert multi.behav_logp.tolist() == [-0.5, -0.25, 0.0, 0.0, -1.0]
    finally:
        worker.close()
        learner.close()
        stop_service(proc)


def test_schema_2_is_refused_on_the_wire_and_upgraded_from_a_journal() -> None:
    lease = wire.PromptLease("g0", 0, "1+1=", "2", 0.0)
    group = make_group(lease)
    current = msgpack.unpackb(wire.encode(wire.PushGroup("w0", "g0", group)))
    columns = {k: v for k, v in current["trajectories"].items() if k not in ("mask_len", "loss_mask")}
    old = msgpack.packb({**current, "v": 2, "trajectories": columns})
    with pytest.raises(wire.WireError) as err:
        wire.decode(old)
    assert err.value.reason == "schema_version" and "no per-token loss mask" in str(err.value)
    upgraded = wire.decode(ingest.upgrade_push(old))
    assert isinstance(upgraded, wire.PushGroup)
    assert [t.loss_mask for t in upgraded.trajectories] == [None, None]
    assert [t.response_ids.tolist() for t in upgraded.trajectories] == [t.response_ids.tolist() for t in group]


@pytest.mark.parametrize(
    ("mask", "detail"),
    [
        (np.array([1, 0, 2, 1, 1], dtype=np.uint8), "above 1"),
        (np.zeros(5, dtype=np.uint8), "no model token"),
    ],
)
def test_a_bad_mask_is_rejected(mask: np.ndarray, detail: str) -> None:
    lease = wire.PromptLease("g0", 0, "1+1=", "2", 0.0)
    group = multi_turn_group(lease)
    group[1].loss_mask = mask
    with pytest.raises(wire.WireError) as err:
        wire.decode(wire.encode(wire.PushGroup("w0", "g0", group)))
    assert err.value.reason == "bad_mask" and detail in str(err.value)
    with pytest.raises(wire.WireError) as err:  # the single-message path checks the same
        wire.decode(wire.encode(group[1]))
    assert err.value.reason == "bad_mask"


def test_a_mask_of_another_length_is_rejected() -> None:
    lease = wire.PromptLease("g0", 0, "1+1=", "2", 0.0)
    group = multi_turn_group(lease)
    raw = msgpack.unpackb(wire.encode(wire.PushGroup("w0", "g0", group)))
    raw["trajectories"]["mask_len"] = np.array([0, 4], "<i4").tobytes()
    raw["trajectories"]["loss_mask"] = bytes([1, 1, 0, 1])
    with pytest.raises(wire.WireError) as err:
        wire.decode(msgpack.packb(raw))
    assert err.value.reason == "bad_mask"
