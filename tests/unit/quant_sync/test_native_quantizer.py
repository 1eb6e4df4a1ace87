"""`quant_sync.native`: the C++ int8 quantizer gives torch's bits on every vector path this CPU runs and any thread
count, leaves rows with a NaN or an infinity to torch, and its error sums agree with torch's; the publication's
quantizer and error metric run on it."""

from __future__ import annotations

import pytest
import torch

from quant_sync import native, quantizers, uaq
from quant_sync.export import export_rollout_tensors
from quant_sync.quantizers import quantize_int8_rows, quantize_weight


def _weight(rows: int = 300, cols: int = 1027, seed: int = 0) -> torch.Tensor:
    """Rows of several magnitudes (a column count that is no multiple of any vector width), a zero row, a row whose
    scale underflows fp32, and values exactly half-way between two int8 steps (ties go to even)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=generator) * torch.logspace(-3, 1, rows)[:, None]
    weight[5] = 0.0
    weight[6] = 1e-44  # a subnormal row: max / 127 is 0 in fp32, so its scale is 1
    weight[7, :6] = torch.tensor([127.0, 0.5, 1.5, -2.5, 3.5, -0.5])  # scale 1: w / scale lands on .5
    weight[7, 6:] = 0.25
    return weight


def test_the_kernels_take_what_they_can() -> None:
    assert native.LIBRARY.get() is not None  # this machine builds it (CI too)
    assert native.takes(torch.zeros(64, 64))
    assert not native.takes(torch.zeros(8, 8))  # tiny: torch's ops
    assert not native.takes(torch.zeros(64, 128).t())  # not contiguous
    assert not native.takes(torch.zeros(64, 64, dtype=torch.float64))
    assert not native.takes(torch.zeros(4, 64, 64))


@pytest.mark.parametrize("threads", [1, 2])
def test_every_vector_path_gives_torchs_int8_bits(threads: int) -> None:
    weight = _weight()
    expected_q, expected_scale = quantize_int8_rows(weight)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for isa in range(native.best_isa() + 1):  # every path this CPU runs, the baseline's scalar loop included
            got = native.int8_rows(weight, isa)
            assert got is not None
            assert torch.equal(got[0], expected_q), isa
            assert torch.equal(got[1], expected_scale), isa
    finally:
        torch.set_num_threads(previous)
    assert expected_scale[5] == 1.0 and expected_scale[6] == 1.0
    assert expected_q[7, :6].tolist() == [127, 0, 2, -2, 4, 0]  # round half to even, as torch.round


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_row_with_a_nan_or_an_infinity_is_left_to_torch(bad: float, monkeypatch: pytest.MonkeyPatch) -> None:
    weight = _weight(rows=64, cols=128, seed=1)
    weight[3, 17] = bad
    assert native.int8_rows(weight) is None
    calls = []
    real = quantizers.quantize_int8_rows
    monkeypatch.setattr(quantizers, "quantize_int8_rows", lambda x: calls.append(x.shape) or real(x))
    published = quantize_weight(weight, "int8")
    assert calls  # torch's ops ran
    expected_q, expected_scale = real(weight)
    assert torch.equal(published.q, expected_q) and torch.equal(
        published.scale,
        expected_scale,
    )


def test_the_publication_quantizes_on_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = _weight(rows=256, cols=512, seed=2)
    monkeypatch.setattr(quantizers, "quantize_int8_rows", lambda x: pytest.fail("torch's quantizer ran"))
    published = quantize_weight(weight, "int8")
    monkeypatch.undo()
    expected_q, expected_scale = quantize_int8_rows(weight)
    assert torch.equal(published.q, expected_q) and torch.equal(published.scale, expected_scale)


def test_the_error_sums_agree_with_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = _weight(seed=3)
    q, scale = quantize_int8_rows(weight)
    for isa in range(native.best_isa() + 1):
        err, norm = native.int8_row_errors(weight, q, scale, isa)
        residual = q.double() * scale.double()[:, None] - weight.double()
        assert err == pytest.approx(float((residual * residual).sum()), rel=1e-5)
        assert norm == pytest.approx(float((weight.double() ** 2).sum()), rel=1e-6)
    with pytest.raises(ValueError, match="int8_row_errors"):
        native.int8_row_errors(weight, q[:-1], scale)
    state = {"model.layers.0.mlp.up_proj.weight": weight, "model.layers.0.self_attn.q_proj.weight": weight[:64]}
    published = export_rollout_tensors(state, "int8")
    fast = uaq.quant_error_by_type(state, published, "int8")
    monkeypatch.setattr(native, "takes", lambda tensor: False)  # torch's chunked ops
    slow = uaq.quant_error_by_type(state, published, "int8")
    assert fast.keys() == slow.keys()
    for key, value in slow.items():
        assert fast[key] == pytest.approx(value, rel=1e-5), key
