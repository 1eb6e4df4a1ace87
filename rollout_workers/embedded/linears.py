"""The execution forms of the embedded engine's linear weights and the one call that runs any of them.

`prepare_linear` turns a published weight (an fp32 tensor, a W8A8 `QuantizedWeight`, a weight-only `GroupQuantized`)
into the fastest exact form this CPU runs, once per weight version: the C++ int8 / fp8 / weight-only kernels,
oneDNN's prepacked fp32 GEMM, fused_decode's batch-invariant fp32 form. `linear(x, weight, bias)` dispatches on the
form. `_fuse` stacks q/k/v and gate/up into one matrix each (exact for per-output-channel quantization).

LoRA adapters (learner/lora.py) ride on top of any form: `low_rank_linear(x, weight, bias, adapter)` is
`y = Q(W) x + s * B (A x)`, the low-rank product over all rows at once (rollout_workers/embedded/low_rank.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quant_sync.quantizers import QuantizedWeight, quantize_activation, quantized_linear
from rollout_workers.embedded import fused_decode
from rollout_workers.embedded.fp8_linear import PackedFp8, fp8_linear, prepare_fp8
from rollout_workers.embedded.int8_linear import PackedInt8, int8_kernel_name, int8_linear, prepare_int8
from rollout_workers.embedded.low_rank import LowRank, add_low_rank
from rollout_workers.embedded.weight_only import GroupQuantized, PackedWeightOnly, pack_weight_only, weight_only_linear

_MKLDNN_LINEAR = (
    torch.backends.mkldnn.is_available()
    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
)
PACK_FP32_MIN_FEATURES = 512
"""fp32 weights with both dimensions at least this large run through oneDNN's prepacked GEMM (see PackedFp32)."""
HEAD_PACKED = False
"""The LM head is not prepacked for oneDNN: that took 50 ms of every version's build (100M config, vocab 8192) and
gave no measurable decode speed (int8 rollout, batch 8 and 32). On CPU in fp32 it takes fused_decode's
batch-invariant form instead (a transposed or padded copy at most: none at hidden 576 or 1024)."""
EXACT_FP32_MAX_IN_FEATURES = 1040
"""An int8 x int8 product summed in fp32 is exact while every partial sum stays below 2^24: in_features x 127^2
< 2^24 holds up to 1040 input features, whatever the summation order."""
UPCAST_INT8_MAX_ELEMENTS = 1 << 18
"""int8 weights up to this size (and EXACT_FP32_MAX_IN_FEATURES inputs) run as exact fp32 GEMMs (UpcastQuantized)
instead of oneDNN's prepacked int8 GEMM. Measured on the 2-core AVX2 machines, one thread, rows 1-64: 1.3-2.5x
faster per call at 512x512 and below, and a version's build costs a cast (0.03 ms) instead of a prepack
(0.8 ms per matrix, whatever its size). From about 1024x1024 up, oneDNN is faster. Only where the int8 kernel is
`onednn` (int8_linear.py): the C++ and VNNI kernels beat the fp32 GEMM at every size measured (Zen 4, 32x64 up)."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(slots=True)
class UpcastQuantized:
    """An int8 `QuantizedWeight` upcast once to fp32 (exact), so steps do not upcast it again: the small ones where
    the int8 kernel is oneDNN's (see UPCAST_INT8_MAX_ELEMENTS), whose integer products the fp32 GEMM sums exactly."""

    q32: torch.Tensor  # (out, in) float32 holding the int8 values
    scale: torch.Tensor
    scheme: str


@dataclass(slots=True)
class PackedFp32:
    """An fp32 weight reordered once into oneDNN's blocked layout (the engine's fast fp32 path on CPU).

    Measured on the 2-core AVX2 machines at hidden 1024, one thread: 1.2-2x faster than `F.linear` (MKL) from 4
    to 512 rows, but 0.6-0.9x at a single row (a GEMV, memory-bound), and slower on small matrices (hence
    PACK_FP32_MIN_FEATURES). So the plain weight is kept too, for single-row calls: twice the memory of these
    layers, for the fastest kernel at every batch size. Same fp32 arithmetic; only the summation order differs
    (outputs agree to ~1e-6 relative).
    """

    packed: torch.Tensor
    weight: torch.Tensor
    out_features: int


def low_rank_linear(
    x: torch.Tensor, weight: Linear, bias: torch.Tensor | None, adapter: LowRank | None
) -> torch.Tensor:
    """`linear(x, weight, bias)` plus the adapter's `s * B (A x)` (in x's dtype, on unquantized x) when it has one."""
    out = linear(x, weight, bias)
    return out if adapter is None else add_low_rank(x, out, adapter)


Linear = (torch.Tensor | QuantizedWeight | PackedInt8 | PackedFp8 | UpcastQuantized | PackedFp32 | GroupQuantized
          | PackedWeightOnly | fused_decode.PackedLinear)  # fmt: skip


