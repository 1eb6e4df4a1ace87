"""Rollout weight export: a learner state dict -> the tensors an embedded engine loads for one version.

Linear layers of the decoder blocks are quantized with `quant.scheme` and travel as `<name>` (int8 or
float8_e4m3fn) plus `<name>_scale` (float32: one per output channel for the W8A8 schemes, one per output channel
and group of 128 input columns for the weight-only `w8a16` / `w4a16`). Embeddings and norms stay in float32. The
LM head stays in float32 too (as SGLang serves it) unless `quantize_head` (`quant.lm_head`, resolved by
`common.config_rules.head_quantized`): then `lm_head.weight` travels quantized like a decoder linear, made from the
embedding matrix when the two are tied (the embedding itself still travels in float32, for the lookup). With
`scheme == "none"` everything is float32. LoRA adapters (learner/lora.py) travel beside their linear as
`<linear>.lora_A`, `.lora_B` and `.lora_scaling` (`LORA_A`, `LORA_B`, `LORA_SCALING`); a peft model's names are
mapped to the base model's by `base_weight_name`. A and B travel in `model.lora.sync_dtype` (`encode_adapter`): float32,
bfloat16, or int8 with one float32 scale per rank component (`<linear>.lora_A_scale`, `.lora_B_scale`, shape (r,));
`decode_adapters` turns them back into the float32 values the engine runs, which are exactly `round_adapter`'s, the
values the learner's forward uses (learner/lora.py).
"""

from __future__ import annotations

import json
import math

import torch

from common.config_schema import LORA_SYNC_DTYPES
from quant_sync.adapter_buffers import Entry, PackedPlan, PooledAdapters, plan_for
from quant_sync.quantizers import WEIGHT_ONLY_BITS, quantize_weight, quantize_weight_only

QUANTIZED_LINEARS = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)  # fmt: skip


HEAD_WEIGHT = "lm_head.weight"
EMBED_WEIGHT = "model.embed_tokens.weight"
LORA_A, LORA_B, LORA_SCALING = ".lora_A", ".lora_B", ".lora_scaling"
"""Suffixes of a LoRA adapter's published tensors after its linear's module name (`model.layers.0.mlp.up_proj`):
A (r, in) and B (out, r) in `model.lora.sync_dtype`, and the scaling alpha / r as a (1,) float32 tensor
(learner/lora.py)."""
LORA_SCALE = "_scale"
"""Suffix after `.lora_A` / `.lora_B` of an int8 adapter matrix's scales: float32, one per rank component (r,)."""
LORA_PACKED, LORA_PACKED_INDEX = "lora.packed", "lora.packed_index"
"""An adapter-only version published as ONE buffer (`pack_adapters`): `lora.packed` (int8 bytes: every adapter
tensor's bytes at a 4-byte-aligned offset) and `lora.packed_index` (int8 bytes: UTF-8 JSON
[[name, dtype, shape, offset], ...]); `decode_adapters` turns them back into views, one per tensor."""
_PACK_ALIGN = 4
"""Each tensor's offset in the packed buffer: a multiple of the largest element size (float32), so that every
tensor is a view of the buffer."""
_PACK_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}
_RANK_DIM = {LORA_A: 0, LORA_B: 1}
"""The dimension of each adapter matrix that runs over the rank: A (r, in), B (out, r). int8 keeps one scale per
rank component, so A's row i and B's column i, the two halves of rank component i, each get their own."""
_PEFT_PREFIX = "base_model.model."


def base_weight_name(name: str) -> str:
    """A peft-wrapped model's parameter or module name -> the base model's (`base_model.model.` and `.base_layer`
    dropped): `base_model.model.model.layers.0.mlp.up_proj.base_layer.weight` -> `model.layers.0.mlp.up_proj.weight`.
    Other names come back unchanged."""
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX) :]
    name = name.replace(".base_layer.", ".")
    return name[: -len(".base_layer")] if name.endswith(".base_layer") else name


def is_quantized_linear(name: str, head: bool = False) -> bool:
    """Whether the weight `name` travels quantized: the decoder blocks' linears, and the LM head when `head`."""
    return (name.startswith("model.layers.") and name.endswith(QUANTIZED_LINEARS)) or (head and name == HEAD_WEIGHT)


