"""Compile the embedded engine's C++ kernel libraries (`csrc/*.cpp`) into a per-machine cache, without torch.

A source is compiled with the system C++ compiler (`$CXX`, else c++ / g++ / clang++; no torch headers) into
`$ASYNCRL_CACHE/kernels` (default ~/.cache/asyncrl/kernels), named by a digest of the source, the compiler's
version, the flags and the machine, so an edit rebuilds and concurrent processes share one file (each build writes
a temporary name, then renames it into place). Measured on the 2-core Zen 4 machines under load (load average 9):
int8_gemm 9 s, fused_decode 22 s, weight_only 13 s, fp8_gemm 7 s, lora_gemm 3 s of wall time (2.1, 3.9, 2.5, 1.4,
0.6 s of CPU). The driver builds the ones a run needs before the rollout workers start (`asyncrl/kernels.py`, with
a progress bar); the workers load them with `native.py`. This module imports no torch: the driver imports it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from common.builtin_model import cache_root

CSRC = Path(__file__).with_name("csrc")
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off")
"""-ffp-contract=off: no fused multiply-adds the source does not write, so fp32 results round like torch's ops."""
ERROR_LINES = 6
"""Compiler lines a build failure quotes (its `error:` lines first)."""


class KernelBuildError(RuntimeError):
    """A kernel library that could not be built: which source, with which compiler, and the compiler's message."""

    def __init__(self, source_name: str, compiler_name: str, message: str) -> None:
        super().__init__(f"{compiler_name} failed on {source_name}: {message}")
        self.source_name, self.compiler_name, self.message = source_name, compiler_name, message


def compiler() -> str:
    """The C++ compiler to build with: `$CXX`, else the first of c++, g++, clang++ on the PATH."""
    for name in (os.environ.get("CXX", ""), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    raise RuntimeError("no C++ compiler found ($CXX, c++, g++, clang++)")


@functools.cache
def _compiler_version(cxx: str) -> str:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout


@dataclass(frozen=True, slots=True)
class KernelTarget:
    """Where the library of `csrc/<source_name>` lives in the cache for this compiler and machine."""

    source_name: str
    compiler: str
    path: Path

    @property
    def cached(self) -> bool:
        return self.path.is_file()


def _flag_attempts() -> list[list[str]]:
    return [[*BASE_FLAGS, "-fopenmp"], list(BASE_FLAGS)]  # the second: a compiler without OpenMP, single-threaded


def kernel_target(source_name: str) -> KernelTarget:
    """The cached library's path of `csrc/<source_name>` (built or not). Raises RuntimeError without a compiler,
    FileNotFoundError for an unknown source."""
    source = CSRC / source_name
    if not source.is_file():
        known = ", ".join(sorted(path.name for path in CSRC.glob("*.cpp")))
        raise FileNotFoundError(f"no kernel source {source_name!r} in {CSRC} (known: {known})")
    cxx = compiler()
    salt = "\0".join([_compiler_version(cxx), *_flag_attempts()[0], platform.machine()])
    digest = hashlib.sha256(source.read_bytes() + salt.encode()).hexdigest()[:16]
    return KernelTarget(source_name, cxx, cache_root() / "kernels" / f"{source.stem}-{digest}.so")


def compiler_message(stderr: str) -> str:
    """The lines of a compiler's output that say what went wrong: its `error:` lines (at most ERROR_LINES), else
    its last lines."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return "\n".join((errors or lines[-ERROR_LINES:])[:ERROR_LINES]) or "(no output)"


def build_library(source_name: str) -> Path:
    """The shared library of `csrc/<source_name>` for this compiler: from the cache, or compiled into it now.

    Built with OpenMP where the compiler has it, without otherwise. Raises KernelBuildError (a RuntimeError: the
    compiler failed, with its message), RuntimeError (no compiler) or OSError."""
    target = kernel_target(source_name)
    if target.cached:
        return target.path
    target.path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.path.parent) as tmp_dir:
        built = Path(tmp_dir) / target.path.name
        for flags in _flag_attempts():
            command = [target.compiler, *flags, str(CSRC / source_name), "-o", str(built)]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode == 0:
                break
        else:
            raise KernelBuildError(source_name, target.compiler, compiler_message(result.stderr))
        os.replace(built, target.path)
    return target.path
