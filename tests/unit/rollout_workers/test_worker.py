"""The rollout worker against a real buffer process: what it cannot generate or push is counted and skipped, and
the rest of its batch goes on."""

from __future__ import annotations

import math

import pytest

from buffer.client import BufferClient
from buffer.launcher import start_service, stop_service
from common.builtin_model import resolve_model_path
from common.config import Config, load_config, to_dict
from common.wire import PromptLease
from quant_sync.export import export_rollout_tensors
from quant_sync.update import WeightUpdate
from rollout_workers.sections import WorkerSections
from rollout_workers.worker import RolloutWorker


@pytest.fixture
def worker_and_buffer(tmp_path):
    cfg: Config = load_config(None, ["train.group_size=2", "train.groups_per_step=2", "staleness.max_lag=50"])
    values = to_dict(cfg)
    (tmp_path / "run").mkdir()
    proc, endpoint = start_service(values, tmp_path / "run")
    sections = to_dict(WorkerSections.pick(cfg))
    worker = RolloutWorker(sections, "w0", str(resolve_model_path(cfg.model.path)), endpoint)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(cfg.model.path))
    worker.engine.stage_weights(WeightUpdate(0, export_rollout_tensors(model.state_dict(), "int8"), "int8"))
    client = BufferClient(endpoint, "w0", timeout_s=5.0)
    try:
        yield worker, client
    finally:
        client.close()
        stop_service(proc)


def test_a_prompt_too_long_for_the_engine_is_skipped_and_the_others_generated(worker_and_buffer):
    worker, client = worker_and_buffer
    leases, _ = client.lease(2)
    room = worker.engine.max_seq_len - worker.sections.rollout.max_new_tokens
    too_long = PromptLease(leases[1].group, leases[1].index, "1+" * room + "1=", "x", leases[1].deadline)
    groups = worker.rollout([leases[0], too_long])
    assert [lease.group for lease, _ in groups] == [leases[0].group] and len(groups[0][1]) == 2
    assert worker.counters["prompts_skipped"] == 1
    assert "do not fit the engine's max sequence length" in worker.last_error


def test_a_group_the_buffer_refuses_to_decode_is_counted_and_dropped(worker_and_buffer):
    worker, client = worker_and_buffer
    leases, _ = client.lease(2)
    (bad, trajectories), (good, good_trajectories) = worker.rollout(leases)
    for trajectory in trajectories:  # a reward function gone wrong: the buffer answers with an ErrorReply
        object.__setattr__(trajectory, "reward", math.nan)
    worker._push(client, bad, trajectories)  # must not raise: the worker loop would die
    assert worker.counters["groups_refused"] == 1 and "nonfinite_reward" in worker.last_error
    worker._push(client, good, good_trajectories)
    assert worker.counters["groups_pushed"] == 1 and client.stats()["queued_groups"] == 1


def test_continuous_rollout_fills_freed_slots_with_new_leases_and_pushes_each_group_as_it_ends(tmp_path):
    """`rollout.continuous`: 2 groups of 2 kept in flight; the built-in model's answers end after 1-5 digits, so groups
    end at different steps: each is pushed as it ends and a new lease is submitted while another group still decodes
    (the batch loop submits only to an idle engine)."""
    import threading
    import time

    from rollout_workers.continuous import run_continuous

    overrides = ["rollout.continuous=true", "rollout.groups_per_lease=2", "rollout.max_new_tokens=8"]
    cfg = load_config(None, ["train.group_size=2", "train.groups_per_step=2", "staleness.max_lag=50", *overrides])
    (tmp_path / "run").mkdir()
    proc, endpoint = start_service(to_dict(cfg), tmp_path / "run")
    worker = RolloutWorker(to_dict(WorkerSections.pick(cfg)), "w0", str(resolve_model_path(cfg.model.path)), endpoint)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(cfg.model.path))
    worker.engine.stage_weights(WeightUpdate(0, export_rollout_tensors(model.state_dict(), "int8"), "int8"))
    busy_at_submit: list[int] = []
    submit = worker.engine.submit
    worker.engine.submit = lambda *a, **k: busy_at_submit.append(worker.engine.num_active) or submit(*a, **k)
    loop_client, client = BufferClient(endpoint, "w0"), BufferClient(endpoint, "test", timeout_s=5.0)
    loop = threading.Thread(target=run_continuous, args=(worker, loop_client, 0))
    try:
        loop.start()
        deadline = time.monotonic() + 60
        while client.stats()["queued_groups"] < 8:
            assert time.monotonic() < deadline and loop.is_alive(), (worker.counters, worker.last_error)
            time.sleep(0.05)
        worker._stop.set()
        loop.join(timeout=30)
        assert not loop.is_alive()
        assert any(active > 0 for active in busy_at_submit), busy_at_submit
        pushed = worker.counters["groups_pushed"]
        assert pushed >= 8 and worker.counters["errors"] == 0, worker.last_error
        assert worker.counters["samples"] == 2 * pushed and 2 * pushed <= worker.counters["tokens"] <= 16 * pushed
        assert worker.engine.num_active == 0  # the groups still in flight at the stop were aborted
        reply = client.fetch_batch(0, 4, wait_s=5.0)  # the buffer's groups: whole, of version 0
        assert [len(group) for group in reply.groups] == [2, 2, 2, 2]
        assert all(set(t.versions) == {0} and len(t.behav_logp) == len(t.response_ids) for g in reply.groups for t in g)
    finally:
        worker._stop.set()
        loop.join(timeout=30)
        loop_client.close()
        client.close()
        stop_service(proc)
