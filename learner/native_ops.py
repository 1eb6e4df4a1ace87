"""The learner's C++ library (`csrc/train_ops.cpp`): its loading, the vector path it runs, and its transposed copy.

`learner.fused_ops` (RMSNorm, SwiGLU) and `learner.fp32_gemm` (the weight gradient's operands) call it. Built on
first use by `common.native_build` (the driver compiles it up front with the engine's kernels, `asyncrl.kernels`);
where it cannot be built, `LIBRARY.get()` is None and each caller runs its torch ops.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from common.native_build import NativeLibrary, isa_variant

SOURCE = Path(__file__).with_name("csrc") / "train_ops.cpp"
ABI_VERSION = 3
ISAS = ("baseline", "avx2", "avx512")
"""The library's vector paths by number (`to_isa`): every one gives the same bits."""
TRANSPOSE_MIN_ELEMENTS = 1 << 12
"""Matrices below this many elements (16 KB) are transposed by torch: the call costs about what it saves there (Zen 4,
2 threads, the AVX2 blocks: 2,048 elements 3.5 us against torch's 3.9, 8,192 4.1 against 7.8, 846 x 256 22 against
115)."""


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    if lib.to_abi_version() != ABI_VERSION:
        raise ValueError(f"train_ops ABI {lib.to_abi_version()}, expected {ABI_VERSION}")
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.to_swiglu.argtypes = [i32, p, p, p, i64, i32]
    lib.to_swiglu_backward.argtypes = [i32, p, p, p, p, p, i64, i32]
    lib.to_rms_norm.argtypes = [i32, p, i64, i64, p, f32, p, p, i32]
    lib.to_norm_partial_rows.argtypes, lib.to_norm_partial_rows.restype = [i64], i64
    lib.to_rms_norm_backward.argtypes = [i32, p, p, p, p, i64, i64, p, p, i32]
    lib.to_transpose.argtypes = [i32, p, i64, i64, p, i32]
    return lib


LIBRARY = NativeLibrary(
    SOURCE, _declare, note="the learner's fused RMSNorm and SwiGLU and its tiled transpose are unavailable: torch ops"
)


def lib() -> ctypes.CDLL:
    """The loaded library; raises (with why it could not be built) where there is none."""
    return LIBRARY.require("learner native ops")


@functools.cache
def _cpu_isa() -> int:
    return int(lib().to_isa())


def best_isa() -> int:
    """The best vector path this CPU runs (an index of `ISAS`), at most AVX2 under `ASYNCRL_ISA_CAP=avx2`."""
    return isa_variant(_cpu_isa())


def kernel_isa() -> str:
    """The vector path the fused ops run here (`avx512`, `avx2`, `baseline`), or `unavailable` (no library)."""
    return "unavailable" if LIBRARY.get() is None else ISAS[best_isa()]


def transpose(matrix: torch.Tensor) -> torch.Tensor:
    """`matrix.t().contiguous()` of a 2-D fp32 CPU tensor, as a tiled copy on torch's threads where the library is
    built and the matrix is contiguous and not tiny: 64 x 64 tiles of 8 x 8 blocks, each block transposed in AVX2
    registers on the `avx2` and `avx512` paths. torch's own transposed copy ran at 3-9 GB/s on the learner's shapes;
    the blocks through a local array (the `baseline` path, and every path before 2026-12-05) 10-20 GB/s in a
    decode-shape step and 20-35 alone; the AVX2 blocks 18-24 in the step and 38-95 alone (Zen 4, 2 threads: the
    step's copies 0.32 -> 0.17 s). The same values either way: a copy."""
    loaded = LIBRARY.get()
    if (
        loaded is None
        or matrix.dim() != 2
        or matrix.dtype != torch.float32
        or matrix.device.type != "cpu"
        or not matrix.is_contiguous()
        or matrix.numel() < TRANSPOSE_MIN_ELEMENTS
    ):
        return matrix.t().contiguous()
    rows, cols = matrix.shape
    out = torch.empty((cols, rows), dtype=torch.float32)
    loaded.to_transpose(best_isa(), matrix.data_ptr(), rows, cols, out.data_ptr(), torch.get_num_threads())
    return out
