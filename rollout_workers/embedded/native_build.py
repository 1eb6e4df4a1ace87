"""The embedded engine's C++ kernel sources (`csrc/*.cpp`), by name, for `common.native_build` to compile.

Measured on the 2-core Zen 4 machines under load (load average 9): int8_gemm 9 s, fused_decode 22 s, weight_only
13 s, fp8_gemm 7 s, lora_gemm 3 s of wall time (2.1, 3.9, 2.5, 1.4, 0.6 s of CPU). The driver builds the ones a run
needs before the rollout workers start (`asyncrl/kernels.py`, with a progress bar); the workers load them with
`native.py`. This module imports no torch: the driver imports it.
"""

from __future__ import annotations

from pathlib import Path

from common import native_build
from common.native_build import BASE_FLAGS, KernelBuildError, KernelTarget, compiler  # noqa: F401  (API)

CSRC = Path(__file__).with_name("csrc")


def kernel_target(source_name: str) -> KernelTarget:
    """The cached library's path of `csrc/<source_name>` (built or not); errors as `common.native_build`'s."""
    return native_build.kernel_target(CSRC / source_name)


def build_library(source_name: str) -> Path:
    """The shared library of `csrc/<source_name>`: from the cache, or compiled into it now."""
    return native_build.build_library(CSRC / source_name)
