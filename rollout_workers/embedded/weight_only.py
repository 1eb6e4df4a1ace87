"""Weight-only linears (`w8a16`, `w4a16`) for the embedded engine: fused dequantize-and-multiply, no fp32 copy.

quant_sync publishes these schemes as int8 values (in [-127, 127] or [-7, 7]) with one fp32 scale per output row
and group of 128 input columns (`quantize_weight_only`). The engine keeps them that way: `pack_weight_only` lays a
weight out once per version (int8 rows, or two int4 values a byte), and `weight_only_linear` streams it through a
small C++ kernel (`csrc/weight_only.cpp`) that converts each weight to fp32 in registers, sums x times it over
each group in fp32 and multiplies the sum by the group's scale. At one row decode is bound by the weight bytes
read: 1/4 (int8) or 1/8 (int4) of fp32's. Results agree with `x @ dequant(W)^T` in fp32 (what the rollout-aligned
learner computes) to fp32 rounding: the products and the order of the sums differ, not the arithmetic's precision.

Kernels, chosen once per weight when it is packed (`ASYNCRL_WO_KERNEL` forces one; `kernel_name()` says which):
- `avx512`: AVX512F/BW/VL/DQ + FMA, 16 lanes;  `avx2`: AVX2 + FMA, 8 lanes (Zen 2/3 class machines);
- `reference`: portable scalar C++ (any CPU the compiler targets, ARM included);
- `torch`: no compiler on the machine: tiles of 64K weights dequantized with torch ops, then `torch.mm`.
The compiled kernels run every batch size: they process up to 4 rows of x per pass over a block of weight rows
(streamed once); measured on Zen 4 at 1024 x 5632 they stay at or above `F.linear`'s speed up to 64 rows, where
dequantizing 256 KiB tiles and running MKL's fp32 GEMM on them was no faster. `pack_fp32` runs the same loop on
fp32 rows, as a batch-invariant fp32 linear (fused_decode.py).

The library is compiled on first use with the system C++ compiler (about 2 s: plain C ABI, no torch headers; a
torch C++ extension took 75 s to build here) and cached (`native.build_library`). Without a compiler only the
`torch` path runs, and a line on stderr says why.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from quant_sync.quantizers import WEIGHT_ONLY_BITS, WEIGHT_ONLY_GROUP, dequantize_published
from rollout_workers.embedded.native import NativeLibrary, chosen_kernel

ENV_KERNEL = "ASYNCRL_WO_KERNEL"
BITS = {**WEIGHT_ONLY_BITS, "fp32": 32}
KERNELS = ("avx512", "avx2", "reference", "torch")
_ISA_CODES = {"reference": 0, "avx2": 1, "avx512": 2}
ROW_ALIGN = 64
"""Packed rows hold a multiple of this many inputs (zero weights after the last): the kernels read whole blocks."""
TILE_ELEMENTS = 1 << 16
"""The `torch` path's weights dequantized per tile (256 KiB of fp32: stays in L2 while the GEMM reads it)."""


