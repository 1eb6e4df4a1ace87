"""The int8 paths no CPU here runs (csrc/int8_gemm.cpp: AVX-VNNI, ISA 4; ARM i8mm, ISA 6) and the AVX2 cap
(`ASYNCRL_ISA_CAP`).

Each runs here as its emulated twin against the reference bit for bit: `avxvnni_emulated` (the same micro-kernel
with `vpdpbusd` emulated by AVX2) and `i8mm_emulated` (the same layout, row pairing and epilogue with `smmla` in
portable C++); dispatch is checked to leave the real ones out where cpuid / HWCAP lacks them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quant_sync.quantizers import QuantizedWeight, quantize_weight, quantized_linear
from rollout_workers.embedded import int8_linear
from rollout_workers.embedded.int8_linear import ENV_KERNEL, int8_kernel_name, integer_product, prepare_int8

REPO = Path(__file__).resolve().parents[3]
EMULATED = int8_linear.EMULATED_KERNELS


def _operands(case: str, rows: int, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows * 7919 + in_features)
    if case == "random":
        q = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
        return torch.randn(rows, in_features, generator=generator) * 3, q
    if case == "max":  # +127 x +127 everywhere: the largest sums (beyond 2^24 for long K)
        return torch.ones(rows, in_features), torch.full((out_features, in_features), 127, dtype=torch.int8)
    q = torch.full((out_features, in_features), -128, dtype=torch.int8)  # -127 activations x -128 / -127 weights
    q[1::2] = -127
    return -torch.ones(rows, in_features), q


@pytest.mark.parametrize("path", EMULATED)
@pytest.mark.parametrize("case", ["random", "max", "min"])
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"), [(1, 1, 37), (3, 17, 1001), (4, 16, 64), (5, 40, 4095), (9, 33, 11008)]
)
def test_each_emulated_path_equals_the_reference_bit_for_bit(path, case, rows, out_features, in_features):
    x, q = _operands(case, rows, out_features, in_features)
    weight = QuantizedWeight(q=q, scale=torch.rand(out_features) + 0.25, scheme="int8")
    bias = torch.randn(out_features)
    packed = prepare_int8(weight, path)
    assert torch.equal(int8_linear.int8_linear(x, packed, bias), quantized_linear(x, weight, bias))
    assert torch.equal(int8_linear.int8_linear(x, packed, None), quantized_linear(x, weight))


@pytest.mark.parametrize("path", EMULATED)
def test_each_emulated_integer_product_is_exact_for_any_int8_and_two_threads(path):
    generator = torch.Generator().manual_seed(0)
    for rows, out_features, in_features in [(1, 1, 1), (3, 17, 5), (33, 50, 1030), (7, 16, 11008)]:
        weights = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
        activations = torch.randint(-128, 128, (rows, in_features), dtype=torch.int8, generator=generator)
        extremes = torch.full((rows, in_features), -128, dtype=torch.int8)
        for q_x, q_w in [(activations, weights), (extremes, torch.full_like(weights, -128)), (extremes, weights)]:
            packed = prepare_int8(QuantizedWeight(q=q_w, scale=torch.ones(out_features), scheme="int8"), path)
            expected = (q_x.to(torch.int64) @ q_w.to(torch.int64).t()).to(torch.int32)
            assert torch.equal(integer_product(q_x, packed), expected)
    weight = quantize_weight(torch.randn(96, 200), "int8")
    x = torch.randn(9, 200) * 4
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(int8_linear.int8_linear(x, prepare_int8(weight, path), None), quantized_linear(x, weight))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(("path", "flag"), [("avxvnni", "avx_vnni"), ("i8mm", "i8mm")])
def test_a_path_is_dispatched_only_where_the_cpu_has_it(path, flag, monkeypatch):
    lib = int8_linear._Library.get()
    assert lib is not None
    has_it = flag in int8_linear._cpu_flags()  # /proc/cpuinfo: x86 flags, or ARM Features
    assert bool(lib.i8_has_isa(int8_linear._ISA[path])) == has_it
    assert (path in int8_linear.available_kernels()) == has_it
    assert not set(EMULATED) & set(int8_linear.available_kernels()) and not set(EMULATED) & set(int8_linear.KERNELS)
    if not has_it:  # this machine: forcing it names what runs instead
        monkeypatch.setenv(ENV_KERNEL, path)
        with pytest.raises(ValueError, match=f"ASYNCRL_INT8_KERNEL={path}: this machine runs only"):
            int8_kernel_name()


CAP_PROBE = """
import json
from rollout_workers.embedded import fp8_linear, fused_decode, int8_linear, low_rank, weight_only
print(json.dumps({"int8": int8_linear.available_kernels(), "weight_only": weight_only.available_kernels(),
                  "fp8": fp8_linear.available_kernels(), "attention_isa": fused_decode.attention_isa(),
                  "lora_native": low_rank._native_lora() is not None,
                  "avx512_flags": sorted(f for f in int8_linear._cpu_flags() if f.startswith("avx512"))}))
"""


def _probe(cap: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ASYNCRL_ISA_CAP": cap}
    return subprocess.run([sys.executable, "-c", CAP_PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def test_the_avx2_cap_leaves_every_library_on_avx2_paths():
    result = _probe("avx2")
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["int8"][0] == "avx2" and not {"amx", "vnni", "avxvnni"} & set(seen["int8"])
    assert "avx512" not in seen["weight_only"] and seen["weight_only"][0] == "avx2"
    assert "bf16" not in seen["fp8"]
    assert seen["attention_isa"] == 1 and seen["lora_native"] is False and seen["avx512_flags"] == []


def test_an_unknown_cap_is_an_error_naming_the_variable():
    result = _probe("sse2")
    assert result.returncode != 0
    assert "ASYNCRL_ISA_CAP='sse2' is not one of avx2" in result.stderr
