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
