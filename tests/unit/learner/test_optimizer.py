"""The learner's AdamW (`learner/optimizer.py`): fused where torch's kernel applies, the same update as the loop to
rounding, and stepped one parameter at a time by `step_measuring_update` with the update sums of one whole step."""

from __future__ import annotations

import torch

from common.config import load_config
from learner.optimizer import adamw, fusable
from learner.update import _snapshot, _update_sums, step_measuring_update, steps_per_parameter


def _params(seed: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((64, 48), (48,), (3, 5, 7))]


def _grads(params: list[torch.nn.Parameter], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)


def test_fused_adamw_takes_the_loops_steps_to_rounding() -> None:
    optim = load_config(None, ["optim.lr=1e-2", "optim.weight_decay=0.1", "optim.betas=[0.8,0.95]"]).optim
    fused_params, loop_params = _params(0), _params(0)
    fused = adamw(fused_params, optim)
    loop = torch.optim.AdamW(loop_params, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    assert fused.param_groups[0]["fused"] is True and not loop.param_groups[0].get("fused")
    for step in range(6):
        _grads(fused_params, step)
        _grads(loop_params, step)
        fused.step()
        loop.step()
    for got, expected, start in zip(fused_params, loop_params, _params(0)):
        assert (got - start).abs().mean() > 1e-2  # the weights moved
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_what_the_fused_kernel_cannot_step_keeps_the_loop() -> None:
    optim = load_config(None, []).optim
    cpu, meta = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, device="meta"))
    assert fusable([cpu]) and not fusable([])
    assert not fusable([meta]) and not fusable([cpu, meta])  # another device; two devices
    assert adamw([torch.nn.Parameter(torch.zeros(2, device="meta"))], optim).param_groups[0]["fused"] is None


def test_a_fused_optimizer_stepped_per_parameter_is_one_fused_step_with_its_update_sums() -> None:
    optim = load_config(None, ["optim.lr=1e-2"]).optim
    whole_params, split_params = _params(1), _params(1)
    whole, split = adamw(whole_params, optim), adamw(split_params, optim)
    assert steps_per_parameter(split)
    model = torch.nn.Module()
    model.weights = torch.nn.ParameterList(split_params)
    for step in range(3):
        _grads(whole_params, step)
        _grads(split_params, step)
        before = _snapshot(model)
        whole.step()
        sums = step_measuring_update(split, model)
        for got, expected in zip(split_params, whole_params):
            assert torch.equal(got, expected)  # the fused kernel is elementwise: per parameter, bit for bit
        assert torch.equal(sums, _update_sums(model, before))
