"""`ASYNCRL_BENCH_ISA`: `asyncrl bench engine` with every kernel family capped at an older ISA, and the check that
the cap took (see engine_bench.py's docstring). The cap's variables are read when torch, oneDNN and MKL start, so
`run_capped` measures in a fresh Python process started with them (`python -m asyncrl.bench.engine_bench`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from asyncrl.bench import BenchResult

ENV_BENCH_ISA = "ASYNCRL_BENCH_ISA"
ISA_CAP_ENV = {
    "avx2": {
        "ASYNCRL_ISA_CAP": "avx2",  # every csrc/ library's ISA probe (rollout_workers/embedded/native.py)
        "ASYNCRL_INT8_KERNEL": "avx2",
        "ASYNCRL_WO_KERNEL": "avx2",
        "ASYNCRL_FP8_KERNEL": "fp32",  # the bf16 kernel needs AVX512-BF16
        "ASYNCRL_ATTENTION_ISA": "1",  # AVX2 + FMA
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }
}
"""`ASYNCRL_BENCH_ISA` values and the environment each measures under (set before torch starts)."""


def run_capped(cap: str, quick: bool) -> BenchResult:
    """The bench in a fresh Python process whose torch, oneDNN, MKL and our kernels start under `cap`."""
    with tempfile.TemporaryDirectory() as tmp_dir:
        path = Path(tmp_dir) / "engine.json"
        command = [sys.executable, "-m", "asyncrl.bench.engine_bench", "--json", str(path), *(["--quick"] * quick)]
        subprocess.run(command, env={**os.environ, ENV_BENCH_ISA: cap, **ISA_CAP_ENV[cap]}, check=True)
        data = json.loads(path.read_text())
    return BenchResult(data["name"], data["metrics"], data["ratios"], data.get("details", {}))


ONEDNN_PROBE = """
import torch
x, w = torch.randn(32, 1024), torch.randn(1024, 1024)
torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, 32), None, "none", [], "")
q = torch.randint(-127, 128, (1024, 1024), dtype=torch.int8)
torch.ops.onednn.qlinear_pointwise(torch.randint(0, 255, (32, 1024), dtype=torch.uint8), 1.0, 128,
    torch.ops.onednn.qlinear_prepack(q, None), torch.ones(1024), torch.zeros(1024, dtype=torch.long), None, 1.0, 0,
    torch.float32, "none", [], "")
"""
"""oneDNN's two GEMMs the engine runs (fp32 prepacked, u8 x s8), once each under `ONEDNN_VERBOSE=1`."""


def onednn_dispatch() -> dict[str, object]:
    """oneDNN's ISA and the implementation of each primitive it ran in ONEDNN_PROBE, in a fresh process under this
    process's environment (oneDNN reads its ISA cap once, when it starts)."""
    env = {**os.environ, "ONEDNN_VERBOSE": "1"}
    probe = subprocess.run([sys.executable, "-c", ONEDNN_PROBE], env=env, capture_output=True, text=True, check=True)
    isa, impls = "unknown", []
    for line in probe.stdout.splitlines():
        fields = line.split(",")
        if line.startswith("onednn_verbose,v1,info,cpu,isa:"):
            isa = line.removeprefix("onednn_verbose,v1,info,cpu,isa:")
        if len(fields) > 6 and fields[2:4] == ["primitive", "exec"] and fields[5] != "reorder":
            impls.append(f"{fields[5]}:{fields[6]}")
    return {"isa": isa, "implementations": impls}


def isa_cap_check(cap: str) -> dict[str, object]:
    """What runs under `cap` (each kernel family, torch's capability, oneDNN's ISA and implementations); a
    RuntimeError naming what escaped the cap. Called in the capped process before it measures."""
    from rollout_workers.embedded import fp8_linear, fused_decode, int8_linear, low_rank, weight_only
    from rollout_workers.embedded.native import isa_cap

    check: dict[str, object] = {
        "env": dict(ISA_CAP_ENV[cap]),
        "native_isa_cap": isa_cap(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "int8": int8_linear.int8_kernel_name(),
        "weight_only": weight_only.kernel_name(),
        "fp8": fp8_linear.fp8_kernel_name(),
        "attention_isa": fused_decode.attention_isa(),
        "lora_native_kernel": low_rank._native_lora() is not None,
        "onednn": onednn_dispatch(),
    }
    expected = {"native_isa_cap": cap, "torch_cpu_capability": "AVX2", "int8": "avx2", "weight_only": "avx2",
                "fp8": "fp32", "attention_isa": 1, "lora_native_kernel": False}  # fmt: skip
    escaped = [f"{key}={check[key]!r}" for key, value in expected.items() if check[key] != value]
    onednn = check["onednn"]
    escaped += [impl for impl in onednn["implementations"] if "avx512" in impl or "amx" in impl]  # type: ignore[index]
    if "AVX2" not in str(onednn["isa"]) or "512" in str(onednn["isa"]):  # type: ignore[index]
        escaped.append(f"oneDNN isa {onednn['isa']!r}")  # type: ignore[index]
    if escaped:
        raise RuntimeError(f"{ENV_BENCH_ISA}={cap}: the cap did not take: {', '.join(escaped)}")
    return check
