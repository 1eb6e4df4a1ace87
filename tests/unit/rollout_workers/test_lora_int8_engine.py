"""Int8 LoRA adapters run as published (`decode_adapters(keep_int8=True)`, csrc/lora_gemm.cpp `lr_apply_q8`): the
packed version's int8 matrices and scales land in a pooled buffer with B's int8 panels, the kernel equals the fp32
product of the dequantized values on ragged shapes, an engine runs them like their float32 decoding, and misshapen
int8 adapters are refused at staging."""

from __future__ import annotations

import pytest
import torch

from asyncrl.bench.engine_bench import lora_adapter_tensors
from common.builtin_model import resolve_model_path
from quant_sync.adapter_buffers import panels_of
from quant_sync.export import (
    LORA_A,
    LORA_B,
    LORA_SCALE,
    decode_adapters,
    encode_adapter,
    export_rollout_tensors,
    pack_adapters,
)
from quant_sync.update import WeightUpdate
from rollout_workers.embedded.engine import EmbeddedEngine, build_weight_map
from rollout_workers.embedded.int8_linear import _cpu_flags
from rollout_workers.embedded.low_rank import ENV_KERNEL, _native_lora, _panels, add_low_rank, stack_low_rank
from rollout_workers.embedded.model import KVCache, ModelWeights, prefill

Q = "model.layers.0.self_attn.q_proj"


def _int8_member(rank: int, out: int, inp: int, seed: int, scaling: float = 2.0):
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(rank, inp, generator=gen), torch.randn(out, rank, generator=gen)
    qa, qb = encode_adapter(a, LORA_A, "int8"), encode_adapter(b, LORA_B, "int8")
    return qa[""], qb[""], scaling, qa[LORA_SCALE], qb[LORA_SCALE]


KERNELS_HERE = (["amx"] if {"amx_bf16", "avx512_bf16"} <= _cpu_flags() else []) + ["avx512"]
"""The int8 adapters' kernels this machine runs (`low_rank.int8_kernel`; `avx512` falls back to torch without
AVX-512F, which the tests then check instead)."""


def _assert_within_kernel_bound(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, kernel: str) -> None:
    """`avx512` (fp32 FMAs) to 1e-5; `amx` within 2^-14 of each output's sum of absolute products `bound`
    (`s * (|x| |A|^T) |B|^T`): its fp32 operand in two bf16 pieces is exact to 2^-17 of each value."""
    if kernel == "amx":
        assert ((got.double() - want).abs() <= 2.0**-14 * bound + 1e-6).all(), (got.double() - want).abs().max()
    else:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS_HERE)
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_the_int8_kernel_equals_the_float32_product_of_the_dequantized_adapters(rows, kernel, monkeypatch):
    """Rows off the kernel's tiles, inputs not of 16, outputs not of 32, members of different ranks and one without
    an adapter: lr_apply_q8 or lr_apply_q8_amx (or, without AVX-512F, torch on the dequantized values) against
    float64."""
    monkeypatch.setenv(ENV_KERNEL, kernel)
    gen = torch.Generator().manual_seed(rows)
    inp, outs = 37, [45, 7, 16, 33]
    members = [_int8_member(3, outs[0], inp, 1), _int8_member(5, outs[1], inp, 2), None,
               _int8_member(2, outs[3], inp, 4, scaling=0.5)]  # fmt: skip
    stacked = stack_low_rank(members, outs)
    assert stacked is not None
    assert (stacked.a.dtype == torch.int8) == (_native_lora() is not None)  # else dequantized to float32 at build
    assert (stacked.amx is not None) == (kernel == "amx")
    x, base = torch.randn(rows, inp, generator=gen), torch.randn(rows, sum(outs), generator=gen)
    want, bound = _float64_product(x, base, members, outs)
    got = add_low_rank(x, base.clone(), stacked)
    _assert_within_kernel_bound(got, want, bound, kernel)
    assert torch.equal(got[:, 52:68], base[:, 52:68])  # the member without an adapter: untouched
    if stacked.a.dtype == torch.int8:  # torch's GEMMs on the same int8 LowRank (its float32 values)
        import dataclasses

        torch_path = add_low_rank(x, base.clone(), dataclasses.replace(stacked, native=None, amx=None))
        _assert_within_kernel_bound(got, torch_path.double(), bound, kernel)


