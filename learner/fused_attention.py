"""Causal self-attention of the learner's short rows as one C++ pass forward and one backward (part of
`learner.fused_ops`).

HF runs a Llama-family model's attention through torch's `scaled_dot_product_attention`, whose CPU flash kernel
runs the learner's rows (about 130 tokens, 64-wide heads) at about 49 GFLOP/s, a fifth of the fp32 GEMM rate: 0.70 s
of a 15 s decode-shape step (`asyncrl bench e2e`). `csrc/train_attention.cpp` holds each batch row's kv head in
register tiles (AVX-512F): the scores, softmax and output rows forward, with the softmax rows saved for the backward
instead of recomputed (B x H x L x L floats: `MAX_LEN` and `MAX_SAVED_BYTES` bound them), and the four products of
the backward. A layer of that shape, one thread: 6.0-6.7 ms forward and 8.8 ms backward, where SDPA took 17.2-17.6
ms for both on two; the whole step 15.41 -> 14.84 s (docs/kernels.md).

`use_fused_attention(model)` registers the function with transformers (`AttentionInterface` and the SDPA mask
builder under `IMPLEMENTATION`) and points the model's `_attn_implementation` at it, for models on `sdpa` whose
library loaded and whose CPU runs its path. Llama attention modules also take the rotary embedding into the same
calls (a class swap to `_fused_rope_class()`: parameters, state-dict keys and hooks unchanged): transformers rotates
q and k with six elementwise passes over (B, H, L, D) views, the kernel reads them back as (B, L, H, D) rows (a
copy each), and the backward retraces all of it; `ta_rope` writes the rotated rows from the projections' outputs in
one pass and `ta_rope_backward` returns the projections' gradients in one pass, with transformers' bits (each
product rounded, then added). transformers' passes took 3.2 ms a layer and micro-batch on the e2e decode shape
(0.17 s a step).

Packed tokens (`learner.packing.pack_tokens`: each group's shared prompt once, no padding) come with a `RowLayout`
under `ROWS_KWARG`: the attention gathers them into their rows, runs the rows as above (right padding needs no mask
under the causal order), and each token takes its own row position's output; the gather's backward sums the shared
prompt's key and value gradients over the group's rows. Rows the kernels do not take go to SDPA, causal, unmasked.

At a call, anything else goes to HF's SDPA function (and transformers' own rotary embedding), with the mask HF
built: a mask (padding, packed rows), dropout, a key length other than the query's (a cache), a non-causal module,
another dtype or device, head sizes other than 32, 64 and 128, rows longer than `MAX_LEN`, or calls past
`MAX_SAVED_BYTES`. Under CPU autocast (`precision.train` bf16 or fp16) the kernels take the projections upcast to
fp32 (`learner.fp32_gemm.fp32_kernel_inputs`): SDPA's CPU flash kernel in bf16 took 2.0 s of a 8.7 s one-thread
bf16 step of the e2e decode shape, its backward most of it; the fused fp32 kernels 0.74 s (docs/kernels.md).

Numerics: fp32, one fixed order of fused multiply-adds per element and sums in 8 fixed lanes, so any thread count
gives the same bits; against float64 within 3e-5 like SDPA's (tests/unit/learner/test_fused_attention.py).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.native_build import NativeLibrary, isa_cap
from learner.fp32_gemm import fp32_kernel_inputs, fp32_kernel_takes

SOURCE = Path(__file__).with_name("csrc") / "train_attention.cpp"
ABI_VERSION = 2
IMPLEMENTATION = "asyncrl_fused_sdpa"
"""The name under which the attention function and its mask builder (SDPA's) are registered with transformers."""
MAX_LEN = 256
"""The longest row the kernels take. Its saved softmax rows cost H x L floats a token and layer, against SDPA's one:
on the e2e decode shape (133 tokens, 16 heads) 15% on top of the layer's other saved activations, 25% at 256."""
MAX_SAVED_BYTES = 256 * 2**20
"""The softmax rows a call may save for its backward (B x H x L x padded L floats); more take SDPA's path."""
HEAD_DIMS = (32, 64, 128)
ROWS_KWARG = "asyncrl_rows"
"""The keyword under which a decoder call hands its attention modules a `RowLayout` (transformers passes a model
call's extra keywords on to every attention module and attention function)."""


@dataclass(frozen=True, slots=True)
class RowLayout:
    """Packed tokens (one sequence of N: each group's shared prefix once, then each row's own tokens) whose attention
    runs as the B rows of S positions they came from (`learner.packing.pack_groups` on this attention).

    The linear layers, norms and MLP see every shared prefix once; the attention gathers each row's positions from
    the packed tokens, attends causally row by row (right padding needs no mask under the causal order: a row's
    tokens never see the positions past its end), and each packed token takes its own row position's output. A
    prefix token takes its first row's; the other rows' copies feed only their own rows' later tokens as keys and
    values, and the gather's backward adds their key and value gradients into the shared token.
    """

    gather: torch.Tensor  # (B * S,) long: the packed token at each row position (a real token past a row's end)
    take: torch.Tensor  # (N,) long: the row position (b * S + s) whose attention output each packed token takes
    rows: int
    width: int

    def to_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """(N, ...) per packed token -> (B, S, ...) per row position (a gather; backward sums the copies)."""
        return tokens.index_select(0, self.gather).view(self.rows, self.width, *tokens.shape[1:])

    def from_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """(B, S, ...) per row position -> (N, ...): each packed token's own row position."""
        return rows.reshape(self.rows * self.width, *rows.shape[2:]).index_select(0, self.take)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    if lib.ta_abi_version() != ABI_VERSION:
        raise ValueError(f"train_attention ABI {lib.ta_abi_version()}, expected {ABI_VERSION}")
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.ta_padded.argtypes, lib.ta_padded.restype = [i64], i64
    lib.ta_forward.argtypes = [p, p, p, p, p, i64, i64, i64, i64, i64, f32, i32]
    lib.ta_backward.argtypes = [p, p, p, p, p, p, p, p, p, i64, i64, i64, i64, i64, f32, i32]
    lib.ta_rope.argtypes = lib.ta_rope_backward.argtypes = [p, p, p, p, i64, i64, i64, i64, i64, i32]
    return lib


LIBRARY = NativeLibrary(SOURCE, _declare, note="the learner's fused attention is unavailable, using torch's SDPA")


@functools.cache
def _cpu_runs_it() -> bool:
    lib = LIBRARY.get()
    return lib is not None and bool(lib.ta_isa())


def available() -> bool:
    """Whether the kernels run here: the library built and an AVX-512F CPU, not capped to AVX2 (`ASYNCRL_ISA_CAP`)."""
    return isa_cap() != "avx2" and _cpu_runs_it()


def _lib() -> ctypes.CDLL:
    return LIBRARY.require("learner fused attention")


def _attend(ctx: Any, q_rows: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, scale: float,
            *saved: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """`ta_forward` of rows q (B, L, H, D), k and v (B, L, KV, D) -> out (B, L, H, D); saves what `_attend_backward`
    reads, then `saved`."""
    lib = _lib()
    batch, length, heads, dim = q_rows.shape
    out = torch.empty_like(q_rows)
    probs = torch.empty((batch, heads, length, lib.ta_padded(length)), dtype=torch.float32)
    lib.ta_forward(q_rows.data_ptr(), k_rows.data_ptr(), v_rows.data_ptr(), out.data_ptr(), probs.data_ptr(),
                   batch, length, heads, k_rows.shape[2], dim, scale, torch.get_num_threads())  # fmt: skip
    ctx.save_for_backward(q_rows, k_rows, v_rows, out, probs, *saved)
    ctx.scale = scale
    return out


def _attend_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`ta_backward`: dq, dk, dv as rows, then the tensors `_attend` saved after its own."""
    q_rows, k_rows, v_rows, out, probs, *saved = ctx.saved_tensors
    grad = grad.contiguous()
    batch, length, heads, dim = q_rows.shape
    dq, dk, dv = torch.empty_like(q_rows), torch.empty_like(k_rows), torch.empty_like(v_rows)
    _lib().ta_backward(q_rows.data_ptr(), k_rows.data_ptr(), v_rows.data_ptr(), out.data_ptr(), probs.data_ptr(),
                       grad.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), batch, length, heads,
                       k_rows.shape[2], dim, ctx.scale, torch.get_num_threads())  # fmt: skip
    return dq, dk, dv, *saved


class _AttentionFn(torch.autograd.Function):
    """q (B, H, L, D), k and v (B, KV, L, D) -> out (B, L, H, D), causal, grouped-query heads."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:  # noqa: ANN001
        return _attend(ctx, *(t.transpose(1, 2).contiguous() for t in (q, k, v)), scale)  # rows (B, L, heads, D)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:  # noqa: ANN001
        dq, dk, dv = _attend_backward(ctx, grad)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None


def _rope(fn: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`ta_rope` or `ta_rope_backward` of rows x (B, L, heads, D) into out; cos and sin (B or 1, L, D) contiguous."""
    batch, length, heads, dim = x.shape
    cs_batch = 0 if cos.shape[0] == 1 else length * dim
    fn(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), batch, length, heads, dim, cs_batch,
       torch.get_num_threads())  # fmt: skip
    return out


class _RopeAttentionFn(torch.autograd.Function):
    """q (B, L, H, D), k and v (B, L, KV, D) projections (not rotated), cos and sin (B or 1, L, D) -> out (B, L, H,
    D): transformers' rotary embedding of q and k, then `_AttentionFn`'s attention, one C++ pass each way."""

    @staticmethod
    def forward(ctx, q, k, v, cos, sin, scale: float) -> torch.Tensor:  # noqa: ANN001
        lib = _lib()
        q_rows = _rope(lib.ta_rope, q, cos, sin, torch.empty_like(q))
        k_rows = _rope(lib.ta_rope, k, cos, sin, torch.empty_like(k))
        return _attend(ctx, q_rows, k_rows, v, scale, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # noqa: ANN001
        lib = _lib()
        dq, dk, dv, cos, sin = _attend_backward(ctx, grad)
        _rope(lib.ta_rope_backward, dq, cos, sin, dq)  # in place: each pair of halves is read before it is written
        _rope(lib.ta_rope_backward, dk, cos, sin, dk)
        return dq, dk, dv, None, None, None


def rope_applies(module: torch.nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
                 position_embeddings: Any, cache: Any, layout: RowLayout | None = None) -> bool:  # fmt: skip
    """Whether a Llama attention call runs `_RopeAttentionFn`: the model on the fused attention, what `applies`
    asks of the call, and the rotary tables (B or 1, L, D), fp32 and contiguous. Otherwise transformers' forward.
    With a `layout` (packed tokens: hidden (1, N, C), tables (1, N, D)) the kernels must take the rows it gathers."""
    config = module.config
    if config._attn_implementation != IMPLEMENTATION or cache is not None or position_embeddings is None:
        return False
    if attention_mask is not None or (module.training and module.attention_dropout > 0) or hidden.dim() != 3:
        return False
    if not getattr(module, "is_causal", True) or (layout is not None and hidden.shape[0] != 1):
        return False
    cos, sin = position_embeddings
    batch, length = hidden.shape[:2]
    dim = module.head_dim
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[0] not in (1, batch) or cos.shape[1:] != (length, dim):
        return False
    if not (cos.is_contiguous() and sin.is_contiguous() and fp32_kernel_takes(hidden, cos, sin)):
        return False
    if layout is not None:
        batch, length = layout.rows, layout.width
    return _fits(batch, config.num_attention_heads, config.num_key_value_heads, length, dim)


def _rows_rope_attention(module: torch.nn.Module, hidden: torch.Tensor, position_embeddings: Any,
                         layout: RowLayout) -> torch.Tensor:  # fmt: skip
    """The projections of packed `hidden` (1, N, C) gathered into the layout's rows, `_RopeAttentionFn` on them (or
    transformers' rotation and SDPA's causal attention for a projection of another dtype), the output (1, N, H * D)
    at each packed token's own row position."""
    shape = (hidden.shape[1], -1, module.head_dim)
    q, k, v = (layout.to_rows(proj(hidden).view(shape)) for proj in (module.q_proj, module.k_proj, module.v_proj))
    cos, sin = (layout.to_rows(table[0]) for table in position_embeddings)  # (B, S, D)
    inputs = fp32_kernel_inputs(q, k, v, cos, sin)
    if inputs is not None:
        out = _RopeAttentionFn.apply(*inputs, module.scaling)
    else:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        out, _ = attention_forward(module, q, k, v.transpose(1, 2), None, scaling=module.scaling)
    return layout.from_rows(out).view(1, hidden.shape[1], -1)


@functools.cache
def _fused_rope_class() -> type:
    """transformers' `LlamaAttention` whose forward runs `_RopeAttentionFn` where `rope_applies`."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    class FusedRopeLlamaAttention(LlamaAttention):
        def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):  # noqa: ANN001, ANN003, ANN201
            cache = kwargs.pop("past_key_values", None) if cache is None else cache
            layout = kwargs.get(ROWS_KWARG)
            if not rope_applies(self, hidden_states, attention_mask, position_embeddings, cache, layout):
                return super().forward(hidden_states, position_embeddings, attention_mask, cache, **kwargs)
            if layout is not None:
                return self.o_proj(_rows_rope_attention(self, hidden_states, position_embeddings, layout)), None
            shape = (*hidden_states.shape[:-1], -1, self.head_dim)
            q, k, v = (proj(hidden_states).view(shape).contiguous() for proj in (self.q_proj, self.k_proj, self.v_proj))
            inputs = fp32_kernel_inputs(q, k, v, *position_embeddings)
            if inputs is not None:
                out = _RopeAttentionFn.apply(*inputs, self.scaling)
            else:  # a projection wrapped to give another dtype or tensor type: transformers' rotation, then SDPA's
                from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

                q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), *position_embeddings)
                out, _ = attention_forward(self, q, k, v.transpose(1, 2), None, scaling=self.scaling)
            return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), None

    FusedRopeLlamaAttention.__qualname__ = FusedRopeLlamaAttention.__name__
    return FusedRopeLlamaAttention


def applies(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attention_mask: torch.Tensor | None, dropout: float) -> bool:  # fmt: skip
    """Whether a call of the attention function runs the fused kernels (the module doc lists what does not)."""
    if attention_mask is not None or dropout > 0 or not getattr(module, "is_causal", True) or query.dim() != 4:
        return False
    batch, heads, length, dim = query.shape
    if key.shape != value.shape or key.shape[0] != batch or key.shape[2] != length or key.shape[3] != dim:
        return False
    return fp32_kernel_takes(query, key, value) and _fits(batch, heads, key.shape[1], length, dim)


def _fits(batch: int, heads: int, kv_heads: int, length: int, dim: int) -> bool:
    """Whether the kernels take a call of this shape here: rows of 2..`MAX_LEN`, a head size of `HEAD_DIMS`, query
    heads a multiple of the kv heads, saved softmax rows within `MAX_SAVED_BYTES`, and the kernels' path on this CPU."""
    if not 2 <= length <= MAX_LEN or dim not in HEAD_DIMS or kv_heads < 1 or heads % kv_heads:
        return False
    return available() and batch * heads * length * _lib().ta_padded(length) * 4 <= MAX_SAVED_BYTES


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: (B, L, H, D) output, no weights. The fused kernels where they
    apply (`applies`), else HF's SDPA function with the same arguments. With a `RowLayout` under `ROWS_KWARG`
    (packed tokens, query (1, H, N, D)): the attention of the layout's rows, by the same rule, at each token's own
    row position."""
    layout = kwargs.pop(ROWS_KWARG, None)
    if layout is not None:
        q, k, v = (layout.to_rows(t[0].transpose(0, 1)).transpose(1, 2) for t in (query, key, value))  # (B, H, S, D)
        out, _ = attention_forward(module, q, k, v, None, dropout, scaling, is_causal, **kwargs)
        return layout.from_rows(out)[None], None
    if is_causal is not False and applies(module, query, key, value, attention_mask, dropout):
        scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
        return _AttentionFn.apply(*fp32_kernel_inputs(query, key, value), scale), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)  # fmt: skip


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


def use_fused_attention(model: torch.nn.Module, enabled: bool = True) -> bool:
    """With `enabled`, a model on `sdpa` attention with its parameters on the CPU, the library built and a CPU that
    runs it: register the fused attention and point the model's config at it (every module reads
    `config._attn_implementation` at each call), and move its Llama attention modules to the fused rotary
    embedding (`_fused_rope_class`). Returns whether it did."""
    config = getattr(model, "config", None)
    if not enabled or getattr(config, "_attn_implementation", None) != "sdpa" or not available():
        return False
    if any(param.device.type != "cpu" for param in model.parameters()):  # a GPU learner keeps SDPA's CUDA kernels
        return False
    _register()
    config._attn_implementation = IMPLEMENTATION
    from transformers.models.llama.modeling_llama import LlamaAttention

    for module in model.modules():
        if type(module) is LlamaAttention:
            module.__class__ = _fused_rope_class()
    return True
