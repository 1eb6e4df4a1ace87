"""Compile our C++ kernels once per machine, in the driver, before the rollout workers and the learner start.

The rollout workers load small C++ libraries (`rollout_workers/embedded/csrc/*.cpp`), the learner its own
(`learner/csrc/`: `learner.fused_ops`) and quant_sync's quantizer (`quant_sync/csrc/quantize.cpp`), built and cached
by `common/native_build.py`. Built inside the
workers, a first run sat for 10-60 s (2 cores, with or without neighbours) with nothing on the console, every
worker compiling the same files at once. `compile_kernels` builds the ones the
config will load (`kernel_sources`), two at a time, with a line per kernel and its elapsed time on a terminal
(`console.KernelBuilds`) and plain lines elsewhere; the workers then find them in the cache. A second start finds
every one cached and prints nothing. A kernel that does not compile is not fatal, as in the workers: its error
(the kernel, the compiler and the compiler's own message) and the slower path run instead are printed to stderr,
and the run goes on. Torch-free: the driver imports no torch.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import learner  # its csrc/ only: the package's __init__ imports nothing
import quant_sync  # the same
from asyncrl.console import KernelBuilds
from common.native_build import KernelBuildError, build_library, compiler, kernel_target
from rollout_workers.embedded import native_build as engine_build

LEARNER_SOURCES = ("train_ops.cpp", "train_attention.cpp")
"""The learner's kernel sources (`learner/csrc/`); the others are the rollout engine's and quant_sync's."""
QUANT_SYNC_SOURCES = ("quantize.cpp",)
"""quant_sync's (`quant_sync/csrc/`): the int8 quantizer the learner publishes with (`quant_sync.native`)."""
FALLBACKS = {
    "fused_decode.cpp": "the rollout engine runs torch ops for RMSNorm, RoPE, decode attention and the fp32 linears "
    "(more per-token work)",
    "weight_only.cpp": "the rollout engine runs weight-only linears dequantized tile by tile with torch (several "
    "times slower)",
    "int8_gemm.cpp": "the rollout engine runs int8 linears on oneDNN's u8 x s8 GEMM, or on the torch reference where "
    "oneDNN is inexact",
    "fp8_gemm.cpp": "the rollout engine runs FP8 linears on the torch reference (e4m3 values as fp32, torch's matmul)",
    "lora_gemm.cpp": "the rollout engine runs LoRA adapters on torch's GEMMs",
    "train_ops.cpp": "the learner runs HF's torch ops for RMSNorm and SwiGLU (more passes over the activations)",
    "quantize.cpp": "the learner quantizes the int8 weights it publishes, and measures their error, with torch's ops "
    "(about 0.2 s more a step on a 100M model)",
}
"""What runs instead of each library when it is missing (each kernel module's own fallback)."""
PARALLEL_BUILDS = 2
"""Compiles at once (each is one single-threaded compiler process): the machines here have 2 cores."""


@dataclass(frozen=True, slots=True)
class KernelBuild:
    """One kernel's outcome: compiled now (`seconds`), found in the cache, or failed (`error`)."""

    source_name: str
    cached: bool
    seconds: float = 0.0
    error: str = ""


def kernel_sources(cfg: Any) -> tuple[str, ...]:
    """The `csrc/` sources the rollout workers of `cfg` will load: none off the embedded engine on CPU; else the
    fused decode ops and the weight-only / fp32 row kernels (every CPU engine), and the scheme's and LoRA's; then
    the learner's: `train_ops.cpp` (`learner.native_ops`: the fused ops, and the transpose of `learner.fp32_gemm`'s
    oneDNN weight gradient) and `train_attention.cpp` (the fused attention, with `learner.fused_ops`), and with
    `quant.scheme=int8` quant_sync's `quantize.cpp` (the learner's publication)."""
    learner_sources = [name for name in LEARNER_SOURCES if cfg.learner.fused_ops or (
        name == "train_ops.cpp" and cfg.learner.fp32_gemm != "blas")]  # fmt: skip
    learner_sources += list(QUANT_SYNC_SOURCES) if cfg.quant.scheme == "int8" else []
    rollout = cfg.rollout
    if rollout.backend != "embedded" or not str(rollout.device).startswith("cpu"):
        return tuple(learner_sources)
    sources = ["fused_decode.cpp", "weight_only.cpp"]
    scheme = cfg.quant.scheme
    if scheme == "int8":
        sources.append("int8_gemm.cpp")
    if scheme in ("fp8", "fp8_trunc"):
        sources.append("fp8_gemm.cpp")
    if cfg.model.lora.rank > 0:
        sources.append("lora_gemm.cpp")
    return tuple(sources + learner_sources)


def source_path(source_name: str) -> Path:
    """Where the kernel source `source_name` lives: `learner/csrc/` for the learner's, `quant_sync/csrc/` for
    quant_sync's, else the engine's `csrc/`."""
    if source_name in LEARNER_SOURCES:
        return Path(learner.__file__).with_name("csrc") / source_name
    if source_name in QUANT_SYNC_SOURCES:
        return Path(quant_sync.__file__).with_name("csrc") / source_name
    return engine_build.CSRC / source_name


def compile_kernels(cfg: Any, sources: tuple[str, ...] | None = None, out: Any = None) -> list[KernelBuild]:
    """Build every kernel of `sources` (default `kernel_sources(cfg)`) missing from the cache, showing progress on
    the console (`logging.console` and a terminal: a bar per kernel; else plain lines, or `out(line)` where given).
    Returns each kernel's outcome; failures are printed to stderr with the fallback the engine will run."""
    sources = kernel_sources(cfg) if sources is None else sources
    if not sources:
        return []
    try:
        targets = [kernel_target(source_path(name)) for name in sources]
    except RuntimeError as err:  # no compiler on the machine: every library falls back
        failed = [KernelBuild(name, False, 0.0, str(err)) for name in sources]
        _report_failures(failed)
        return failed
    missing = [target.source_name for target in targets if not target.cached]
    results = {target.source_name: KernelBuild(target.source_name, True) for target in targets if target.cached}
    if missing:
        view = KernelBuilds(cfg.logging.console, out)
        view.start(missing, compiler())
        try:
            with ThreadPoolExecutor(max_workers=PARALLEL_BUILDS, thread_name_prefix="kernel-build") as pool:
                for build in pool.map(lambda name: _build(name, view), missing):
                    results[build.source_name] = build
        finally:
            view.close()
    outcome = [results[name] for name in sources]
    _report_failures([build for build in outcome if build.error])
    return outcome


def _build(source_name: str, view: KernelBuilds) -> KernelBuild:
    view.compiling(source_name)
    start = time.monotonic()
    try:
        build_library(source_path(source_name))
    except (KernelBuildError, OSError, RuntimeError) as err:
        message = (
            f"{err.compiler_name}: {err.message}"
            if isinstance(err, KernelBuildError)
            else f"{type(err).__name__}: {err}"
        )
        view.finished(source_name, time.monotonic() - start, error="see below")
        return KernelBuild(source_name, False, time.monotonic() - start, message)
    seconds = time.monotonic() - start
    view.finished(source_name, seconds)
    return KernelBuild(source_name, False, seconds)


def _report_failures(failures: list[KernelBuild]) -> None:
    for build in failures:
        fallback = FALLBACKS.get(build.source_name, "its module runs its torch fallback")
        message = "\n    ".join(build.error.splitlines())
        print(f"asyncrl: kernel {build.source_name} did not compile:\n    {message}\n  {fallback} instead (slower); "
              "set $CXX to another C++ compiler to retry", file=sys.stderr)  # fmt: skip
