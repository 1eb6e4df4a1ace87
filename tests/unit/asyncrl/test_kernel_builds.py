"""The driver's compile step for our C++ kernels (asyncrl/kernels.py): the lines it prints off a terminal,
nothing on a second start (the cache), a failing compile's message with the kernel, the compiler's words and the
fallback, and which kernels a config needs. Real compiler runs, on a small source in a scratch `csrc/`."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from asyncrl import console as console_module
from asyncrl.kernels import compile_kernels, kernel_sources, source_path
from common.config import load_config
from rollout_workers.embedded import native_build

SMALL_SOURCE = 'extern "C" int answer(void) { return 42; }\n'


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty kernel cache and a scratch `csrc/` holding `small.cpp` (compiles in well under a second)."""
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "small.cpp").write_text(SMALL_SOURCE)
    monkeypatch.setattr(native_build, "CSRC", csrc)
    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path / "cache"))
    return csrc


def _cfg(*overrides: str):
    return load_config("configs/dapo_int8.yaml", list(overrides))


def test_a_cold_cache_prints_a_line_per_kernel_and_a_second_start_prints_nothing(scratch: Path) -> None:
    lines: list[str] = []
    first = compile_kernels(_cfg(), ("small.cpp",), out=lines.append)
    assert lines[0].startswith("compiling the C++ kernels with ") and lines[0].endswith(": small.cpp")
    assert lines[1] == "compiling kernel small.cpp ..."
    assert lines[2].startswith("compiled kernel small.cpp in ") and lines[2].endswith(" s")
    assert len(lines) == 3
    assert [(b.source_name, b.cached, b.error) for b in first] == [("small.cpp", False, "")]
    library = native_build.kernel_target("small.cpp").path
    assert ctypes.CDLL(str(library)).answer() == 42  # the library a worker loads
    built_at = library.stat().st_mtime_ns

    lines.clear()
    second = compile_kernels(_cfg(), ("small.cpp",), out=lines.append)
    assert lines == []
    assert [(b.source_name, b.cached) for b in second] == [("small.cpp", True)]
    assert native_build.build_library("small.cpp") == library  # the worker's call: no rebuild
    assert library.stat().st_mtime_ns == built_at


def test_an_edited_source_is_compiled_again(scratch: Path) -> None:
    compile_kernels(_cfg(), ("small.cpp",), out=lambda line: None)
    (scratch / "small.cpp").write_text(SMALL_SOURCE.replace("42", "43"))
    assert not native_build.kernel_target("small.cpp").cached
    lines: list[str] = []
    compile_kernels(_cfg(), ("small.cpp",), out=lines.append)
    assert lines[-1].startswith("compiled kernel small.cpp in ")
    assert ctypes.CDLL(str(native_build.kernel_target("small.cpp").path)).answer() == 43


