"""`learner.fp32_gemm`: the learner's fp32 linears on oneDNN give nn.Linear's values and gradients, and fall back
to it wherever oneDNN's fp32 GEMM does not apply."""

from __future__ import annotations

import pytest
import torch
from tiny_learner import tiny_batch, tiny_config, tiny_model, with_behavior

from learner.acrl import AcrlReference
from learner.fp32_gemm import (
    PACK_MIN_AVAILABLE_FACTOR,
    OnednnLinear,
    pack_allowed,
    packed_weights,
    pick_kernel,
    race_shape,
    use_fp32_gemm,
)
from learner.precision import LossScaler
from learner.update import train_on_batch


@pytest.fixture
def onednn_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The output shapes of every oneDNN GEMM the module runs."""
    from learner import fp32_gemm

    calls, real = [], fp32_gemm.onednn_linear

    def counted(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        calls.append((x.shape[0], weight.shape[0]))
        return real(x, weight, bias)

    monkeypatch.setattr(fp32_gemm, "onednn_linear", counted)
    return calls


def _pair(bias: bool, in_features: int = 48, out_features: int = 40) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    torch.manual_seed(0)
    plain = torch.nn.Linear(in_features, out_features, bias=bias)
    swapped = torch.nn.Linear(in_features, out_features, bias=bias)
    swapped.load_state_dict(plain.state_dict())
    use_fp32_gemm(swapped, "onednn")
    return plain, swapped


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 48), (3, 5, 48)])
def test_values_and_every_gradient_match_nn_linear(bias: bool, shape: tuple[int, ...], onednn_calls: list) -> None:
    plain, swapped = _pair(bias)
    assert type(swapped) is OnednnLinear and type(plain) is torch.nn.Linear
    x = torch.randn(shape)
    grad_out = torch.randn(*shape[:-1], 40)
    results = []
    for module in (plain, swapped):
        leaf = x.clone().requires_grad_()
        out = module(leaf)
        out.backward(grad_out)
        results.append((out, leaf.grad, module.weight.grad, None if module.bias is None else module.bias.grad))
    rows = 7 if len(shape) == 2 else 15
    assert onednn_calls == [(rows, 40), (rows, 48), (40, 48)]  # forward, input gradient, weight gradient
    for got, expected in zip(results[1], results[0]):
        if expected is None:
            assert got is None
        else:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_transposed_input_and_an_expanded_gradient() -> None:
    plain, swapped = _pair(bias=True)
    base = torch.randn(48, 9)
    for module in (plain, swapped):
        leaf = base.clone().requires_grad_()
        module(leaf.t()).sum().backward()  # a strided input; sum's gradient is an expanded ones tensor (stride 0)
        module.input_grad = leaf.grad
    torch.testing.assert_close(swapped.input_grad, plain.input_grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(swapped.weight.grad, plain.weight.grad, rtol=1e-5, atol=1e-5)


def test_a_frozen_weight_gets_no_gradient_and_the_input_still_does() -> None:
    _, swapped = _pair(bias=True)
    swapped.weight.requires_grad_(False)
    swapped.bias.requires_grad_(False)
    x = torch.randn(4, 48, requires_grad=True)
    swapped(x).square().sum().backward()
    assert swapped.weight.grad is None and swapped.bias.grad is None
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_autocast_and_other_dtypes_fall_back_to_nn_linear(onednn_calls: list) -> None:
    plain, swapped = _pair(bias=True)
    x = torch.randn(4, 48)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert swapped(x).dtype == torch.bfloat16
        torch.testing.assert_close(swapped(x), plain(x))
    swapped.double()
    assert swapped(x.double()).dtype == torch.float64
    assert swapped(torch.zeros(0, 48, dtype=torch.float64)).shape == (0, 40)
    assert onednn_calls == []


def test_without_onednn_auto_keeps_blas_and_onednn_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from learner import fp32_gemm

    monkeypatch.setattr(fp32_gemm, "onednn_available", lambda: False)
    assert fp32_gemm.pick_kernel("auto", 64, 64) == fp32_gemm.KernelPick("blas")
    with pytest.raises(RuntimeError, match="no oneDNN linear"):
        fp32_gemm.use_fp32_gemm(torch.nn.Linear(4, 4), "onednn")


def test_only_plain_linears_are_swapped_and_the_state_dict_keeps_its_keys() -> None:
    class Other(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Other(8, 8), torch.nn.Sequential(torch.nn.Linear(8, 4)))
    keys = list(model.state_dict())
    pick = use_fp32_gemm(model, "onednn")
    assert pick.kernel == "onednn"
    assert [type(m).__name__ for m in model.modules()] == ["Sequential", "OnednnLinear", "Other", "Sequential",
                                                           "OnednnLinear"]  # fmt: skip
    assert list(model.state_dict()) == keys
    assert use_fp32_gemm(torch.nn.Sequential(torch.nn.Linear(8, 8)), "blas").kernel == "blas"


def test_auto_races_the_two_and_keeps_the_faster_by_the_margin() -> None:
    from learner.fp32_gemm import WIN_MARGIN

    pick = pick_kernel("auto", 256, 256)
    assert pick.blas_gflops > 0 and pick.onednn_gflops > 0
    assert pick.kernel == ("onednn" if pick.onednn_gflops >= WIN_MARGIN * pick.blas_gflops else "blas")
    with pytest.raises(ValueError, match="expected one of auto, blas, onednn"):
        pick_kernel("mkl", 8, 8)


def test_the_race_shape_is_the_most_frequent_linear_not_the_head() -> None:
    layers = [torch.nn.Linear(64, 64), torch.nn.Linear(64, 32), torch.nn.Linear(64, 64), torch.nn.Linear(64, 5000)]
    assert race_shape(torch.nn.Sequential(*layers)) == (64, 64)


def test_a_learner_step_on_onednn_is_the_step_on_blas(onednn_calls: list) -> None:
    """Two whole `train_on_batch` steps (forward, PPO loss, backward, AdamW) of the tiny model under each kernel."""
    results = {}
    for kernel in ("blas", "onednn"):
        model = tiny_model(seed=2, hidden=64)
        assert use_fp32_gemm(model, kernel).kernel == kernel
        cfg = tiny_config("loss.weighting=tis", "loss.cap=2.0")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for seed in (4, 5):
            batch = with_behavior(tiny_batch(seed=seed), model, seed=seed)
            result = train_on_batch(
                model, optimizer, LossScaler(enabled=False), batch, cfg, AcrlReference(cfg.loss.acrl)
            )
        results[kernel] = (result, [p.detach().clone() for p in model.parameters()])
        assert bool(onednn_calls) == (kernel == "onednn")
    (onednn, onednn_weights), (blas, blas_weights) = results["onednn"], results["blas"]
    assert any(type(m) is OnednnLinear for m in model.modules())
    torch.testing.assert_close(onednn.prox_logp, blas.prox_logp, rtol=1e-5, atol=1e-5)
    for key, value in blas.metrics.items():
        if key != "learner/packed_weights":  # oneDNN's second step packs its weights (BLAS has none to pack)
            assert onednn.metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    for got, expected in zip(onednn_weights, blas_weights):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_a_large_weight_gradient_reads_the_tiled_transpose_and_keeps_its_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the learner's shapes dy^T comes from `native_ops.transpose`: the weight gradient is the one oneDNN gives
    on torch's transposed copy, bit for bit, and nn.Linear's to rounding."""
    from learner import fp32_gemm, native_ops

    transposed: list[tuple[int, ...]] = []

    def counted(matrix: torch.Tensor) -> torch.Tensor:
        transposed.append(tuple(matrix.shape))
        return native_ops.transpose(matrix)

    monkeypatch.setattr(fp32_gemm, "transpose", counted)
    rows, in_features, out_features = 300, 96, 1000  # dy: 300,000 elements, past TRANSPOSE_MIN_ELEMENTS
    assert rows * out_features >= native_ops.TRANSPOSE_MIN_ELEMENTS
    plain, swapped = _pair(bias=False, in_features=in_features, out_features=out_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1))
    grad_out = torch.randn(rows, out_features, generator=torch.Generator().manual_seed(2))
    for module in (plain, swapped):
        module(x).backward(grad_out)
    assert transposed == [(rows, out_features)]
    expected = fp32_gemm.onednn_linear(grad_out.t().contiguous(), x.t())
    assert torch.equal(swapped.weight.grad, expected)
    torch.testing.assert_close(swapped.weight.grad, plain.weight.grad, rtol=1e-5, atol=1e-4)


