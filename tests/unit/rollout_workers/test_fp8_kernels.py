"""The FP8 kernels: the C++ quantizer equals quant_sync's bit for bit, every GEMM path agrees to fp32 rounding."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from quant_sync.quantizers import QuantizedWeight, quantize_activation, quantize_weight, quantized_linear
from rollout_workers.embedded import fp8_linear
from rollout_workers.embedded.fp8_linear import ENV_KERNEL, fp8_kernel_name, prepare_fp8

PATHS = fp8_linear.available_kernels()
SCHEMES = ("fp8", "fp8_trunc")


def test_the_compiled_kernels_build_here():
    assert fp8_linear._Library.error == "" and PATHS[-2:] == ("fp32", "reference")
    if "avx512_bf16" in Path("/proc/cpuinfo").read_text() and torch.backends.cpu.get_cpu_capability() == "AVX512":
        assert PATHS[0] == "bf16"


def _grid_rows() -> torch.Tensor:
    """Rows whose quotients x / s_x land on, between and an ulp or a tolerance's width around every e4m3 value."""
    values = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    middles = (values[1:] + values[:-1]) / 2  # ties: nearest-even decides
    row = torch.cat([values, middles, middles * (1 + 2**-23), middles * (1 - 2**-23)])
    row = torch.cat([row, values * (1 + 2**-21), values * (1 - 2**-21), values * (1 + 2**-19), values * (1 - 2**-19)])
    row = torch.cat([torch.tensor([448.0]), row])  # amax 448: s_x = 1, the quotients are the values themselves
    return torch.stack([row, -row, row * 2**-40, row * 2**40])


@pytest.mark.parametrize("isa", [0, 1])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_quantizer_equals_quant_syncs_bit_for_bit(scheme, isa):
    lib = fp8_linear._Library.get()
    if isa == 1 and not lib.f8_has_isa(1):  # a CPU without AVX512-BF16: the kernel refuses the path
        assert "bf16" not in PATHS and lib.f8_linear(1, None, 0, 0, 0, 0, None, 0, 0, None, None, None, 0, 1) == -1
        return
    generator = torch.Generator().manual_seed(1)
    magnitudes = torch.tensor([1e-30, 1e-3, 1.0, 1e3, 1e30, 3e38, 1e-40, 0.0])
    random = (torch.rand(8, 1001, generator=generator) * 2 - 1) * magnitudes[:, None]
    for x in (_grid_rows(), random, torch.randn(3, 37, generator=generator)):
        rows, in_features = x.shape
        expected_q, expected_scale = quantize_activation(x, scheme)
        for out_kind, dtype in ((0, torch.float32), (1, torch.int16)):  # fp32 values, bf16 bits
            q = torch.empty((rows, in_features), dtype=dtype)
            scale = torch.empty(rows)
            lib.f8_quantize_rows(isa, x.data_ptr(), rows, in_features, in_features, int(scheme == "fp8_trunc"),
                                 out_kind, q.data_ptr(), in_features, scale.data_ptr())  # fmt: skip
            values = q if out_kind == 0 else q.view(torch.bfloat16).to(torch.float32)
            assert torch.equal(scale, expected_scale) and torch.equal(values, expected_q.to(torch.float32))


@pytest.mark.parametrize("isa", [0, 1])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_non_finite_row_quantizes_as_quant_syncs(scheme, isa):
    """A NaN in a row: torch's amax keeps it, the scale is 1 and the NaN stays NaN (visible downstream); the vector
    max and clamp dropped it (the scale came from the finite values and the NaN became -448: finite output)."""
    lib = fp8_linear._Library.get()
    if isa == 1 and not lib.f8_has_isa(1):
        return
    x = torch.randn(6, 37, generator=torch.Generator().manual_seed(2))
    x[0, 1], x[1, 20], x[2, 36], x[3, 5], x[4, 9] = math.nan, math.nan, math.nan, math.inf, -math.inf  # vector, tail
    rows, in_features = x.shape
    expected_q, expected_scale = quantize_activation(x, scheme)
    q, scale = torch.empty((rows, in_features)), torch.empty(rows)
    lib.f8_quantize_rows(isa, x.data_ptr(), rows, in_features, in_features, int(scheme == "fp8_trunc"), 0,
                         q.data_ptr(), in_features, scale.data_ptr())  # fmt: skip
    expected = expected_q.to(torch.float32)
    assert torch.equal(scale, expected_scale) and torch.equal(q.isnan(), expected.isnan())
    assert q.isnan()[:3].any(dim=1).all() and torch.equal(q.nan_to_num(7.0), expected.nan_to_num(7.0))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(("rows", "out_features", "in_features"), [(1, 1, 37), (33, 40, 1001), (5, 600, 576)])
def test_every_path_agrees_with_the_reference_to_fp32_rounding(path, scheme, rows, out_features, in_features):
    generator = torch.Generator().manual_seed(rows)
    weight = quantize_weight(torch.randn(out_features, in_features, generator=generator), scheme)
    x = torch.randn(rows, in_features, generator=generator) * 3
    bias = torch.randn(out_features, generator=generator)
    out = fp8_linear.fp8_linear(x, prepare_fp8(weight, path), bias)
    expected = quantized_linear(x, weight, bias)
    q_x, s_x = quantize_activation(x, scheme)
    magnitude = (q_x.float().abs() @ weight.q.float().abs().t()) * s_x[:, None] * weight.scale[None, :] + bias.abs()
    # two fp32 sums of the same exact products in different orders: within 2 K u sum |terms| (u = 2^-24)
    assert bool(((out - expected).abs() <= 2 * (in_features + 1) * 2.0**-24 * magnitude).all())
    if path == "reference":
        assert torch.equal(out, expected)


@pytest.mark.parametrize("path", PATHS)
def test_e4m3_extremes_are_exact_operands(path):
    """+-448 weights against +-448 activations: sums of K equal products, exact in every order."""
    q = torch.full((24, 256), 448.0).to(torch.float8_e4m3fn)
    weight = QuantizedWeight(q=q, scale=torch.ones(24), scheme="fp8")
    x = torch.ones(3, 256)
    x[1] = -1.0
    assert torch.equal(fp8_linear.fp8_linear(x, prepare_fp8(weight, path), None), quantized_linear(x, weight))


@pytest.mark.parametrize("path", PATHS)
def test_the_environment_variable_forces_each_path(path, monkeypatch):
    monkeypatch.setenv(ENV_KERNEL, path)
    assert fp8_kernel_name() == path and prepare_fp8(quantize_weight(torch.randn(4, 8), "fp8")).kernel == path
    monkeypatch.setenv(ENV_KERNEL, "fp4")
    with pytest.raises(ValueError, match="ASYNCRL_FP8_KERNEL='fp4' is not one of"):
        fp8_kernel_name()


def test_without_the_compiled_library_the_reference_runs(monkeypatch):
    monkeypatch.setattr(fp8_linear._Library, "lib", None)
    fp8_linear.available_kernels.cache_clear()
    try:
        assert fp8_linear.available_kernels() == ("reference",)
        weight = quantize_weight(torch.randn(16, 64), "fp8_trunc")
        x = torch.randn(2, 64)
        assert torch.equal(fp8_linear.fp8_linear(x, prepare_fp8(weight), None), quantized_linear(x, weight))
    finally:
        fp8_linear.available_kernels.cache_clear()