def _float64_product(
    x: torch.Tensor, base: torch.Tensor, members: list, outs: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """base + each int8 member's s * (x A^T) B^T in float64, and each output's s * (|x| |A|^T) |B|^T."""
    want, bound, col = base.double().clone(), torch.zeros(base.shape, dtype=torch.float64), 0
    for member, out in zip(members, outs):
        if member is not None:
            a, b, scaling = _float64(member, True)
            want[:, col : col + out] += scaling * (x.double() @ a.t()) @ b.t()
            bound[:, col : col + out] = abs(scaling) * (x.double().abs() @ a.abs().t()) @ b.abs().t()
        col += out
    return want, bound


@pytest.mark.parametrize("int8", [*[f"int8-{kernel}" for kernel in KERNELS_HERE], ""])
def test_the_kernel_gives_the_same_bits_on_any_thread_count_past_one_panel_pair(int8, monkeypatch):
    """Outputs of whole 64-column tiles, a pair with a ragged second panel and a lone last panel (130 = 64 + 64 + 2,
    100 = 64 + 36), rows off the 4-row tiles, adapter rows off the 4-row groups (13): 1, 2 and 3 threads give the
    bits of one, and equal float64 (int8 adapters on lr_apply_q8 or lr_apply_q8_amx, float32 ones on lr_apply)."""
    kernel = int8.removeprefix("int8-") or "avx512"
    monkeypatch.setenv(ENV_KERNEL, kernel)
    gen = torch.Generator().manual_seed(7)
    inp, outs = 80, [130, 100, 64]
    if int8:
        members = [_int8_member(5, outs[0], inp, 1), _int8_member(8, outs[1], inp, 2), None]
    else:
        members = [_float_member(5, outs[0], inp, 1), _float_member(8, outs[1], inp, 2), None]
    stacked = stack_low_rank(members, outs)
    assert stacked is not None and (stacked.native is not None) == (_native_lora() is not None)
    x, base = torch.randn(9, inp, generator=gen), torch.randn(9, sum(outs), generator=gen)
    want, bound, col = base.double().clone(), torch.zeros(base.shape, dtype=torch.float64), 0
    for member, out in zip(members, outs):
        if member is not None:
            a, b, scaling = _float64(member, bool(int8))
            want[:, col : col + out] += scaling * (x.double() @ a.t()) @ b.t()
            bound[:, col : col + out] = scaling * (x.double().abs() @ a.abs().t()) @ b.abs().t()
        col += out
    previous, results = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(add_low_rank(x, base.clone(), stacked))
    finally:
        torch.set_num_threads(previous)
    _assert_within_kernel_bound(results[0], want, bound, kernel)
    assert all(torch.equal(result, results[0]) for result in results[1:])
    assert torch.equal(results[0][:, 230:], base[:, 230:])  # the member without an adapter: untouched


def _float_member(rank: int, out: int, inp: int, seed: int, scaling: float = 2.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rank, inp, generator=gen), torch.randn(out, rank, generator=gen), scaling


def _float64(member, int8: bool) -> tuple[torch.Tensor, torch.Tensor, float]:
    if not int8:
        a, b, scaling = member
        return a.double(), b.double(), scaling
    qa, qb, scaling, sa, sb = member
    return qa.double() * sa.double()[:, None], qb.double() * sb.double()[None, :], scaling


def _micro():
    from transformers import AutoModelForCausalLM

    model_dir = str(resolve_model_path("builtin:micro", log=lambda *_: None))
    return model_dir, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def test_a_packed_int8_version_kept_int8_holds_the_published_values_and_panels():
    _, model = _micro()
    encoded = lora_adapter_tensors(model.state_dict(), rank=4, sync_dtype="int8", seed=3)
    kept = decode_adapters(pack_adapters(encoded), keep_int8=True)
    assert set(kept) == set(encoded)
    for name, value in encoded.items():
        assert kept[name].dtype == value.dtype and torch.equal(kept[name], value), name
    b = kept[Q + LORA_B]
    panels = panels_of(b)
    assert panels is not None and panels.dtype == torch.int8 and torch.equal(panels, _panels(b.t().contiguous()))


def test_an_engine_runs_an_int8_version_as_its_float32_decoding():
    """The logits of an int8 version kept int8 equal those of the same version decoded to float32 (which the
    learner's forward runs) to float32 rounding; with the native kernel the build runs int8 views of the buffer."""
    model_dir, model = _micro()
    base = export_rollout_tensors(model.state_dict(), "int8", quantize_head=True)
    packed = pack_adapters(lora_adapter_tensors(model.state_dict(), rank=4, sync_dtype="int8", seed=3))
    engine = EmbeddedEngine(model_dir, seed=0)
    logits = []
    for keep in (True, False):
        adapters = decode_adapters(packed, keep_int8=keep)
        weights = ModelWeights.build(engine.arch, build_weight_map(WeightUpdate(1, {**base, **adapters}, "int8")))
        if keep and engine.runs_int8_adapters:
            assert weights.layers[0].qkv_lora.a.dtype == torch.int8
            assert weights.layers[0].qkv_lora.a.data_ptr() == adapters[Q + LORA_A].data_ptr()  # no copy
        tokens = torch.tensor([[1, 4, 5, 13, 6, 7, 15]])
        cache = KVCache(engine.arch, slots=1, max_len=16)
        logits.append(prefill(engine.arch, weights, cache, tokens, torch.tensor([7]), torch.tensor([0]),
                              torch.tensor([0])))  # fmt: skip
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.pop(Q + LORA_A + LORA_SCALE), "int8 LoRA matrices need float32 scales"),
        (lambda t: t.__setitem__(Q + LORA_B + LORA_SCALE, torch.ones(3)), "int8 LoRA matrices need float32 scales"),
        (lambda t: t.__setitem__(Q + LORA_A + LORA_SCALE, torch.ones(4, dtype=torch.int8)), "float32 scales"),
        (lambda t: t.__setitem__(Q + LORA_A, t[Q + LORA_A].float()), "LoRA needs float"),
    ],
)
def test_misshapen_int8_adapters_are_refused_at_staging(change, message):
    model_dir, model = _micro()
    base = export_rollout_tensors(model.state_dict(), "int8", quantize_head=True)
    adapters = dict(lora_adapter_tensors(model.state_dict(), rank=4, sync_dtype="int8", seed=3))
    change(adapters)
    engine = EmbeddedEngine(model_dir, seed=0)
    with pytest.raises(ValueError, match=message):
        engine.stage_weights(WeightUpdate(1, {**base, **adapters}, "int8"))


