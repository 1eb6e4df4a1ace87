"""One published weight version as an engine receives it. Producer: `quant_sync` (transport, exporters);
consumer: every rollout engine's `stage_weights`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from quant_sync.adapter_buffers import PooledAdapters


@dataclass(slots=True)
class WeightUpdate:
    """A complete set of engine weights for one version (quantized linears plus full-precision rest)."""

    version: int
    tensors: dict[str, torch.Tensor]
    scheme: str
    pooled: PooledAdapters | None = None
    """An adapter-only version written into a pooled buffer (`quant_sync.export.decode_pooled_adapters`): its
    tensors are among `tensors`, valid while this object is held. A holder that keeps any of them keeps this too."""
    base: WeightUpdate | None = None
    """With `pooled`: the pinned base version whose tensors complete `tensors` (the same objects)."""
