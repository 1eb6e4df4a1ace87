"""The learner's C++ library (`csrc/train_ops.cpp`): its loading, the vector path it runs, its transposed copy and the
sums of a parameter's update.

`learner.fused_ops` (RMSNorm, SwiGLU), `learner.fp32_gemm` (the weight gradient's operands) and `learner.update`
(norm_update's sums) call it. Built on first use by `common.native_build` (the driver compiles it up front with the
engine's kernels, `asyncrl.kernels`); where it cannot be built, `LIBRARY.get()` is None and each caller runs its torch
ops.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from common.native_build import NativeLibrary, isa_variant

SOURCE = Path(__file__).with_name("csrc") / "train_ops.cpp"
ABI_VERSION = 4
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
    lib.to_update_sum_chunks.argtypes, lib.to_update_sum_chunks.restype = [i64], i64
    lib.to_update_sums.argtypes = [i32, p, p, i64, p, p, i32]
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


def update_sums(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor | None:
    """(sum of (new - old)^2, sum of old^2) in float64, as a (2,) tensor, in one pass over two same-shaped contiguous
    fp32 CPU tensors on torch's threads; None where the library is not built or the tensors are not such (the caller
    sums in torch). Each element's difference and squares in float64, summed in 8 lanes per chunk of 65,536 and the
    chunks in order: the same bits at any thread count and vector path; against torch's float64 dots, rounding only.
    torch's chunked float64 conversion, subtraction and two dots read and wrote each element 6-8 times (the 101M
    decode model's norm_update: 0.12 s a step on 2 threads)."""
    loaded = LIBRARY.get()
    if (
        loaded is None
        or new.dtype != torch.float32
        or old.dtype != torch.float32
        or new.device.type != "cpu"
        or old.device.type != "cpu"
        or new.shape != old.shape
        or not new.is_contiguous()
        or not old.is_contiguous()
    ):
        return None
    partials = torch.empty(2 * loaded.to_update_sum_chunks(new.numel()), dtype=torch.float64)
    out = torch.empty(2, dtype=torch.float64)
    loaded.to_update_sums(best_isa(), new.data_ptr(), old.data_ptr(), new.numel(), partials.data_ptr(),
                          out.data_ptr(), torch.get_num_threads())  # fmt: skip
    return out
