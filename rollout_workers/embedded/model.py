"""The embedded engine's Llama-family forward: RMSNorm, RoPE, grouped-query attention, SwiGLU, over a slot KV cache.

Reads a Hugging Face `config.json` (Llama incl. llama3 RoPE scaling, Qwen2 with q/k/v biases, Qwen3 with q/k norms,
SmolLM). A published weight map (linear weights are float tensors or `QuantizedWeight`s, W8A8) is turned once per
version into `ModelWeights`: q/k/v and gate/up fused into one matrix each (exact: the quantization is per output
channel and the activation scale per token, so a fused W8A8 product equals the separate ones). The engine swaps a
whole `ModelWeights` object between decode steps, so a step never mixes two versions.

The KV cache holds one row ("slot") per sequence, position p of a sequence at index p of its slot. `prefill` runs
right-padded prompts from position 0 and writes their keys/values into any slots; `decode` runs one token for each
of the first n slots (the engine keeps its active sequences in slots 0..n-1); `forward_step` runs both in one forward,
sharing every linear between them (the engine's step: prompts that join a running batch ride along with it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from quant_sync.quantizers import QuantizedWeight, quantize_activation, quantized_linear
from rollout_workers.embedded import fused_decode
from rollout_workers.embedded.fp8_linear import PackedFp8, fp8_linear, prepare_fp8
from rollout_workers.embedded.int8_linear import PackedInt8, int8_kernel_name, int8_linear, prepare_int8
from rollout_workers.embedded.weight_only import GroupQuantized, PackedWeightOnly, pack_weight_only, weight_only_linear

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
LINEAR_SUFFIXES = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip

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


class ModelDirError(ValueError):
    """A model directory that cannot be served: missing files, unsupported architecture, bad config."""


@dataclass(frozen=True, slots=True)
class ArchConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    max_positions: int
    rope_scaling: tuple[tuple[str, float | str], ...] = ()
    """HF `rope_parameters` / `rope_scaling` items other than rope_theta (e.g. rope_type llama3 and its factors)."""

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ArchConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelDirError(f"{model_dir}: no config.json (is this a Hugging Face model directory?)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ModelDirError(f"{path}: invalid JSON: {err}") from err
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelDirError(
                f"{path}: model_type {model_type!r} is not supported by the embedded engine "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
            rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ModelDirError(
                    f"{path}: rope_type {rope_type!r} is not supported by the embedded engine "
                    f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
                )
            rope_theta = float(raw.get("rope_theta") or rope.pop("rope_theta", None) or 10000.0)
            rope.pop("rope_theta", None)
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((int(eos),) if eos is not None else ())
            return cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                eos_token_ids=eos_ids,
                max_positions=int(raw.get("max_position_embeddings", 4096)),
                rope_scaling=(("rope_type", rope_type), *sorted(rope.items())) if rope_type != "default" else (),
            )
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, ModelDirError):
                raise
            raise ModelDirError(f"{path}: missing or invalid field: {err}") from err


def rope_inv_freq(arch: ArchConfig) -> torch.Tensor:
    """(head_dim / 2,) inverse frequencies, as HF computes them (default, linear and llama3 rope types)."""
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    scaling = dict(arch.rope_scaling)
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_context = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_tables(arch: ArchConfig, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (max_len, head_dim) for positions 0..max_len-1, HF's rotate-half layout."""
    freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * rope_inv_freq(arch)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: statistics in fp32, the normalised value cast back to x's dtype before the weight."""
    if x.dtype == torch.float32:  # one op: the same formula (weight * (x * rsqrt(mean(x^2) + eps))), same bits
        return torch.rms_norm(x, x.shape[-1:], weight, eps)
    h = x.to(torch.float32)
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_rotate: torch.Tensor) -> torch.Tensor:
    """HF's `x * cos + rotate_half(x) * sin` in 3 ops instead of 7: rotate_half(x) * sin = roll(x, D/2) * sin_rotate,
    sin_rotate being sin with its first half negated (KVCache.sin_rotate): the same products, signs flipped exactly;
    `addcmul` may fuse the last multiply-add (HF's result to an ulp). x (B, H, S, D); cos/sin_rotate (B, 1, S, D)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_rotate)


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


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear  # (q + 2 kv, hidden): q_proj, k_proj, v_proj stacked
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3
    k_norm: torch.Tensor | None
    o_proj: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # (2 * intermediate, hidden): gate_proj, up_proj stacked
    down: Linear


@dataclass(slots=True)
class ModelWeights:
    """One weight version in the forward's layout, built once per version (off the decode thread)."""

    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    head: Linear

    @classmethod
    def build(
        cls, arch: ArchConfig, weights: dict[str, Linear], dtype: torch.dtype = torch.float32, device: str = "cpu"
    ) -> ModelWeights:
        *_, built = cls.build_in_parts(arch, weights, dtype, device)
        return built  # type: ignore[return-value]

    @classmethod
    def build_in_parts(
        cls, arch: ArchConfig, weights: dict[str, Linear], dtype: torch.dtype = torch.float32, device: str = "cpu"
    ) -> Iterator[ModelWeights | None]:
        """Build half a layer per iteration (None), then yield the result: lets the engine spread the work over steps.

        Float tensors are cast to the compute `dtype` and moved to `device`; quantized linears keep their scheme.
        Raises KeyError before any work if a weight is missing.
        """
        missing = [name for name in required_weight_names(arch) if name not in weights]
        if missing:
            raise KeyError(f"weights missing from the published version: {', '.join(missing[:5])}")
        target = torch.device(device)

        def tensor(name: str) -> torch.Tensor | None:
            value = weights.get(name)
            return None if value is None else value.to(device=target, dtype=dtype)  # type: ignore[union-attr]

        def prepare(weight: Linear) -> Linear:
            return prepare_linear(weight, dtype, target)

        layers = []
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            attn = [weights[p + f"self_attn.{name}_proj.weight"] for name in "qkv"]
            biases = [tensor(p + f"self_attn.{name}_proj.bias") for name in "qkv"]
            gate_up = prepare(_fuse([weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]]))
            yield None  # the largest matrix, a part of its own: a step's build slice overruns by half a layer at most
            layers.append(
                LayerWeights(
                    input_norm=tensor(p + "input_layernorm.weight"),  # type: ignore[arg-type]
                    qkv=prepare(_fuse(attn)),
                    qkv_bias=torch.cat(biases) if all(b is not None for b in biases) else None,  # type: ignore
                    q_norm=tensor(p + "self_attn.q_norm.weight"),
                    k_norm=tensor(p + "self_attn.k_norm.weight"),
                    o_proj=prepare(weights[p + "self_attn.o_proj.weight"]),
                    post_norm=tensor(p + "post_attention_layernorm.weight"),  # type: ignore[arg-type]
                    gate_up=gate_up,
                    down=prepare(weights[p + "mlp.down_proj.weight"]),
                )
            )
            yield None
        embed = weights["model.embed_tokens.weight"]
        yield cls(
            embed=tensor("model.embed_tokens.weight"),  # type: ignore[arg-type]
            layers=layers,
            norm=tensor("model.norm.weight"),  # type: ignore[arg-type]
            head=prepare_linear(weights.get("lm_head.weight", embed), dtype, target, pack=HEAD_PACKED),
        )


