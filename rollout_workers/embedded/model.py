"""The embedded engine's Llama-family forward: RMSNorm, RoPE, grouped-query attention, SwiGLU, over a slot KV cache.

Reads a Hugging Face `config.json` (Llama incl. llama3 RoPE scaling, Qwen2 with q/k/v biases, Qwen3 with q/k norms,
SmolLM). A published weight map (linear weights are float tensors or `QuantizedWeight`s, W8A8) is turned once per
version into `ModelWeights`: q/k/v and gate/up fused into one matrix each (exact: the quantization is per output
channel and the activation scale per token, so a fused W8A8 product equals the separate ones). The engine swaps a
whole `ModelWeights` object between decode steps, so a step never mixes two versions. LoRA adapters published with
a version (`<linear>.lora_A`, `.lora_B`, `.lora_scaling`, learner/lora.py) run on top of their (quantized) linear:
`y = Q(W) x + s * B (A x)` (`linears.low_rank_linear`), a fused group's adapters stacked into one low-rank pair.

The KV cache holds one row ("slot") per sequence, position p of a sequence at index p of its slot. `prefill` runs
right-padded prompts from position 0 (or, with `Prompts.starts`, each from its own position over the K/V its slots
already hold: a prefix-cache hit) and writes their keys/values into any slots; `decode` runs one token for each of
the first n slots (the engine keeps its active sequences in slots 0..n-1); `forward_step` runs both in one forward,
sharing every linear between them (the engine's step: prompts that join a running batch ride along with it).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quant_sync.adapter_buffers import PooledAdapters
from quant_sync.export import LORA_A, LORA_B, LORA_SCALE, LORA_SCALING
from quant_sync.quantizers import QuantizedWeight
from rollout_workers.embedded import fused_decode, native_layers
from rollout_workers.embedded.arch import (  # noqa: F401 - re-exported: the engine's model API
    SUPPORTED_MODEL_TYPES,
    SUPPORTED_ROPE_TYPES,
    ArchConfig,
    ModelDirError,
)
from rollout_workers.embedded.linears import (  # noqa: F401 - re-exported: the engine's model API
    DTYPES,
    EXACT_FP32_MAX_IN_FEATURES,
    HEAD_PACKED,
    PACK_FP32_MIN_FEATURES,
    UPCAST_INT8_MAX_ELEMENTS,
    Linear,
    PackedFp32,
    UpcastQuantized,
    _fuse,
    linear,
    prepare_linear,
)
from rollout_workers.embedded.low_rank import LowRank, add_low_rank, pack_jobs, repack, stack_low_rank  # noqa: F401 - re-exported
from rollout_workers.embedded.native_layers import LayersPlan
from rollout_workers.embedded.offset_prefill import OffsetPrompts
from rollout_workers.embedded.weight_only import GroupQuantized

LINEAR_SUFFIXES = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip


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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_rotate: torch.Tensor) -> torch.Tensor:
    """HF's `x * cos + rotate_half(x) * sin` in 3 ops instead of 7: rotate_half(x) * sin = roll(x, D/2) * sin_rotate,
    sin_rotate being sin with its first half negated (KVCache.sin_rotate): the same products, signs flipped exactly;
    `addcmul` may fuse the last multiply-add (HF's result to an ulp). x (B, H, S, D); cos/sin_rotate (B, 1, S, D)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_rotate)


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
    qkv_lora: LowRank | None = None  # LoRA adapters of each linear above (None: none)
    o_lora: LowRank | None = None
    gate_up_lora: LowRank | None = None
    down_lora: LowRank | None = None


@dataclass(slots=True)
class ModelWeights:
    """One weight version in the forward's layout, built once per version (off the decode thread)."""

    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    head: Linear
    pooled: PooledAdapters | None = None
    """The adapter version these run, where it came in a pooled buffer (held: the pool does not rewrite it)."""
    layers_plan: LayersPlan | bool | None = None
    """`native_layers.plan_for(self)`, made at the first decode step (False: it does not apply; None: not made yet)."""

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
        used: set | None = set() if any(name.endswith(LORA_A) for name in weights) else None  # a LoRA version

        def tensor(name: str) -> torch.Tensor | None:
            value = weights.get(name)
            return None if value is None else value.to(device=target, dtype=dtype)  # type: ignore[union-attr]

        def prepare(*sources: Linear) -> Linear:  # several: a fused group
            def build() -> Linear:
                return prepare_linear(_fuse(list(sources)) if len(sources) > 1 else sources[0], dtype, target)

            return prepared_once(list(sources), build, (dtype, target, len(sources)), used)

        layers = []
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            attn = [weights[p + f"self_attn.{name}_proj.weight"] for name in "qkv"]
            biases = [tensor(p + f"self_attn.{name}_proj.bias") for name in "qkv"]
            gate_up = prepare(weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"])
            yield None  # the largest matrix, a part of its own: a step's build slice overruns by half a layer at most
            layers.append(
                LayerWeights(
                    input_norm=tensor(p + "input_layernorm.weight"),  # type: ignore[arg-type]
                    qkv=prepare(*attn),
                    qkv_bias=torch.cat(biases) if all(b is not None for b in biases) else None,  # type: ignore
                    q_norm=tensor(p + "self_attn.q_norm.weight"),
                    k_norm=tensor(p + "self_attn.k_norm.weight"),
                    o_proj=prepare(weights[p + "self_attn.o_proj.weight"]),
                    post_norm=tensor(p + "post_attention_layernorm.weight"),  # type: ignore[arg-type]
                    gate_up=gate_up,
                    down=prepare(weights[p + "mlp.down_proj.weight"]),
                    **_layer_adapters(weights, p, dtype, target),
                )
            )
            yield None
        embed = weights["model.embed_tokens.weight"]
        head = weights.get("lm_head.weight", embed)
        built = cls(
            embed=tensor("model.embed_tokens.weight"),  # type: ignore[arg-type]
            layers=layers,
            norm=tensor("model.norm.weight"),  # type: ignore[arg-type]
            head=prepared_once(
                [head], lambda: prepare_linear(head, dtype, target, pack=HEAD_PACKED), (dtype, target, "head"), used
            ),
        )
        _end_build(used)
        yield built

    def with_adapters(
        self,
        arch: ArchConfig,
        weights: dict[str, Linear],
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        pooled: PooledAdapters | None = None,
    ) -> ModelWeights:
        """These weights with the adapters of `weights` instead of their own: an adapter-only version on the very base
        these were built from (`StagedVersions` knows), whose base forms `build_in_parts` would find unchanged.
        `pooled`: those adapters came in it (`WeightUpdate.pooled`), kept by the result; the layers' stacked
        adapters are made once per pooled buffer (`PooledAdapters.derived`: its views, rewritten in place by each
        version written there) and reused by every later version in it."""
        target = torch.device(device)

        made: list[bool] = []

        def stacked() -> list[dict[str, LowRank | None]]:
            made.append(True)
            return [_layer_adapters(weights, f"model.layers.{i}.", dtype, target) for i in range(len(self.layers))]

        key = ("layers", dtype, target, None if pooled is None else pooled.others)  # what stacking reads beyond views
        adapters = stacked() if pooled is None else pooled.derived(key, stacked)
        if not made:  # an earlier version's stacking in this buffer: the `amx` kernel's layouts are copies, redone
            groups = [adapter for layer in adapters for adapter in layer.values() if adapter is not None]
            repack(pooled.derived((*key, "amx"), lambda: pack_jobs(groups)))  # type: ignore[union-attr]
        layers = [dataclasses.replace(layer, **held) for layer, held in zip(self.layers, adapters)]
        return dataclasses.replace(self, layers=layers, pooled=pooled, layers_plan=None)


ADAPTER_GROUPS = (
    ("qkv_lora", "self_attn.", ("q_proj", "k_proj", "v_proj")),
    ("o_lora", "self_attn.", ("o_proj",)),
    ("gate_up_lora", "mlp.", ("gate_proj", "up_proj")),
    ("down_lora", "mlp.", ("down_proj",)),
)
"""A decoder layer's LoRA groups: its `LayerWeights` field, the linears' prefix and names (fused in this order)."""


def _layer_adapters(
    weights: dict[str, Linear], layer_prefix: str, dtype: torch.dtype, target: torch.device
) -> dict[str, LowRank | None]:
    """A decoder layer's stacked adapters by `LayerWeights` field (None for a group without any)."""
    return {field: _group_adapters(weights, layer_prefix + prefix, names, dtype, target)
            for field, prefix, names in ADAPTER_GROUPS}  # fmt: skip


def _group_adapters(
    weights: dict[str, Linear], prefix: str, names: tuple[str, ...], dtype: torch.dtype, target: torch.device
) -> LowRank | None:
    """The stacked adapters of one fused group (`prefix` + each of `names`), None where none has one."""
    members = [_adapter(weights, prefix + name) for name in names]
    if not any(members):
        return None
    outs = [_matrix(weights[prefix + name + ".weight"]).shape[0] for name in names]
    return stack_low_rank(members, outs, dtype, target)


_PREPARED: dict[tuple, tuple[list[tuple[weakref.ref, int]], Linear]] = {}
"""LoRA versions: the base's execution forms by the identity (and in-place version counter) of the published tensors
they were built from (`prepared_once`). Holds one base's forms at most: emptied by a version without adapters, and
each LoRA build drops the entries it did not use."""


def _source_tensors(weight: Linear) -> list[torch.Tensor]:
    if isinstance(weight, (QuantizedWeight, GroupQuantized)):
        return [weight.q, weight.scale]
    return [weight] if isinstance(weight, torch.Tensor) else []


def prepared_once(sources: list[Linear], build: Callable[[], Linear], key: tuple, used: set | None) -> Linear:
    """`build()`, or, in a LoRA build (`used`: the keys it used so far), the form built before from these very
    published tensors (same objects, unmodified): adapter-only versions hand the engine the base's tensors again,
    whose fused and prepacked forms are then reused instead of rebuilt (an adapter version builds in milliseconds)."""
    if used is None or any(not _source_tensors(weight) for weight in sources):  # nothing to key on
        return build()
    tensors = [t for weight in sources for t in _source_tensors(weight)]
    full_key = (tuple(id(t) for t in tensors), *key)
    used.add(full_key)
    held = _PREPARED.get(full_key)
    if held is not None and all(ref() is t and t._version == seen for (ref, seen), t in zip(held[0], tensors)):
        return held[1]
    built = build()
    _PREPARED[full_key] = ([(weakref.ref(t), t._version) for t in tensors], built)
    return built


def _end_build(used: set | None) -> None:
    """After a build: keep only the base forms this LoRA build used; none after a version without adapters."""
    for key in [key for key in _PREPARED if used is None or key not in used]:
        del _PREPARED[key]


def _adapter(weights: dict[str, Linear], linear_name: str) -> tuple | None:
    """(A, B, scaling) of the LoRA adapter on `linear_name` (e.g. `model.layers.0.mlp.up_proj`), None if it has none;
    int8 A and B (`decode_adapters(keep_int8=True)`) come with their per-rank scales: (A, B, scaling, sA, sB)."""
    a = weights.get(linear_name + LORA_A)
    if a is None:
        return None
    b, scaling = weights[linear_name + LORA_B], weights[linear_name + LORA_SCALING].item()  # type: ignore[union-attr]
    if a.dtype != torch.int8:  # type: ignore[union-attr]
        return a, b, scaling
    return a, b, scaling, weights[linear_name + LORA_A + LORA_SCALE], weights[linear_name + LORA_B + LORA_SCALE]


def required_weight_names(arch: ArchConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + suffix + ".weight" for suffix in LINEAR_SUFFIXES]
    return names


def check_weight_shapes(arch: ArchConfig, weights: dict[str, Linear]) -> dict[str, tuple[int, ...]]:
    """Raise ValueError naming the first weight whose shape (or, in a fused group, kind) does not fit `arch`; returns
    the shape the model needs of every weight it may hold (LoRA adapters then check against it:
    `check_adapter_shapes`).

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
    check_adapter_shapes(weights, expected)
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
    return expected


def check_adapter_shapes(weights: dict[str, Linear], expected: dict[str, tuple[int, ...]]) -> None:
    """Every LoRA tensor sits on a decoder linear, comes with its two partners, and fits it: A (r, in), B (out, r),
    scaling (1,), all float, or A and B int8 each with float32 per-rank scales (r,) (`.lora_A_scale`,
    `.lora_B_scale`: a packed int8 version kept int8). Each adapted linear is checked once (an adapter version
    holds ~170 such tensors)."""
    suffixes = (LORA_A, LORA_B, LORA_SCALING)
    scales = (LORA_A + LORA_SCALE, LORA_B + LORA_SCALE)
    linears = dict.fromkeys(
        name.removesuffix(LORA_SCALE).removesuffix(LORA_A).removesuffix(LORA_B).removesuffix(LORA_SCALING)
        for name in weights
        if name.endswith((*suffixes, *scales))
    )
    for linear_name in linears:
        shape = expected.get(linear_name + ".weight")
        if shape is None or len(shape) != 2:
            name = next(linear_name + s for s in (*suffixes, *scales) if linear_name + s in weights)
            raise ValueError(f"{name}: a LoRA tensor on {linear_name}, which is not a decoder linear of the model")
        parts = [weights.get(linear_name + s) for s in suffixes]
        if any(not isinstance(part, torch.Tensor) for part in parts):
            raise ValueError(f"{linear_name}: LoRA needs float {LORA_A}, {LORA_B} and {LORA_SCALING} tensors together")
        a, b, scaling = parts
        int8 = a.dtype == torch.int8 and b.dtype == torch.int8  # type: ignore[union-attr]
        if not scaling.is_floating_point() or not (int8 or (a.is_floating_point() and b.is_floating_point())):  # type: ignore[union-attr]
            raise ValueError(f"{linear_name}: LoRA needs float {LORA_A}, {LORA_B} and {LORA_SCALING} tensors together")
        rank = a.shape[0]  # type: ignore[union-attr]
        want = ((rank, shape[1]), (shape[0], rank), (1,))
        for part, suffix, wanted in zip(parts, suffixes, want):
            if part.shape != wanted or rank < 1:  # type: ignore[union-attr]
                raise ValueError(f"{linear_name}{suffix} has shape {list(part.shape)}, the model needs "  # type: ignore
                                 f"{list(wanted)}")  # fmt: skip
        held = [weights.get(linear_name + s) for s in scales]
        if int8 and any(
            not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != (rank,) for t in held
        ):
            raise ValueError(f"{linear_name}: int8 LoRA matrices need float32 scales {scales[0]}, {scales[1]} of "
                             f"shape ({rank},)")  # fmt: skip
        if not int8 and any(t is not None for t in held):
            raise ValueError(f"{linear_name}: LoRA scales beside float matrices")


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

    def write_prefix(self, slot: int, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Positions 0..length-1 of `slot` from K/V held elsewhere (layers, kv_heads, >= length, head_dim)."""
        self.keys[:, slot, :, :length] = keys[:, :, :length]
        self.values[:, slot, :, :length] = values[:, :, :length]


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


def low_rank_linear(
    x: torch.Tensor, weight: Linear, bias: torch.Tensor | None, adapter: LowRank | None
) -> torch.Tensor:
    """`linear` (this module's: tests count its calls) plus a LoRA adapter's `s * B (A x)` when there is one."""
    out = linear(x, weight, bias)
    return out if adapter is None else add_low_rank(x, out, adapter)


def _mlp_block(
    arch: ArchConfig, layer: LayerWeights, x: torch.Tensor, attn: torch.Tensor, next_norm: torch.Tensor, fused: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rest of a layer after attention: returns the residual stream and its RMSNorm by `next_norm` (the next
    layer's input norm, or the final norm). Fused: the residual adds happen in place, each with its norm."""
    eps = arch.rms_norm_eps
    if fused:
        h = fused_decode.add_rms_norm_(x, low_rank_linear(attn, layer.o_proj, None, layer.o_lora), layer.post_norm, eps)
        gate, up = low_rank_linear(h, layer.gate_up, None, layer.gate_up_lora).chunk(2, dim=-1)
        down = low_rank_linear(F.silu(gate) * up, layer.down, None, layer.down_lora)
        return x, fused_decode.add_rms_norm_(x, down, next_norm, eps)
    x = x + low_rank_linear(attn, layer.o_proj, None, layer.o_lora)
    gate, up = low_rank_linear(rms_norm(x, layer.post_norm, eps), layer.gate_up, None, layer.gate_up_lora).chunk(2, -1)
    x = x + low_rank_linear(F.silu(gate) * up, layer.down, None, layer.down_lora)
    return x, rms_norm(x, next_norm, eps)


def forward_step(
    arch: ArchConfig,
    weights: ModelWeights,
    cache: KVCache,
    decoding: tuple[torch.Tensor, torch.Tensor] | None = None,
    prompts: Prompts | None = None,
    need_logits: bool = True,
    prompt_hidden: list[torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """One forward over decode tokens and prompts together; returns logits (N + M, V): decode rows, then prompts.
    With `prompt_hidden` (a list) the final-norm hidden states of the prompt rows (M, S, hidden) are appended to it
    (column j of row r: position `starts[r] + j`), for prompt log-probs (scoring.py).

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
    if fused and prompts is None and prompt_hidden is None and _layers_plan(weights) is not None:
        h = native_layers.decode_layers(weights.layers_plan, arch, x, decoding[1], cache)  # type: ignore[arg-type, index]
        return linear(h, weights.head, None).to(torch.float32) if need_logits else None
    offset = None if prompts is None or prompts.starts is None else OffsetPrompts.of(prompts, cache)
    if prompts is not None:
        cos_p, sin_p = cache.cos[None, None, :seq], cache.sin_rotate[None, None, :seq]
        if offset is not None:
            cos_p, sin_p = offset.cos, offset.sin_rotate
    h = (fused_decode.rms_norm if fused else rms_norm)(x, weights.layers[0].input_norm, arch.rms_norm_eps)
    for i, layer in enumerate(weights.layers):
        qkv = low_rank_linear(h, layer.qkv, layer.qkv_bias, layer.qkv_lora)
        attn = [_attend_decode(arch, layer, qkv[:n], cache, i, decoding[1])] if decoding is not None else []
        if prompts is not None:
            q, k, v = _heads(arch, layer, qkv[n:].view(m, seq, -1), cos_p, sin_p)
            gqa = arch.num_kv_heads != arch.num_heads
            if offset is None:
                cache.keys[i, prompts.slots, :, :seq] = k[prompts.slot_rows]
                cache.values[i, prompts.slots, :, :seq] = v[prompts.slot_rows]
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            else:
                out = offset.attend(q, k, v, cache, i, gqa)
            attn.append(out.transpose(1, 2).reshape(m * seq, arch.num_heads * arch.head_dim))
        next_norm = weights.layers[i + 1].input_norm if i + 1 < len(weights.layers) else weights.norm
        x, h = _mlp_block(arch, layer, x, torch.cat(attn) if len(attn) > 1 else attn[0], next_norm, fused)
    if prompt_hidden is not None and prompts is not None:
        prompt_hidden.append(h[n:].view(m, seq, -1))
    if not need_logits:
        return None
    last = [h[:n]] if decoding is not None else []  # h: the final norm of every row
    if prompts is not None:
        last.append(h[n:].view(m, seq, -1)[torch.arange(m), prompts.lengths - 1])
    return linear(torch.cat(last) if len(last) > 1 else last[0], weights.head, None).to(torch.float32)


def _layers_plan(weights: ModelWeights) -> LayersPlan | None:
    """The weights' `native_layers` plan, made on first use (None where it does not apply)."""
    if weights.layers_plan is None:
        weights.layers_plan = native_layers.plan_for(weights) or False
    return weights.layers_plan or None  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class Prompts:
    """Prompts to prefill: `tokens` (M, S) int64 right-padded, `lengths` (M,) real tokens per row; the K/V of row
    `slot_rows[j]` goes to cache slot `slots[j]` (a prompt shared by n samples fills n slots). `starts` (M,): the
    position of each row's first token (None: all 0); the slots of a row must already hold the K/V of its
    positions 0..start-1 (a prefix-cache hit copied there), which its tokens attend to."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    slot_rows: torch.Tensor
    slots: torch.Tensor
    starts: torch.Tensor | None = None


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
