"""Activation checkpointing (`learner.gradient_checkpointing`, learner/recompute.py): the layers' forward runs again in
backward, fewer activations are saved, and the learner takes the same steps as without it."""

from __future__ import annotations

import pytest
import torch
from tiny_learner import random_groups, tiny_batch, tiny_model

from common.builtin_model import resolve_model_path
from common.config import load_config, to_dict
from learner.batch import micro_batch_budget, token_logp
from learner.recompute import CheckpointingUnsupported, enable_gradient_checkpointing, is_checkpointed
from learner.sections import LearnerSections
from learner.trainer import Learner


def _learner(*overrides: str) -> Learner:
    model_dir = str(resolve_model_path("builtin:micro", log=lambda *_: None))
    cfg = load_config(None, ["model.path=builtin:micro", "learner.threads=1", "learner.micro_batch_tokens=4096",
                             "algo.filter_groups=false", *overrides])  # fmt: skip
    return Learner(to_dict(LearnerSections.pick(cfg)), model_dir, "tcp://127.0.0.1:9")  # fetch is replaced below


def _steps(learner: Learner, steps: int) -> tuple[list[dict[str, float]], int]:
    """`steps` train steps on the same groups as any other learner gets; (metrics, the first layer's first norm's
    calls with grad: a recomputation stops after the layer's last saved tensor, so a module further on may not run)."""
    calls = []
    norm = next(module for name, module in learner.model.named_modules() if name.endswith("layers.0.input_layernorm"))
    hook = norm.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    try:
        history = []
        for step in range(steps):
            groups = random_groups(learner.model.config.vocab_size, [step, max(step - 1, 0)])
            learner.fetch = lambda _step, groups=groups: (groups, 0, 0.0)
            history.append(learner.train_step(step))
    finally:
        hook.remove()
    return history, sum(calls)


@pytest.mark.parametrize("lora", [False, True])
def test_a_checkpointed_learner_recomputes_its_layers_and_takes_the_same_steps(lora):
    extra = ("model.lora.rank=4", "quant.scheme=int8") if lora else ()
    plain, checkpointed = _learner(*extra), _learner(*extra, "learner.gradient_checkpointing=true")
    try:
        assert not is_checkpointed(plain.model) and is_checkpointed(checkpointed.model)
        plain_history, plain_calls = _steps(plain, 2)
        history, calls = _steps(checkpointed, 2)
        assert calls == 2 * plain_calls > 0  # every forward with grad ran the layer once more, in backward
        for mine, theirs in zip(history, plain_history, strict=True):
            for key in ("loss", "grad_norm", "entropy"):
                assert mine[key] == theirs[key], key
        for (name, param), other in zip(checkpointed.model.named_parameters(), plain.model.parameters(), strict=True):
            assert torch.equal(param, other), name  # the same kernels on the same values: bit for bit
    finally:
        plain.close()
        checkpointed.close()


def test_checkpointed_layers_save_only_their_inputs_and_the_auto_micro_batch_grows_by_it():
    def saved_bytes(model: torch.nn.Module) -> int:
        sizes = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            sizes.append(tensor.numel() * tensor.element_size())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):  # the checkpoint's own are inner
            logp, _ = token_logp(model, tiny_batch(seed=1, groups=2, group_size=8), 1.0, share_prefix=False)
        logp.sum().backward()
        return sum(sizes)

    plain, checkpointed = tiny_model(seed=2, hidden=64, layers=6), tiny_model(seed=2, hidden=64, layers=6)
    enable_gradient_checkpointing(checkpointed)
    plain_bytes, checkpointed_bytes = saved_bytes(plain), saved_bytes(checkpointed)
    assert checkpointed_bytes < plain_bytes / 4, (checkpointed_bytes, plain_bytes)
    for name, param in checkpointed.named_parameters():
        torch.testing.assert_close(param.grad, dict(plain.named_parameters())[name].grad, rtol=0.0, atol=0.0)
    assert micro_batch_budget(0, checkpointed) > 3 * micro_batch_budget(0, plain)  # 6 layers: about 4.6x


def test_a_model_without_transformers_checkpointing_is_refused_by_name():
    with pytest.raises(CheckpointingUnsupported, match=r"learner.gradient_checkpointing: Linear does not support it"):
        enable_gradient_checkpointing(torch.nn.Linear(2, 2))
