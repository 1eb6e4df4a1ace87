"""The exact INT8 kernels: every path against the reference integer arithmetic bit for bit, dispatch, fallbacks."""

from __future__ import annotations

import pytest
import torch

from quant_sync.quantizers import QuantizedWeight, quantize_weight, quantized_linear
from rollout_workers.embedded import int8_linear
from rollout_workers.embedded.int8_linear import ENV_KERNEL, int8_kernel_name, integer_product, prepare_int8

PATHS = int8_linear.available_kernels()
COMPILED = [path for path in PATHS if path in ("amx", "vnni", "avxvnni", "avx2", "portable")]


def test_the_compiled_kernels_build_and_pass_their_self_test_here():
    """gcc is on every machine we run, and this CPU (AVX2 at least) runs the C++ paths: a failed build or self-test
    would silently fall back to a slow path."""
    assert int8_linear._Library.error == ""
    assert PATHS[-1] == "reference" and {"avx2", "portable", "onednn"} <= set(PATHS)
    flags = int8_linear._cpu_flags()
    if "avx512_vnni" in flags and torch.backends.cpu.get_cpu_capability() == "AVX512":
        assert PATHS[0] == ("amx" if "amx_int8" in flags else "vnni")


def _operands(case: str, rows: int, out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, ...]:
    """(x float, q_w int8, s_w) for a named operand pattern."""
    generator = torch.Generator().manual_seed(seed)
    scale = torch.rand(out_features, generator=generator) + 0.25
    if case == "random":
        q = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
        return torch.randn(rows, in_features, generator=generator) * 3, q, scale
    if case == "max":  # every activation +127, every weight +127: the largest sums, beyond 2^24 for long K
        return torch.ones(rows, in_features), torch.full((out_features, in_features), 127, dtype=torch.int8), scale
    if case == "min":  # activations -127, weights -128 and -127 (a weight of -128 is no quantizer's, but exact too)
        q = torch.full((out_features, in_features), -128, dtype=torch.int8)
        q[1::2] = -127
        return -torch.ones(rows, in_features), q, scale
    # "mixed": +-127 activations against +-127 / -128 weights, signs alternating along K and across rows
    x = torch.ones(rows, in_features)
    x[:, 1::2] = -1.0
    x[1::2] *= -1.0
    q = torch.full((out_features, in_features), 127, dtype=torch.int8)
    q[:, ::3] = -128
    q[::2, 1::2] = -127
    return x, q, scale


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", ["random", "max", "min", "mixed"])
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    [(1, 1, 37), (17, 33, 1001), (33, 40, 64), (4, 17, 11008), (2, 24, 4096), (5, 48, 4095)],
)
def test_every_path_equals_the_reference_bit_for_bit(path, case, rows, out_features, in_features):
    x, q, scale = _operands(case, rows, out_features, in_features, seed=rows + in_features)
    weight = QuantizedWeight(q=q, scale=scale, scheme="int8")
    bias = torch.randn(out_features)
    packed = prepare_int8(weight, path)
    expected = quantized_linear(x, weight, bias)
    assert torch.equal(int8_linear.int8_linear(x, packed, bias), expected)
    assert torch.equal(int8_linear.int8_linear(x, packed, None), quantized_linear(x, weight))
    batched = x.reshape(1, rows, in_features).expand(2, rows, in_features)  # (..., in) inputs keep their batch dims
    assert torch.equal(int8_linear.int8_linear(batched, packed, bias), expected.expand(2, rows, out_features))


@pytest.mark.parametrize("path", COMPILED)
def test_every_row_count_and_panel_count_through_the_register_tiles(path):
    """The micro-kernels' tiles (rows by panels of 16 columns) and their tails: every row count from 1 to 40 (whole
    blocks, then the rest, whatever a kernel's block is) against 1, 3 and 5 panels (whole and partial groups), with
    the last panel's columns partly padding; the fused linear and the raw integer product."""
    generator = torch.Generator().manual_seed(3)
    for out_features in (16, 40, 77):
        weight = quantize_weight(torch.randn(out_features, 132, generator=generator), "int8")
        packed = prepare_int8(weight, path)
        for rows in range(1, 41):
            x = torch.randn(rows, 132, generator=generator) * 3
            expected_out = quantized_linear(x, weight)
            assert torch.equal(int8_linear.int8_linear(x, packed, None), expected_out), (rows, out_features)
            q_x = torch.randint(-128, 128, (rows, 132), dtype=torch.int8, generator=generator)
            expected = q_x.to(torch.int32) @ weight.q.to(torch.int32).t()
            assert torch.equal(integer_product(q_x, packed), expected), (rows, out_features)


@pytest.mark.parametrize("path", COMPILED)
def test_the_integer_product_is_the_int32_dot_product_for_any_int8(path):
    """The accumulator alone, on raw int8 operands the quantizer never makes (-128 activations too)."""
    generator = torch.Generator().manual_seed(0)
    for rows, out_features, in_features in [(1, 1, 1), (3, 17, 5), (33, 50, 1030), (7, 16, 11008)]:
        weights = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
        activations = torch.randint(-128, 128, (rows, in_features), dtype=torch.int8, generator=generator)
        extremes = torch.full((rows, in_features), -128, dtype=torch.int8)
        for q_x, q_w in [(activations, weights), (extremes, torch.full_like(weights, -128)), (extremes, weights)]:
            packed = prepare_int8(QuantizedWeight(q=q_w, scale=torch.ones(out_features), scheme="int8"), path)
            expected = (q_x.to(torch.int64) @ q_w.to(torch.int64).t()).to(torch.int32)  # |sum| < 2^31 here
            assert torch.equal(integer_product(q_x, packed), expected)


