"""Exact W8A8 INT8 linears for the embedded engine, on the fastest exact kernel this CPU has (chosen at run time).

Numerics are those of `quant_sync.quantizers.quantized_linear`, bit for bit, on every kernel: activations quantized
per token by the shared quantizer (s_x = max|x| / 127, q = clamp(round(x / s_x), -127, 127)), an int32 accumulator
equal to the exact dot product of the int8 operands, then `acc * s_x * s_w` in fp32 (+ bias), so the rollout-aligned
learner and quant_sync keep reproducing the engine's log-probs. Kernels, best first (`ASYNCRL_INT8_KERNEL` forces
one, `int8_kernel_name()` says which runs; a vectorised one needs both cpuid and torch's CPU capability, so
`ATEN_CPU_CAPABILITY=avx2` emulates an AVX2 machine; each is admitted only after an exactness self-test on operands
that expose saturation, rounded fp32 sums and layout tails):

- `amx` (AMX-INT8: Intel Xeon Sapphire Rapids and later): the same library's `TDPBSUD` tiles (16 rows x 64 inputs
  x 16 columns a product) on the `vnni` layout with inputs padded to 64, from 6 rows a call; fewer rows run `vnni`
  on the same packed weight. On an AMX Xeon (2026-12-06, one thread, a decode step's 101 MB of int8 weights) 16 rows
  took 8.0-10.1 ms against `vnni`'s 12.8-15.4, 32 rows 10.1-12.6 against 21.0-23.2 (docs/kernels.md).
- `vnni` (AVX512-VNNI: Zen 4, Ice Lake and later): the C++ library's fused kernel (`csrc/int8_gemm.cpp`), one call
  per linear: quantize, `vpdpbusd` on (w + 128) x q with the offset's share subtracted in int32, fp32 epilogue.
- `avxvnni` (AVX-VNNI without AVX-512: Intel Alder Lake and later client cores, Zen 5 with AVX-512 off): the same
  library with the VEX-encoded 256-bit `vpdpbusd` (`_mm256_dpbusd_avx_epi32`) on the `vnni` layout, dispatched on
  cpuid's `avx_vnni` bit. Run on the AMX Xeon (which has AVX-VNNI too, 2026-12-06): bit for bit there; its micro-kernel
  (layout, tails, offset compensation, epilogue) runs here bit for bit against the reference as the test-only path
  `avxvnni_emulated`, the same code with `vpdpbusd` emulated by AVX2; on a real AVX-VNNI CPU it is admitted only
  after the self-test below.
- `avx2` (AVX2 without VNNI: Zen 2/3, Haswell to Skylake): the same library with `vpmaddwd` on int16-widened
  operands (exact int32 pair sums, no saturating step).
- `onednn` (no C++ compiler): oneDNN's prepacked u8 x s8 GEMM. Where the CPU has VNNI or AMX it is fed u8 = q + 128
  with zero point 128 (oneDNN subtracts the zero point's share in int32, so its fp32 output is float(acc), also
  beyond 2^24); elsewhere its AVX2 kernel saturates int16 pairs of full-range products, so activations go in as
  two 7-bit halves relu(q), relu(-q), exact while in_features <= HALVES_MAX_IN_FEATURES (wider: `reference`).
  It comes after the compiled kernels on AMX too: on an AMX Xeon (2026-12-03, one thread) `vnni` ran 0.9-9.8x
  oneDNN's u8 x s8 GEMM at 1-64 rows (K x N 1024 x 1024 to 2816, 576 x 1536, 768 x 3072) and 0.8-1.8x at 128-1024.
- `i8mm` (ARM Armv8.6 I8MM, by HWCAP2): the same library with `smmla` (2 rows x 2 columns x 8 inputs per
  instruction) on its own layout (inputs in groups of 8, columns in pairs). Untested: compile-checked for aarch64
  (clang via `python -m ziglang c++ -target aarch64-linux-gnu`), never run; no ARM machine here. Its layout, row
  pairing and epilogue run here bit for bit against the reference as the test-only path `i8mm_emulated` (the same
  code with `smmla` in portable C++).
- `dotprod` (ARM Armv8.2 dotprod, by HWCAP): the same library with `sdot` on the VNNI layout without the offset.
  Untested: compile-checked for aarch64 like `i8mm`, never run.
- `portable`: the C++ library's plain loops (any CPU its compiler targets: ARM, x86 without AVX2; untested on ARM,
  no such machine here), after `onednn`.
- `reference`: `quantized_linear` itself (`torch._int_mm`, or int32 matmuls): anywhere torch runs.

The library is compiled on first use (`native.py`, about 2 s, cached per machine).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from quant_sync.quantizers import QuantizedWeight, quantize_activation, quantized_linear
from rollout_workers.embedded.native import NativeLibrary, chosen_kernel, fp32_rows, isa_cap

ENV_KERNEL = "ASYNCRL_INT8_KERNEL"
KERNELS = ("amx", "vnni", "avxvnni", "avx2", "i8mm", "dotprod", "onednn", "portable", "reference")
EXACT_U8_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
"""CPU flags under which oneDNN's u8 x s8 GEMM accumulates without saturating (VNNI or AMX instructions)."""
HALVES_MAX_IN_FEATURES = 1040
"""oneDNN's halves form sums each 7-bit half in fp32, exact while every half's sum stays below 2^24:
in_features x 127^2 < 2^24 holds up to 1040 inputs."""
TORCH_CAPABILITY_KERNELS = {"AVX512": ("amx", "vnni", "avxvnni", "avx2"), "AVX2": ("avxvnni", "avx2")}
"""The vectorised C++ kernels allowed under each torch CPU capability (cpuid must have them too)."""
PANEL = 16
"""Output columns per panel of the C++ kernels' packed layouts (csrc/int8_gemm.cpp)."""
_ISA = {"portable": 0, "avx2": 1, "vnni": 2, "dotprod": 3, "avxvnni": 4, "avxvnni_emulated": 5, "i8mm": 6,
        "i8mm_emulated": 7, "amx": 8}  # fmt: skip