def prepare_linear(
    weight: Linear, dtype: torch.dtype = torch.float32, device: torch.device | None = None, pack: bool = True
) -> Linear:
    """The engine's execution form of one linear weight (built once per weight version) on `device` (default CPU).

    Float weights are cast to the compute dtype (`precision.rollout`); quantized ones keep their own numerics. The
    prepacked oneDNN forms are CPU-only; on a GPU, W8A8 weights run `quantized_linear` (`torch._int_mm`).
    `pack=False` keeps a float weight plain (the LM head: see ModelWeights.build_in_parts).
    """
    device = device or torch.device("cpu")
    if device.type != "cpu":
        if isinstance(weight, GroupQuantized):  # weight-only on a GPU: the exact dequantized matrix
            return weight.dequantize().to(device=device, dtype=dtype)
        if isinstance(weight, QuantizedWeight):
            return QuantizedWeight(weight.q.to(device), weight.scale.to(device), weight.scheme)
        return weight.to(device=device, dtype=dtype)  # type: ignore[union-attr]
    if isinstance(weight, torch.Tensor):
        weight = weight.to(dtype)
        if pack and dtype == torch.float32 and _MKLDNN_LINEAR and min(weight.shape) >= PACK_FP32_MIN_FEATURES:
            weight = weight.contiguous()
            return PackedFp32(torch.ops.mkldnn._reorder_linear_weight(weight, 64), weight, weight.shape[0])
        return fused_decode.pack_fp32_linear(weight) if fused_decode.enabled_for(weight) else weight
    if isinstance(weight, GroupQuantized):  # w8a16 / w4a16: the fused dequantize-and-multiply kernel
        return pack_weight_only(weight)
    if not isinstance(weight, QuantizedWeight):
        return weight
    if weight.scheme in ("fp8", "fp8_trunc"):
        return prepare_fp8(weight)  # the fastest exact form of the FP8 product on this CPU (fp8_linear.py)
    if weight.scheme == "int8" and _upcast_is_exact_and_faster(weight.q):
        q32, scale = weight.q.to(torch.float32), weight.scale.to(torch.float32)
        return UpcastQuantized(q32=q32, scale=scale, scheme=weight.scheme)
    if weight.scheme == "int8":
        return prepare_int8(weight)  # the fastest exact int8 kernel this CPU runs (int8_linear.py)
    return weight


def _upcast_is_exact_and_faster(q: torch.Tensor) -> bool:
    out_features, in_features = q.shape
    small = in_features <= EXACT_FP32_MAX_IN_FEATURES and out_features * in_features <= UPCAST_INT8_MAX_ELEMENTS
    return small and int8_kernel_name() == "onednn"


def _upcast_linear(x: torch.Tensor, weight: UpcastQuantized, bias: torch.Tensor | None) -> torch.Tensor:
    shape = x.shape
    flat = x.reshape(-1, shape[-1]).to(torch.float32)
    q_x, s_x = quantize_activation(flat, weight.scheme)
    out = (q_x.to(torch.float32) @ weight.q32.t()) * s_x[:, None] * weight.scale[None, :]
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.reshape(*shape[:-1], weight.q32.shape[0])


def linear(x: torch.Tensor, weight: Linear, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    if isinstance(weight, PackedFp32):
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] == 1:
            return F.linear(x, weight.weight, bias)
        out = torch.ops.mkldnn._linear_pointwise(rows, weight.packed, bias, "none", [], "")
        return out.reshape(*x.shape[:-1], weight.out_features)
    if isinstance(weight, PackedInt8):
        out = int8_linear(x, weight, bias)
    elif isinstance(weight, PackedFp8):
        out = fp8_linear(x, weight, bias)
    elif isinstance(weight, UpcastQuantized):
        out = _upcast_linear(x, weight, bias)
    elif isinstance(weight, PackedWeightOnly):
        out = weight_only_linear(x, weight, bias)
    elif isinstance(weight, fused_decode.PackedLinear):
        return fused_decode.linear(x, weight, bias)
    else:
        out = quantized_linear(x, weight, bias)
    return out.to(x.dtype)  # quantized products come back in fp32; the rest of the forward runs in x's dtype


def _fuse(weights: list[Linear]) -> Linear:
    """Stack linears along the output dimension (exact for per-output-channel quantized weights)."""
    first = weights[0]
    if isinstance(first, QuantizedWeight):
        assert all(isinstance(w, QuantizedWeight) and w.scheme == first.scheme for w in weights)
        return QuantizedWeight(
            q=torch.cat([w.q for w in weights]).contiguous(),  # type: ignore[union-attr]
            scale=torch.cat([w.scale for w in weights]).contiguous(),  # type: ignore[union-attr]
            scheme=first.scheme,
        )
    if isinstance(first, GroupQuantized):
        return GroupQuantized.stack(weights)  # type: ignore[arg-type]
    return torch.cat(weights).contiguous()  # type: ignore[arg-type]
