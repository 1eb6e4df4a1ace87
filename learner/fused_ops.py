"""RMSNorm and SwiGLU of the learner's model as one C++ pass each, forward and backward (`learner.fused_ops`).

HF's `LlamaRMSNorm` is five torch ops forward (`pow`, `mean`, `rsqrt`, two `mul`s) and autograd runs about twice as
many backward; its MLP's `act_fn(gate_proj(x)) * up_proj(x)` is `silu` and `mul` forward and three passes backward,
and saves `silu(gate)` beside `gate` and `up`. Each op is a pass over activations that no longer sit in cache: on
the ~100M decode shape of `asyncrl bench e2e` (931-token micro-batches of a 1024 x 2816 Llama) a profiled step
spent 1.4 s of 18.8 s in them, 0.34 s fused; unprofiled, the step went from 15.02 to 14.68 s (docs/kernels.md).
`csrc/train_ops.cpp` computes each in one pass over its rows (RMSNorm's backward: the input gradient and per-block
partial sums of the weight gradient, summed here), and the MLP saves `gate` and `up` only.

`use_fused_ops(model)` moves every module of the families whose forward is HF's Llama formula (`FAMILIES`: Llama,
Mistral, Qwen2, Qwen3, SmolLM3) onto a subclass that runs the fused op (a class swap, as `learner.fp32_gemm` does:
parameters, state-dict keys and hooks unchanged), after checking, module by module, that the fused forward gives
the module's own values on a probe input (a module whose forward differs, another activation say, keeps its own).
At a call, anything else takes the module's own forward: another dtype or device, a DTensor or another tensor
subclass. Under CPU autocast (`precision.train` bf16 or fp16) the ops run in fp32 on the inputs upcast
(`learner.fp32_gemm.fp32_kernel_inputs`): HF's ops would run the MLP product in bf16, several passes each.

Numerics: fp32 throughout, each element's arithmetic in a fixed order (the same bits on every ISA and thread
count); they differ from torch's ops in rounding only (the norm's sums run in 8 lanes; the sigmoid's exp is Cephes'
expf polynomial, within 2 ulp): against float64, errors of the same size as torch's (tests/unit/learner).
"""

from __future__ import annotations

from typing import Any

import torch

from learner.fp32_gemm import fp32_kernel_inputs
from learner.fused_attention import use_fused_attention
from learner.native_ops import ISAS, LIBRARY, best_isa, kernel_isa, lib

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "smollm3")
"""transformers model families (`transformers.models.<family>`) whose RMSNorm and MLP classes the swap may take."""
PROBE_ROWS = 3
"""Rows of the probe input on which a class's fused forward must give the module's own values."""
PROBE_RTOL = 1e-4
"""Relative and absolute tolerance of the probe: fp32 rounding passes, another formula (activation, scale) fails."""


def _isa(isa: int | None) -> int:
    if isa is None:
        return best_isa()
    if not 0 <= isa <= best_isa():
        raise ValueError(f"fused ops ISA {isa}: this CPU runs 0..{best_isa()} ({', '.join(ISAS[: best_isa() + 1])})")
    return isa


class _RmsNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, isa: int) -> torch.Tensor:  # noqa: ANN001
        x, weight = x.contiguous(), weight.contiguous()
        dim = x.shape[-1]
        rows = x.numel() // dim
        out, rstd = torch.empty_like(x), torch.empty(rows, dtype=torch.float32)
        lib().to_rms_norm(isa, x.data_ptr(), rows, dim, weight.data_ptr(), eps, out.data_ptr(), rstd.data_ptr(),
                           torch.get_num_threads())  # fmt: skip
        ctx.save_for_backward(x, weight, rstd)
        ctx.isa = isa
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:  # noqa: ANN001
        x, weight, rstd = ctx.saved_tensors
        grad = grad.contiguous()
        ops = lib()
        dim = x.shape[-1]
        rows = x.numel() // dim
        grad_x = torch.empty_like(x)
        partial = torch.empty((ops.to_norm_partial_rows(rows), dim), dtype=torch.float32)
        ops.to_rms_norm_backward(ctx.isa, grad.data_ptr(), x.data_ptr(), weight.data_ptr(), rstd.data_ptr(), rows,
                                 dim, grad_x.data_ptr(), partial.data_ptr(), torch.get_num_threads())  # fmt: skip
        return grad_x, partial.sum(0), None, None