_X86_KERNELS = ("amx", "vnni", "avxvnni", "avx2")
_COMPILED_KERNELS = ("amx", "vnni", "avxvnni", "avx2", "i8mm", "dotprod", "portable", "avxvnni_emulated",
                     "i8mm_emulated")  # fmt: skip
EMULATED_KERNELS = ("avxvnni_emulated", "i8mm_emulated")
"""Test paths: `prepare_int8(weight, name)` runs them wherever AVX2 does; never dispatched or forced."""
_MMLA_KERNELS = ("i8mm", "i8mm_emulated")
"""Kernels whose layout takes inputs in groups of 8 (the others: 4)."""
PADDED_IN_MULTIPLE = {"amx": 64}
"""Kernels whose layout pads the inputs beyond their group: amx's tiles take 64 inputs a row."""
_CAPPED_FLAGS = ("avx512", "avx_vnni", "amx")
"""/proc/cpuinfo flag prefixes `ASYNCRL_ISA_CAP=avx2` hides (an AVX2-only CPU has none of them)."""
_ONEDNN = hasattr(torch.ops, "onednn") and hasattr(torch.ops.onednn, "qlinear_prepack")


@dataclass(slots=True)
class PackedInt8:
    """An int8 `QuantizedWeight` laid out once per weight version for the exact int8 kernel `kernel`."""

    kernel: str
    q: torch.Tensor  # (out, in) int8: the published values (the reference kernel's operand)
    scale: torch.Tensor  # (out,) float32
    packed: torch.Tensor | None  # the C++ layout (vnni, avx2, portable), oneDNN's prepacked weight, None (reference)
    padded_in: int  # inputs a row of the C++ layout holds (a multiple of 4; of 8 for i8mm)
    onednn_u8: bool = False  # onednn: fed q + 128 with zero point 128 (exact here), not the two halves

    @property
    def out_features(self) -> int:
        return self.q.shape[0]


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    if lib.i8_abi_version() != 6:
        raise ValueError("int8_gemm library: unexpected ABI version")
    lib.i8_has_isa.argtypes, lib.i8_has_isa.restype = [cint], cint
    lib.i8_quantize_rows.argtypes = [cint, ptr, i64, i64, i64, cint, ptr, i64, ptr]
    lib.i8_quantize_rows.restype = None
    lib.i8_scale_output.argtypes = [ptr, cint, i64, i64, i64, ptr, ptr, ptr, ptr, i64]
    lib.i8_scale_output.restype = None
    lib.i8_linear.argtypes = [cint, ptr, i64, i64, i64, ptr, i64, i64, ptr, ptr, ptr, i64, cint]
    lib.i8_linear.restype = cint
    lib.i8_gemm_s32.argtypes = [cint, ptr, i64, i64, ptr, i64, ptr, i64]
    lib.i8_gemm_s32.restype = cint
    lib.i8_pack.argtypes, lib.i8_pack.restype = [cint, ptr, i64, i64, i64, ptr], cint
    return lib