def test_an_adapter_version_on_the_base_just_built_replaces_only_the_adapters(monkeypatch):
    """Versions 2 and 3 hold new adapters on version 1's very base tensors: each completes the weights it swaps from
    (`ModelWeights.with_adapters`: the base forms are the same objects, the adapters its own) and runs exactly like
    a full build of the same tensors; a misshapen third version on that base is still refused."""
    model_dir, model = _micro()
    base = export_rollout_tensors(model.state_dict(), "int8", quantize_head=True)
    engine = EmbeddedEngine(model_dir, seed=0)
    versions = {v: lora_adapter_tensors(model.state_dict(), rank=4, sync_dtype="int8", seed=v) for v in (1, 2, 3)}
    built, full_builds = {}, []
    build_in_parts = ModelWeights.build_in_parts
    monkeypatch.setattr(
        ModelWeights, "build_in_parts", lambda *a, **k: full_builds.append(1) or build_in_parts(*a, **k)
    )
    for version, adapters in versions.items():
        engine.stage_weights(WeightUpdate(version, {**base, **adapters}, "int8"))
        assert engine.apply_staged() and engine._version == version
        built[version] = engine._weights
    assert len(full_builds) == 1  # version 1 only
    for version in (2, 3):
        layer, before = built[version].layers[0], built[version - 1].layers[0]
        assert layer.qkv is before.qkv and layer.down is before.down and built[version].head is built[1].head
        assert layer.qkv_lora is not before.qkv_lora
    fresh = ModelWeights.build(engine.arch, build_weight_map(WeightUpdate(3, {**base, **versions[3]}, "int8")))
    tokens = torch.tensor([[1, 4, 5, 13, 6, 7, 15]])
    logits = [
        prefill(
            engine.arch,
            weights,
            KVCache(engine.arch, slots=1, max_len=16),
            tokens,
            torch.tensor([7]),
            torch.tensor([0]),
            torch.tensor([0]),
        )  # fmt: skip
        for weights in (built[3], fresh)
    ]
    assert torch.equal(logits[0], logits[1])
    bad = {**versions[3], Q + LORA_B: versions[3][Q + LORA_B][:, :2]}
    with pytest.raises(ValueError, match="has shape"):
        engine.stage_weights(WeightUpdate(4, {**base, **bad}, "int8"))


