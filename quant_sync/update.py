"""One published weight version as an engine receives it. Producer: `quant_sync` (transport, exporters);
consumer: every rollout engine's `stage_weights`."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class WeightUpdate:
    """A complete set of engine weights for one version (quantized linears plus full-precision rest)."""

    version: int
    tensors: dict[str, torch.Tensor]
    scheme: str
