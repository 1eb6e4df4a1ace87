"""A decode step's decoder layers on int8 weights as one C++ call (`fd_decode_layers` in `csrc/fused_decode.cpp`).

With the fused ops (`fused_decode`) a decode step of the ~100M decode shape of `asyncrl bench e2e` still made about
ten Python-level calls per layer (each int8 linear, the attention, the two residual adds with their norms, SiLU x up
as torch ops), 0.28 s of a 1.64 s generate of 16 x 128 tokens on one Zen 4 thread besides the kernels themselves.
`decode_layers` runs all of them, layer after layer, in one call: the same kernels (`int8_gemm.cpp`'s `i8_linear`,
reached through its address, and the fused norms and attention), and SiLU x up in C++ (torch's formula, each
operation rounded; the same value as `F.silu(gate) * up` to rounding). Only the embedding, the LM head and
sampling stay in Python. Every op computes each row on its own, as before: a sequence gets the same bits alone or in
any batch.

It applies to a step of decode rows only (prompts joining the step take `model.forward_step`'s path) whose weights
are all int8 on one C++ kernel with no LoRA adapters (`plan_for`); anything else runs the per-op path, which gives
the same values to rounding.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rollout_workers.embedded import fused_decode, int8_linear
from rollout_workers.embedded.arch import ArchConfig

if TYPE_CHECKING:
    from rollout_workers.embedded.model import KVCache, ModelWeights


class _Int8LinearC(ctypes.Structure):
    _fields_ = [("packed", ctypes.c_void_p), ("out_features", ctypes.c_int64), ("in_features", ctypes.c_int64),
                ("padded_in", ctypes.c_int64), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p)]  # fmt: skip


class _LayerC(ctypes.Structure):
    _fields_ = [("qkv", _Int8LinearC), ("o_proj", _Int8LinearC), ("gate_up", _Int8LinearC), ("down", _Int8LinearC),
                ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p)]  # fmt: skip


@dataclass(frozen=True, slots=True)
class LayersPlan:
    """One weight version's layers as `fd_decode_layers` reads them (the tensors stay alive with the version)."""

    layers: ctypes.Array
    final_norm: torch.Tensor
    kernel_isa: int
    intermediate: int
    kept: tuple[torch.Tensor, ...]
    """Every tensor the descriptors point into (float copies of the biases included)."""


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def plan_for(weights: ModelWeights) -> LayersPlan | None:
    """The plan of one weight version, or None where `decode_layers` does not apply: a linear that is not int8 on
    a C++ kernel, kernels that differ, a LoRA adapter, or no C++ libraries."""
    layers = weights.layers
    linears = [(layer.qkv, layer.o_proj, layer.gate_up, layer.down) for layer in layers]
    kernels = {w.kernel if isinstance(w, int8_linear.PackedInt8) else None for group in linears for w in group}
    if len(kernels) != 1 or next(iter(kernels)) not in int8_linear._COMPILED_KERNELS:
        return None
    if any(layer.qkv_lora or layer.o_lora or layer.gate_up_lora or layer.down_lora for layer in layers):
        return None
    if fused_decode._Library.get() is None or int8_linear._Library.get() is None:
        return None
    kept: list[torch.Tensor] = []

    def linear(weight: int8_linear.PackedInt8, bias: torch.Tensor | None) -> _Int8LinearC:
        bias32 = None if bias is None else bias.to(torch.float32).contiguous()
        kept.extend(t for t in (weight.packed, weight.scale, bias32) if t is not None)
        return _Int8LinearC(weight.packed.data_ptr(), weight.out_features, weight.q.shape[1], weight.padded_in,  # type: ignore[union-attr]
                            weight.scale.data_ptr(), _ptr(bias32))  # fmt: skip

    descriptors = (_LayerC * len(layers))()
    for slot, layer in zip(descriptors, layers):
        norms = [t.contiguous() if t is not None else None for t in (layer.input_norm, layer.post_norm,
                                                                        layer.q_norm, layer.k_norm)]  # fmt: skip
        kept.extend(t for t in norms if t is not None)
        slot.qkv, slot.o_proj = linear(layer.qkv, layer.qkv_bias), linear(layer.o_proj, None)
        slot.gate_up, slot.down = linear(layer.gate_up, None), linear(layer.down, None)
        slot.input_norm, slot.post_norm, slot.q_norm, slot.k_norm = (_ptr(t) for t in norms)
    final_norm = weights.norm.contiguous()
    kernel = next(iter(kernels))
    return LayersPlan(descriptors, final_norm, int8_linear._ISA[kernel], layers[0].down.q.shape[1], tuple(kept))


def decode_layers(
    plan: LayersPlan, arch: ArchConfig, x: torch.Tensor, positions: torch.Tensor, cache: KVCache
) -> torch.Tensor:
    """Rows x (N, hidden) fp32 (the embedded tokens; updated in place into the residual stream) of cache slots
    0..N-1 at `positions` (N,) int64 through every layer (their keys and values written into `cache`, a
    `KVCache`); returns the final RMSNorm of each row (N, hidden)."""
    lib = fused_decode._Library.lib
    n, hidden = x.shape
    heads, kv_heads, head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
    threads = max(1, min(torch.get_num_threads(), n))  # the attention's (a row each); the linears take them all
    work = torch.empty(lib.fd_decode_layers_work_floats(n, hidden, heads, kv_heads, head_dim, plan.intermediate))
    attn_scratch = torch.empty(threads * lib.fd_scratch_floats(heads, kv_heads, head_dim, cache.max_len))
    h = torch.empty_like(x)
    positions = positions.contiguous()
    keys, values = cache.keys, cache.values
    status = lib.fd_decode_layers(
        _i8_linear_address(), plan.kernel_isa, ctypes.addressof(plan.layers), len(plan.layers),
        plan.final_norm.data_ptr(), x.data_ptr(), h.data_ptr(), n, hidden, heads, kv_heads, head_dim,
        plan.intermediate, positions.data_ptr(), cache.cos.data_ptr(), cache.sin_rotate.data_ptr(),
        arch.rms_norm_eps, keys.data_ptr(), values.data_ptr(), keys.shape[1], keys.shape[3], work.data_ptr(),
        attn_scratch.data_ptr(), threads, fused_decode.attention_isa(), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"decode layers refused their arguments (status {status}; positions must lie in "
                         f"[0, {keys.shape[3]}))")  # fmt: skip
    return h


@functools.cache
def _i8_linear_address() -> int:
    """The address of int8_gemm.cpp's `i8_linear`, which `fd_decode_layers` calls for every linear."""
    return ctypes.cast(int8_linear._Library.lib.i8_linear, ctypes.c_void_p).value  # type: ignore[union-attr, return-value]
