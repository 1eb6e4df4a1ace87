"""The ACRL reference discrepancy X (ACRL eq. 6): the one piece of ACRL state that outlives a train step.

Per train step, before the loss:

    group_y = group_discrepancy(behav_logp, prox_logp, mask, group_index)  # (n_groups,) Y_g, whole batch
    x = reference.update_and_get(group_y)
    LossInputs(..., group_index=group_index, acrl_x=x, acrl_y=group_y)  # the same Y for every minibatch

Modes (`loss.acrl`):
- `x > 0`: X is that number, always (it wins over `x_mode`; nothing is measured).
- `x_mode = first_batch` (the paper): X = mean over the groups of the first batch's Y_g, frozen afterwards.
  A first batch without measurable mismatch (X <= weightings.ACRL_X_MIN) leaves ACRL at alpha = 0 for the run.
- `x_mode = ema`: X starts like first_batch, then X <- decay * X + (1 - decay) * mean_g Y_g every step,
  this step's batch included (the paper's sec. 6 suggestion for very long runs).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from common.config import AcrlConfig


class AcrlReference:
    def __init__(self, cfg: AcrlConfig) -> None:
        self.cfg = cfg
        self.measured_x: float | None = None  # None until the first batch (and always with the x override)

    def update_and_get(self, group_discrepancies: torch.Tensor) -> float:
        """Fold this step's Y_g (n_groups,) into the reference and return X; call once per train step."""
        if self.cfg.x > 0:
            return self.cfg.x
        batch_x = float(group_discrepancies.mean())  # eq. 6: mean over groups of Y_g
        if not math.isfinite(batch_x):  # a non-finite forward (its step is skipped): X would stay NaN for the run
            return self.measured_x if self.measured_x is not None else batch_x
        if self.measured_x is None:
            self.measured_x = batch_x
        elif self.cfg.x_mode == "ema":
            self.measured_x = self.cfg.ema_decay * self.measured_x + (1.0 - self.cfg.ema_decay) * batch_x
        return self.measured_x

    def state_dict(self) -> dict[str, Any]:
        return {"measured_x": self.measured_x}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.measured_x = state["measured_x"]
