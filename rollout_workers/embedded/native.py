"""Build and load the embedded engine's small C++ kernel libraries (plain C ABI, called through ctypes).

A source under `csrc/` is compiled on first use with the system C++ compiler (`$CXX`, else c++ / g++ / clang++; no
torch headers, a few seconds) into `$ASYNCRL_CACHE/kernels` (default ~/.cache/asyncrl), named by a digest of the
source, the compiler's version, the flags and the machine, so an edit rebuilds and concurrent workers share one
file (each build writes a temporary name, then renames it into place). Kernels pick their instruction set at run
time (function-level target attributes and cpuid), so one build serves every CPU of an architecture.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from common.builtin_model import cache_root

CSRC = Path(__file__).with_name("csrc")
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off")
"""-ffp-contract=off: no fused multiply-adds the source does not write, so fp32 results round like torch's ops."""


def compiler() -> str:
    """The C++ compiler to build with: `$CXX`, else the first of c++, g++, clang++ on the PATH."""
    for name in (os.environ.get("CXX", ""), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    raise RuntimeError("no C++ compiler found ($CXX, c++, g++, clang++)")


def build_library(source_name: str) -> Path:
    """The shared library of `csrc/<source_name>` for this compiler: from the cache, or compiled into it now.

    Built with OpenMP where the compiler has it, without otherwise. Raises RuntimeError (compiler missing or
    failing, with its last error lines) or OSError.
    """
    source = CSRC / source_name
    cxx = compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    attempts = [[*BASE_FLAGS, "-fopenmp"], list(BASE_FLAGS)]
    digest = hashlib.sha256(
        source.read_bytes() + "\0".join([version, *attempts[0], platform.machine()]).encode()
    ).hexdigest()[:16]
    target = cache_root() / "kernels" / f"{source.stem}-{digest}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp_dir:
        built = Path(tmp_dir) / target.name
        for flags in attempts:  # the second: a compiler without OpenMP builds single-threaded
            result = subprocess.run([cxx, *flags, str(source), "-o", str(built)], capture_output=True, text=True)
            if result.returncode == 0:
                break
        else:
            raise RuntimeError(f"{cxx} failed on {source.name}: {result.stderr[-1000:]}")
        os.replace(built, target)
    return target


def load_library(source_name: str) -> ctypes.CDLL:
    """Build (or find in the cache) and load `csrc/<source_name>`."""
    return ctypes.CDLL(str(build_library(source_name)))


class NativeLibrary:
    """One `csrc/` library of a kernel module, built or loaded on first `get()` (once per process, thread-safe) and
    declared by `declare` (argument types, ABI check); `lib` stays None where it could not be (no compiler, a
    failed build, a wrong ABI), and `error` says why (printed once to stderr with `note`, where given)."""

    def __init__(self, source_name: str, declare: Callable[[ctypes.CDLL], ctypes.CDLL], note: str = "") -> None:
        self.source_name, self.declare, self.note = source_name, declare, note
        self.lib: ctypes.CDLL | None = None
        self.tried = False
        self.error = ""
        self._lock = threading.Lock()

    def get(self) -> ctypes.CDLL | None:
        if self.tried:
            return self.lib
        with self._lock:
            if not self.tried:
                try:
                    self.lib = self.declare(load_library(self.source_name))
                except (OSError, RuntimeError, ValueError) as err:
                    self.error = f"{type(err).__name__}: {err}"[:500]
                    if self.note:
                        print(f"{self.note}: {self.error}", file=sys.stderr)
                self.tried = True
        return self.lib


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