def test_a_group_mixing_int8_and_float_adapters_runs_their_float32_values():
    inp, outs = 24, [16, 8]
    int8_member = _int8_member(2, outs[0], inp, 1)
    qa, qb, scaling, sa, sb = int8_member
    float_member = (torch.randn(3, inp), torch.randn(outs[1], 3), 0.5)
    mixed = stack_low_rank([int8_member, float_member], outs)
    plain = stack_low_rank([(qa.float() * sa[:, None], qb.float() * sb[None, :], scaling), float_member], outs)
    assert mixed is not None and plain is not None and mixed.a.dtype == torch.float32
    x, base = torch.randn(5, inp), torch.randn(5, sum(outs))
    assert torch.equal(add_low_rank(x, base.clone(), mixed), add_low_rank(x, base.clone(), plain))


def _logits(engine: EmbeddedEngine, weights: ModelWeights) -> torch.Tensor:
    tokens = torch.tensor([[1, 4, 5, 13, 6, 7, 15]])
    cache = KVCache(engine.arch, slots=1, max_len=16)
    return prefill(engine.arch, weights, cache, tokens, torch.tensor([7]), torch.tensor([0]), torch.tensor([0]))


def test_pooled_adapter_versions_run_like_a_full_build_and_stack_once_per_buffer(monkeypatch):
    """Versions as the subscriber of an int8 engine hands them over (`WeightUpdate.pooled`, on its pinned base):
    each runs exactly like a full build of its own tensors, though the stacked adapters are made once per pooled
    buffer (its views rewritten by each version written there), and a version with other scalings in the same buffer
    gets its own; the staged and running versions hold their buffers."""
    import gc

    from quant_sync.export import LORA_SCALING, decode_pooled_adapters
    from rollout_workers.embedded import model as model_module

    gc.collect()
    model_dir, model = _micro()
    base_update = WeightUpdate(0, export_rollout_tensors(model.state_dict(), "int8", quantize_head=True), "int8")
    engine = EmbeddedEngine(model_dir, seed=0)
    stacked, counting = [], []  # the engine's stacking of a version's adapters (per layer), not the fresh builds'
    layer_adapters = model_module._layer_adapters
    monkeypatch.setattr(
        model_module, "_layer_adapters", lambda *a: (counting and stacked.append(a[1])) or layer_adapters(*a)
    )
    seeds = [1, 2, 1, 3, 2, 3, 1]
    published = {seed: lora_adapter_tensors(model.state_dict(), rank=4, sync_dtype="int8", seed=seed) for seed in seeds}
    published[4] = {name: value * 2 if name.endswith(LORA_SCALING) else value for name, value in published[1].items()}
    seeds.append(4)
    buffers = set()
    for version, seed in enumerate(seeds, start=1):
        pooled = decode_pooled_adapters(pack_adapters(published[seed]))
        assert pooled is not None and pooled.buffer_id is not None
        buffers.add(pooled.buffer_id)
        tensors = {**base_update.tensors, **pooled.tensors}
        engine.stage_weights(WeightUpdate(version, tensors, "int8", pooled=pooled, base=base_update))
        del pooled, tensors  # the engine holds what it runs
        counting.append(1)
        assert engine.apply_staged() and engine.version == version
        counting.clear()
        fresh = ModelWeights.build(engine.arch, build_weight_map(WeightUpdate(version, {**base_update.tensors,
                                   **decode_adapters(pack_adapters(published[seed]))}, "int8")))  # fmt: skip
        if engine.runs_int8_adapters:  # the same int8 kernel on the same values: the same bits
            kept = decode_adapters(pack_adapters(published[seed]), keep_int8=True)
            fresh = ModelWeights.build(engine.arch, build_weight_map(WeightUpdate(version, {**base_update.tensors,
                                       **kept}, "int8")))  # fmt: skip
            assert torch.equal(_logits(engine, engine._weights), _logits(engine, fresh)), version
            del kept
        else:
            torch.testing.assert_close(_logits(engine, engine._weights), _logits(engine, fresh))
        del fresh
    assert len(buffers) <= 3  # running, staged and the one being written: buffers are reused
    layers = engine.arch.num_layers
    if engine.runs_int8_adapters:  # the full build of version 1, then once per buffer, once more for new scalings
        assert len(stacked) == layers * (1 + len(buffers) + 1) < layers * len(seeds), (len(stacked), len(buffers))


