"""`learner.native_ops.transpose`: the tiled copy gives `t().contiguous()`'s exact values at every shape, thread
count and vector path, and torch's copy takes what the library does not apply to."""

from __future__ import annotations

import pytest
import torch

from learner import native_ops
from learner.native_ops import TRANSPOSE_MIN_ELEMENTS, transpose


@pytest.fixture
def tiled_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The (rows, cols) of every matrix the library transposed."""
    calls: list[tuple[int, int]] = []
    lib = native_ops.lib()

    class Counting:
        def to_isa(self) -> int:
            return lib.to_isa()

        def to_transpose(self, isa: int, src: int, rows: int, cols: int, dst: int, threads: int) -> None:
            calls.append((rows, cols))
            lib.to_transpose(isa, src, rows, cols, dst, threads)

    monkeypatch.setattr(native_ops.LIBRARY, "lib", Counting())
    return calls


@pytest.mark.parametrize("isa", native_ops.ISAS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(517, 515), (64, 4097), (4099, 70), (931, 2816), (1, 300_000), (300_000, 1)])
def test_the_tiled_copy_is_the_transpose(shape: tuple[int, int], threads: int, isa: str, tiled_calls: list,
                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Every vector path up to this CPU's best (a path it lacks runs its best: the same check)."""
    best = native_ops.best_isa()
    monkeypatch.setattr(native_ops, "best_isa", lambda: min(native_ops.ISAS.index(isa), best))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        matrix = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        out = transpose(matrix)
    finally:
        torch.set_num_threads(previous)
    assert tiled_calls == [shape]  # tile edges: rows and columns that are not multiples of 8 or 64
    assert out.shape == shape[::-1] and out.is_contiguous()
    assert torch.equal(out, matrix.t())


def test_small_strided_or_other_dtype_matrices_take_torchs_copy(tiled_calls: list) -> None:
    side = int(TRANSPOSE_MIN_ELEMENTS**0.5)
    small = torch.randn(side - 1, side)
    strided = torch.randn(2 * side, 2 * side)[:, ::2]
    doubles = torch.randn(side, side, dtype=torch.float64)
    for matrix in (small, strided, doubles):
        out = transpose(matrix)
        assert out.is_contiguous() and torch.equal(out, matrix.t())
    assert tiled_calls == []
    big = torch.randn(side, side)
    assert torch.equal(transpose(big), big.t()) and tiled_calls == [(side, side)]


def test_without_the_library_torchs_copy_does_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_ops.LIBRARY, "lib", None)
    monkeypatch.setattr(native_ops.LIBRARY, "tried", True)
    matrix = torch.randn(700, 800)
    assert torch.equal(transpose(matrix), matrix.t())


@pytest.mark.parametrize("numel", [1, 7, 8, 65_536, 3 * 65_536 + 13])
def test_the_update_sums_are_float64_sums_with_the_same_bits_on_every_path_and_thread_count(
    numel: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """norm_update's per-parameter sums: (sum (new - old)^2, sum old^2) to float64 rounding against torch's float64
    ops, and bit for bit the same at 1 and 2 threads and on every vector path up to this CPU's best (chunk edges,
    lane tails)."""
    generator = torch.Generator().manual_seed(numel)
    old = torch.randn(numel, generator=generator) * 3.0
    new = old + 1e-3 * torch.randn(numel, generator=generator)
    expected = torch.stack(((new.double() - old.double()).pow(2).sum(), old.double().pow(2).sum()))
    shape = (numel,) if numel % 2 == 0 else (numel, 1)  # any contiguous shape: one flat pass
    best, previous = native_ops.best_isa(), torch.get_num_threads()
    results = []
    try:
        for isa in range(best + 1):
            monkeypatch.setattr(native_ops, "best_isa", lambda isa=isa: isa)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                results.append(native_ops.update_sums(new.reshape(shape), old.reshape(shape)))
    finally:
        torch.set_num_threads(previous)
    assert all(result is not None and result.dtype == torch.float64 for result in results)
    assert all(torch.equal(result, results[0]) for result in results), results
    assert torch.allclose(results[0], expected, rtol=1e-12, atol=0.0), (results[0], expected)


def test_update_sums_leave_what_the_library_does_not_take_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Strided, other-dtype or mismatched tensors give None, and norm_update's `_param_sums` then sums in torch: the
    same values to rounding; without the library too."""
    from learner.update import _param_sums

    old = torch.randn(300, 40)
    new = old + 0.01
    for pair in ((new.t(), old.t()), (new.double(), old.double()), (new, old[:, :20].contiguous())):
        assert native_ops.update_sums(*pair) is None
    strided = _param_sums(new.t(), old.t())
    assert torch.equal(_param_sums(new, old), native_ops.update_sums(new, old))
    assert torch.allclose(strided, _param_sums(new, old), rtol=1e-12, atol=0.0)
    monkeypatch.setattr(native_ops.LIBRARY, "lib", None)
    monkeypatch.setattr(native_ops.LIBRARY, "tried", True)
    assert native_ops.update_sums(new, old) is None
    assert torch.allclose(_param_sums(new, old), strided, rtol=1e-12, atol=0.0)
