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