def test_a_pooled_version_on_the_checked_base_skips_the_per_tensor_checks(monkeypatch):
    """Staging a pooled version whose base is the very version checked before looks at no tensor: the adapters'
    layout is its plan's, checked once; the same tensors with another base object, or without `pooled`, take the
    per-tensor path (its layout checked once more)."""
    from quant_sync.export import decode_pooled_adapters
    from rollout_workers.embedded import staging

    model_dir, model = _micro()
    base_update = WeightUpdate(0, export_rollout_tensors(model.state_dict(), "int8", quantize_head=True), "int8")
    engine = EmbeddedEngine(model_dir, seed=0)
    checks = []
    check = staging.check_adapter_shapes
    monkeypatch.setattr(staging, "check_adapter_shapes", lambda *a: checks.append(1) or check(*a))
    packed = pack_adapters(lora_adapter_tensors(model.state_dict(), rank=4, sync_dtype="int8", seed=5))
    other_base = WeightUpdate(0, dict(base_update.tensors), "int8")
    for version, base, want_checks in [(1, base_update, 0), (2, base_update, 1), (3, base_update, 1),
                                       (4, other_base, 2), (5, None, 2)]:  # fmt: skip
        pooled = decode_pooled_adapters(packed)
        update = WeightUpdate(version, {**base_update.tensors, **pooled.tensors}, "int8", pooled=pooled, base=base)
        if base is None:
            update.pooled = None
        engine.stage_weights(update)
        assert engine.apply_staged() and engine.version == version
        assert len(checks) == want_checks, version


@pytest.mark.parametrize("kernel", KERNELS_HERE)
def test_each_row_gets_the_same_bits_alone_and_in_any_batch(kernel, monkeypatch):
    """Batch invariance on every int8 kernel here: rows 1-40 and 70 (past the amx kernel's 16-row tiles and its 64-row
    chunks), a rank past 32 (two K steps of the B product), an input size off 32 and a stacked rank off 16: each row
    of a batch equals that row computed alone, bit for bit, on 1 and 2 threads. (Without csrc/lora_gemm.cpp torch's
    GEMMs run them, which promise no such thing: there each batch is only checked against float64.)"""
    monkeypatch.setenv(ENV_KERNEL, kernel)
    inp, outs = 50, [40, 70]
    members = [_int8_member(37, outs[0], inp, 1), _int8_member(6, outs[1], inp, 2)]
    stacked = stack_low_rank(members, outs)
    assert stacked is not None and (stacked.amx is not None) == (kernel == "amx")
    gen = torch.Generator().manual_seed(3)
    x, base = torch.randn(70, inp, generator=gen), torch.randn(70, sum(outs), generator=gen)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([add_low_rank(x[i : i + 1], base[i : i + 1].clone(), stacked) for i in range(70)])
        want, bound = _float64_product(x, base, members, outs)
        _assert_within_kernel_bound(alone, want, bound, "amx")  # the looser bound: rank 37 sums past 1e-5 in fp32
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows in [*range(1, 41), 70]:
                batch = add_low_rank(x[:rows], base[:rows].clone(), stacked)
                if stacked.native is not None:
                    assert torch.equal(batch, alone[:rows]), (threads, rows)
                else:
                    _assert_within_kernel_bound(batch, want[:rows], bound[:rows], "amx")
    finally:
        torch.set_num_threads(previous)


def test_the_int8_kernel_named_must_run_here(monkeypatch):
    """`ASYNCRL_LORA_KERNEL` picks the int8 adapters' kernel: a name not among them, or one this CPU does not run
    (AMX tiles hidden here), is an error naming what runs; unset, the best that runs."""
    from rollout_workers.embedded import low_rank

    lib = low_rank._native_lora()
    if lib is None:  # no AVX-512F here: torch's GEMMs run int8 adapters, whatever is asked
        monkeypatch.setenv(ENV_KERNEL, "amx")
        assert low_rank.int8_kernel() is None
        return
    monkeypatch.delenv(ENV_KERNEL, raising=False)
    assert low_rank.int8_kernel() == ("amx" if lib.lr_has_amx() else "avx512")
    monkeypatch.setenv(ENV_KERNEL, "tiles")
    with pytest.raises(ValueError, match="ASYNCRL_LORA_KERNEL='tiles' is not one of amx, avx512"):
        low_rank.int8_kernel()
    monkeypatch.setattr(lib, "lr_has_amx", lambda: 0)
    monkeypatch.setenv(ENV_KERNEL, "amx")
    with pytest.raises(ValueError, match="ASYNCRL_LORA_KERNEL=amx: this machine runs only avx512"):
        low_rank.int8_kernel()
    monkeypatch.setenv(ENV_KERNEL, "avx512")
    assert low_rank.int8_kernel() == "avx512"
