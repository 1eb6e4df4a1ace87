"""Rollout-aligned learner forward (QaRL sec. 3, `learner.rollout_aligned = true`).

The decoder's linear layers (the ones quant_sync quantizes, `quant_sync.export.is_quantized_linear`) run their
forward on the rollout's quantized operands, computed by quant_sync's quantizer, so the learner's pi_theta is the
very function the rollout engine samples from:

- W8A8 (`int8`, `fp8`, `fp8_trunc`): `quantized_linear(x, quantize_weight(W))`: per-token quantized activations
  times the per-channel quantized weight, exactly the engine's arithmetic;
- weight-only (`w8a16`, `w4a16`): `x @ dequantize_published(quantize_weight_only(W))^T` in fp32, like the engine.

Backward is the straight-through estimator with a full-precision backward (QaRL: "we execute the forward pass in
low bit while keeping the backward pass in full precision"): the quantizers count as the identity, so
`dL/dx = g @ W` and `dL/dW = g^T @ x` with the fp32 master weight W and the layer's input x.

Operands are cached per weight version: `install_operands` hands each layer the tensors just published to the
rollout workers (from `quant_sync.export.export_rollout_tensors`), and the next forwards use those very tensors;
a layer whose master weight changed since (an optimizer step without publication, e.g. between PPO minibatches)
quantizes it again with the same quantizer. With FSDP2 the weight a layer sees in forward is re-gathered every
time, so the cache is off there and each forward quantizes (the same function of the same values: the same bits).
The aligned layers compute in fp32 under any autocast (`precision.train`), as the rollout does.

Under LoRA (`learner.lora_base = rollout`, learner/lora.py) the frozen base linears are aligned layers and peft's
adapters wrap them: the base's operands are installed once, from version 0, and never change (no gradient reaches
the frozen weight; the straight-through backward still gives the adapters below their input gradient).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from common.config import QUANT_SCHEMES
from quant_sync.export import base_weight_name, is_quantized_linear
from quant_sync.quantizers import (
    WEIGHT_ONLY_BITS,
    QuantizedWeight,
    dequantize_published,
    quantize_weight,
    quantize_weight_only,
    quantized_linear,
)

ALIGNED_SCHEMES = tuple(scheme for scheme in QUANT_SCHEMES if scheme != "none")
Operand = QuantizedWeight | torch.Tensor  # W8A8 weight, or the fp32 dequantized weight-only matrix


def quantize_operand(weight: torch.Tensor, scheme: str) -> Operand:
    """The forward operand the rollout engine builds from this weight (quant_sync's quantizers, nothing else)."""
    if scheme in WEIGHT_ONLY_BITS:
        q, scale = quantize_weight_only(weight.detach(), scheme)
        return dequantize_published(q, scale, scheme)
    return quantize_weight(weight.detach(), scheme)


def aligned_linear_forward(x: torch.Tensor, operand: Operand, bias: torch.Tensor | None) -> torch.Tensor:
    """The rollout engine's linear: W8A8 through `quantized_linear`, weight-only as an fp32 matmul."""
    if isinstance(operand, QuantizedWeight):
        return quantized_linear(x, operand, bias)
    return F.linear(x.to(torch.float32), operand, None if bias is None else bias.to(torch.float32))


class _AlignedLinearFn(torch.autograd.Function):
    """Forward on the quantized operand; straight-through, full-precision backward to x, W and b."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x, weight, bias, operand):  # noqa: ANN001, ANN205 - autograd.Function signature
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return aligned_linear_forward(x, operand, bias)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        x, weight = ctx.saved_tensors
        grad_out = grad_out.to(torch.float32)
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None  # (..., in)
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = grad_out.reshape(-1, grad_out.shape[-1]).t() @ x.reshape(-1, x.shape[-1])  # (out, in)
        grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


class AlignedLinear(torch.nn.Linear):
    """An `nn.Linear` (same parameters, same state-dict keys) whose forward runs on the rollout's operands."""

    scheme: str
    aligned: bool
    cache: bool

    def enable(self, scheme: str, cache: bool) -> None:
        self.scheme, self.aligned, self.cache = scheme, True, cache
        self._operand: Operand | None = None
        self._operand_key: tuple[int, int] | None = None
        self.quantize_calls = 0

    def _weight_key(self) -> tuple[int, int]:
        return (self.weight._version, self.weight.data_ptr())

    def operand(self) -> Operand:
        """The cached operand if the master weight has not changed since it was made, else a fresh one."""
        if self.cache and self._operand is not None and self._operand_key == self._weight_key():
            return self._operand
        self.quantize_calls += 1
        operand = quantize_operand(self.weight, self.scheme)
        if self.cache:
            self._operand, self._operand_key = operand, self._weight_key()
        return operand

    def install(self, operand: Operand) -> None:
        """Use `operand` (made from the current master weight) for the forwards until the weight changes."""
        if self.cache:
            self._operand, self._operand_key = operand, self._weight_key()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.aligned:
            return super().forward(x)
        return _AlignedLinearFn.apply(x, self.weight, self.bias, self.operand())


def make_rollout_aligned(model: torch.nn.Module, scheme: str, cache: bool = True, head: bool = False) -> int:
    """Turn the quantized linears of `model` into AlignedLinear in place (parameters kept); returns how many.

    `head`: the LM head is quantized in rollout too (`quant.lm_head`), so it runs aligned as well (a tied head keeps
    sharing its weight with the embedding: the lookup stays full precision, the head's product is quantized)."""
    if scheme not in ALIGNED_SCHEMES:
        raise ValueError(
            f"learner.rollout_aligned needs a quantized quant.scheme ({', '.join(ALIGNED_SCHEMES)}), got {scheme!r}"
        )
    count = 0
    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear and is_quantized_linear(base_weight_name(name) + ".weight", head):
            module.__class__ = AlignedLinear
            module.enable(scheme, cache)
            count += 1
    if count == 0:
        raise ValueError("learner.rollout_aligned: the model has no decoder linear layers quant_sync quantizes")
    return count


def aligned_layers(model: torch.nn.Module) -> Iterator[tuple[str, AlignedLinear]]:
    for name, module in model.named_modules():
        if isinstance(module, AlignedLinear):
            yield name, module


def install_operands(model: torch.nn.Module, published: dict[str, torch.Tensor], scheme: str) -> None:
    """Make the tensors just published (export_rollout_tensors) the operands of the next aligned forwards (a peft
    model's layers by their base model's names: the frozen base under LoRA adapters, learner/lora.py)."""
    for name, module in aligned_layers(model):
        name = base_weight_name(name)
        q, scale = published[name + ".weight"], published[name + ".weight_scale"]
        if scheme in WEIGHT_ONLY_BITS:
            module.install(dequantize_published(q, scale, scheme))
        else:
            module.install(QuantizedWeight(q=q, scale=scale, scheme=scheme))


@contextlib.contextmanager
def full_precision(model: torch.nn.Module) -> Iterator[None]:
    """Run the aligned layers as plain fp32 linears inside this block (e.g. for the full-precision evaluation)."""
    layers = [module for _, module in aligned_layers(model)]
    for module in layers:
        module.aligned = False
    try:
        yield
    finally:
        for module in layers:
            module.aligned = True
