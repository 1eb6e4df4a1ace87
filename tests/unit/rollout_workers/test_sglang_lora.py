"""`rollout.backend: sglang` with `model.lora.rank > 0`, against `asyncrl serve --enable-lora` in a real subprocess:
the base is loaded once, every version's adapters go through `/load_lora_adapter` as a peft directory, samples name
the newest adapter in `lora_path` and their tokens carry its version, old adapters are unloaded once unused and
outside the newest `max_lag + 1`, a relaunched server gets the base and the newest adapter again; the log-probs are
peft's on the same base and adapters (fp32, <= 1e-5)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from common.builtin_model import resolve_model_path
from common.config import load_config
from quant_sync.export import LORA_A, LORA_B, LORA_SCALING, base_weight_name, export_rollout_tensors
from quant_sync.update import WeightUpdate
from rollout_workers.engine import SamplingParams
from rollout_workers.sections import EngineSections
from rollout_workers.sglang_api.backend import SGLangEngine, server_command
from rollout_workers.sglang_api.checkpoint import read_tensors
from rollout_workers.sglang_api.lora_sync import write_adapter_dir

PROMPT = [3, 4, 10, 5, 12]
TOL = 1e-5
RANK = 4


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(resolve_model_path("builtin:micro", log=lambda *a: None))


def config(tmp_path, *overrides: str):
    return load_config(None, ["model.path=builtin:micro", "rollout.backend=sglang", "rollout.sglang.launcher=asyncrl",
                              f"rollout.sglang.ckpt_dir={tmp_path}", "rollout.sglang.startup_timeout_s=120",
                              "quant.scheme=none", f"model.lora.rank={RANK}", *overrides])  # fmt: skip


def peft_model(model_dir: str, seed: int):
    """The micro model with peft adapters on every decoder linear (random non-zero A and B), as the learner has."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=8, target_modules=targets))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return model.eval()


def published_adapters(model) -> dict[str, torch.Tensor]:
    """The adapters as the learner publishes them (learner/lora.py): base-model names, A, B, scaling."""
    from peft.tuners.lora import LoraLayer

    tensors = {}
    for name, layer in model.named_modules():
        if isinstance(layer, LoraLayer):
            module = base_weight_name(name)
            tensors[module + LORA_A] = layer.lora_A["default"].weight.detach().clone()
            tensors[module + LORA_B] = layer.lora_B["default"].weight.detach().clone()
            tensors[module + LORA_SCALING] = torch.tensor([layer.scaling["default"]], dtype=torch.float32)
    return tensors


def reference(model, completion) -> torch.Tensor:
    tokens = list(completion.response_ids)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([PROMPT + tokens])).logits[0], -1)
    positions = torch.arange(len(PROMPT) - 1, len(PROMPT) + len(tokens) - 1)
    return logp[positions, torch.tensor(tokens)]


def wait_for(predicate, timeout_s: float = 60, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def check(engine: SGLangEngine, model, version: int) -> None:
    params = SamplingParams(max_new_tokens=8, stop_token_ids=(-1,), seed=3)
    for completion in engine.generate([PROMPT] * 2, params):
        assert completion.versions == [version] * 8  # every token from the adapter of `version`
        served = torch.tensor(completion.behav_logp)
        assert (served - reference(model, completion)).abs().max() <= TOL


def test_server_command_has_sglangs_lora_flags(tmp_path):
    cfg = config(tmp_path, "model.lora.targets=[q_proj,v_proj]")
    for launcher in ("sglang", "asyncrl"):
        cfg.rollout.sglang.launcher = launcher
        command = server_command(EngineSections.pick(cfg), "/ckpt/base", 30001, "0", seed=7)
        start = command.index("--enable-lora")
        assert command[start:start + 6] == ["--enable-lora", "--max-lora-rank", "4", "--lora-target-modules",
                                            "q_proj", "v_proj"]  # fmt: skip


def test_peft_directory_of_published_adapters_loads_with_peft(model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = peft_model(model_dir, seed=4)
    path = write_adapter_dir(tmp_path / "lora-v3", published_adapters(model), model_dir)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), path)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, model(ids).logits)
    with pytest.raises(ValueError, match="one peft LoraConfig needs one rank"):
        tensors = published_adapters(model)
        tensors["model.layers.0.mlp.up_proj" + LORA_SCALING] = torch.tensor([0.5])
        write_adapter_dir(tmp_path / "bad", tensors, model_dir)


@pytest.mark.slow  # two server starts (launch, relaunch)
def test_adapter_versions_go_through_sglangs_lora_api(model_dir, tmp_path):
    floats = {name: tensor.to(torch.float32) for name, tensor in read_tensors(model_dir).items()}
    base = export_rollout_tensors(floats, "none")  # version 0's base; later versions reuse these tensor objects
    engine = SGLangEngine(EngineSections.pick(config(tmp_path, "staleness.max_lag=0")), model_dir, seed=0)
    try:
        model0, model1 = peft_model(model_dir, seed=0), peft_model(model_dir, seed=1)
        engine.stage_weights(WeightUpdate(0, {**base, **published_adapters(model0)}, "none"))
        wait_for(lambda: engine.version >= 0, what=str(engine.stats()))
        check(engine, model0, 0)
        engine.stage_weights(WeightUpdate(1, {**base, **published_adapters(model1)}, "none"))
        wait_for(lambda: engine.version >= 1, what=str(engine.stats()))
        check(engine, model1, 1)
        stats = engine.stats()
        assert stats["sglang_weight_updates"] == 1 and stats["sglang_lora_loads"] == 2  # the base once
        wait_for(lambda: engine.stats()["sglang_lora_unloads"] == 1, what="v0 unloaded (max_lag + 1 = 1 kept)")
        assert sorted(p.name for p in engine.root.glob("lora-v*")) == ["lora-v1"]
        # the server dies: the relaunched one gets the base (its launch checkpoint) and the newest adapter again
        os.kill(engine.server_pid, signal.SIGKILL)
        check(engine, model1, 1)
        assert engine.stats()["sglang_server_restarts"] == 1 and engine.stats()["sglang_lora_loads"] == 3
    finally:
        engine.close()
    assert not engine.root.exists()
