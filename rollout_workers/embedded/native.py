"""Load the embedded engine's small C++ kernel libraries (plain C ABI, called through ctypes).

`common/native_build.py` compiles a source under `csrc/` once per machine into a cache (the driver does it before the
rollout workers start, with a progress bar: `asyncrl/kernels.py`); this module loads it, declares its functions and
keeps the process going without it where it cannot be built (each kernel module then runs its torch fallback).
Kernels pick their instruction set at run time (function-level target attributes and cpuid), so one build serves
every CPU of an architecture.

`ASYNCRL_ISA_CAP=avx2` caps every library's run-time ISA probe at AVX2 + FMA (no AVX-512, VNNI or BF16 paths),
whatever the CPU has: with `ATEN_CPU_CAPABILITY=avx2`, `ONEDNN_MAX_CPU_ISA=AVX2` and `MKL_ENABLE_INSTRUCTIONS=AVX2`
(set before torch starts) it runs an AVX2-only machine's kernels on a newer core (`asyncrl bench engine` under
`ASYNCRL_BENCH_ISA=avx2`).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence

import torch

from common import native_build
from common.native_build import ENV_ISA_CAP, ISA_CAPS, isa_cap  # noqa: F401  (API: the engine's kernels read the cap)
from rollout_workers.embedded.native_build import BASE_FLAGS, CSRC, build_library, compiler  # noqa: F401  (API)

_AVX2_PROBES: dict[str, Callable[[Callable[..., int]], Callable[..., int]]] = {
    "i8_has_isa": lambda probe: lambda isa: probe(isa) if isa in (0, 1) else 0,  # portable, avx2
    "f8_has_isa": lambda probe: lambda isa: probe(isa) if isa == 0 else 0,  # portable (bf16 needs AVX512-BF16)
    "wo_has_isa": lambda probe: lambda isa: probe(isa) if isa in (0, 1) else 0,  # reference, avx2
    "fd_linear_isa": lambda probe: lambda: min(probe(), 1),  # 2 AVX-512, 1 AVX2 + FMA, 0 portable
    "lr_has_avx512f": lambda probe: lambda: 0,
    "lr_has_amx": lambda probe: lambda: 0,
}
"""Each library's ISA probe (by symbol) as `ASYNCRL_ISA_CAP=avx2` answers it: only what an AVX2-only CPU runs."""


def _capped(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` with its ISA probes answering under `isa_cap()` (unchanged without a cap)."""
    if not isa_cap():
        return lib
    for symbol, cap in _AVX2_PROBES.items():
        if hasattr(lib, symbol):
            setattr(lib, symbol, cap(getattr(lib, symbol)))
    return lib


class NativeLibrary(native_build.NativeLibrary):
    """A `csrc/` library of a kernel module (`common.native_build.NativeLibrary`), its ISA probes answering under
    `ASYNCRL_ISA_CAP`; a bad cap is an error, not a reason to run without the library."""

    def __init__(self, source_name: str, declare: Callable[[ctypes.CDLL], ctypes.CDLL], note: str = "") -> None:
        super().__init__(CSRC / source_name, declare, note)

    def load(self) -> ctypes.CDLL:
        return _capped(super().load())

    def get(self) -> ctypes.CDLL | None:
        isa_cap()
        return super().get()


def chosen_kernel(env_var: str, kernels: Sequence[str], available: Sequence[str], library: NativeLibrary) -> str:
    """The kernel a module packs new weights for: `$env_var` if set (one of `kernels`, and available here: else a
    ValueError naming what runs), else the best available one (`available`, best first)."""
    forced = os.environ.get(env_var, "")
    if not forced:
        return available[0]
    if forced not in kernels:
        raise ValueError(f"{env_var}={forced!r} is not one of {', '.join(kernels)}")
    if forced not in available:
        detail = f" (C++ library: {library.error})" if library.error else ""
        raise ValueError(f"{env_var}={forced}: this machine runs only {', '.join(available)}{detail}")
    return forced


def fp32_rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., in) as the contiguous fp32 (rows, in) matrix the kernels take, without a copy (or an op) where it is
    one already."""
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1])
    if x.dtype != torch.float32:
        x = x.to(torch.float32)
    return x if x.is_contiguous() else x.contiguous()
