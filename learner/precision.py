"""Training precision (`precision.train`): fp32 master weights, autocast compute, dynamic loss scaling for fp16.

The recipe of mixed-precision training (and of the FP16 paper, sec. 3.2): parameters, gradients and AdamW state stay in
fp32 (the master weights); forwards and backwards run under `torch.autocast(device, dtype)` (`cpu`, or `cuda` for a GPU
learner) so matmuls compute in bf16 or fp16. Log-softmax and the loss run in fp32 (autocast's fp32 list, and
`token_logp` upcasts the logits). Both autocast dtypes work on CPU with torch >= 2.6; on CPUs without bf16 / fp16 matrix
units the GEMMs are emulated (several times slower than fp32: `asyncrl bench learner`), so on such machines they buy
numerics, not speed. The proximal forward runs in the same precision as the current one, so that r = exp(lc - lp) is
exactly 1 before the first update (a precision gap between them would masquerade as policy change).

fp16's 5-bit exponent underflows small gradients, hence dynamic loss scaling (`LossScaler`): the loss is
multiplied by `scale` before backward and the gradients divided by it before clipping; a step whose gradients are
not finite is skipped and the scale halved; after `growth_interval` clean steps in a row the scale doubles.
Scales are powers of two, so scaling and unscaling are exact.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MIN_LOSS_SCALE = 2.0**-24
MAX_LOSS_SCALE = 2.0**64


def compute_dtype(precision: str) -> torch.dtype:
    """The autocast dtype of `precision.train`."""
    if precision not in COMPUTE_DTYPES:
        raise ValueError(f"precision.train must be one of {', '.join(COMPUTE_DTYPES)}, got {precision!r}")
    return COMPUTE_DTYPES[precision]


def autocast(precision: str, device_type: str = "cpu") -> contextlib.AbstractContextManager[Any]:
    """Autocast to the compute dtype of `precision` for the model's `device_type` (`cpu`, or `cuda` for a GPU learner:
    `learner.devices`); a no-op context for fp32."""
    dtype = compute_dtype(precision)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


@dataclass(slots=True)
class LossScaler:
    """Dynamic loss scaling: scale the loss up, skip and halve on non-finite gradients, double after clean runs.

    A pure component: the caller reports each optimizer step's outcome with `update(finite)`. Disabled (fp32, bf16)
    it keeps scale 1 and never changes it.
    """

    scale: float = 2.0**16
    growth_interval: int = 2000
    enabled: bool = True
    clean_steps: int = 0
    """Consecutive finite steps since the last change of scale."""
    skipped: int = 0
    """Steps skipped for non-finite gradients, over the scaler's life."""

    def __post_init__(self) -> None:
        if not self.enabled:
            self.scale = 1.0
        if self.scale <= 0 or self.growth_interval < 1:
            raise ValueError(f"need loss scale > 0 and growth interval >= 1, got {self.scale}, {self.growth_interval}")

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    @torch.no_grad()
    def unscale_(self, params: Iterable[torch.Tensor]) -> None:
        """Divide every gradient by the scale in place (exact: scales are powers of two)."""
        if not self.enabled or self.scale == 1.0:
            return
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, finite: bool) -> None:
        """Record one optimizer step: halve the scale on a non-finite one, double it after `growth_interval` clean."""
        if not self.enabled:
            self.skipped += 0 if finite else 1
            return
        if not finite:
            self.scale = max(self.scale * 0.5, MIN_LOSS_SCALE)
            self.clean_steps = 0
            self.skipped += 1
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale = min(self.scale * 2.0, MAX_LOSS_SCALE)
            self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped, "enabled": self.enabled}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped = state["skipped"]
        if self.enabled and state.get("enabled", True):  # an fp16 run resumed from an fp32/bf16 checkpoint keeps its
            self.scale, self.clean_steps = state["scale"], state["clean_steps"]  # loss_scale_init; a disabled one 1
