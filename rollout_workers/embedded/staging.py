"""Weight versions handed to the embedded engine: checked on the caller's thread, built on the decode thread.

`stage` (any thread) turns a published `WeightUpdate` into the forward's weight map and checks it against the
model; a newer staged version replaces an older one not yet built. `advance` (the decode thread, between two steps)
builds the staged version (`ModelWeights.build_in_parts`: fusing q/k/v and gate/up, prepacking int8) for up to a
time budget and returns it once complete, so that a build neither pauses decoding nor fights it for the GIL from
another thread. A version whose build fails is dropped (the exception propagates; the running version stays).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import torch

from quant_sync.adapter_buffers import PooledAdapters
from quant_sync.export import LORA_A, LORA_B, LORA_SCALE, LORA_SCALING
from quant_sync.quantizers import WEIGHT_ONLY_BITS, QuantizedWeight
from quant_sync.update import WeightUpdate
from rollout_workers.embedded.model import (
    ArchConfig,
    ModelWeights,
    check_adapter_shapes,
    check_weight_shapes,
    required_weight_names,
)
from rollout_workers.embedded.weight_only import GroupQuantized

SCALE_SUFFIX = "_scale"
ADAPTER_SUFFIXES = (LORA_A, LORA_B, LORA_SCALING, LORA_A + LORA_SCALE, LORA_B + LORA_SCALE)
"""LoRA tensors: float, or int8 A and B with their scales (`decode_adapters(keep_int8=True)`), kept as they are."""


def _adapter_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A LoRA tensor as the engine stages it: int8 (kept with its scales) and float32 as they are, other floats cast."""
    return tensor if tensor.dtype in (torch.int8, torch.float32) else tensor.to(torch.float32)


def build_weight_map(update: WeightUpdate) -> dict[str, torch.Tensor | QuantizedWeight | GroupQuantized]:
    """Published tensors -> the forward's weight map: `X.weight` + `X.weight_scale` pairs become QuantizedWeight
    (W8A8) or GroupQuantized (weight-only: the engine multiplies by them without dequantizing a copy)."""
    weights: dict[str, torch.Tensor | QuantizedWeight | GroupQuantized] = {}
    for name, tensor in update.tensors.items():
        if name.endswith(ADAPTER_SUFFIXES):  # LoRA: never paired into a QuantizedWeight
            weights[name] = _adapter_tensor(tensor)
            continue
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = update.tensors.get(name + SCALE_SUFFIX)
        if scale is not None and update.scheme in WEIGHT_ONLY_BITS:
            weights[name] = GroupQuantized(q=tensor, scale=scale, scheme=update.scheme)
        elif scale is not None:
            weights[name] = QuantizedWeight(q=tensor, scale=scale, scheme=update.scheme)
        else:
            weights[name] = tensor.to(torch.float32)
    return weights