@dataclass(slots=True)
class GroupQuantized:
    """A published weight-only matrix: `q` (out, in) int8 in [-qmax, qmax], `scale` (out, ceil(in / 128)) fp32."""

    q: torch.Tensor
    scale: torch.Tensor
    scheme: str

    def dequantize(self) -> torch.Tensor:
        return dequantize_published(self.q, self.scale, self.scheme)

    def check_scale(self, name: str) -> None:
        """Raise ValueError naming `name` if the scale is not one per output row and group of 128 inputs."""
        need = (self.q.shape[0], -(-self.q.shape[1] // WEIGHT_ONLY_GROUP))
        if tuple(self.scale.shape) != need:
            raise ValueError(f"{name}: scale of shape {list(self.scale.shape)}, the model needs {list(need)}")

    @staticmethod
    def stack(weights: list[GroupQuantized]) -> GroupQuantized:
        """Matrices of one scheme stacked along the output rows (exact: the quantization is per row)."""
        assert all(w.scheme == weights[0].scheme for w in weights)
        q, scale = torch.cat([w.q for w in weights]), torch.cat([w.scale for w in weights])
        return GroupQuantized(q.contiguous(), scale.contiguous(), weights[0].scheme)


@dataclass(slots=True)
class PackedWeightOnly:
    """A weight-only matrix laid out for `kernel` (see the module docstring), built once per weight version."""

    packed: torch.Tensor  # (out, row_bytes) uint8: int8 rows, int4 pairs or fp32; int8 (out, in) for `torch`
    scale: torch.Tensor  # (out, groups) float32
    scheme: str  # w8a16, w4a16, or fp32 (see pack_fp32)
    in_features: int
    out_features: int
    kernel: str
    group: int = WEIGHT_ONLY_GROUP  # inputs per scale


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    if lib.wo_abi_version() != 1:
        raise ValueError("weight_only library: unexpected ABI version")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.wo_has_isa.argtypes, lib.wo_has_isa.restype = [ctypes.c_int], ctypes.c_int
    lib.wo_linear.argtypes = [ctypes.c_int, ctypes.c_int, ptr, i64, i64, i64, ptr, i64, ptr, i64, i64, ptr, ptr,
                              i64, i64, ctypes.c_int]  # fmt: skip
    lib.wo_linear.restype = ctypes.c_int
    return lib


_Library = NativeLibrary("weight_only.cpp", _declare, note="weight-only kernels unavailable, using the slow torch path")
"""The compiled kernels (ctypes); `_Library.get()` is None where no compiler could build them (then only the `torch`
path runs, and `_Library.error` says why)."""


@functools.cache
def _compiled_kernels() -> tuple[str, ...]:
    lib = _Library.get()
    return tuple(name for name in KERNELS[:3] if lib is not None and lib.wo_has_isa(_ISA_CODES[name]))


def available_kernels() -> list[str]:
    """The paths this machine runs, best first (`torch` always)."""
    return [*_compiled_kernels(), "torch"]


def kernel_name() -> str:
    """The kernel weights are packed for here: `ASYNCRL_WO_KERNEL` if set (it must be available), else the best."""
    return chosen_kernel(ENV_KERNEL, KERNELS, available_kernels(), _Library)


def pack_weight_only(weight: GroupQuantized, kernel: str | None = None) -> PackedWeightOnly:
    """Lay a published weight-only matrix out for `kernel` (default `kernel_name()`)."""
    kernel = kernel or kernel_name()
    if kernel not in available_kernels():
        raise ValueError(f"weight-only kernel {kernel!r} does not run here ({', '.join(available_kernels())} do)")
    bits = WEIGHT_ONLY_BITS[weight.scheme]
    out_features, in_features = weight.q.shape
    scale = weight.scale.to(torch.float32).contiguous()
    if kernel == "torch":
        return PackedWeightOnly(weight.q.contiguous(), scale, weight.scheme, in_features, out_features, kernel)
    padded_in = -(-in_features // ROW_ALIGN) * ROW_ALIGN
    rows = torch.zeros((out_features, padded_in), dtype=torch.int8)
    rows[:, :in_features] = weight.q
    if bits == 8:
        packed = rows.view(torch.uint8)
    else:  # per block of 64 inputs: byte j = (q[j] + 8) | (q[j + 32] + 8) << 4
        nibbles = (rows.view(out_features, -1, 2, 32).to(torch.int16) + 8).to(torch.uint8)
        packed = (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).reshape(out_features, padded_in // 2)
    return PackedWeightOnly(packed.contiguous(), scale, weight.scheme, in_features, out_features, kernel)


def pack_fp32(weight: torch.Tensor) -> PackedWeightOnly | None:
    """An fp32 (out, in) matrix laid out for the compiled kernel as a batch-invariant fp32 linear (None where only
    the `torch` path runs): every output is summed in one order whatever the number of rows, while MKL's sgemm sums
    a row alone, in 2-3 rows and in 4 or more differently, so a sequence's logits would depend on its batch (at
    temperature 1e-4 a last-bit difference moves a log-prob by 1e-5). Same loop as the weight-only kernels, on fp32
    rows, scale 1 in one group. Measured at one thread: within 1.5x of `F.linear` on builtin:tiny's matrices."""
    kernel = kernel_name()
    if kernel == "torch":
        return None
    out_features, in_features = weight.shape
    padded_in = -(-in_features // ROW_ALIGN) * ROW_ALIGN
    rows = weight.to(torch.float32).contiguous()
    if padded_in != in_features:
        rows = torch.zeros((out_features, padded_in)).index_copy_(1, torch.arange(in_features), rows)
    scale = torch.ones((out_features, 1))
    return PackedWeightOnly(rows.view(torch.uint8), scale, "fp32", in_features, out_features, kernel, padded_in)


def weight_only_linear(x: torch.Tensor, weight: PackedWeightOnly, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) -> (..., out) float32: x @ dequant(W)^T (+ bias), the weight never materialised whole."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1]).to(torch.float32).contiguous()
    bias32 = None if bias is None else bias.to(torch.float32).contiguous()
    if weight.kernel == "torch":
        return _tiled_linear(flat, weight, bias32).reshape(*shape[:-1], weight.out_features)
    rows = flat.shape[0]
    out = torch.empty((rows, weight.out_features), dtype=torch.float32)
    status = _Library.get().wo_linear(  # type: ignore[union-attr]  # a packed weight implies the library loaded
        _ISA_CODES[weight.kernel], BITS[weight.scheme], flat.data_ptr(), rows, weight.in_features,
        weight.in_features, weight.packed.data_ptr(), weight.packed.shape[1], weight.scale.data_ptr(),
        weight.scale.shape[1], weight.group, 0 if bias32 is None else bias32.data_ptr(), out.data_ptr(),
        weight.out_features, weight.out_features, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"the weight-only kernel refused its arguments (status {status})")
    return out.reshape(*shape[:-1], weight.out_features)


def _tiled_linear(flat: torch.Tensor, weight: PackedWeightOnly, bias: torch.Tensor | None) -> torch.Tensor:
    """The `torch` path: fp32 GEMMs over tiles of TILE_ELEMENTS exactly dequantized weights (one reused buffer)."""
    out_t = torch.empty((weight.out_features, flat.shape[0]), dtype=torch.float32)  # (out, rows): tiles contiguous
    tile_rows = max(1, TILE_ELEMENTS // weight.in_features)
    buffer = torch.empty((min(tile_rows, weight.out_features), weight.in_features), dtype=torch.float32)
    for start in range(0, weight.out_features, tile_rows):
        end = min(start + tile_rows, weight.out_features)
        tile = buffer[: end - start]
        torch.mul(weight.packed[start:end], _group_scales(weight.scale[start:end], weight.in_features), out=tile)
        torch.mm(tile, flat.t(), out=out_t[start:end])
    if bias is not None:
        out_t += bias[:, None]
    return out_t.t()


def _group_scales(scale: torch.Tensor, in_features: int) -> torch.Tensor:
    return scale.repeat_interleave(WEIGHT_ONLY_GROUP, dim=1)[:, :in_features]
