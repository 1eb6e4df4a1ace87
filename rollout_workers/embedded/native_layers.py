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
are all int8 on one C++ kernel, their LoRA adapters (if any) on `csrc/lora_gemm.cpp` (`plan_for`), which runs them
after their linears as `low_rank.add_low_rank` does; anything else runs the per-op path, which gives the same values
to rounding.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rollout_workers.embedded import fused_decode, int8_linear
from rollout_workers.embedded.arch import ArchConfig
from rollout_workers.embedded.low_rank import LowRank, _native_lora

if TYPE_CHECKING:
    from rollout_workers.embedded.model import KVCache, ModelWeights


class _Int8LinearC(ctypes.Structure):
    _fields_ = [("packed", ctypes.c_void_p), ("out_features", ctypes.c_int64), ("in_features", ctypes.c_int64),
                ("padded_in", ctypes.c_int64), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p)]  # fmt: skip


class _LoraC(ctypes.Structure):
    _fields_ = [("a", ctypes.c_void_p), ("a_scale", ctypes.c_void_p), ("rank", ctypes.c_int64),
                ("members", ctypes.c_int64), ("ranks", ctypes.c_void_p), ("cols", ctypes.c_void_p),
                ("bs", ctypes.c_void_p), ("b_scales", ctypes.c_void_p), ("scalings", ctypes.c_void_p)]  # fmt: skip


class _LayerC(ctypes.Structure):
    _fields_ = [("qkv", _Int8LinearC), ("o_proj", _Int8LinearC), ("gate_up", _Int8LinearC), ("down", _Int8LinearC),
                ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("qkv_lora", ctypes.POINTER(_LoraC)), ("o_lora", ctypes.POINTER(_LoraC)),
                ("gate_up_lora", ctypes.POINTER(_LoraC)), ("down_lora", ctypes.POINTER(_LoraC))]  # fmt: skip


@dataclass(frozen=True, slots=True)
class LayersPlan:
    """One weight version's layers as `fd_decode_layers` reads them (the tensors stay alive with the version)."""

    layers: ctypes.Array
    final_norm: torch.Tensor
    kernel_isa: int
    intermediate: int
    max_rank: int
    """The largest LoRA rank of any linear (0: no adapters): the adapters' scratch is rows x this."""
    kernels: tuple[int, int | None, int | None]
    """The addresses of int8_gemm.cpp's `i8_linear` and, where adapters come, lora_gemm.cpp's `lr_apply` and
    `lr_apply_q8` (or `lr_apply_q8_amx` for adapters packed for it, with the same arguments; else nulls): looked up
    once per version, not per step."""
    kept: tuple[object, ...]
    """Every tensor and ctypes array the descriptors point into (float copies of the biases included)."""


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def plan_for(weights: ModelWeights) -> LayersPlan | None:
    """The plan of one weight version, or None where `decode_layers` does not apply: a linear that is not int8 on
    a C++ kernel, kernels that differ, a LoRA adapter on torch's GEMMs, or no C++ libraries."""
    layers = weights.layers
    linears = [(layer.qkv, layer.o_proj, layer.gate_up, layer.down) for layer in layers]
    kernels = {w.kernel if isinstance(w, int8_linear.PackedInt8) else None for group in linears for w in group}
    if len(kernels) != 1 or next(iter(kernels)) not in int8_linear._COMPILED_KERNELS:
        return None
    adapters = [a for layer in layers for a in (layer.qkv_lora, layer.o_lora, layer.gate_up_lora, layer.down_lora)]
    if any(a is not None and a.native is None for a in adapters):  # adapters on torch's GEMMs
        return None
    amx = {a.amx is not None for a in adapters if a is not None and a.a_scale is not None}
    if len(amx) > 1:  # int8 adapters on both kernels (built before and after ASYNCRL_LORA_KERNEL changed)
        return None
    if fused_decode._Library.get() is None or int8_linear._Library.get() is None:
        return None
    kept: list[object] = []

    def lora(adapter: LowRank | None) -> ctypes._Pointer | None:
        if adapter is None:
            return None
        int8 = adapter.a_scale is not None
        ranks, cols, bs, *b_scales, scalings = adapter.native  # type: ignore[misc]  # checked above
        a = adapter.a if adapter.amx is None else adapter.amx  # the `amx` kernel's A^T (lr_apply_q8_amx)
        descriptor = _LoraC(a.data_ptr(), _ptr(adapter.a_scale), adapter.a.shape[0], len(adapter.b_t),
                            ctypes.addressof(ranks), ctypes.addressof(cols), ctypes.addressof(bs),
                            ctypes.addressof(b_scales[0]) if int8 else None, ctypes.addressof(scalings))  # fmt: skip
        kept.extend((adapter, descriptor))
        return ctypes.pointer(descriptor)

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
        for name in ("qkv_lora", "o_lora", "gate_up_lora", "down_lora"):
            pointer = lora(getattr(layer, name))
            if pointer is not None:
                setattr(slot, name, pointer)
    final_norm = weights.norm.contiguous()
    kernel = next(iter(kernels))
    max_rank = max((a.a.shape[0] for a in adapters if a is not None), default=0)
    lora_lib = _native_lora() if max_rank else None  # loaded: `LowRank.native` is made only where it is
    q8 = (lora_lib.lr_apply_q8_amx if amx == {True} else lora_lib.lr_apply_q8) if lora_lib else None
    lora_fns = (_address(lora_lib.lr_apply), _address(q8)) if lora_lib else (None, None)
    kernels = (_address(int8_linear._Library.lib.i8_linear), *lora_fns)  # type: ignore[union-attr]
    return LayersPlan(
        descriptors, final_norm, int8_linear._ISA[kernel], layers[0].down.q.shape[1], max_rank, kernels, tuple(kept)
    )


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
    low = torch.empty(n * plan.max_rank) if plan.max_rank else None
    positions = positions.contiguous()
    keys, values = cache.keys, cache.values
    status = lib.fd_decode_layers(
        plan.kernels[0], plan.kernel_isa, ctypes.addressof(plan.layers), len(plan.layers),
        plan.final_norm.data_ptr(), x.data_ptr(), h.data_ptr(), n, hidden, heads, kv_heads, head_dim,
        plan.intermediate, positions.data_ptr(), cache.cos.data_ptr(), cache.sin_rotate.data_ptr(),
        arch.rms_norm_eps, keys.data_ptr(), values.data_ptr(), keys.shape[1], keys.shape[3], work.data_ptr(),
        attn_scratch.data_ptr(), threads, fused_decode.attention_isa(), torch.get_num_threads(),
        *plan.kernels[1:], _ptr(low),
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"decode layers refused their arguments (status {status}; positions must lie in "
                         f"[0, {keys.shape[3]}))")  # fmt: skip
    return h


def _address(function: ctypes._CFuncPtr) -> int:
    """A C function's address, for `fd_decode_layers` to call it."""
    return ctypes.cast(function, ctypes.c_void_p).value  # type: ignore[return-value]