class StagedVersions:
    """The newest staged version and its build in progress (see the module docstring). Thread-safe for `stage`."""

    def __init__(self, arch: ArchConfig, dtype: torch.dtype, device: torch.device):
        self.arch, self.dtype, self.device = arch, dtype, device
        self._lock = threading.Lock()
        self._staged: tuple[int, dict, dict | None, PooledAdapters | None] | None = None
        """version, weight map, the checked base's map, the version's pooled adapters (held while staged)"""
        self._building: tuple[int, Iterator[ModelWeights | None]] | None = None
        self._build_s = 0.0
        self._base: tuple[list[tuple[str, torch.Tensor, int]], dict, dict[str, tuple[int, ...]]] | None = None
        """The base of the last LoRA version fully checked (`_remember_base`)."""
        self._base_source: WeightUpdate | None = None
        """The subscriber's pinned base version that base came from (`WeightUpdate.base`), if it said."""
        self._checked_layout: object = None
        """The adapters' names, dtypes and shapes last checked on that base, or the packed plan that fixes them (a
        pooled version's): the next version with the same skips `check_adapter_shapes` (an adapter version has ~280
        tensors, and each train step publishes one)."""
        self.last_build_s = 0.0
        """Decode-thread time the last completed build took (summed over its slices)."""
        self._last_built: tuple[dict, ModelWeights] | None = None
        """The last LoRA version built on a checked base: that base's map and its weights (the running ones, or
        about to be), which the next adapter version on the same base completes (`ModelWeights.with_adapters`)."""

    @property
    def pending(self) -> bool:
        return self._staged is not None

    def stage(self, update: WeightUpdate) -> None:
        """Check `update` against the model (KeyError / ValueError naming the weight) and stage it if newer."""
        try:
            weight_map = self._on_checked_base(update)
            if weight_map is None:
                weight_map = build_weight_map(update)
                missing = [name for name in required_weight_names(self.arch) if name not in weight_map]
                if missing:
                    raise KeyError(f"version {update.version} lacks weights: {', '.join(missing[:5])}")
                expected = check_weight_shapes(self.arch, weight_map)
                self._remember_base(update, weight_map, expected)
            base_map = None if self._base is None else self._base[1]  # a LoRA version's checked base
        except ValueError as err:
            raise ValueError(f"version {update.version} does not fit the model: {err}") from None
        with self._lock:
            if self._staged is None or update.version > self._staged[0]:
                self._staged = (update.version, weight_map, base_map, update.pooled)

    def _remember_base(self, update: WeightUpdate, weight_map: dict, expected: dict[str, tuple[int, ...]]) -> None:
        """After a LoRA version passed the full check: its base (every tensor but the adapters, as objects, with
        their in-place version counters), that part of its weight map, and the shapes the model needs."""
        if not any(name.endswith(LORA_A) for name in update.tensors):
            self._base = self._base_source = None
            return
        entries = [(name, tensor, tensor._version) for name, tensor in update.tensors.items()
                   if not name.endswith(ADAPTER_SUFFIXES)]  # fmt: skip
        base_map = {name: value for name, value in weight_map.items() if not name.endswith(ADAPTER_SUFFIXES)}
        self._base = (entries, base_map, expected)
        self._base_source = update.base
        self._checked_layout = None

    def _on_checked_base(self, update: WeightUpdate) -> dict | None:
        """The weight map of an adapter version on the base the last LoRA version was checked with (the very same
        tensors, unchanged, and nothing else but adapters): that base's map and only the adapters checked (an
        adapter-only version arrives every train step). None for any other version (the full check runs)."""
        if self._base is None:
            return None
        entries, base_map, expected = self._base
        tensors, pooled = update.tensors, update.pooled
        if pooled is not None and update.base is not None and update.base is self._base_source:
            # the subscriber's pinned base, the very version checked (nothing writes its tensors), and adapters of
            # one packed layout (its plan: the same names, dtypes and shapes), int8 and float32 as they are; the
            # subscriber made `tensors` from the two (`pooled.tensors` are the adapters among them)
            if len(tensors) != len(entries) + len(pooled.tensors):
                return None
            weight_map, layout = {**base_map, **pooled.tensors}, pooled.plan
        else:
            adapters = {name: tensor for name, tensor in tensors.items() if name.endswith(ADAPTER_SUFFIXES)}
            if not adapters or len(tensors) - len(adapters) != len(entries):
                return None
            for name, tensor, version in entries:
                if tensors.get(name) is not tensor or tensor._version != version:
                    return None
            weight_map = {**base_map, **{name: _adapter_tensor(tensor) for name, tensor in adapters.items()}}
            layout = tuple((name, tensor.dtype, tensor.shape) for name, tensor in adapters.items())
        if layout != self._checked_layout:  # what check_adapter_shapes reads: names, dtypes and shapes
            check_adapter_shapes(weight_map, expected)
            self._checked_layout = layout
        return weight_map

    def advance(self, running_version: int, budget_s: float) -> tuple[int, ModelWeights] | None:
        """Build the staged version for up to `budget_s` seconds; (version, weights) once complete, else None. A
        version not newer than `running_version` is dropped."""
        with self._lock:
            staged = self._staged
        if staged is None:
            return None
        version, weight_map, base_map, pooled = staged
        if version <= running_version:
            self._drop(staged)
            return None
        last = self._last_built
        if base_map is not None and last is not None and last[0] is base_map:  # adapters on the base just built
            started = time.perf_counter()
            self._building = None
            try:
                built = last[1].with_adapters(self.arch, weight_map, self.dtype, str(self.device), pooled)
            except Exception:
                self._drop(staged)
                raise
            finally:
                self.last_build_s = time.perf_counter() - started
            self._last_built = (base_map, built)
            self._drop(staged)
            return version, built
        if self._building is None or self._building[0] != version:
            self._building = (version, ModelWeights.build_in_parts(self.arch, weight_map, self.dtype, self.device))
            self._build_s = 0.0
        started = time.perf_counter()
        part = None
        try:
            for part in self._building[1]:
                if part is not None:
                    break
                if time.perf_counter() >= started + budget_s:
                    return None
        except Exception:  # a version that cannot be built is dropped; the running one stays
            self._building = None
            self._drop(staged)
            raise
        finally:
            self._build_s += time.perf_counter() - started
        self._building = None
        self.last_build_s = self._build_s
        self._drop(staged)
        if part is None:  # the build ended without weights (cannot happen with build_in_parts): drop the version
            return None
        part.pooled = pooled
        self._last_built = None if base_map is None else (base_map, part)
        return version, part

    def _drop(self, staged: tuple[int, dict, dict | None, PooledAdapters | None]) -> None:
        with self._lock:
            if self._staged is staged:
                self._staged = None