class _SwigluFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, isa: int) -> torch.Tensor:  # noqa: ANN001
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        lib().to_swiglu(isa, gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(), torch.get_num_threads())
        ctx.save_for_backward(gate, up)
        ctx.isa = isa
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # noqa: ANN001
        gate, up = ctx.saved_tensors
        grad = grad.contiguous()
        grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
        lib().to_swiglu_backward(ctx.isa, grad.data_ptr(), gate.data_ptr(), up.data_ptr(), grad_gate.data_ptr(),
                                  grad_up.data_ptr(), gate.numel(), torch.get_num_threads())  # fmt: skip
        return grad_gate, grad_up, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, isa: int | None = None) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2, -1) + eps)) in one pass (fp32 CPU tensors), differentiable in x and weight;
    `isa`: the vector path (an index of `ISAS`; default the best here)."""
    if x.shape[-1] != weight.numel():
        raise ValueError(f"rms_norm: input width {x.shape[-1]} against a weight of {weight.numel()}")
    return _RmsNormFn.apply(x, weight, eps, _isa(isa))


def swiglu(gate: torch.Tensor, up: torch.Tensor, isa: int | None = None) -> torch.Tensor:
    """silu(gate) * up in one pass (fp32 CPU tensors of one shape), differentiable in both; `isa` as `rms_norm`'s."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    return _SwigluFn.apply(gate, up, _isa(isa))


class FusedRMSNorm(torch.nn.Module):
    """Mixin of a swapped RMSNorm class (`use_fused_ops`): HF's formula in one pass where it applies."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inputs = fp32_kernel_inputs(x, self.weight) if x.numel() else None
        if inputs is not None:
            return rms_norm(*inputs, float(self.variance_epsilon))
        return super().forward(x)


class FusedMLP(torch.nn.Module):
    """Mixin of a swapped MLP class (`use_fused_ops`): down_proj(silu(gate_proj(x)) * up_proj(x)), the product in
    one pass where it applies."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        inputs = fp32_kernel_inputs(gate, up) if gate.numel() and gate.shape == up.shape else None
        if inputs is not None:
            return self.down_proj(swiglu(*inputs))
        return self.down_proj(self.act_fn(gate) * up)


_FUSED_CLASSES: dict[type, type] = {}
"""Each swapped class's fused subclass, made once."""


def _family(cls: type) -> str:
    parts = cls.__module__.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["transformers", "models"] else ""


def _mixin(cls: type) -> type[torch.nn.Module] | None:
    if _family(cls) not in FAMILIES:
        return None
    if cls.__name__.endswith("RMSNorm"):
        return FusedRMSNorm
    if cls.__name__.endswith("MLP"):
        return FusedMLP
    return None


def _probe_matches(module: torch.nn.Module, fused_cls: type) -> bool:
    """Whether the module gives its own values under `fused_cls` on a random (PROBE_ROWS, in) input (the global RNG
    forked: dropout draws alike in both forwards, and training's random stream is left as it was)."""
    weight, gate_proj = getattr(module, "weight", None), getattr(module, "gate_proj", None)
    width = weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() == 1 else None
    width = getattr(gate_proj, "in_features", None) if width is None else width
    if not isinstance(width, int) or not all(p.dtype == torch.float32 for p in module.parameters()):
        return False
    x = torch.randn(PROBE_ROWS, width, generator=torch.Generator().manual_seed(0))
    own_cls = type(module)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            state = torch.random.get_rng_state()
            own = module(x)
            torch.random.set_rng_state(state)
            module.__class__ = fused_cls
            fused = module(x)
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return False
    finally:
        module.__class__ = own_cls
    return bool(own.shape == fused.shape and torch.allclose(fused, own, rtol=PROBE_RTOL, atol=PROBE_RTOL))


def _fused_class(module: torch.nn.Module) -> type | None:
    """The fused subclass `module` may be moved onto: of a class of `FAMILIES`, and its fused forward giving the
    module's own values on the probe (per module: an MLP's activation comes from its config)."""
    cls = type(module)
    mixin = _mixin(cls)
    if mixin is None:
        return None
    if cls not in _FUSED_CLASSES:
        _FUSED_CLASSES[cls] = type(f"Fused{cls.__name__}", (mixin, cls), {"__module__": __name__})
    return _FUSED_CLASSES[cls] if _probe_matches(module, _FUSED_CLASSES[cls]) else None


def use_fused_ops(model: torch.nn.Module, enabled: bool = True) -> dict[str, Any]:
    """With `enabled` and the library built: swap every RMSNorm and MLP module of `FAMILIES` whose class passes the
    probe onto its fused subclass, and move the model's SDPA attention onto the fused one (`learner.fused_attention`,
    where its CPU runs it). Returns what was done: modules swapped, the library's ISA (`kernel_isa`), and whether
    attention moved."""
    if not enabled:
        return {"swapped": 0, "isa": "off", "attention": False}
    attention = use_fused_attention(model)
    if LIBRARY.get() is None:
        return {"swapped": 0, "isa": "unavailable", "attention": attention}
    swapped = 0
    for module in model.modules():
        fused_cls = _fused_class(module)
        if fused_cls is not None:
            module.__class__ = fused_cls
            swapped += 1
    return {"swapped": swapped, "isa": kernel_isa(), "attention": attention}