@pytest.fixture
def reorders(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shapes of every weight `packed_weights` reorders."""
    from learner import fp32_gemm

    calls, real = [], fp32_gemm.reorder_weight

    def counted(weight: torch.Tensor, rows: int) -> torch.Tensor:
        calls.append(tuple(weight.shape))
        return real(weight, rows)

    monkeypatch.setattr(fp32_gemm, "reorder_weight", counted)
    return calls


def test_inside_packed_weights_each_weight_is_packed_once_and_gives_the_same_bits(reorders: list) -> None:
    """Micro-batches of several sizes through one block: one reorder of the weight (forward) and one of its transpose
    (input gradient), outputs and every gradient bit for bit those of the unpacked ones; a changed weight (its version
    moves) is packed again; nothing outlives the block."""
    from learner import fp32_gemm

    plain, swapped = _pair(bias=True, in_features=96, out_features=80)
    plain.__class__ = OnednnLinear  # the same kernel
    xs = [torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)) for rows in (64, 31, 2, 1)]
    grads = [torch.randn(x.shape[0], 80, generator=torch.Generator().manual_seed(9)) for x in xs]
    got: dict[str, list[torch.Tensor]] = {}

    def run(name: str, module: torch.nn.Module) -> None:
        for x, grad in zip(xs, grads):
            leaf = x.clone().requires_grad_()
            out = module(leaf)
            out.backward(grad)
            got.setdefault(name, []).extend([out.detach(), leaf.grad])

    run("plain", plain)  # outside the block: never packed
    assert reorders == []
    with packed_weights(swapped, available_bytes=2**40) as packing:
        assert packing
        run("packed", swapped)
        assert reorders == [(80, 96), (96, 80)]  # once for the micro-batches (a one-row GEMM is never packed)
        with torch.no_grad():
            swapped.weight.mul_(1.0)  # an optimizer's in-place step: a new version
        swapped(xs[0])
        assert reorders == [(80, 96), (96, 80), (80, 96)]
    assert fp32_gemm._packing is None
    assert all(torch.equal(a, b) for a, b in zip(got["packed"], got["plain"]))
    assert torch.equal(swapped.weight.grad, plain.weight.grad) and torch.equal(swapped.bias.grad, plain.bias.grad)


def test_packing_only_with_memory_to_spare_and_never_nested(reorders: list) -> None:
    from learner import fp32_gemm

    _, swapped = _pair(bias=False, in_features=96, out_features=80)
    copies_bytes = 2 * 96 * 80 * 4  # W and W^T
    assert pack_allowed(swapped, PACK_MIN_AVAILABLE_FACTOR * copies_bytes)
    assert not pack_allowed(swapped, PACK_MIN_AVAILABLE_FACTOR * copies_bytes - 1)
    assert not pack_allowed(swapped, None)  # unknown memory: no copies
    assert not pack_allowed(torch.nn.Linear(96, 80), 2**40)  # not on oneDNN: nothing to pack
    with packed_weights(swapped, available_bytes=None) as packing:
        assert not packing
        swapped(torch.randn(8, 96))
    assert reorders == []
    with packed_weights(swapped, available_bytes=2**40):
        with pytest.raises(RuntimeError, match="already inside"), packed_weights(swapped, available_bytes=2**40):
            pass
        swapped(torch.randn(8, 96))  # the outer block still packs
    assert reorders == [(80, 96)] and fp32_gemm._packing is None


def test_a_learner_step_packs_each_minibatch_and_equals_the_unpacked_step(
    monkeypatch: pytest.MonkeyPatch, reorders: list
) -> None:
    """`train_on_batch` packs inside each minibatch of every update after the first: the same metrics and weights,
    bit for bit, as with packing off (no memory to spare), and no packed copy is left after the step."""
    from learner import fp32_gemm, update

    results, linears = {}, 0
    for available in (2**40, None):
        monkeypatch.setattr(update, "available_memory_bytes", lambda available=available: available)
        model = tiny_model(seed=2, hidden=64)
        use_fp32_gemm(model, "onednn")
        linears = sum(type(m) is OnednnLinear for m in model.modules())
        cfg = tiny_config("loss.weighting=tis", "loss.cap=2.0", "learner.minibatches=2")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        reorders.clear()
        for seed in (4, 5):
            batch = with_behavior(tiny_batch(seed=seed), model, seed=seed)
            result = train_on_batch(
                model, optimizer, LossScaler(enabled=False), batch, cfg, AcrlReference(cfg.loss.acrl)
            )
            assert fp32_gemm._packing is None
        # each weight and its transpose once a minibatch, from the second update on (the first allocates AdamW's state)
        assert len(reorders) == (2 * 2 * linears if available else 0)
        results[available] = (result, [p.detach().clone() for p in model.parameters()])
    (on, on_weights), (off, off_weights) = results[2**40], results[None]
    assert on.metrics.pop("learner/packed_weights") == 1.0 and off.metrics.pop("learner/packed_weights") == 0.0
    assert on.metrics == off.metrics
    assert all(torch.equal(a, b) for a, b in zip(on_weights, off_weights))
