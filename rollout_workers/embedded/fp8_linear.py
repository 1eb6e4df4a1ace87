"""FP8 (e4m3) W8A8 linears for the embedded engine (`fp8`, `fp8_trunc`), on the fastest form this CPU runs them in.

The FP8 numerics stay quant_sync's: per-token activations quantized onto the e4m3 grid by the shared quantizer
(nearest even, or toward zero for `fp8_trunc`), the per-channel e4m3 weight, products of the two summed in fp32,
then `acc * s_x * s_w` (+ bias), as `quantized_linear` computes. Every operand is exact (an e4m3 value has 4
significant bits, a product of two 8, both exact in fp32); only the order of the fp32 sum is the GEMM's own, as
it is for any fp32 GEMM (results agree with the reference to fp32 rounding, the aligned learner's log-probs to
<= 1e-5). Integer arithmetic on the FP8 grid does not pay here: e4m3 values span 2^-9 to 448, so exact integer
products would need about 18-bit operands (several int8 GEMMs per product).

Kernels (`ASYNCRL_FP8_KERNEL` forces one, `fp8_kernel_name()` says which runs):
- `bf16` (AVX512-BF16: Zen 4, Cooper Lake, Sapphire Rapids): the C++ library `csrc/fp8_gemm.cpp`, one call per
  linear: quantize to e4m3 values held as bf16 (exact), `vdpbf16ps` (exact products, fp32 sums), fp32 epilogue.
  Measured on Zen 4, one thread, 32 rows: 2.1-2.3x oneDNN's prepacked fp32 GEMM on the same shapes.
- `fp32` (elsewhere): the library's quantizer (e4m3 values as fp32), then oneDNN's prepacked fp32 GEMM on the
  weight upcast once (MKL for small matrices and single rows, as `PackedFp32`), then the epilogue.
- `reference`: the shared quantizer and `q_x.float() @ q_w.float().t()` in torch (no C++ compiler).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from quant_sync.quantizers import QuantizedWeight, quantize_activation
from rollout_workers.embedded.native import NativeLibrary, chosen_kernel, fp32_rows

ENV_KERNEL = "ASYNCRL_FP8_KERNEL"
KERNELS = ("bf16", "fp32", "reference")
PANEL = 16
"""Output columns per panel of the bf16 layout (csrc/fp8_gemm.cpp)."""
PACK_MIN_FEATURES = 512
"""Weights with both dimensions at least this large run oneDNN's prepacked fp32 GEMM on `fp32` (see PackedFp32)."""
_ISA_PORTABLE, _ISA_BF16 = 0, 1
_OUT_FP32, _OUT_BF16 = 0, 1
_MKLDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@dataclass(slots=True)
class PackedFp8:
    """An e4m3 `QuantizedWeight` laid out once per weight version for the FP8 kernel `kernel`."""

    kernel: str
    scheme: str  # fp8 or fp8_trunc: how activations are rounded
    q32: torch.Tensor | None  # (out, in) float32 holding the e4m3 values (fp32, reference)
    scale: torch.Tensor  # (out,) float32
    packed: torch.Tensor | None  # bf16 pairs (bf16), oneDNN's prepacked q32 (fp32 with large dims), else None
    padded_in: int  # inputs a row of the bf16 layout holds (even)
    out_features: int


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    if lib.f8_abi_version() != 2:
        raise ValueError("fp8_gemm library: unexpected ABI version")
    lib.f8_has_isa.argtypes, lib.f8_has_isa.restype = [cint], cint
    lib.f8_quantize_rows.argtypes = [cint, ptr, i64, i64, i64, cint, cint, ptr, i64, ptr]
    lib.f8_quantize_rows.restype = None
    lib.f8_scale_output.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr]
    lib.f8_scale_output.restype = None
    lib.f8_linear.argtypes = [cint, ptr, i64, i64, i64, cint, ptr, i64, i64, ptr, ptr, ptr, i64, cint]
    lib.f8_linear.restype = cint
    lib.f8_upcast.argtypes, lib.f8_upcast.restype = [ptr, i64, ptr], None
    lib.f8_pack_bf16.argtypes, lib.f8_pack_bf16.restype = [ptr, i64, i64, i64, ptr], cint
    return lib


_Library = NativeLibrary("fp8_gemm.cpp", _declare)
"""The compiled kernels (ctypes); `_Library.get()` is None where no compiler could build them."""


@functools.cache
def available_kernels() -> tuple[str, ...]:
    """The FP8 kernels this process runs, best first (`reference` always); `bf16` needs cpuid's AVX512-BF16 and
    torch's AVX512 capability (`ATEN_CPU_CAPABILITY=avx2` emulates a machine without it)."""
    lib = _Library.get()
    if lib is None:
        return ("reference",)
    bf16 = bool(lib.f8_has_isa(_ISA_BF16)) and torch.backends.cpu.get_cpu_capability() == "AVX512"
    return (*(("bf16",) if bf16 else ()), "fp32", "reference")


def fp8_kernel_name() -> str:
    """The kernel new FP8 weights are laid out for: `ASYNCRL_FP8_KERNEL` if set (it must be available), else the
    best available one."""
    return chosen_kernel(ENV_KERNEL, KERNELS, available_kernels(), _Library)