def export_rollout_tensors(
    state_dict: dict[str, torch.Tensor], scheme: str, quantize_head: bool = False, tied_head: bool = False
) -> dict[str, torch.Tensor]:
    """Quantize (or copy) a full state dict into the published tensor set of one version. `tied_head`: the model ties
    its LM head to the embedding (config.json's `tie_word_embeddings`), also where the state dict holds two copies
    (FSDP2's gathered one: the head went out as an extra fp32 tensor every version)."""
    tensors: dict[str, torch.Tensor] = {}
    embed = state_dict.get(EMBED_WEIGHT)
    head = quantize_head and scheme != "none"
    if head and HEAD_WEIGHT not in state_dict and embed is not None:
        state_dict = {**state_dict, HEAD_WEIGHT: embed}  # tied weights listed once: the head is the embedding
    for name, value in state_dict.items():
        value = value.detach()
        tied = name == HEAD_WEIGHT and embed is not None and (tied_head or value.data_ptr() == embed.data_ptr())
        if tied and not head:
            continue  # tied: the engine falls back to the embedding
        if scheme in WEIGHT_ONLY_BITS and is_quantized_linear(name, head):
            q, scale = quantize_weight_only(value, scheme)
            tensors[name], tensors[name + "_scale"] = q, scale.contiguous()
        elif scheme != "none" and is_quantized_linear(name, head):
            quantized = quantize_weight(value, scheme)
            tensors[name] = quantized.q.contiguous()
            tensors[name + "_scale"] = quantized.scale.contiguous()
        else:
            tensors[name] = value.to(torch.float32).contiguous().clone()
    return tensors


def _check_adapter_part(part: str, sync_dtype: str) -> None:
    if part not in _RANK_DIM:
        raise ValueError(f"LoRA adapter part must be {LORA_A!r} or {LORA_B!r}, got {part!r}")
    if sync_dtype not in LORA_SYNC_DTYPES:
        raise ValueError(f"model.lora.sync_dtype must be one of {', '.join(LORA_SYNC_DTYPES)}, got {sync_dtype!r}")