_Library = NativeLibrary("int8_gemm.cpp", _declare)
"""The compiled kernels (ctypes); `_Library.get()` is None where no compiler could build them."""


def _cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none), less those `ASYNCRL_ISA_CAP` hides."""
    path = Path("/proc/cpuinfo")
    if not path.is_file():
        return set()
    for line in path.read_text().splitlines():
        if line.startswith(("flags", "Features")):
            flags = set(line.split(":", 1)[1].split())
            return {flag for flag in flags if not flag.startswith(_CAPPED_FLAGS)} if isa_cap() == "avx2" else flags
    return set()


def _torch_capability() -> str:
    """The vector ISA torch runs its own kernels with (`ATEN_CPU_CAPABILITY` lowers it, e.g. to emulate AVX2)."""
    return torch.backends.cpu.get_cpu_capability()


@functools.cache
def _onednn_u8_is_exact() -> bool:
    """Whether oneDNN's u8 x s8 GEMM with zero point 128 is exact here (VNNI / AMX flags and the self-test)."""
    return _ONEDNN and bool(set(EXACT_U8_FLAGS) & _cpu_flags()) and _passes_self_test("onednn", u8_form=True)


@functools.cache
def available_kernels() -> tuple[str, ...]:
    """The kernels this process runs exactly, best first (`reference` always). Probed once per process."""
    lib = _Library.get()
    compiled = ("amx", "vnni", "avxvnni", "avx2", "i8mm", "dotprod")
    candidates = [name for name in compiled if lib is not None and lib.i8_has_isa(_ISA[name])]
    allowed = TORCH_CAPABILITY_KERNELS.get(_torch_capability(), ())
    candidates = [name for name in candidates if name not in _X86_KERNELS or name in allowed]
    if _ONEDNN:
        candidates.append("onednn")
    if lib is not None:
        candidates.append("portable")
    return (*[name for name in candidates if _passes_self_test(name)], "reference")


def int8_kernel_name() -> str:
    """The kernel new int8 weights are packed for: `ASYNCRL_INT8_KERNEL` if set (it must be available), else the
    best available one. Benchmarks record it."""
    return chosen_kernel(ENV_KERNEL, KERNELS, available_kernels(), _Library)


def prepare_int8(weight: QuantizedWeight, kernel: str | None = None) -> PackedInt8:
    """Lay an int8 `QuantizedWeight` out for `kernel` (default `int8_kernel_name()`), once per weight version."""
    kernel = kernel or int8_kernel_name()
    q = weight.q.contiguous()
    scale = weight.scale.to(torch.float32).contiguous()
    if kernel in _COMPILED_KERNELS:
        packed, padded_in = _pack(q, kernel)
        return PackedInt8(kernel, q, scale, packed, padded_in)
    if kernel == "onednn":
        u8_form = _onednn_u8_is_exact()
        if u8_form or q.shape[1] <= HALVES_MAX_IN_FEATURES:
            return PackedInt8(kernel, q, scale, torch.ops.onednn.qlinear_prepack(q, None), q.shape[1], u8_form)
        kernel = "reference"
    if kernel != "reference":
        raise ValueError(f"unknown int8 kernel {kernel!r} (valid: {', '.join(KERNELS)})")
    return PackedInt8(kernel, q, scale, None, q.shape[1])


