"""Int8 adapter versions decoded by csrc/lora_gemm.cpp in one pass equal torch's two-pass decoding bit for bit: every
A, every B (a view of B^T) and every B's panels, on each ISA path this CPU runs."""

from __future__ import annotations

import pytest
import torch

from quant_sync import adapter_buffers
from quant_sync.adapter_buffers import panels_of
from quant_sync.export import LORA_A, LORA_B, LORA_SCALING, decode_adapters, encode_adapter, pack_adapters
from rollout_workers.embedded.low_rank import NativeDequantizer, native_dequantizer

SHAPES = {  # (out, in): outputs that are, and are not, multiples of the 32-column panels
    "model.layers.0.self_attn.q_proj": (64, 48),
    "model.layers.0.self_attn.k_proj": (24, 48),
    "model.layers.0.self_attn.v_proj": (24, 48),
    "model.layers.0.mlp.down_proj": (48, 80),
    "model.layers.1.self_attn.q_proj": (64, 48),
}


def _packed(seed: int) -> dict[str, torch.Tensor]:
    gen, tensors = torch.Generator().manual_seed(seed), {}
    for linear, (out, inp) in SHAPES.items():
        matrices = {LORA_A: torch.randn(8, inp, generator=gen), LORA_B: 0.01 * torch.randn(out, 8, generator=gen)}
        for part, matrix in matrices.items():
            for suffix, value in encode_adapter(matrix, part, "int8").items():
                tensors[linear + part + suffix] = value
        tensors[linear + LORA_SCALING] = torch.tensor([2.0])
    return pack_adapters(tensors)


def _paths() -> list[bool]:
    dequantizer = native_dequantizer()
    assert dequantizer is not None, "csrc/lora_gemm.cpp did not build"
    return [False, True] if dequantizer.avx512 else [False]


@pytest.mark.parametrize("avx512", _paths())
def test_native_decoding_equals_torchs_bit_for_bit(avx512):
    packed = _packed(seed=3)
    adapter_buffers.use_native(None)
    expected = decode_adapters(packed)
    lib = native_dequantizer()._lib  # type: ignore[union-attr]
    calls: list[str] = []

    class Counting(NativeDequantizer):
        def rows(self, *args: torch.Tensor) -> None:
            calls.append("rows")
            super().rows(*args)

        def panels(self, *args: torch.Tensor) -> None:
            calls.append("panels")
            super().panels(*args)

    adapter_buffers.use_native(lambda: Counting(lib, avx512))
    try:
        got = decode_adapters(packed)
    finally:
        adapter_buffers.use_native(None)
    assert "rows" in calls and "panels" in calls
    assert list(got) == list(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
        if name.endswith((LORA_A, LORA_B)):  # decoded into another of the plan's buffers (scalings: views as sent)
            assert got[name].data_ptr() != value.data_ptr(), name
        if name.endswith(LORA_B):
            got_panels, expected_panels = panels_of(got[name]), panels_of(value)
            assert got_panels is not None and torch.equal(got_panels, expected_panels), name


def test_an_engine_decodes_through_the_native_library():
    from rollout_workers.embedded.engine import EmbeddedEngine  # noqa: F401 - importing sets nothing by itself

    adapter_buffers.use_native(None)
    assert adapter_buffers._dequantizer() is None
    from common.builtin_model import resolve_model_path

    EmbeddedEngine(resolve_model_path("builtin:tiny"), max_batch=2)
    assert isinstance(adapter_buffers._dequantizer(), NativeDequantizer)
    adapter_buffers.use_native(None)
