"""quant_sync's C++ library (`csrc/quantize.cpp`): the publication's int8 quantizer and its error, one pass a row.

Each step the learner quantizes every published linear weight (`quant_sync.quantizers.quantize_weight`) and measures
what that cost (`quant_sync.uaq.quant_error_by_type`). torch runs the quantizer as six passes over memory and the
error as five; on the ~100M decode shape of `asyncrl bench e2e` the two took 0.16-0.33 and 0.11-0.29 s a step (Zen
4, 2 threads). The kernels read a row twice to quantize it (its max, then the divisions) and once for its error.
`int8_rows` gives torch's bits (tested); `int8_row_errors` sums in another order (a metric). Built on first use by
`common.native_build` (the driver compiles it up front with the other kernels, `asyncrl.kernels`); where it cannot
be built, `LIBRARY.get()` is None and the callers run their torch ops.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from common.native_build import NativeLibrary, isa_variant

SOURCE = Path(__file__).with_name("csrc") / "quantize.cpp"
ABI_VERSION = 1
MIN_ELEMENTS = 1 << 12
"""Weights below this many elements stay on torch's ops (a call costs about what it saves there)."""


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    if lib.qs_abi_version() != ABI_VERSION:
        raise ValueError(f"quantize ABI {lib.qs_abi_version()}, expected {ABI_VERSION}")
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.qs_int8_rows.argtypes, lib.qs_int8_rows.restype = [i32, p, i64, i64, p, p, i32], i64
    lib.qs_int8_error.argtypes, lib.qs_int8_error.restype = [i32, p, p, p, i64, i64, p, p, i32], None
    return lib


LIBRARY = NativeLibrary(SOURCE, _declare, note="the publication's int8 quantizer is unavailable: torch ops")


@functools.cache
def _cpu_isa() -> int:
    lib = LIBRARY.get()
    return 0 if lib is None else int(lib.qs_isa())


def best_isa() -> int:
    """The best vector path this CPU runs (2 AVX-512F, 1 AVX2, 0 baseline), at most AVX2 under `ASYNCRL_ISA_CAP`."""
    return isa_variant(_cpu_isa())


def takes(weight: torch.Tensor) -> bool:
    """Whether the kernels take this tensor: the library built, and a contiguous 2-D fp32 CPU tensor, not tiny."""
    return (
        weight.dim() == 2
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.is_contiguous()
        and weight.numel() >= MIN_ELEMENTS
        and type(weight) is torch.Tensor
        and LIBRARY.get() is not None
    )


def int8_rows(weight: torch.Tensor, isa: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`quantize_int8_rows(weight)`'s (q, scale) from the kernel, or None where a row holds a NaN or an infinity
    (the caller runs torch's ops, whose semantics those rows keep). `weight` must pass `takes`."""
    rows, cols = weight.shape
    q = torch.empty((rows, cols), dtype=torch.int8)
    scale = torch.empty(rows, dtype=torch.float32)
    weight = weight.detach()
    poisoned = LIBRARY.require("quant_sync quantizer").qs_int8_rows(
        best_isa() if isa is None else isa, weight.data_ptr(), rows, cols, q.data_ptr(), scale.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return None if poisoned else (q, scale)


def int8_row_errors(weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                    isa: int | None = None) -> tuple[float, float]:  # fmt: skip
    """(sum over rows of ||q * scale - w||^2, of ||w||^2) of an int8 per-row quantization of `weight` (which must
    pass `takes`; q int8 and scale fp32 contiguous, of its shape)."""
    rows, cols = weight.shape
    if q.shape != weight.shape or q.dtype != torch.int8 or scale.shape != (rows,) or scale.dtype != torch.float32:
        raise ValueError(f"int8_row_errors: q {tuple(q.shape)} {q.dtype}, scale {tuple(scale.shape)} {scale.dtype} "
                         f"for a weight of {tuple(weight.shape)}")  # fmt: skip
    err = torch.empty(rows, dtype=torch.float64)
    norm = torch.empty(rows, dtype=torch.float64)
    weight, q, scale = weight.detach(), q.contiguous(), scale.contiguous()  # held through the call
    LIBRARY.require("quant_sync quantizer").qs_int8_error(
        best_isa() if isa is None else isa, weight.data_ptr(), q.data_ptr(), scale.data_ptr(), rows, cols,
        err.data_ptr(), norm.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return float(err.sum()), float(norm.sum())