def test_the_amx_tiles_are_exact_at_every_row_count_and_refuse_unpadded_inputs(monkeypatch):
    """AMX's tiles take 16 rows: every count from 1 to 40 (whole blocks, then a block of the rest under its own tile
    configuration), partial panel groups, two threads; below `amx_min_rows` rows `int8_linear` runs the VNNI kernel
    on the same layout, from it the tiles, and both give the reference's bits. Inputs not padded to 64 are refused.
    On a CPU without AMX-INT8 (or whose kernel gives no tile state) the library says it has none, and asking for
    the kernel is refused by name."""
    if "amx" not in PATHS:
        assert not int8_linear._Library.lib.i8_has_isa(int8_linear._ISA["amx"])
        monkeypatch.setenv(ENV_KERNEL, "amx")
        with pytest.raises(ValueError, match=f"{ENV_KERNEL}=amx: this machine runs only {PATHS[0]}"):
            int8_kernel_name()
        return
    path = "amx"
    generator = torch.Generator().manual_seed(1)
    weight = quantize_weight(torch.randn(72, 130, generator=generator), "int8")  # 5 panels: a group of 4 and of 1
    packed = prepare_int8(weight, path)
    assert packed.padded_in == 192
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for rows in range(1, 41):
            x = torch.randn(rows, 130, generator=generator) * 3
            assert torch.equal(int8_linear.int8_linear(x, packed, None), quantized_linear(x, weight)), rows
            q_x = torch.randint(-128, 128, (rows, 130), dtype=torch.int8, generator=generator)
            assert torch.equal(integer_product(q_x, packed), q_x.to(torch.int32) @ weight.q.to(torch.int32).t()), rows
    finally:
        torch.set_num_threads(threads)
    lib = int8_linear._Library.lib
    out = torch.empty(16, 72)
    x = torch.randn(16, 130)
    for padded_in, status in ((192, 0), (132, -1)):
        assert lib.i8_linear(int8_linear._ISA[path], x.data_ptr(), 16, 130, 130, packed.packed.data_ptr(), 72,
                             padded_in, packed.scale.data_ptr(), None, out.data_ptr(), 72, 1) == status  # fmt: skip


@pytest.mark.parametrize("path", PATHS)
def test_quantized_weights_with_bf16_inputs_and_threads(path):
    """The engine's own operands: a quantizer's weight, bf16 activations (precision.rollout=bf16), two threads."""
    weight = quantize_weight(torch.randn(96, 200), "int8")
    x = (torch.randn(9, 200) * 4).to(torch.bfloat16)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(int8_linear.int8_linear(x, prepare_int8(weight, path), None), quantized_linear(x, weight))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("path", PATHS)
def test_the_environment_variable_forces_each_path(path, monkeypatch):
    monkeypatch.setenv(ENV_KERNEL, path)
    assert int8_kernel_name() == path
    weight = quantize_weight(torch.randn(8, 24), "int8")
    assert prepare_int8(weight).kernel == path
    monkeypatch.delenv(ENV_KERNEL)
    assert int8_kernel_name() == PATHS[0]


def test_a_forced_path_must_exist_and_run_here(monkeypatch):
    monkeypatch.setenv(ENV_KERNEL, "sse9")
    with pytest.raises(ValueError, match="ASYNCRL_INT8_KERNEL='sse9' is not one of"):
        int8_kernel_name()
    monkeypatch.setattr(int8_linear, "available_kernels", lambda: ("avx2", "reference"))  # e.g. a Zen 3 machine
    monkeypatch.setenv(ENV_KERNEL, "vnni")
    with pytest.raises(ValueError, match="ASYNCRL_INT8_KERNEL=vnni: this machine runs only avx2, reference"):
        int8_kernel_name()


def test_without_the_compiled_library_onednn_and_reference_stay_exact(monkeypatch):
    """No C++ compiler: quantization and the epilogue fall back to torch ops, and dispatch skips the C++ paths."""
    monkeypatch.setattr(int8_linear._Library, "lib", None)
    monkeypatch.setattr(int8_linear._Library, "error", "RuntimeError: no C++ compiler found")
    weight = quantize_weight(torch.randn(40, 300), "int8")
    x = torch.randn(6, 300) * 2
    bias = torch.randn(40)
    expected = quantized_linear(x, weight, bias)
    for path in ("onednn", "reference"):
        assert torch.equal(int8_linear.int8_linear(x, prepare_int8(weight, path), bias), expected)
    int8_linear.available_kernels.cache_clear()
    try:
        assert int8_linear.available_kernels() == ("onednn", "reference")
    finally:
        int8_linear.available_kernels.cache_clear()


def test_onednn_halves_fall_back_to_the_reference_beyond_exact_fp32_sums(monkeypatch):
    """Without VNNI, oneDNN's two 7-bit halves are summed in fp32: exact only up to HALVES_MAX_IN_FEATURES inputs."""
    monkeypatch.setattr(int8_linear, "_onednn_u8_is_exact", lambda: False)
    narrow = prepare_int8(quantize_weight(torch.randn(8, int8_linear.HALVES_MAX_IN_FEATURES), "int8"), "onednn")
    wide_weight = quantize_weight(torch.randn(8, int8_linear.HALVES_MAX_IN_FEATURES + 4), "int8")
    wide = prepare_int8(wide_weight, "onednn")
    assert narrow.kernel == "onednn" and not narrow.onednn_u8 and wide.kernel == "reference"
    x, q, scale = _operands("max", 3, 8, int8_linear.HALVES_MAX_IN_FEATURES, seed=0)
    weight = QuantizedWeight(q=q, scale=scale, scheme="int8")
    assert torch.equal(int8_linear.int8_linear(x, prepare_int8(weight, "onednn"), None), quantized_linear(x, weight))
