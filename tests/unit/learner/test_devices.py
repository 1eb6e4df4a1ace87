"""`learner.device`: the config's rules, each rank's device, the process group's backend, the ranks' and the workers'
Ray GPU requests, and a learner that asks for a GPU it does not have (this machine has none: the CUDA path itself is
untested here)."""

from __future__ import annotations

import pytest
import torch

from common.config import ConfigError, load_config, to_dict
from common.local_actors import LocalActorClass
from learner.devices import CUDA_BACKEND, cpu_state, model_device, process_group_backend, rank_device
from learner.group import LearnerActor, actor_options


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["learner.device=gpu"], "`learner.device` must be cpu, cuda or cuda:N, got 'gpu'"),
        (["learner.device=cuda", "learner.rollout_aligned=true"], "does not run rollout-aligned forwards yet"),
        (["learner.device=cuda", "model.lora.rank=8"], "LoRA's `learner.lora_base=rollout`"),
    ],
)
def test_the_config_refuses_what_a_gpu_learner_cannot_do(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)


def test_the_config_takes_a_gpu_learner_with_full_precision_forwards():
    cfg = load_config(None, ["learner.device=cuda", "learner.world_size=2", "model.lora.rank=8",
                             "learner.lora_base=full", "ray.learner_gpus=2"])  # fmt: skip
    assert (cfg.learner.device, cfg.ray.learner_gpus) == ("cuda", 2.0)
    assert load_config(None, []).learner.device == "cpu"  # the default


def test_each_rank_takes_its_own_gpu(monkeypatch):
    assert rank_device("cpu", 3) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [rank_device("cuda", rank) for rank in range(4)] == [torch.device("cuda", i) for i in (0, 1, 0, 1)]
    assert [rank_device("cuda:1", 0), rank_device("cuda:0", 1)] == [torch.device("cuda", 1)] * 2  # N + rank
    with pytest.raises(RuntimeError, match=r"`learner.device=cuda:1` puts rank 1 on GPU 2, but this learner process"):
        rank_device("cuda:1", 1)


def test_a_rank_without_a_gpu_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"`learner.device=cuda` but this learner process sees no GPU") as raised:
        rank_device("cuda", 0)
    assert "`ray.learner_gpus`" in str(raised.value) and "`learner.device=cpu`" in str(raised.value)


def test_a_learner_asking_for_a_gpu_here_fails_before_loading_anything(monkeypatch):
    from common.builtin_model import resolve_model_path
    from learner.sections import LearnerSections
    from learner.trainer import Learner

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on this machine, whatever torch is installed
    model_dir = str(resolve_model_path("builtin:micro", log=lambda *_: None))
    cfg = load_config(None, ["model.path=builtin:micro", "learner.device=cuda"])
    with pytest.raises(RuntimeError, match="sees no GPU"):
        Learner(to_dict(LearnerSections.pick(cfg)), model_dir, "tcp://127.0.0.1:9")


def test_cuda_ranks_use_nccl_for_cuda_tensors_and_gloo_for_the_rest():
    assert process_group_backend(torch.device("cpu")) == "gloo"  # a CPU learner keeps gloo on a GPU machine too
    assert process_group_backend(torch.device("cuda", 1)) == CUDA_BACKEND == "cpu:gloo,cuda:nccl"


def test_gpu_ranks_ask_ray_for_their_gpus():
    ray_cfg = load_config(None, ["ray.num_cpus=4", "ray.learner_cpus=2"]).ray
    assert actor_options(ray_cfg, 2) == {"num_cpus": 1.0}  # no GPU request on cpu
    assert actor_options(ray_cfg, 2, "cuda") == {"num_cpus": 1.0, "num_gpus": 1.0}  # 0: one GPU a rank
    shared = load_config(None, ["ray.num_cpus=4", "ray.learner_cpus=2", "ray.learner_gpus=1"]).ray
    assert actor_options(shared, 2, "cuda:0") == {"num_cpus": 1.0, "num_gpus": 0.5}
    LocalActorClass(LearnerActor, actor_options(ray_cfg, 1, "cuda"))  # the local launcher takes the request too


def test_gpu_requests_go_to_ray_and_each_worker_asks_for_its_own():
    from asyncrl.supervise import worker_options
    from common import actors

    for key in ("ray.worker_gpus=1", "ray.learner_gpus=2"):  # only Ray places GPUs: auto picks it
        assert actors.resolve_launcher(load_config(None, ["ray.launcher=auto", key]).ray) == "ray"
        with pytest.raises(ConfigError, match="are Ray's GPU requests: `ray.launcher=local` places nothing"):
            load_config(None, ["ray.launcher=local", key])
    assert actors.resolve_launcher(load_config(None, ["learner.device=cuda"]).ray) == "local"  # GPU r for rank r
    ray_cfg = load_config(None, ["ray.num_cpus=4", "ray.worker_gpus=1", "ray.worker_resources={rollout_node: 0.5}"]).ray
    assert worker_options(ray_cfg) == {"num_cpus": 0.5, "max_concurrency": 4, "num_gpus": 1.0,
                                       "resources": {"rollout_node": 0.5}}  # fmt: skip
    assert "num_gpus" not in worker_options(load_config(None, []).ray)


def test_published_state_is_moved_to_the_cpu_and_models_report_their_device():
    weight = torch.ones(2, 2)
    assert cpu_state({"w": weight})["w"] is weight  # nothing copied on a CPU learner
    assert model_device(torch.nn.Linear(2, 2)) == torch.device("cpu")
    assert model_device(torch.nn.ReLU()) == torch.device("cpu")  # no parameters


def test_the_prepared_gpu_check_passes_the_cpu_against_itself_and_refuses_a_missing_gpu(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "check.json"
    done = subprocess.run([sys.executable, "-m", "learner.device_check", "--device", "cpu", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["ok"] and result["device"] == "cpu"
    assert {name: check["value"] for name, check in result["checks"].items()} == {
        "prox_logp_max_abs": 0.0,
        "loss_rel": 0.0,
        "grad_norm_rel": 0.0,
        "update_rel": 0.0,
        "bf16_update_finite": 1.0,
    }  # the same computation twice: the same bits
    if not torch.cuda.is_available():  # this machine: the check refuses, naming what is missing
        done = subprocess.run([sys.executable, "-m", "learner.device_check", "--device", "cuda"],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 2 and "sees no GPU" in done.stderr
    done = subprocess.run([sys.executable, "-m", "learner.device_check", "--device", "gpu"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 2 and "--device must be cpu, cuda or cuda:N, got 'gpu'" in done.stderr


def test_the_gpu_check_fails_when_the_two_sides_differ(monkeypatch):
    from learner import device_check

    real, calls = device_check.one_update, []

    def nudged(model, device, precision="fp32"):
        calls.append(precision)
        if len(calls) == 2:  # the checked device's side: one weight matrix moved by 0.01
            with torch.no_grad():
                model.get_input_embeddings().weight.add_(1e-2)
        return real(model, device, precision)

    monkeypatch.setattr(device_check, "one_update", nudged)
    out = device_check.compare(torch.device("cpu"))
    assert not out["ok"] and not out["checks"]["prox_logp_max_abs"]["ok"] and not out["checks"]["loss_rel"]["ok"]