def _int8_per_rank(weight: torch.Tensor, part: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8, scale float32 (r,)): symmetric, scale = amax / 127 per rank component (1 where it is all zero)."""
    w = weight.detach().to(torch.float32)
    dim = _RANK_DIM[part]
    amax = w.abs().amax(dim=1 - dim)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).contiguous()
    shaped = scale[:, None] if dim == 0 else scale[None, :]
    q = torch.round(w / shaped).clamp_(-127, 127).to(torch.int8).contiguous()
    return q, scale


def _dequantize_per_rank(q: torch.Tensor, scale: torch.Tensor, part: str) -> torch.Tensor:
    shaped = scale[:, None] if _RANK_DIM[part] == 0 else scale[None, :]
    return (q * shaped).contiguous()  # promoted to float32 inside the one multiply: q exactly, then q * scale


def encode_adapter(weight: torch.Tensor, part: str, sync_dtype: str) -> dict[str, torch.Tensor]:
    """One adapter matrix (`part`: LORA_A or LORA_B) as published in `sync_dtype`: {"": tensor} plus, for int8,
    {LORA_SCALE: scales}; keys are suffixes after `<linear><part>`."""
    _check_adapter_part(part, sync_dtype)
    if sync_dtype == "int8":
        q, scale = _int8_per_rank(weight, part)
        return {"": q, LORA_SCALE: scale}
    dtype = torch.bfloat16 if sync_dtype == "bf16" else torch.float32
    return {"": weight.detach().to(dtype).contiguous().clone()}


def round_adapter(weight: torch.Tensor, part: str, sync_dtype: str) -> torch.Tensor:
    """The float32 values the engine runs for this adapter matrix: `decode_adapters(encode_adapter(...))`, bit for
    bit (the learner's forward uses them, learner/lora.py). Not differentiable: the caller adds its own gradient."""
    _check_adapter_part(part, sync_dtype)
    if sync_dtype == "int8":
        return _dequantize_per_rank(*_int8_per_rank(weight, part), part)
    if sync_dtype == "bf16":
        return weight.detach().to(torch.bfloat16).to(torch.float32)
    return weight.detach().to(torch.float32)


def pack_adapters(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An adapter-only version's tensors (`<linear>.lora_A`, `.lora_B`, their `_scale`s, `.lora_scaling`) as one
    buffer and its index (`LORA_PACKED`, `LORA_PACKED_INDEX`): the publisher and the subscriber then handle two
    tensors instead of ~5 per linear (one header entry, one checksum per chunk, one map). The bytes are the same
    values; `decode_adapters` unpacks them. Raises ValueError naming a tensor that is not an adapter's.

    The index lists the tensors in the caller's order; their bytes are placed in the engine's order
    (`_placement_key`): the int8 matrices of one part and shape back to back by layer and linear, their scales
    likewise, so that a worker dequantizes each such group with one multiply from the buffer itself
    (`adapter_buffers.PackedPlan`). Each B travels transposed (its B^T's bytes, row-major, marked by a fifth index
    field 1): the layout the engine runs, so that no one transposes it on the worker."""
    entries, sizes, values = [], [], []
    for name, value in tensors.items():
        dtype = str(value.dtype).removeprefix("torch.")
        if not name.endswith((LORA_A, LORA_B, LORA_SCALING, LORA_A + LORA_SCALE, LORA_B + LORA_SCALE)):
            raise ValueError(f"pack_adapters: {name} is not a LoRA adapter tensor")
        if dtype not in _PACK_DTYPES:
            raise ValueError(f"pack_adapters: {name} has dtype {dtype}, expected one of {', '.join(_PACK_DTYPES)}")
        transposed = name.endswith(LORA_B) and value.dim() == 2
        entries.append([name, dtype, list(value.shape), 0, 1] if transposed else [name, dtype, list(value.shape), 0])
        sizes.append(-(-value.nbytes // _PACK_ALIGN) * _PACK_ALIGN)
        values.append(value.detach().t() if transposed else value.detach())
    offset = 0
    for position in sorted(range(len(entries)), key=lambda i: _placement_key(entries[i][0], tensors)):
        entries[position][3] = offset
        offset += sizes[position]
    packed = torch.zeros(offset, dtype=torch.int8)
    for (_, _, _, start, *_), value in zip(entries, values):
        flat = value.contiguous().reshape(-1).view(torch.int8)
        packed[start : start + flat.numel()] = flat
    index = torch.frombuffer(bytearray(json.dumps(entries, separators=(",", ":")).encode()), dtype=torch.int8)
    return {LORA_PACKED: packed, LORA_PACKED_INDEX: index}


_LINEAR_POSITION = {name.removesuffix(".weight"): position for position, name in enumerate(QUANTIZED_LINEARS)}


def _placement_key(name: str, tensors: dict[str, torch.Tensor]) -> tuple:
    """Where `pack_adapters` places a tensor: A matrices, A scales, B matrices, B scales, then the rest; within
    each, by the matrix's dtype and shape, then layer and linear (q, k, v, o, gate, up, down: a fused group's
    members adjacent), so that every (part, shape) group and its scales lie back to back in one order."""
    kinds = ((LORA_A, 0), (LORA_A + LORA_SCALE, 1), (LORA_B, 2), (LORA_B + LORA_SCALE, 3))
    kind, matrix = next(((k, name.removesuffix(LORA_SCALE)) for suffix, k in kinds if name.endswith(suffix)), (4, name))
    linear = matrix.removesuffix(LORA_A).removesuffix(LORA_B)
    value = tensors.get(matrix, tensors[name])
    layer, position = 1 << 30, len(_LINEAR_POSITION)
    parts = linear.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        layer, position = int(parts[2]), _LINEAR_POSITION.get(parts[3], position)
    return kind, str(value.dtype), tuple(value.shape), layer, position, name


def _packed_entries(packed: torch.Tensor, index: torch.Tensor) -> list[tuple[str, str, tuple[int, ...], int, bool]]:
    """The packed index's entries (name, dtype, shape, byte offset, whether the bytes hold the transpose), each
    checked to lie inside the buffer; raises ValueError naming what is wrong."""
    if packed.dtype != torch.int8 or index.dtype != torch.int8:
        raise ValueError(f"{LORA_PACKED} and {LORA_PACKED_INDEX} travel together, both int8")
    try:
        entries, seen = [], set()
        numel = packed.numel()
        if numel % _PACK_ALIGN:
            raise ValueError(f"the buffer's {numel} bytes are not a multiple of {_PACK_ALIGN}")
        for name, dtype_name, shape, start, *layout in json.loads(index.numpy().tobytes().decode()):
            transposed = layout == [1]
            if layout not in ([], [0], [1]) or (transposed and len(shape) != 2):
                raise ValueError(f"{name}: layout {layout} (a fifth field 1 marks a transposed matrix)")
            nbytes = math.prod(shape) * _PACK_DTYPES[dtype_name].itemsize
            if type(start) is not int or start < 0 or start % _PACK_ALIGN or start + nbytes > numel:
                raise ValueError(f"{name} lies outside the buffer ({start}, {nbytes} bytes)")
            if name in seen or not isinstance(name, str) or min(shape, default=0) < 0:
                raise ValueError(f"{name!r} twice or with a negative size")
            seen.add(name)
            entries.append((name, dtype_name, tuple(shape), start, transposed))
    except (ValueError, TypeError, KeyError, UnicodeDecodeError) as err:
        raise ValueError(f"{LORA_PACKED_INDEX}: malformed packed adapters ({err!r})") from None
    return entries


def _unpack_adapters(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with `LORA_PACKED` and its index replaced by one view per adapter tensor (no copy)."""
    packed, index = tensors.get(LORA_PACKED), tensors.get(LORA_PACKED_INDEX)
    if packed is None and index is None:
        return tensors
    if packed is None or index is None:
        raise ValueError(f"{LORA_PACKED} and {LORA_PACKED_INDEX} travel together, both int8")
    entries = _packed_entries(packed, index)
    unpacked = {name: value for name, value in tensors.items() if name not in (LORA_PACKED, LORA_PACKED_INDEX)}
    flat = packed.reshape(-1)
    typed = {name: flat.view(dtype) for name, dtype in _PACK_DTYPES.items()}  # the whole buffer, per dtype
    for name, dtype_name, shape, start, transposed in entries:
        if name in unpacked:
            raise ValueError(f"{LORA_PACKED_INDEX}: malformed packed adapters ({name!r} twice)")
        whole = typed[dtype_name]
        strides, step = [], 1
        for dim in reversed(shape):  # contiguous strides: one as_strided view per tensor, no copy
            strides.append(step)
            step *= dim
        strides = [1, shape[0]] if transposed else strides[::-1]  # transposed: a view of the stored (r, out)
        unpacked[name] = whole.as_strided(shape, strides, whole.storage_offset() + start // whole.element_size())
    return unpacked


def decode_adapters(tensors: dict[str, torch.Tensor], keep_int8: bool = False) -> dict[str, torch.Tensor]:
    """A published version's tensors with every LoRA matrix in float32 (int8 ones dequantized with their scales,
    which are dropped; a packed version, `pack_adapters`, unpacked first); the other entries are the same objects.
    Raises ValueError naming a matrix without its scales, or scales without their matrix, or a bad packed index.

    The int8 matrices of one part and shape (e.g. every (r, hidden) A) are dequantized together: one stacked
    `q * scale` per group instead of one per matrix (a version holds ~100 small matrices, so the per-call overhead
    dominated the subscriber's fetch), each result a contiguous view of its group's. Elementwise the same
    float32 multiply, so the values are bit for bit `round_adapter`'s.

    A packed version of int8 matrices whose groups lie back to back (as `pack_adapters` places them) decodes with
    one multiply per group straight from the buffer into a reused float32 buffer (`adapter_buffers.PackedPlan`):
    no stacking, no fresh allocation, B's values laid out transposed (B a transposed view), the same values.
    `keep_int8`: such a version's matrices stay int8 beside their scales, in a reused buffer
    (`PackedPlan.decode_int8`), for an engine that runs them so; any other version decodes to float32 as above."""
    fast = _decode_planned(tensors, keep_int8)
    if fast is not None:
        return fast
    tensors = _unpack_adapters(tensors)
    if not any(name.endswith((LORA_A, LORA_B, LORA_A + LORA_SCALE, LORA_B + LORA_SCALE)) for name in tensors):
        return tensors
    decoded: dict[str, torch.Tensor] = {}
    groups: dict[tuple, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
    for name, value in tensors.items():
        part = LORA_A if name.endswith(LORA_A) else LORA_B if name.endswith(LORA_B) else None
        if name.endswith(LORA_A + LORA_SCALE) or name.endswith(LORA_B + LORA_SCALE):
            if name[: -len(LORA_SCALE)] not in tensors:
                raise ValueError(f"{name}: LoRA scales without their matrix {name[: -len(LORA_SCALE)]}")
            continue
        if part is None:
            decoded[name] = value
        elif value.dtype == torch.int8:
            scale = tensors.get(name + LORA_SCALE)
            rank = value.shape[_RANK_DIM[part]] if value.dim() == 2 else -1
            if scale is None or scale.dtype != torch.float32 or tuple(scale.shape) != (rank,):
                got = None if scale is None else (scale.dtype, tuple(scale.shape))
                raise ValueError(f"{name}: an int8 LoRA matrix needs float32 scales {name + LORA_SCALE} of shape "
                                 f"({rank},), got {got}")  # fmt: skip
            decoded[name] = value  # a placeholder, keeping the order of `tensors`; replaced below
            groups.setdefault((part, tuple(value.shape)), []).append((name, value, scale))
        else:
            decoded[name] = value if value.dtype == torch.float32 else value.to(torch.float32)
    for (part, _), members in groups.items():
        if len(members) == 1:
            name, q, scale = members[0]
            decoded[name] = _dequantize_per_rank(q, scale, part)
            continue
        qs = torch.stack([q for _, q, _ in members])
        scales = torch.stack([scale for _, _, scale in members])
        shaped = scales[:, :, None] if _RANK_DIM[part] == 0 else scales[:, None, :]
        for (name, _, _), value in zip(members, (qs * shaped).unbind(0)):  # contiguous views of one product
            decoded[name] = value
    return decoded


def decode_pooled_adapters(tensors: dict[str, torch.Tensor]) -> PooledAdapters | None:
    """A packed int8 adapter version (nothing else in `tensors`) as `decode_adapters(keep_int8=True)` gives it,
    written into a pooled buffer whose views are made once (`PackedPlan.decode_pooled`; hold the result while using
    its tensors); None for any other version (`decode_adapters` then handles it)."""
    packed, index = tensors.get(LORA_PACKED), tensors.get(LORA_PACKED_INDEX)
    if len(tensors) != 2 or packed is None or index is None or packed.dtype != torch.int8 or index.dtype != torch.int8:
        return None
    plan = packed_plan(index, packed.numel())
    return None if plan is None else plan.decode_pooled(packed)


def packed_plan(index: torch.Tensor, packed_nbytes: int) -> PackedPlan | None:
    """The cached `PackedPlan` of a packed index for a buffer of `packed_nbytes` (None where none fits: the generic
    decoder then handles the version); ValueError naming what is wrong with a malformed index."""
    return plan_for(index, packed_nbytes, lambda: [_plan_entry(*entry) for entry in _packed_entries(
        torch.empty(packed_nbytes, dtype=torch.int8, device="meta"), index)])  # fmt: skip


def _decode_planned(tensors: dict[str, torch.Tensor], keep_int8: bool = False) -> dict[str, torch.Tensor] | None:
    """`decode_adapters` of a packed version through its cached `PackedPlan`; None where none fits (the generic
    path then decodes it, or names what is wrong)."""
    packed, index = tensors.get(LORA_PACKED), tensors.get(LORA_PACKED_INDEX)
    if packed is None or index is None or packed.dtype != torch.int8 or index.dtype != torch.int8:
        return None
    others = {name: value for name, value in tensors.items() if name not in (LORA_PACKED, LORA_PACKED_INDEX)}
    if any(name.endswith((LORA_A, LORA_B, LORA_SCALING, LORA_A + LORA_SCALE, LORA_B + LORA_SCALE)) for name in others):
        return None  # adapter tensors beside the packed ones: the generic path checks them together
    plan = packed_plan(index, packed.numel())
    if plan is None:
        return None
    decoded = plan.decode(packed, keep_int8)
    if not others:
        return decoded
    if any(name in others for name in decoded):
        raise ValueError(f"{LORA_PACKED_INDEX}: malformed packed adapters (a name beside the packed ones)")
    return {**others, **decoded}


def _plan_entry(name: str, dtype_name: str, shape: tuple[int, ...], start: int, transposed: bool) -> Entry:
    for suffix, role in ((LORA_A + LORA_SCALE, "A_scale"), (LORA_B + LORA_SCALE, "B_scale"), (LORA_A, "A"),
                         (LORA_B, "B")):  # fmt: skip
        if name.endswith(suffix):
            matrix = name.removesuffix(LORA_SCALE) if role.endswith("_scale") else ""
            return Entry(name, role, _PACK_DTYPES[dtype_name], shape, start, matrix, transposed)
    return Entry(name, "", _PACK_DTYPES[dtype_name], shape, start, transposed=transposed)