def prepare_fp8(weight: QuantizedWeight, kernel: str | None = None) -> PackedFp8:
    """Lay an e4m3 `QuantizedWeight` (`fp8` / `fp8_trunc`) out for `kernel` (default `fp8_kernel_name()`)."""
    kernel = kernel or fp8_kernel_name()
    out_features, in_features = weight.q.shape
    scale = weight.scale.to(torch.float32).contiguous()
    q = weight.q.contiguous()
    if kernel == "bf16":
        padded_in = -(-in_features // 2) * 2
        packed = torch.empty(-(-out_features // PANEL) * PANEL * padded_in, dtype=torch.int16)
        lib = _Library.get()
        if lib is None:
            raise ValueError(f"the fp8 bf16 kernel needs the C++ library: {_Library.error}")
        status = lib.f8_pack_bf16(q.data_ptr(), out_features, in_features, padded_in, packed.data_ptr())
        if status != 0:
            raise ValueError(f"fp8 pack refused its arguments (status {status})")
        return PackedFp8(kernel, weight.scheme, None, scale, packed, padded_in, out_features)
    if kernel not in ("fp32", "reference"):
        raise ValueError(f"unknown fp8 kernel {kernel!r} (valid: {', '.join(KERNELS)})")
    q32 = _upcast(q)
    packed = None
    if kernel == "fp32" and _MKLDNN_LINEAR and min(q32.shape) >= PACK_MIN_FEATURES:
        packed = torch.ops.mkldnn._reorder_linear_weight(q32, 64)
    return PackedFp8(kernel, weight.scheme, q32, scale, packed, in_features, out_features)


def _upcast(q: torch.Tensor) -> torch.Tensor:
    """(out, in) e4m3 -> float32, exact (the library's table; torch's conversion where it did not build)."""
    lib = _Library.get()
    if lib is None:
        return q.to(torch.float32)
    out = torch.empty(q.shape, dtype=torch.float32)
    lib.f8_upcast(q.data_ptr(), q.numel(), out.data_ptr())
    return out


def fp8_linear(x: torch.Tensor, weight: PackedFp8, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) float -> (..., out) float32: the FP8 W8A8 product of `quantized_linear` (fp32-rounding apart)."""
    shape = x.shape
    flat = fp32_rows(x)
    bias32 = None if bias is None else bias.to(torch.float32).contiguous()
    out = (_bf16_linear if weight.kernel == "bf16" else _fp32_linear)(flat, weight, bias32)
    return out if len(shape) == 2 else out.reshape(*shape[:-1], weight.out_features)


def quantize_fp8_values(flat: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, in) float32 -> (the e4m3 activations as float32, their scales): `quantize_activation`'s, bit for bit."""
    lib = _Library.get()
    if lib is None:
        q, s_x = quantize_activation(flat, scheme)
        return q.to(torch.float32), s_x
    rows, in_features = flat.shape
    q = torch.empty((rows, in_features), dtype=torch.float32)
    s_x = torch.empty(rows, dtype=torch.float32)
    isa = _ISA_BF16 if lib.f8_has_isa(_ISA_BF16) else _ISA_PORTABLE
    lib.f8_quantize_rows(isa, flat.data_ptr(), rows, in_features, in_features, int(scheme == "fp8_trunc"), _OUT_FP32,
                         q.data_ptr(), in_features, s_x.data_ptr())  # fmt: skip
    return q, s_x


def _bf16_linear(flat: torch.Tensor, weight: PackedFp8, bias: torch.Tensor | None) -> torch.Tensor:
    rows, in_features = flat.shape
    out = torch.empty((rows, weight.out_features), dtype=torch.float32)
    status = _Library.lib.f8_linear(  # type: ignore[union-attr]  # a bf16-packed weight implies the library loaded
        _ISA_BF16, flat.data_ptr(), rows, in_features, in_features, int(weight.scheme == "fp8_trunc"),
        weight.packed.data_ptr(), weight.out_features, weight.padded_in, weight.scale.data_ptr(),  # type: ignore[union-attr]
        None if bias is None else bias.data_ptr(), out.data_ptr(), weight.out_features, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"fp8 bf16 kernel refused its arguments (status {status})")
    return out


def _fp32_linear(flat: torch.Tensor, weight: PackedFp8, bias: torch.Tensor | None) -> torch.Tensor:
    q_x, s_x = quantize_fp8_values(flat, weight.scheme) if weight.kernel == "fp32" else _reference_values(flat, weight)
    if weight.packed is not None and q_x.shape[0] > 1:
        acc = torch.ops.mkldnn._linear_pointwise(q_x, weight.packed, None, "none", [], "")
    else:
        acc = q_x @ weight.q32.t()  # type: ignore[union-attr]
    lib = _Library.get()
    if weight.kernel == "reference" or lib is None:
        out = acc * s_x[:, None] * weight.scale[None, :]
        return out if bias is None else out + bias
    lib.f8_scale_output(acc.data_ptr(), acc.stride(0), acc.shape[0], acc.shape[1], s_x.data_ptr(),
                        weight.scale.data_ptr(), None if bias is None else bias.data_ptr())  # fmt: skip
    return acc


def _reference_values(flat: torch.Tensor, weight: PackedFp8) -> tuple[torch.Tensor, torch.Tensor]:
    q, s_x = quantize_activation(flat, weight.scheme)
    return q.to(torch.float32), s_x
