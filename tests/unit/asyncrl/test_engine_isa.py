"""`ASYNCRL_BENCH_ISA=avx2 asyncrl bench engine` (asyncrl/bench/engine_isa.py): the check that the cap took, in a
process started under it and in one that was not, and a bad cap named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.bench import engine_bench
from asyncrl.bench.engine_isa import ENV_BENCH_ISA, ISA_CAP_ENV, isa_cap_check

REPO = Path(__file__).resolve().parents[3]


def test_under_the_avx2_cap_every_kernel_family_and_onednn_run_avx2():
    code = "import json\nfrom asyncrl.bench.engine_isa import isa_cap_check\nprint(json.dumps(isa_cap_check('avx2')))"
    env = {**os.environ, **ISA_CAP_ENV["avx2"]}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    check = json.loads(result.stdout.strip().splitlines()[-1])
    assert check["torch_cpu_capability"] == "AVX2" and check["native_isa_cap"] == "avx2"
    assert (check["int8"], check["weight_only"], check["fp8"], check["attention_isa"]) == ("avx2", "avx2", "fp32", 1)
    assert check["lora_native_kernel"] is False
    assert check["onednn"]["isa"] == "Intel AVX2"
    assert any("avx2" in impl for impl in check["onednn"]["implementations"])


def test_without_the_cap_the_check_names_what_escaped(monkeypatch):
    for key in ISA_CAP_ENV["avx2"]:
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeError, match="ASYNCRL_BENCH_ISA=avx2: the cap did not take: ") as raised:
        isa_cap_check("avx2")
    message = str(raised.value)
    assert "native_isa_cap=''" in message  # on any CPU: the kernels' own cap was not set
    if engine_bench.cpu_isa()["avx512_vnni"]:  # Zen 4 and AMX Xeons: AVX-512 kernels (AMX tiles on the latter) ran
        kernel = "amx" if engine_bench.cpu_isa()["amx_int8"] else "vnni"
        assert f"int8='{kernel}'" in message and "avx512" in message


def test_an_unknown_bench_isa_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv(ENV_BENCH_ISA, "sse4")
    with pytest.raises(ValueError, match="ASYNCRL_BENCH_ISA='sse4' is not one of avx2"):
        engine_bench.run(quick=True)
