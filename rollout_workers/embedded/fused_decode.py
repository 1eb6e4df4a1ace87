"""Fused fp32 decode ops for the embedded engine on CPU (`csrc/fused_decode.cpp`, called through ctypes).

A small model's decode step is bound by dispatch, not arithmetic: `builtin:tiny` ran 287 ATen ops per token at
several microseconds each (about 100 now). C++ calls replace most of them:
- `rms_norm`: HF's LlamaRMSNorm in fp32 (7 ATen ops inside `torch.rms_norm`);
- `add_rms_norm_`: the residual add, then the next RMSNorm (the residual stream updated in place);
- `decode_attention`: per decode row, Qwen3's q/k norms if any, RoPE on q and k, the new key and value written into
  the row's cache slot, attention over positions 0..p (about 30 ops with torch). AVX-512 and AVX2 forms (head_dim a
  multiple of 16 / 8) compute a position's score as one vector of products reduced once, the softmax's exp on whole
  vectors and the weighted sum of values over two interleaved partial sums; the portable form runs elsewhere
  (`ASYNCRL_ATTENTION_ISA=0|1|2` caps the form). Measured on Zen 4, one thread, builtin:tiny's shape (4 heads, 2 KV
  heads, head_dim 32), 64 rows at position 31: 159 us portable, 56 AVX-512, 61 AVX2 (at position 55: 260, 79, 86).
  Inside a decode step the cache (16 MB for 64 slots of 128 positions, 4 layers) is read from memory: about twice
  those times;
- `linear` (and `weight_only.pack_fp32` for long rows): fp32 linears that sum every output in one order whatever
  the batch (`pack_fp32_linear`), for the weights MKL would run (a small model's layers, every LM head).
Every op computes each row on its own, so a sequence gets the same bits alone or in any batch (continuous batching
keeps greedy decoding and its log-probs exact; with MKL a row alone, in 2-3 rows and in 4+ rows sums differently).
Agreement with the torch path: RMSNorm and RoPE round like HF's ops; attention's and the linears' sums differ in
order only (fp32 rounding). `enabled_for(tensor)` says whether the engine uses them: on CPU, in fp32, where the
library built, unless `ASYNCRL_FUSED_DECODE=0` (then the torch ops run, as on a GPU or in bf16/fp16).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from rollout_workers.embedded.native import NativeLibrary
from rollout_workers.embedded.weight_only import PackedWeightOnly, pack_fp32

ENV_SWITCH = "ASYNCRL_FUSED_DECODE"
ENV_ATTENTION_ISA = "ASYNCRL_ATTENTION_ISA"


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    if lib.fd_abi_version() != 4:
        raise ValueError("fused_decode library: unexpected ABI version")
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.fd_rms_norm.argtypes, lib.fd_rms_norm.restype = [ptr, i64, i64, ptr, f32, ptr], None
    lib.fd_add_rms_norm.argtypes, lib.fd_add_rms_norm.restype = [ptr, ptr, i64, i64, ptr, f32, ptr], None
    lib.fd_decode_attention.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, f32, ptr, ptr, i64,
                                        ptr, ptr, ctypes.c_int, ctypes.c_int]  # fmt: skip
    lib.fd_decode_attention.restype = ctypes.c_int
    lib.fd_scratch_floats.argtypes, lib.fd_scratch_floats.restype = [i64, i64, i64, i64], i64
    lib.fd_linear_isa.argtypes, lib.fd_linear_isa.restype = [], ctypes.c_int
    lib.fd_linear_t.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, i64, ptr, ptr, ctypes.c_int]
    lib.fd_linear_t.restype = None
    lib.fd_decode_layers_work_floats.argtypes = [i64] * 6
    lib.fd_decode_layers_work_floats.restype = i64
    cint = ctypes.c_int
    lib.fd_decode_layers.argtypes = [ptr, cint, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ptr, ptr, ptr,
                                     f32, ptr, ptr, i64, i64, ptr, ptr, cint, cint, cint, ptr, ptr, ptr]  # fmt: skip
    lib.fd_decode_layers.restype = ctypes.c_int
    return lib


_Library = NativeLibrary("fused_decode.cpp", _declare, note="fused decode ops unavailable, using torch ops")
"""The compiled kernels (ctypes); `_Library.get()` is None where no compiler could build them."""


def enabled_for(cache_keys: torch.Tensor) -> bool:
    """Whether a step over this KV cache runs the fused ops (CPU, fp32, library built, not switched off)."""
    if cache_keys.device.type != "cpu" or cache_keys.dtype != torch.float32:
        return False
    return os.environ.get(ENV_SWITCH, "1") != "0" and _Library.get() is not None


@dataclass(slots=True)
class PackedLinear:
    """An fp32 (out, in) weight transposed once per version for `linear` (zero columns pad `out` to LINEAR_COLUMNS)."""

    weight_t: torch.Tensor  # (in, padded out) fp32
    out_features: int
    isa: int


LINEAR_COLUMNS = 64
ROW_MAJOR_MIN_IN = 512
"""Measured at one thread, Zen 4: from in = 512 the row-major kernel beat the transposed one (1024 x 8192, rows 1
and 64: 1.0 vs 2.2 ms, 12.3 vs 20.9 ms; MKL 1.5, 13.7), below it the transposed one (128 x 768: 11 vs 18 us)."""


def pack_fp32_linear(weight: torch.Tensor) -> PackedLinear | PackedWeightOnly | torch.Tensor:
    """A plain fp32 (out, in) weight (a small model's layer, any LM head) in a batch-invariant form, for where
    `enabled_for` holds: short rows (in < ROW_MAJOR_MIN_IN) transposed for `linear`, long ones as the weight-only
    kernel's fp32 rows (its per-row dot products amortise their horizontal sums there, and it streams a large LM
    head from memory faster than MKL at one row); the weight itself where neither kernel runs."""
    if weight.shape[1] >= ROW_MAJOR_MIN_IN:
        return pack_fp32(weight) or weight
    return pack_linear(weight)


def pack_linear(weight: torch.Tensor) -> PackedLinear:
    """Lay an fp32 (out, in) weight out for `linear` (call where `enabled_for` holds)."""
    out_features, in_features = weight.shape
    padded = -(-out_features // LINEAR_COLUMNS) * LINEAR_COLUMNS
    weight_t = torch.zeros((in_features, padded))
    weight_t[:, :out_features] = weight.t()
    return PackedLinear(weight_t, out_features, _Library.get().fd_linear_isa())  # type: ignore[union-attr]


def linear(x: torch.Tensor, weight: PackedLinear, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) @ W^T (+ bias) in fp32, batch-invariant: every output is one fused multiply-add chain over the
    inputs in order, whatever the number of rows (MKL's sgemm sums a row alone, in 2-3 rows and in 4 or more
    differently, so with it a sequence's logits depend on its batch: at temperature 1e-4 a last-bit difference
    moves a log-prob by 1e-5)."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty((flat.shape[0], weight.out_features))
    _Library.get().fd_linear_t(  # type: ignore[union-attr]
        weight.isa, flat.data_ptr(), flat.shape[0], flat.shape[1], weight.weight_t.data_ptr(), weight.weight_t.shape[1],
        weight.out_features, _ptr(bias), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out if x.dim() == 2 else out.view(*x.shape[:-1], weight.out_features)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (rows, dim) fp32 -> weight * (x * rsqrt(mean(x^2) + eps)), a new tensor."""
    x = x.contiguous()
    out = torch.empty_like(x)
    _Library.get().fd_rms_norm(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), eps, out.data_ptr())  # type: ignore[union-attr]
    return out


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += delta in place (x contiguous (rows, dim) fp32), then return rms_norm(x) (a new tensor)."""
    delta = delta.contiguous()
    out = torch.empty_like(x)
    _Library.get().fd_add_rms_norm(  # type: ignore[union-attr]
        x.data_ptr(), delta.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), eps, out.data_ptr()
    )
    return out


def decode_attention(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    heads: tuple[int, int, int],
    rope: tuple[torch.Tensor, torch.Tensor],
    norms: tuple[torch.Tensor | None, torch.Tensor | None, float],
    cache: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """Decode rows i < N (row i in cache slot i at positions[i]): qkv (N, >= (H + 2 KV) D) fp32; heads = (H, KV, D);
    rope = (cos, sin_rotate) tables (max_len, D); norms = (q_norm, k_norm, eps) (Qwen3, else None); cache = one
    layer's (keys, values), each (slots, KV, max_len, D), written at the rows' positions. Returns (N, H * D)."""
    num_heads, kv_heads, head_dim = heads
    keys, values = cache
    qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    n, max_len = qkv.shape[0], keys.shape[2]
    threads = max(1, min(torch.get_num_threads(), n))
    lib = _Library.get()
    scratch = torch.empty(threads * lib.fd_scratch_floats(num_heads, kv_heads, head_dim, max_len))  # type: ignore[union-attr]
    out = torch.empty((n, num_heads * head_dim))
    q_norm, k_norm, eps = norms
    status = lib.fd_decode_attention(  # type: ignore[union-attr]
        qkv.data_ptr(), qkv.stride(0), n, num_heads, kv_heads, head_dim, positions.data_ptr(), rope[0].data_ptr(),
        rope[1].data_ptr(), _ptr(q_norm), _ptr(k_norm), eps, keys.data_ptr(), values.data_ptr(), max_len,
        out.data_ptr(), scratch.data_ptr(), threads, attention_isa(),
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"decode attention refused its arguments (positions must lie in [0, {max_len}))")
    return out


def attention_isa() -> int:
    """The decode attention's form: 2 AVX-512, 1 AVX2 + FMA, 0 portable (`ASYNCRL_ATTENTION_ISA` caps it, for tests
    and comparisons; the default is the best this CPU runs)."""
    best = _Library.get().fd_linear_isa()  # type: ignore[union-attr]
    forced = os.environ.get(ENV_ATTENTION_ISA, "")
    return min(best, int(forced)) if forced in ("0", "1", "2") else best


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()