def _pack(q: torch.Tensor, kernel: str) -> tuple[torch.Tensor, int]:
    """(out, in) int8 -> the C++ `kernel`'s layout (csrc/int8_gemm.cpp: pairs of inputs per column for avx2 and
    portable, w + 128 in groups of 4 for vnni and avxvnni, w in groups of 4 for dotprod, groups of 8 by column pairs
    for i8mm; zero-weight padding to PANEL columns and a multiple of 4 inputs, of 8 for i8mm)."""
    out_features, in_features = q.shape
    multiple = PADDED_IN_MULTIPLE.get(kernel, 8 if kernel in _MMLA_KERNELS else 4)  # the layout's group of inputs
    padded_in = -(-in_features // multiple) * multiple
    packed = torch.empty(-(-out_features // PANEL) * PANEL * padded_in, dtype=torch.uint8)
    lib = _Library.get()
    if lib is None:
        raise ValueError(f"the int8 {kernel} kernel needs the C++ library: {_Library.error}")
    status = lib.i8_pack(_ISA[kernel], q.data_ptr(), out_features, in_features, padded_in, packed.data_ptr())
    if status != 0:
        raise ValueError(f"int8 pack refused its arguments (status {status})")
    return packed, padded_in


def int8_linear(x: torch.Tensor, weight: PackedInt8, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) float -> (..., out) float32: the W8A8 product of `quantized_linear`, bit for bit."""
    shape = x.shape
    flat = fp32_rows(x)
    bias32 = None if bias is None else bias.to(torch.float32).contiguous()
    out = _KERNEL_FNS[weight.kernel](flat, weight, bias32)
    return out if len(shape) == 2 else out.reshape(*shape[:-1], weight.out_features)


def _compiled_linear(flat: torch.Tensor, weight: PackedInt8, bias: torch.Tensor | None) -> torch.Tensor:
    rows, in_features = flat.shape
    out = torch.empty((rows, weight.out_features), dtype=torch.float32)
    status = _Library.lib.i8_linear(  # type: ignore[union-attr]  # a packed weight implies the library loaded
        _ISA[weight.kernel], flat.data_ptr(), rows, in_features, in_features, weight.packed.data_ptr(),  # type: ignore[union-attr]
        weight.out_features, weight.padded_in, weight.scale.data_ptr(), None if bias is None else bias.data_ptr(),
        out.data_ptr(), weight.out_features, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"int8 {weight.kernel} kernel refused its arguments (status {status})")
    return out


def _quantize(flat: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token int8 activations (as uint8 q + 128 with offset 128) and their scales, as `quantize_activation`."""
    lib = _Library.get()
    if lib is None:
        q, s_x = quantize_activation(flat, "int8")
        return ((q.to(torch.int16) + offset).to(torch.uint8) if offset else q), s_x
    rows, in_features = flat.shape
    q = torch.empty((rows, in_features), dtype=torch.uint8 if offset else torch.int8)
    s_x = torch.empty(rows, dtype=torch.float32)
    isa = _ISA["avx2"] if lib.i8_has_isa(_ISA["avx2"]) else _ISA["portable"]
    lib.i8_quantize_rows(isa, flat.data_ptr(), rows, in_features, in_features, offset, q.data_ptr(), in_features,
                         s_x.data_ptr())  # fmt: skip
    return q, s_x


def _scale_output(acc: torch.Tensor, s_x: torch.Tensor, s_w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """acc (rows, out) fp32 holding float(exact integer) -> fl(fl(acc * s_x) * s_w) (+ bias), in place."""
    lib = _Library.get()
    if lib is None:
        out = acc * s_x[:, None] * s_w[None, :]
        return out if bias is None else out + bias
    rows, out_features = acc.shape
    lib.i8_scale_output(acc.data_ptr(), 0, acc.stride(0), rows, out_features, s_x.data_ptr(), s_w.data_ptr(),
                        None if bias is None else bias.data_ptr(), acc.data_ptr(), acc.stride(0))  # fmt: skip
    return acc


def _onednn_linear(flat: torch.Tensor, weight: PackedInt8, bias: torch.Tensor | None) -> torch.Tensor:
    ones, zero_points = torch.ones(weight.out_features), torch.zeros(weight.out_features, dtype=torch.long)
    if weight.onednn_u8:
        q, s_x = _quantize(flat, 128)
        acc = torch.ops.onednn.qlinear_pointwise(
            q, 1.0, 128, weight.packed, ones, zero_points, None, 1.0, 0, torch.float32, "none", [], ""
        )
        return _scale_output(acc, s_x, weight.scale, bias)
    q_x, s_x = quantize_activation(flat, "int8")
    rows = q_x.shape[0]
    halves = torch.cat((q_x.clamp_min(0), q_x.neg().clamp_min(0))).view(torch.uint8)
    acc = torch.ops.onednn.qlinear_pointwise(
        halves, 1.0, 0, weight.packed, ones, zero_points, None, 1.0, 0, torch.float32, "none", [], ""
    )
    out = (acc[:rows] - acc[rows:]) * s_x[:, None] * weight.scale[None, :]
    return out if bias is None else out + bias


def _reference_linear(flat: torch.Tensor, weight: PackedInt8, bias: torch.Tensor | None) -> torch.Tensor:
    return quantized_linear(flat, QuantizedWeight(weight.q, weight.scale, "int8"), bias)


_KERNEL_FNS: dict[str, Callable[[torch.Tensor, PackedInt8, torch.Tensor | None], torch.Tensor]] = {
    "amx": _compiled_linear,
    "vnni": _compiled_linear,
    "avxvnni": _compiled_linear,
    "avxvnni_emulated": _compiled_linear,
    "i8mm": _compiled_linear,
    "i8mm_emulated": _compiled_linear,
    "avx2": _compiled_linear,
    "dotprod": _compiled_linear,
    "onednn": _onednn_linear,
    "portable": _compiled_linear,
    "reference": _reference_linear,
}


def integer_product(q_x: torch.Tensor, weight: PackedInt8) -> torch.Tensor:
    """The int32 accumulator alone of a C++ kernel (any of `_COMPILED_KERNELS`): q_x (rows, in) any int8 ->
    (rows, out)."""
    lib = _Library.get()
    assert lib is not None and weight.kernel in _COMPILED_KERNELS, "needs a C++ kernel's weight"
    rows, in_features = q_x.shape
    padded = torch.zeros((rows, weight.padded_in), dtype=torch.int8)
    padded[:, :in_features] = q_x
    acc = torch.empty((rows, weight.out_features), dtype=torch.int32)
    status = lib.i8_gemm_s32(_ISA[weight.kernel], padded.data_ptr(), rows, weight.padded_in,
                             weight.packed.data_ptr(), weight.out_features, acc.data_ptr(), weight.out_features)  # type: ignore[union-attr]  # fmt: skip
    if status != 0:
        raise ValueError(f"int8 {weight.kernel} kernel refused its arguments (status {status})")
    return acc


def _passes_self_test(kernel: str, u8_form: bool = False) -> bool:
    """Whether `kernel` gives the reference's exact result here on operands that expose int16 saturation, rounded
    fp32 sums beyond 2^24 (in_features 1100; 1040 for oneDNN's halves), 40 columns (a partial panel) and 1-33 rows."""
    generator = torch.Generator().manual_seed(0)
    in_features = 1100 if kernel != "onednn" or u8_form else HALVES_MAX_IN_FEATURES
    q = torch.randint(100, 128, (40, in_features), dtype=torch.int8, generator=generator)
    q[::2] *= -1
    weight = QuantizedWeight(q=q, scale=torch.rand(40, generator=generator) + 0.5, scheme="int8")
    try:
        if kernel == "onednn":
            packed = PackedInt8(kernel, q, weight.scale, torch.ops.onednn.qlinear_prepack(q, None), 0, u8_form)
        else:
            packed = prepare_int8(weight, kernel)
        for rows in (1, 5, 33):
            x = torch.randn(rows, in_features, generator=generator).abs() + 1.0  # every q_x near +127
            x[1::2] *= -1
            if not torch.equal(int8_linear(x, packed, None), quantized_linear(x, weight)):
                return False
    except RuntimeError:  # an operator this torch build lacks
        return False
    return True