def required_weight_names(arch: ArchConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + suffix + ".weight" for suffix in LINEAR_SUFFIXES]
    return names


def check_weight_shapes(arch: ArchConfig, weights: dict[str, Linear]) -> None:
    """Raise ValueError naming the first weight whose shape (or, in a fused group, kind) does not fit `arch`.

    `weights` is a published weight map (`build_weight_map`) holding every `required_weight_names` entry.
    """
    hidden, q_out, kv_out = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    gate = weights["model.layers.0.mlp.gate_proj.weight"] if arch.num_layers else None
    inter = _matrix(gate).shape[0] if gate is not None else 0
    expected: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (arch.vocab_size, hidden),
        "lm_head.weight": (arch.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        for name, shape in (
            ("input_layernorm", (hidden,)), ("post_attention_layernorm", (hidden,)),
            ("self_attn.q_norm", (arch.head_dim,)), ("self_attn.k_norm", (arch.head_dim,)),
            ("self_attn.q_proj", (q_out, hidden)), ("self_attn.k_proj", (kv_out, hidden)),
            ("self_attn.v_proj", (kv_out, hidden)), ("self_attn.o_proj", (hidden, q_out)),
            ("mlp.gate_proj", (inter, hidden)), ("mlp.up_proj", (inter, hidden)), ("mlp.down_proj", (hidden, inter)),
        ):  # fmt: skip
            expected[p + name + ".weight"] = shape
        for name, out in (("q", q_out), ("k", kv_out), ("v", kv_out)):
            expected[p + f"self_attn.{name}_proj.bias"] = (out,)
        for group in (("q", "k", "v"), ("gate", "up")):
            prefix = "self_attn." if group[0] == "q" else "mlp."
            kinds = {_kind(weights[p + f"{prefix}{name}_proj.weight"]) for name in group}
            if len(kinds) > 1:
                raise ValueError(f"{p}{prefix}{'/'.join(group)}_proj: mixed kinds {sorted(kinds)} cannot be fused")
    for name, shape in expected.items():
        weight = weights.get(name)
        if weight is None:
            continue
        got = tuple(_matrix(weight).shape)
        if got != shape:
            raise ValueError(f"{name} has shape {list(got)}, the model needs {list(shape)}")
        if isinstance(weight, QuantizedWeight) and tuple(weight.scale.shape) != shape[:1]:
            raise ValueError(f"{name}: scale of shape {list(weight.scale.shape)}, the model needs {[shape[0]]}")
        if isinstance(weight, GroupQuantized):
            weight.check_scale(name)


def _kind(weight: Linear) -> str:
    quantized = isinstance(weight, (QuantizedWeight, GroupQuantized))
    return f"quantized {weight.scheme}" if quantized else f"float {weight.dtype}"  # type: ignore[union-attr]


def _matrix(weight: Linear) -> torch.Tensor:
    return weight.q if isinstance(weight, (QuantizedWeight, GroupQuantized)) else weight  # type: ignore[return-value]


class KVCache:
    """Preallocated keys and values: (layers, slots, kv_heads, max_len, head_dim), plus RoPE tables to max_len."""

    def __init__(self, arch: ArchConfig, slots: int, max_len: int, dtype: torch.dtype = torch.float32):
        shape = (arch.num_layers, slots, arch.num_kv_heads, max_len, arch.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype)
        self.values = torch.zeros(shape, dtype=dtype)
        self.slots = slots
        self.max_len = max_len
        cos, sin = rope_tables(arch, max_len)  # computed in fp32 and cast, as HF does
        half = arch.head_dim // 2
        self.cos, self.sin_rotate = cos.to(dtype), torch.cat((-sin[:, :half], sin[:, half:]), -1).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        self.keys[:, dst, :, :length] = self.keys[:, src, :, :length]
        self.values[:, dst, :, :length] = self.values[:, src, :, :length]


def _heads(
    arch: ArchConfig, layer: LayerWeights, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused projections qkv (B, S, q + 2 kv) -> q (B, H, S, D), k, v (B, KV, S, D), q/k norms and RoPE applied."""
    batch, seq, _ = qkv.shape
    heads, q_size, kv_size = arch.num_heads, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    v = qkv[..., q_size + kv_size :].view(batch, seq, arch.num_kv_heads, arch.head_dim).transpose(1, 2)
    if layer.q_norm is None:  # RoPE on q and k at once: their heads are adjacent in qkv
        qk = qkv[..., : q_size + kv_size].view(batch, seq, heads + arch.num_kv_heads, arch.head_dim).transpose(1, 2)
        qk = apply_rope(qk, cos, sin)
        return qk[:, :heads], qk[:, heads:], v
    q = qkv[..., :q_size].view(batch, seq, heads, arch.head_dim).transpose(1, 2)  # Qwen3: q/k norms first
    k = qkv[..., q_size : q_size + kv_size].view(batch, seq, arch.num_kv_heads, arch.head_dim).transpose(1, 2)
    q = rms_norm(q, layer.q_norm, arch.rms_norm_eps)
    k = rms_norm(k, layer.k_norm, arch.rms_norm_eps)  # type: ignore[arg-type]
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _attend_decode(
    arch: ArchConfig, layer: LayerWeights, qkv: torch.Tensor, cache: KVCache, index: int, positions: torch.Tensor
) -> torch.Tensor:
    """Decode rows qkv (N, q + 2 kv) of slots 0..N-1 at `positions` -> attention output (N, H * D); their keys and
    values written into the cache. Fused on CPU in fp32 (`fused_decode`), else torch ops (a GPU, bf16, fp16)."""
    keys, values = cache.keys[index], cache.values[index]
    shape = (arch.num_heads, arch.num_kv_heads, arch.head_dim)
    if fused_decode.enabled_for(keys):
        norms, tables = (layer.q_norm, layer.k_norm, arch.rms_norm_eps), (cache.cos, cache.sin_rotate)
        return fused_decode.decode_attention(qkv, positions, shape, tables, norms, (keys, values))
    n, span = qkv.shape[0], int(positions.max()) + 1
    cos, sin = cache.cos[positions][:, None, None], cache.sin_rotate[positions][:, None, None]  # (N, 1, 1, D)
    q, k, v = _heads(arch, layer, qkv[:, None], cos, sin)
    slots = torch.arange(n)
    keys[slots, :, positions], values[slots, :, positions] = k[:, :, 0], v[:, :, 0]
    mask = (torch.arange(span)[None, :] <= positions[:, None])[:, None, None]  # (N, 1, 1, span)
    gqa = arch.num_kv_heads != arch.num_heads
    out = F.scaled_dot_product_attention(q, keys[:n, :, :span], values[:n, :, :span], attn_mask=mask, enable_gqa=gqa)
    return out.transpose(1, 2).reshape(n, -1)


def _mlp_block(
    arch: ArchConfig, layer: LayerWeights, x: torch.Tensor, attn: torch.Tensor, next_norm: torch.Tensor, fused: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rest of a layer after attention: returns the residual stream and its RMSNorm by `next_norm` (the next
    layer's input norm, or the final norm). Fused: the residual adds happen in place, each with its norm."""
    eps = arch.rms_norm_eps
    if fused:
        h = fused_decode.add_rms_norm_(x, linear(attn, layer.o_proj, None), layer.post_norm, eps)
        gate, up = linear(h, layer.gate_up, None).chunk(2, dim=-1)
        return x, fused_decode.add_rms_norm_(x, linear(F.silu(gate) * up, layer.down, None), next_norm, eps)
    x = x + linear(attn, layer.o_proj, None)
    gate, up = linear(rms_norm(x, layer.post_norm, eps), layer.gate_up, None).chunk(2, dim=-1)
    x = x + linear(F.silu(gate) * up, layer.down, None)
    return x, rms_norm(x, next_norm, eps)


def forward_step(
    arch: ArchConfig,
    weights: ModelWeights,
    cache: KVCache,
    decoding: tuple[torch.Tensor, torch.Tensor] | None = None,
    prompts: Prompts | None = None,
    need_logits: bool = True,
) -> torch.Tensor | None:
    """One forward over decode tokens and prompts together; returns logits (N + M, V): decode rows, then prompts.

    `decoding` = (tokens (N,), positions (N,)): the next token of the sequences in cache slots 0..N-1, at those
    positions (= the cache index each is written to). `prompts` run from position 0 and write their K/V into their
    slots. Every linear (norms, q/k/v, o, gate/up, down, head) runs once over the rows of both, so that prompts
    joining a running batch share its weight reads instead of costing a forward of their own; only attention is
    computed apart (decode rows over their cache, prompt rows causally over themselves). Each row's result is that
    of the separate forwards: quantized products are exact per row, float GEMMs agree to their rounding. On CPU in
    fp32 the norms and the decode attention run fused (`fused_decode`), row by row.
    """
    n = 0 if decoding is None else int(decoding[0].shape[0])
    m, seq = (0, 0) if prompts is None else prompts.tokens.shape
    rows = [weights.embed[decoding[0]]] if decoding is not None else []
    if prompts is not None:
        rows.append(weights.embed[prompts.tokens].reshape(m * seq, -1))
    x = torch.cat(rows) if len(rows) > 1 else rows[0]  # (N + M * S, hidden)
    fused = fused_decode.enabled_for(cache.keys)
    if prompts is not None:
        cos_p, sin_p = cache.cos[None, None, :seq], cache.sin_rotate[None, None, :seq]
    h = (fused_decode.rms_norm if fused else rms_norm)(x, weights.layers[0].input_norm, arch.rms_norm_eps)
    for i, layer in enumerate(weights.layers):
        qkv = linear(h, layer.qkv, layer.qkv_bias)
        attn = [_attend_decode(arch, layer, qkv[:n], cache, i, decoding[1])] if decoding is not None else []
        if prompts is not None:
            q, k, v = _heads(arch, layer, qkv[n:].view(m, seq, -1), cos_p, sin_p)
            cache.keys[i, prompts.slots, :, :seq] = k[prompts.slot_rows]
            cache.values[i, prompts.slots, :, :seq] = v[prompts.slot_rows]
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=arch.num_kv_heads != arch.num_heads
            )
            attn.append(out.transpose(1, 2).reshape(m * seq, arch.num_heads * arch.head_dim))
        next_norm = weights.layers[i + 1].input_norm if i + 1 < len(weights.layers) else weights.norm
        x, h = _mlp_block(arch, layer, x, torch.cat(attn) if len(attn) > 1 else attn[0], next_norm, fused)
    if not need_logits:
        return None
    last = [h[:n]] if decoding is not None else []  # h: the final norm of every row
    if prompts is not None:
        last.append(h[n:].view(m, seq, -1)[torch.arange(m), prompts.lengths - 1])
    return linear(torch.cat(last) if len(last) > 1 else last[0], weights.head, None).to(torch.float32)


@dataclass(frozen=True, slots=True)
class Prompts:
    """Prompts to prefill: `tokens` (M, S) int64 right-padded, `lengths` (M,) real tokens per row; the K/V of row
    `slot_rows[j]` goes to cache slot `slots[j]` (a prompt shared by n samples fills n slots)."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    slot_rows: torch.Tensor
    slots: torch.Tensor


def prefill(
    arch: ArchConfig,
    weights: ModelWeights,
    cache: KVCache,
    tokens: torch.Tensor,  # (M, S) int64, right-padded
    lengths: torch.Tensor,  # (M,) int64, real tokens per row
    slot_rows: torch.Tensor,  # (R,) int64, the prefill row whose K/V each of `slots` receives
    slots: torch.Tensor,  # (R,) int64 cache slots to write
    need_logits: bool = True,
) -> torch.Tensor | None:
    """Run prompts from position 0; write their K/V into `slots`; return logits at each row's last token (M, V)."""
    return forward_step(
        arch, weights, cache, prompts=Prompts(tokens, lengths, slot_rows, slots), need_logits=need_logits
    )


def decode(
    arch: ArchConfig,
    weights: ModelWeights,
    cache: KVCache,
    tokens: torch.Tensor,  # (N,) int64: the next token of the sequences in slots 0..N-1
    positions: torch.Tensor,  # (N,) int64: their positions (= cache index they are written to)
) -> torch.Tensor:
    """One decode step for slots 0..N-1; returns logits (N, V)."""
    return forward_step(arch, weights, cache, decoding=(tokens, positions))  # type: ignore[return-value]
