"""Quantizers: the one implementation of rollout weight/activation quantization (ALGORITHMS.md, "Quantized rollout";
docs/algorithms.md, "Quantized rollout: details").

Pure functions shared by the engine (quantized execution), quant_sync (publication) and the learner (metrics and,
later, the rollout-aligned forward). Weights are quantized per output channel (row of an (out, in) matrix),
activations per token (row of a (tokens, in) matrix), symmetrically.

- int8:      s = max|row| / 127, q = clamp(round(x / s), -127, 127)      (round half to even, torch.round)
- fp8:       s = max|row| / 448, q = float8_e4m3fn(x / s)                 (round to nearest even)
- fp8_trunc: as fp8 but rounded toward zero (ACRL sec. 5.3 stress test); a quotient x / s within fp32 rounding
             noise (TRUNC_TOLERANCE) below an fp8 value counts as that value (a row's max is 448, not 416)

FP8 numerics are exact on CPU: values are stored as float8_e4m3fn and computed on in fp32 after an exact upcast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quant_sync import native

INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0
TRUNC_TOLERANCE = 1.0 + 2.0**-20
"""fp8_trunc rounds toward zero values more than this factor (8 fp32 ulps) above the fp8 value below them."""


@dataclass(slots=True)
class QuantizedWeight:
    """A per-output-channel quantized (out, in) matrix: `dequant = q.float() * scale[:, None]`."""

    q: torch.Tensor  # (out, in) int8 or float8_e4m3fn
    scale: torch.Tensor  # (out,) float32
    scheme: str

    def dequantize(self) -> torch.Tensor:
        return self.q.to(torch.float32) * self.scale[:, None]


def nonzero_scale(scale: torch.Tensor) -> torch.Tensor:
    """`max|x| / qmax` as ALGORITHMS.md writes it, however small; 1 where it is 0 (an all-zero row, or one whose
    scale underflows fp32), so that dividing by it is defined (and the row quantizes to zeros)."""
    return torch.where(scale > 0, scale, 1.0)


def _row_scale(x: torch.Tensor, qmax: float) -> torch.Tensor:
    return nonzero_scale(x.detach().abs().amax(dim=-1).to(torch.float32) / qmax)


def quantize_int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) -> int8 (rows, cols), scale float32 (rows,). Symmetric, per row."""
    scale = _row_scale(x, INT8_MAX)
    q = torch.clamp(torch.round(x.to(torch.float32) / scale[:, None]), -INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def fp8_round_toward_zero(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float8_e4m3fn rounded toward zero (magnitude never increases), saturating at 448."""
    x = x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    nearest = x.to(torch.float8_e4m3fn)
    # Overshoot beyond fp32 rounding noise only: x is a quotient (w / s), and one that is mathematically an fp8
    # value can land an ulp below it (a row's max / (max / 448) = 447.99997); truncating that would drop a whole
    # fp8 step on the last bit of the input, and the learner's and the engine's activations differ in such bits.
    overshoot = nearest.to(torch.float32).abs() > x.abs() * TRUNC_TOLERANCE
    if not bool(overshoot.any()):
        return nearest
    # Step one fp8 ulp toward zero where nearest-even rounded away from zero: for e4m3fn bit patterns of the same
    # sign, the magnitude code is monotone, so subtracting 1 from the low 7 bits is the next value toward zero.
    bits = nearest.view(torch.uint8)
    stepped = torch.where(overshoot, bits - 1, bits)
    return stepped.view(torch.float8_e4m3fn)


def quantize_fp8_rows(x: torch.Tensor, trunc: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) -> float8_e4m3fn (rows, cols), scale float32 (rows,). Nearest-even, or toward zero if trunc."""
    scale = _row_scale(x, FP8_E4M3_MAX)
    scaled = x.to(torch.float32) / scale[:, None]
    q = fp8_round_toward_zero(scaled) if trunc else scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


WEIGHT_CHUNK_ELEMENTS = 1 << 21
"""`quantize_weight` quantizes a weight in blocks of rows of about this many elements (8 MiB of fp32): each row is
quantized on its own, so the blocks give the whole matrix's bits, and the quantizer's fp32 temporaries (|x|, x / s,
its rounding and clamp: four of the matrix's size at once, 0.45 GB for SmolLM2-135M's 49,152 x 576 head) stay
small while the learner publishes on top of its step's memory."""


def _quantize_rows(weight: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    if scheme == "int8":
        return quantize_int8_rows(weight)
    if scheme in ("fp8", "fp8_trunc"):
        return quantize_fp8_rows(weight, trunc=scheme == "fp8_trunc")
    raise ValueError(f"quant.scheme {scheme!r} has no weight quantizer here (valid: int8, fp8, fp8_trunc)")


def quantize_weight(weight: torch.Tensor, scheme: str) -> QuantizedWeight:
    """Quantize an (out, in) linear weight with a W8A8 scheme (`int8`, `fp8`, `fp8_trunc`): int8 on the C++ kernel
    where it takes the weight (`quant_sync.native`), else torch's ops in blocks of rows (`WEIGHT_CHUNK_ELEMENTS`)."""
    if scheme == "int8" and native.takes(weight):  # one C++ pass a row, no temporaries; torch's bits
        quantized = native.int8_rows(weight)
        if quantized is not None:
            return QuantizedWeight(q=quantized[0], scale=quantized[1], scheme=scheme)
    rows = max(1, WEIGHT_CHUNK_ELEMENTS // max(weight.shape[-1], 1))
    if weight.dim() != 2 or weight.shape[0] <= rows:
        q, scale = _quantize_rows(weight, scheme)
        return QuantizedWeight(q=q, scale=scale, scheme=scheme)
    q, scale = _quantize_rows(weight[:rows], scheme)
    q = torch.cat([q, q.new_empty((weight.shape[0] - rows, weight.shape[1]))])
    scale = torch.cat([scale, scale.new_empty(weight.shape[0] - rows)])
    for lo in range(rows, weight.shape[0], rows):
        q[lo : lo + rows], scale[lo : lo + rows] = _quantize_rows(weight[lo : lo + rows], scheme)
    return QuantizedWeight(q=q, scale=scale, scheme=scheme)


def quantize_activation(x: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic activation quantization of (tokens, in) -> (q, scale (tokens,))."""
    if scheme == "int8":
        return quantize_int8_rows(x)
    return quantize_fp8_rows(x, trunc=scheme == "fp8_trunc")


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 linear: x (..., in) float -> (..., out) float32, activations quantized per token.

    int8 uses an exact int8 x int8 -> int32 GEMM (`torch._int_mm`) where its shape rules allow, else an exact
    fp32 emulation (integer products summed in fp64 would be needed beyond 2^24; we use int32 via matmul on int64
    only for tiny shapes). fp8 upcasts the e4m3 operands exactly to fp32 and multiplies in fp32.
    """
    shape = x.shape
    flat = x.reshape(-1, shape[-1]).to(torch.float32)
    q_x, s_x = quantize_activation(flat, weight.scheme)
    if weight.scheme == "int8":
        acc = int8_matmul(q_x, weight.q).to(torch.float32)
    else:
        acc = q_x.to(torch.float32) @ weight.q.to(torch.float32).t()
    out = acc * s_x[:, None] * weight.scale[None, :]
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.reshape(*shape[:-1], weight.q.shape[0])


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact int8 (m, k) x int8 (n, k)^T -> int32 (m, n)."""
    m = a.shape[0]
    if m > 16 and a.shape[1] % 8 == 0 and b.shape[0] % 8 == 0:
        return torch._int_mm(a, b.t())
    # Small batches: _int_mm needs m > 16 on some builds; pad rows (still exact).
    if a.shape[1] % 8 == 0 and b.shape[0] % 8 == 0:
        padded = torch.zeros((17, a.shape[1]), dtype=torch.int8, device=a.device)
        padded[:m] = a
        return torch._int_mm(padded, b.t())[:m]
    return (a.to(torch.int32) @ b.to(torch.int32).t()).to(torch.int32)


WEIGHT_ONLY_BITS = {"w8a16": 8, "w4a16": 4}
WEIGHT_ONLY_GROUP = 128


def quantize_weight_only(weight: torch.Tensor, scheme: str, group: int = WEIGHT_ONLY_GROUP):
    """QaRL weight-only (`w8a16`, `w4a16`): symmetric per output row and group of `group` input columns.

    Returns q (out, in) int8 holding values in [-qmax, qmax] (qmax = 127 or 7) and scale (out, ceil(in / group))
    float32 with s = max|W_group| / qmax. Activations stay in floating point.
    """
    qmax = float(2 ** (WEIGHT_ONLY_BITS[scheme] - 1) - 1)
    out_features, in_features = weight.shape
    n_groups = -(-in_features // group)
    padded = torch.zeros((out_features, n_groups * group), dtype=torch.float32)
    padded[:, :in_features] = weight.detach().to(torch.float32)
    grouped = padded.view(out_features, n_groups, group)
    scale = nonzero_scale(grouped.abs().amax(-1) / qmax)  # (out, n_groups)
    q = torch.clamp(torch.round(grouped / scale[..., None]), -qmax, qmax).to(torch.int8)
    return q.view(out_features, -1)[:, :in_features].contiguous(), scale


def dequantize_published(q: torch.Tensor, scale: torch.Tensor, scheme: str) -> torch.Tensor:
    """A published (q, scale) pair back to float32: per-channel (scale (out,)) or per group (scale (out, groups))."""
    if scale.dim() == 1:
        return q.to(torch.float32) * scale[:, None]
    group = -(-q.shape[1] // scale.shape[1])
    if scheme in WEIGHT_ONLY_BITS:
        group = WEIGHT_ONLY_GROUP
    expanded = scale.repeat_interleave(group, dim=1)[:, : q.shape[1]]
    return q.to(torch.float32) * expanded


def relative_error(original: torch.Tensor, approx: torch.Tensor) -> float:
    """||approx - original||^2 / ||original||^2 (the QuRL eq. 14 form)."""
    denom = float(original.double().pow(2).sum())
    return float((approx.double() - original.double()).pow(2).sum()) / max(denom, 1e-30)
