"""Learning-rate schedules of `optim.sched`: constant, cosine, length_decay (ALGORITHMS.md, "Length-decay LR";
docs/algorithms.md, "Optimizer and LR schedules" and "Length-decay LR: details").

Steps are the trainer's 0-based train steps; call `lr(step, mean_response_len)` once per step, in order, before
that step's update (length_decay is stateful). A repeated call for the same step returns the same value.
Every schedule starts with a linear warmup over `optim.warmup_steps`: lr * min(1, (step + 1) / warmup_steps),
so step 0 already moves.

length_decay (length-decay paper alg. 1 and sec. 3.3), with the paper's step t = step + 1 (alg. 1 runs t = 1..T):
- the surge test at step t uses the mean response length of the batch trained at t (known before its update):
  baseline = mean of the lengths of t = 1..k, window = mean of t-k+1..t, surge when t > k and
  window >= surge_factor * baseline (k = surge_window); the first such t is t_s;
- decay_period = round(1.8 * t_s) (sec. 4.2) unless optim.decay_period > 0;
- at every t >= t_s with t % decay_period == 0: lr = max(lr / 2, lr_min), lr_min = lr_min_ratio * lr_0
  (alg. 1: absolute multiples of the period, so the first halving at t = decay_period when it exceeds t_s).
  Before the surge the LR stays lr_0 even with an explicit decay_period (sec. 3.3: decay starts on the trigger).
"""

from __future__ import annotations

import math
from typing import Any

from common.config import SCHEDULES, OptimConfig


class LrSchedule:
    def __init__(self, cfg: OptimConfig, total_steps: int) -> None:
        if cfg.sched not in SCHEDULES:
            raise ValueError(f"unknown optim.sched {cfg.sched!r} (choose from {', '.join(SCHEDULES)})")
        self.cfg = cfg
        self.total_steps = total_steps
        self.lr_min = cfg.lr_min_ratio * cfg.lr
        self.decayed_lr = cfg.lr  # length_decay: lr_0 halved so far (before warmup)
        self.surge_step: int | None = None  # trainer step (0-based) at which the surge was detected
        self.decay_period: int | None = None  # halving period in paper steps t, set at the surge
        self.baseline_lens: list[float] = []  # response lengths of the first k steps
        self.recent_lens: list[float] = []  # response lengths of the last k steps
        self.last_step = -1
        self.last_lr = cfg.lr

    def lr(self, step: int, mean_response_len: float | None = None) -> float:
        """The learning rate of train step `step` (0-based); length_decay needs this step's mean response length."""
        if step == self.last_step:
            return self.last_lr
        if step != self.last_step + 1:
            raise ValueError(
                f"LrSchedule.lr called for step {step} after step {self.last_step}: call every step in order"
            )
        self.last_step = step
        self.last_lr = self._warmup(step) * self._base_lr(step, mean_response_len)
        return self.last_lr

    def _warmup(self, step: int) -> float:
        warmup = self.cfg.warmup_steps
        return min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0

    def _base_lr(self, step: int, mean_response_len: float | None) -> float:
        cfg = self.cfg
        if cfg.sched == "constant":
            return cfg.lr
        if cfg.sched == "cosine":  # lr_0 at the end of warmup, 0 at step total_steps
            progress = (step - cfg.warmup_steps) / max(1, self.total_steps - cfg.warmup_steps)
            return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, progress))))
        if mean_response_len is None:
            raise ValueError("optim.sched=length_decay needs the step's mean response length")
        t = step + 1  # alg. 1 counts steps from 1
        self._observe_length(t, float(mean_response_len))
        if self.decay_period is not None and t % self.decay_period == 0:
            self.decayed_lr = max(self.decayed_lr / 2, self.lr_min)
        return self.decayed_lr

    def _observe_length(self, t: int, length: float) -> None:
        k = self.cfg.surge_window
        if len(self.baseline_lens) < k:
            self.baseline_lens.append(length)
        self.recent_lens = (self.recent_lens + [length])[-k:]
        if self.surge_step is not None or t <= k:
            return
        baseline = sum(self.baseline_lens) / k
        if sum(self.recent_lens) / k >= self.cfg.surge_factor * baseline:
            self.surge_step = t - 1
            self.decay_period = self.cfg.decay_period if self.cfg.decay_period > 0 else max(1, round(1.8 * t))

    def metrics(self) -> dict[str, float]:
        """`lr/surge_step` (-1 before the surge) and `lr/decay_period` (0 before the surge), for length_decay."""
        if self.cfg.sched != "length_decay":
            return {}
        surge = -1 if self.surge_step is None else self.surge_step
        return {"lr/surge_step": float(surge), "lr/decay_period": float(self.decay_period or 0)}

    def state_dict(self) -> dict[str, Any]:
        return {
            "decayed_lr": self.decayed_lr,
            "surge_step": self.surge_step,
            "decay_period": self.decay_period,
            "baseline_lens": list(self.baseline_lens),
            "recent_lens": list(self.recent_lens),
            "last_step": self.last_step,
            "last_lr": self.last_lr,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.decayed_lr = state["decayed_lr"]
        self.surge_step = state["surge_step"]
        self.decay_period = state["decay_period"]
        self.baseline_lens = list(state["baseline_lens"])
        self.recent_lens = list(state["recent_lens"])
        self.last_step = state["last_step"]
        self.last_lr = state["last_lr"]
