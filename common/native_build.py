"""Compile our C++ kernel libraries (one `.cpp` each, plain C ABI) into a per-machine cache, without torch.

The rollout engine's live in `rollout_workers/embedded/csrc/` (`rollout_workers/embedded/native_build.py` names
them), the learner's in `learner/csrc/` (`learner/fused_ops.py`). A source is compiled with the system C++
compiler (`$CXX`, else c++ / g++ / clang++; no torch headers) into `$ASYNCRL_CACHE/kernels` (default
~/.cache/asyncrl/kernels), named by a digest of the source, the compiler's version, the flags and the machine, so
an edit rebuilds and concurrent processes share one file (each build writes a temporary name, then renames it into
place). The driver builds the ones a run needs before its processes start (`asyncrl/kernels.py`, with a progress
bar); the processes load them with `NativeLibrary`. This module imports no torch: the driver imports it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common.builtin_model import cache_root

ENV_ISA_CAP = "ASYNCRL_ISA_CAP"
ISA_CAPS = ("avx2",)
"""The ISA caps `ASYNCRL_ISA_CAP` takes: every library's run-time ISA probe answers as an AVX2-only CPU would."""
INCLUDE = Path(__file__).with_name("csrc")
"""Headers every kernel may include (`fp32_lanes.h`): on the include path, and part of each library's digest."""
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off")
"""-ffp-contract=off: no fused multiply-adds the source does not write, so fp32 results round like torch's ops."""
ERROR_LINES = 6
"""Compiler lines a build failure quotes (its `error:` lines first)."""


class KernelBuildError(RuntimeError):
    """A kernel library that could not be built: which source, with which compiler, and the compiler's message."""

    def __init__(self, source_name: str, compiler_name: str, message: str) -> None:
        super().__init__(f"{compiler_name} failed on {source_name}: {message}")
        self.source_name, self.compiler_name, self.message = source_name, compiler_name, message


def isa_cap() -> str:
    """`ASYNCRL_ISA_CAP` ('' where unset); a ValueError naming the variable for a value not in ISA_CAPS."""
    cap = os.environ.get(ENV_ISA_CAP, "")
    if cap and cap not in ISA_CAPS:
        raise ValueError(f"{ENV_ISA_CAP}={cap!r} is not one of {', '.join(ISA_CAPS)}")
    return cap


def isa_variant(best: int) -> int:
    """The `ISA_VARIANTS` path to run (common/csrc/isa_variants.h: 2 AVX-512F, 1 AVX2, 0 the baseline) on a CPU whose
    best is `best`: at most AVX2 under `ASYNCRL_ISA_CAP=avx2`."""
    return min(best, 1) if isa_cap() == "avx2" else best


def compiler() -> str:
    """The C++ compiler to build with: `$CXX`, else the first of c++, g++, clang++ on the PATH."""
    for name in (os.environ.get("CXX", ""), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    raise RuntimeError("no C++ compiler found ($CXX, c++, g++, clang++)")


@functools.cache
def _compiler_version(cxx: str) -> str:
    """`cxx --version` (part of a kernel's cache key); a compiler that cannot say keys by its name, and its compile
    is what reports the fault (a traceback ended the run before any kernel was named)."""
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    except (subprocess.CalledProcessError, OSError) as err:
        return f"{cxx}: no version ({type(err).__name__})"


@dataclass(frozen=True, slots=True)
class KernelTarget:
    """Where the library of `source` lives in the cache for this compiler and machine."""

    source: Path
    compiler: str
    path: Path

    @property
    def source_name(self) -> str:
        return self.source.name

    @property
    def cached(self) -> bool:
        return self.path.is_file()


def _flag_attempts() -> list[list[str]]:
    flags = [*BASE_FLAGS, f"-I{INCLUDE}"]
    return [[*flags, "-fopenmp"], flags]  # the second: a compiler without OpenMP, single-threaded


def kernel_target(source: Path) -> KernelTarget:
    """The cached library's path of the C++ file `source` (built or not). Raises RuntimeError without a compiler,
    FileNotFoundError for a missing source (naming the sources its directory has)."""
    if not source.is_file():
        known = ", ".join(sorted(path.name for path in source.parent.glob("*.cpp"))) or "none"
        raise FileNotFoundError(f"no kernel source {source.name!r} in {source.parent} (known: {known})")
    cxx = compiler()
    salt = "\0".join([_compiler_version(cxx), *BASE_FLAGS, "-fopenmp", platform.machine()])  # not the -I path
    headers = b"".join(header.read_bytes() for header in sorted(INCLUDE.glob("*.h")))
    digest = hashlib.sha256(source.read_bytes() + headers + salt.encode()).hexdigest()[:16]
    return KernelTarget(source, cxx, cache_root() / "kernels" / f"{source.stem}-{digest}.so")


def compiler_message(stderr: str) -> str:
    """The lines of a compiler's output that say what went wrong: its `error:` lines (at most ERROR_LINES), else
    its last lines."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return "\n".join((errors or lines[-ERROR_LINES:])[:ERROR_LINES]) or "(no output)"


def build_library(source: Path) -> Path:
    """The shared library of the C++ file `source` for this compiler: from the cache, or compiled into it now.

    Built with OpenMP where the compiler has it, without otherwise. Raises KernelBuildError (a RuntimeError: the
    compiler failed, with its message), RuntimeError (no compiler) or OSError."""
    target = kernel_target(source)
    if target.cached:
        return target.path
    target.path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.path.parent) as tmp_dir:
        built = Path(tmp_dir) / target.path.name
        for flags in _flag_attempts():
            command = [target.compiler, *flags, str(source), "-o", str(built)]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode == 0:
                break
        else:
            raise KernelBuildError(source.name, target.compiler, compiler_message(result.stderr))
        os.replace(built, target.path)
    return target.path


class NativeLibrary:
    """One C++ library of a kernel module (`source`), built or loaded on first `get()` (once per process,
    thread-safe) and declared by `declare` (argument types, ABI check); `lib` stays None where it could not be (no
    compiler, a failed build, a wrong ABI), and `error` says why (printed once to stderr with `note`, where given).
    The module then runs its torch fallback."""

    def __init__(self, source: Path, declare: Callable[[ctypes.CDLL], ctypes.CDLL], note: str = "") -> None:
        self.source, self.declare, self.note = source, declare, note
        self.lib: ctypes.CDLL | None = None
        self.tried = False
        self.error = ""
        self._lock = threading.Lock()

    @property
    def source_name(self) -> str:
        return self.source.name

    def load(self) -> ctypes.CDLL:
        """Build (or find in the cache), load and declare the library; raises where it cannot."""
        return self.declare(ctypes.CDLL(str(build_library(self.source))))

    def get(self) -> ctypes.CDLL | None:
        if self.tried:
            return self.lib
        with self._lock:
            if not self.tried:
                try:
                    self.lib = self.load()
                except (OSError, RuntimeError, ValueError) as err:
                    self.error = f"{type(err).__name__}: {err}"[:500]
                    if self.note:
                        print(f"{self.note}: {self.error}", file=sys.stderr)
                self.tried = True
        return self.lib

    def require(self, what: str) -> ctypes.CDLL:
        """The library, for a caller that has no torch fallback at this point: raises, naming `what` and why the
        library could not be built, where `get()` is None."""
        lib = self.get()
        if lib is None:
            raise RuntimeError(f"{what}: {self.error}")
        return lib