def test_a_failing_compile_names_the_kernel_the_compilers_message_and_the_fallback(
    scratch: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (scratch / "int8_gemm.cpp").write_text('extern "C" int broken(void) { return undeclared_name; }\n')
    lines: list[str] = []
    (build,) = compile_kernels(_cfg(), ("int8_gemm.cpp",), out=lines.append)
    assert lines[-1] == "kernel int8_gemm.cpp failed: see below"
    assert "undeclared_name" in build.error and "error" in build.error and not build.cached
    err = capsys.readouterr().err
    assert "asyncrl: kernel int8_gemm.cpp did not compile:" in err
    assert "undeclared_name" in err  # the compiler's own message
    assert "the rollout engine runs int8 linears on oneDNN's u8 x s8 GEMM" in err  # the engine's fallback
    assert "instead (slower)" in err
    with pytest.raises(native_build.KernelBuildError, match="int8_gemm.cpp") as raised:  # the worker's side
        native_build.build_library("int8_gemm.cpp")
    assert "undeclared_name" in raised.value.message


def test_a_compiler_that_fails_its_version_check_is_reported_like_a_failed_compile(
    scratch: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = scratch / "badcxx"  # exits 1 on everything, `--version` too: a CalledProcessError traceback ended the run
    broken.write_text("#!/bin/sh\necho 'badcxx: broken install' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CXX", str(broken))
    from common import native_build as builder

    builder._compiler_version.cache_clear()
    (build,) = compile_kernels(_cfg(), ("small.cpp",), out=lambda line: None)
    assert "badcxx: broken install" in build.error and not build.cached
    assert "kernel small.cpp did not compile" in capsys.readouterr().err


def test_without_a_compiler_every_kernel_reports_its_fallback(
    scratch: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CXX", "")
    monkeypatch.setenv("PATH", str(scratch))  # no c++, g++ or clang++ here
    builds = compile_kernels(_cfg(), ("small.cpp", "fused_decode.cpp"), out=lambda line: None)
    assert all("no C++ compiler found" in build.error for build in builds)
    err = capsys.readouterr().err
    assert "kernel fused_decode.cpp did not compile" in err and "torch ops for RMSNorm" in err


def test_on_a_terminal_a_bar_per_kernel_ends_with_its_time(
    scratch: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(console_module, "is_terminal", lambda enabled: enabled)
    compile_kernels(_cfg(), ("small.cpp",))
    out = capsys.readouterr().out
    assert "compiling the C++ kernels" in out and "compiled kernel small.cpp in" in out


def test_the_kernels_a_config_needs() -> None:
    learner = ("train_ops.cpp", "train_attention.cpp")
    int8 = (*learner, "quantize.cpp")  # the learner publishes int8 weights with quant_sync's quantizer
    assert kernel_sources(_cfg()) == ("fused_decode.cpp", "weight_only.cpp", "int8_gemm.cpp", *int8)
    assert kernel_sources(_cfg("quant.scheme=fp8", "learner.fused_ops=false", "learner.fp32_gemm=blas")) == (
        "fused_decode.cpp", "weight_only.cpp", "fp8_gemm.cpp",
    )  # fmt: skip
    assert kernel_sources(_cfg("quant.scheme=fp8", "learner.fused_ops=false"))[-1] == "train_ops.cpp"  # transpose
    assert kernel_sources(_cfg("quant.scheme=w4a16", "model.lora.rank=8")) == (
        "fused_decode.cpp", "weight_only.cpp", "lora_gemm.cpp", *learner,
    )  # fmt: skip
    assert kernel_sources(_cfg("rollout.device=cuda")) == int8  # the learner's, on the CPU
    assert kernel_sources(_cfg("rollout.device=cuda", "learner.fused_ops=false", "learner.fp32_gemm=blas")) == (
        "quantize.cpp",
    )
    assert kernel_sources(_cfg("rollout.device=cuda", "quant.scheme=fp8", "learner.fused_ops=false",
                               "learner.fp32_gemm=blas")) == ()  # fmt: skip
    for name in ("fused_decode.cpp", "weight_only.cpp", "int8_gemm.cpp", "fp8_gemm.cpp", "lora_gemm.cpp"):
        assert (native_build.CSRC / name).is_file()
        assert source_path(name) == native_build.CSRC / name
    for name in learner:
        assert source_path(name).is_file() and source_path(name).parent.parent.name == "learner"
    assert source_path("quantize.cpp").is_file() and source_path("quantize.cpp").parent.parent.name == "quant_sync"


def test_the_learner_s_kernel_failing_names_the_learner_s_fallback(
    scratch: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CXX", "")
    monkeypatch.setenv("PATH", str(scratch))  # no compiler: the learner's kernel cannot be built either
    (build,) = compile_kernels(_cfg(), ("train_ops.cpp",), out=lambda line: None)
    assert "no C++ compiler found" in build.error
    assert "the learner runs HF's torch ops for RMSNorm and SwiGLU" in capsys.readouterr().err


def test_a_native_library_loads_once_and_require_names_why_it_could_not(scratch: Path) -> None:
    from common.native_build import NativeLibrary

    def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
        lib.answer.restype = ctypes.c_int
        return lib

    good = NativeLibrary(scratch / "small.cpp", declare)
    assert good.require("small kernel").answer() == 42 and good.get() is good.require("small kernel")
    (scratch / "broken.cpp").write_text("this is not C++\n")
    broken = NativeLibrary(scratch / "broken.cpp", declare)
    assert broken.get() is None and broken.error  # the module's torch fallback runs
    with pytest.raises(RuntimeError, match=r"^broken kernel: .*broken\.cpp"):
        broken.require("broken kernel")
