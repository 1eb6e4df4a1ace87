"""LoRA on a frozen base (`model.lora.rank > 0`, docs/algorithms.md, "LoRA on a frozen quantized base").

    HF model --(learner.lora_base=rollout: make_rollout_aligned)--> peft LoRA adapters on `model.lora.targets`
      version 0:   the quantized base + the adapters, pinned at the publisher (late workers fetch it)
      version k+1: the adapters alone (lora_A, lora_B, lora_scaling per adapted linear), based on version 0

The adapters are built with peft (`get_peft_model`): the base parameters are frozen, so only the adapters get
gradients and optimizer state. With `learner.lora_base=rollout` (the default when `quant.scheme` is not none) the
base linears are `learner.aligned.AlignedLinear`s running the published quantized operands (the engine's numerics,
installed from version 0), and peft's adapters run in fp32 on top: `y = Q(W) x + s * B (A x)`, the engine's formula
(`rollout_workers.embedded.linears.low_rank_linear`). The base then adds no training-inference mismatch at all.

Published names are the base model's (`quant_sync.export.base_weight_name`): `<module>.lora_A` (r, in),
`<module>.lora_B` (out, r), in `model.lora.sync_dtype` (`quant_sync.export.encode_adapter`: fp32, bf16, or int8 with
per-rank-component scales), and `<module>.lora_scaling` (1,) float32 = alpha / r. With a sync dtype other than fp32
the adapters' linears are `RoundedLinear`s: the forward multiplies by `round_adapter(W)`, the very float32 values
the workers decode, with a straight-through gradient to the fp32 master W (only the masters train and sit in AdamW).

Under FSDP2 (`learner.world_size > 1`) peft's adapters live inside the layers' FSDP2 units like any parameter: every
rank holds a shard of each, AdamW steps the shards, and publication and saving gather the adapters alone on rank 0
(`gather_adapters`: one all-gather per adapter matrix; version 0 gathers the whole base once, to quantize it).

Saved (`Adapters.save`: checkpoints' `model/` and `final/`): a peft adapter directory for the original base model,
whose adapters are the values the model ran (rounded to `sync_dtype`); when those differ from the fp32 masters the
masters go beside them (`adapter_master.safetensors`), and resume loads those.
The learner trains on the UAQ-reparametrized base (`quant.uaq.scale = s`), where the input of q/k/v/gate/up is `s`
times the original's, so those adapters' A are saved times `s` (`A_orig = s * A`; same function on the original
model) and divided by `s` on resume (`Adapters.load`, exact to fp32 rounding of A). `merge_adapters` merges such a
directory into the original base (`checkpoint.merge_lora`: `final-merged/`, plain Hugging Face safetensors).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from common.config_rules import lora_base
from learner import aligned
from learner.devices import cpu_state
from learner.distributed import SINGLE, Dist, full_state_dict
from quant_sync.export import (
    LORA_A,
    LORA_B,
    LORA_SCALING,
    base_weight_name,
    encode_adapter,
    export_rollout_tensors,
    pack_adapters,
    round_adapter,
)
from quant_sync.uaq import NORM_TO_LINEARS, quant_error_by_type

if TYPE_CHECKING:
    from learner.sections import LearnerSections
    from quant_sync.publisher import WeightPublisher

ADAPTER = "default"
"""The one peft adapter the learner trains."""
ADAPTER_FILE = "adapter_model.safetensors"
MASTER_FILE = "adapter_master.safetensors"
"""Beside ADAPTER_FILE when `model.lora.sync_dtype` is not fp32: the fp32 master adapters (resume loads these)."""
UAQ_INPUT_LINEARS = tuple(name.rsplit(".", 1)[-1] for names in NORM_TO_LINEARS.values() for name in names)
"""The linears whose input UAQ scales by `s` (q/k/v, gate/up): their saved A carry the factor."""


def add_adapters(
    model: torch.nn.Module, sections: LearnerSections, quantized_head: bool, resume_dir: str = ""
) -> tuple[torch.nn.Module, Adapters]:
    """Freeze `model`, put LoRA adapters on `model.lora.targets` (peft), and align the base with the rollout when
    `learner.lora_base` resolves to `rollout`; returns the peft model and its `Adapters`. `resume_dir`: a checkpoint
    whose `model/` adapter directory (`Adapters.save`) the adapters are loaded from."""
    from peft import LoraConfig, get_peft_model

    lora = sections.model.lora
    if lora.rank < 1:
        raise ValueError(f"model.lora.rank must be >= 1 to add adapters, got {lora.rank}")
    base = lora_base(sections.learner, sections.quant)
    scheme = sections.quant.scheme
    if base == "rollout" and not any(True for _ in aligned.aligned_layers(model)):  # FSDP2: no cache (aligned.py)
        aligned.make_rollout_aligned(model, scheme, cache=sections.learner.world_size == 1, head=quantized_head)
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.targets),
        bias="none",
    )
    peft_model = get_peft_model(model, config)
    adapters = Adapters(scheme, quantized_head, base == "rollout", sections.quant.uaq.scale, lora.sync_dtype)
    round_adapters(peft_model, lora.sync_dtype)
    if resume_dir:
        adapters.load(peft_model, Path(resume_dir) / "model")
    return peft_model, adapters


def merge_adapters(
    base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path, trust_remote_code: bool = False
) -> str:
    """Write `out_dir` (`checkpoint.merge_lora`: `runs/<name>/final-merged/`): the Hugging Face model of `base_dir`
    with the peft adapters of `adapter_dir` (an `Adapters.save` directory: UAQ's factor already taken out, so they
    fit the original base) merged into its weights by peft's `merge_and_unload`, saved as safetensors with the other
    files of `adapter_dir` (the tokenizer). Written to `<out_dir>.tmp` first, then renamed; returns `out_dir`."""
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapters, target = Path(adapter_dir), Path(out_dir)
    if not (adapters / ADAPTER_FILE).is_file() or not (adapters / "adapter_config.json").is_file():
        raise FileNotFoundError(f"merge_adapters: {adapters} is not a peft adapter directory (no {ADAPTER_FILE} or "
                                "adapter_config.json)")  # fmt: skip
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32, trust_remote_code=trust_remote_code)
    merged = PeftModel.from_pretrained(base, str(adapters)).merge_and_unload()
    staging = target.with_name(target.name + ".tmp")
    if staging.exists():
        shutil.rmtree(staging)
    merged.save_pretrained(staging, safe_serialization=True)
    for extra in adapters.iterdir():  # the tokenizer files Learner.save wrote beside the adapters
        if extra.is_file() and extra.name not in (ADAPTER_FILE, MASTER_FILE, "adapter_config.json", "README.md"):
            shutil.copy2(extra, staging / extra.name)
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)
    return str(target)


class _RoundedWeight(torch.autograd.Function):
    """`round_adapter(W)` forward, the identity backward (straight-through to the fp32 master W)."""

    @staticmethod
    def forward(ctx, weight, part, sync_dtype):  # noqa: ANN001, ANN205 - autograd.Function signature
        return round_adapter(weight, part, sync_dtype).to(weight.dtype)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad, None, None


class RoundedLinear(torch.nn.Linear):
    """A peft `lora_A` / `lora_B` linear whose forward uses its weight rounded as it is published
    (`model.lora.sync_dtype`): the learner runs the adapter values the workers run. Same parameters and names as the
    `nn.Linear` it replaces (its class is swapped in place: `round_adapters`)."""

    lora_part: str
    sync_dtype: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, _RoundedWeight.apply(self.weight, self.lora_part, self.sync_dtype), self.bias)


def round_adapters(model: torch.nn.Module, sync_dtype: str) -> int:
    """Make every adapter linear of `model` a `RoundedLinear` for `sync_dtype` (none for fp32: published as is);
    returns how many."""
    if sync_dtype == "fp32":
        return 0
    count = 0
    for _, _, layer in _adapter_modules(model):
        for part, linear in ((LORA_A, layer.lora_A[ADAPTER]), (LORA_B, layer.lora_B[ADAPTER])):
            if type(linear) not in (torch.nn.Linear, RoundedLinear):
                raise TypeError(f"model.lora.sync_dtype={sync_dtype}: adapter linear of type {type(linear).__name__}")
            linear.__class__ = RoundedLinear
            linear.lora_part, linear.sync_dtype = part, sync_dtype
            count += 1
    return count


def _adapter_modules(model: torch.nn.Module) -> list[tuple[str, str, torch.nn.Module]]:
    """(base model's module name, module name in `model`, peft LoRA layer) of every adapted linear, in order."""
    from peft.tuners.lora import LoraLayer

    return [
        (base_weight_name(name), name, module)
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A
    ]


def lora_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(base model's module name, peft LoRA layer) of every adapted linear, in module order."""
    return [(base, layer) for base, _, layer in _adapter_modules(model)]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly FSDP2-sharded DTensor) parameter: an all-gather under FSDP2."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


@torch.no_grad()
def gather_adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every adapter parameter, whole and detached, by its name in `model` (`...lora_A.default.weight`): under FSDP2
    one all-gather per matrix, a collective every rank calls in the same order; else the live tensors."""
    gathered = {}
    for _, module_name, layer in _adapter_modules(model):
        for part, linear in (("lora_A", layer.lora_A[ADAPTER]), ("lora_B", layer.lora_B[ADAPTER])):
            gathered[f"{module_name}.{part}.{ADAPTER}.weight"] = _full(linear.weight).detach()
    return gathered


@torch.no_grad()
def adapter_tensors(
    model: torch.nn.Module, sync_dtype: str = "fp32", gathered: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The adapters as published: `<module>.lora_A` (r, in), `.lora_B` (out, r) in `sync_dtype` (int8: with
    `.lora_A_scale`, `.lora_B_scale`), `.lora_scaling` (1,) fp32; fresh copies. `gathered`: `gather_adapters`'s
    output (FSDP2), else the model's own parameters."""
    gathered = gather_adapters(model) if gathered is None else gathered
    tensors: dict[str, torch.Tensor] = {}
    for name, module_name, layer in _adapter_modules(model):
        for part in (LORA_A, LORA_B):
            weight = gathered[f"{module_name}{part}.{ADAPTER}.weight"]
            for suffix, value in encode_adapter(weight, part, sync_dtype).items():
                tensors[name + part + suffix] = value
        tensors[name + LORA_SCALING] = torch.tensor([float(layer.scaling[ADAPTER])], dtype=torch.float32)
    if not tensors:
        raise ValueError("model.lora: the model has no LoRA adapters (is model.lora.targets right for it?)")
    return tensors


def base_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The frozen base's weights under the base model's names (peft's wrappers and the adapters left out), from
    `state` (a full state dict of the peft model) or the model's own."""
    state = model.state_dict() if state is None else state
    return {base_weight_name(name): value for name, value in state.items() if ".lora_" not in name}


@torch.no_grad()
def norm_b(model: torch.nn.Module, gathered: dict[str, torch.Tensor] | None = None) -> float:
    """sqrt(sum over adapters of ||B||_F^2) of the fp32 masters: 0 at initialization (peft starts B at zero)."""
    gathered = gather_adapters(model) if gathered is None else gathered
    total = sum(float(value.double().pow(2).sum()) for name, value in gathered.items() if ".lora_B." in name)
    return total**0.5


def _uaq_factor(name: str, uaq_scale: float) -> float:
    """`s` for the A of an adapter on a linear whose input UAQ scaled (peft's saved names), else 1."""
    module = name.rsplit(".lora_A", 1)[0] if ".lora_A" in name else ""
    return uaq_scale if module.endswith(UAQ_INPUT_LINEARS) else 1.0


class Adapters:
    """The learner's adapters: publishes the quantized base once (pinned: every later version builds on it) and then
    the adapters alone; saves and loads them as a peft adapter directory."""

    def __init__(
        self, scheme: str, quantized_head: bool, aligned_base: bool, uaq_scale: float = 1.0, sync_dtype: str = "fp32"
    ):
        self.scheme = scheme
        self.quantized_head = quantized_head
        self.aligned_base = aligned_base
        self.uaq_scale = uaq_scale
        self.sync_dtype = sync_dtype
        self.base_version: int | None = None
        self.base_quant_err: dict[str, float] = {}

    def publish(
        self, model: torch.nn.Module, publisher: WeightPublisher | None, version: int, ranks: Dist = SINGLE
    ) -> dict[str, float]:
        """Publish `version` (the base and the adapters the first time, the adapters after); returns metrics (rank 0;
        {} elsewhere). A collective under FSDP2: every rank calls it, rank 0 (`publisher`) publishes."""
        started = time.perf_counter()
        gathered = gather_adapters(model)
        state = None
        if self.base_version is None and ranks.world > 1:
            state = full_state_dict(model, ranks)  # the whole base, once (a collective)
        if not ranks.is_main:
            self.base_version = version if self.base_version is None else self.base_version
            return {}
        if publisher is None:
            raise ValueError("Adapters.publish: rank 0 needs the weight publisher")
        adapters = cpu_state(adapter_tensors(model, self.sync_dtype, gathered))  # quant_sync publishes CPU tensors
        if self.base_version is None:
            base = cpu_state(base_state_dict(model, state))
            tied = bool(getattr(model.config, "tie_word_embeddings", False))  # FSDP2's gathered state: two copies
            tensors = export_rollout_tensors(base, self.scheme, quantize_head=self.quantized_head, tied_head=tied)
            if self.aligned_base:  # the base forwards run on exactly the tensors the workers get (QaRL)
                aligned.install_operands(model, tensors, self.scheme)
            self.base_quant_err = quant_error_by_type(base, tensors, self.scheme)
            tensors.update(adapters)
            publisher.publish(version, tensors, self.scheme, pin=True)
            self.base_version = version
        else:
            tensors = pack_adapters(adapters)  # one buffer: the workers' fetch handles 2 tensors, not ~5 per linear
            publisher.publish(version, tensors, self.scheme, base=self.base_version)
        return {
            **self.base_quant_err,  # the frozen base's: the same every version
            "sync/bytes_per_version": float(sum(t.nbytes for t in tensors.values())),
            "sync/publish_s": time.perf_counter() - started,
            "lora/norm_B": norm_b(model, gathered),
        }

    @torch.no_grad()
    def save(
        self, model: torch.nn.Module, out_dir: str | Path, gathered: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Write a peft adapter directory (adapter_config.json, adapter_model.safetensors) for the original base: the
        adapters as the model runs them (rounded to `sync_dtype`), plus the fp32 masters (MASTER_FILE) if those
        differ. `gathered`: `gather_adapters`'s output (FSDP2: gathered on every rank, written by rank 0)."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        gathered = gather_adapters(model) if gathered is None else gathered
        masters = get_peft_model_state_dict(model, state_dict=gathered, adapter_name=ADAPTER)
        masters = {name: (value * _uaq_factor(name, self.uaq_scale)).contiguous() for name, value in masters.items()}
        model.peft_config[ADAPTER].save_pretrained(str(out))
        if self.sync_dtype == "fp32":
            save_file(masters, str(out / ADAPTER_FILE), metadata={"format": "pt"})
            return
        rounded = get_peft_model_state_dict(model, state_dict=self._rounded(gathered), adapter_name=ADAPTER)
        rounded = {name: (value * _uaq_factor(name, self.uaq_scale)).contiguous() for name, value in rounded.items()}
        save_file(rounded, str(out / ADAPTER_FILE), metadata={"format": "pt"})
        save_file(masters, str(out / MASTER_FILE), metadata={"format": "pt"})

    def _rounded(self, gathered: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            name: round_adapter(value, LORA_A if ".lora_A." in name else LORA_B, self.sync_dtype)
            for name, value in gathered.items()
        }

    @torch.no_grad()
    def load(self, model: torch.nn.Module, adapter_dir: Path) -> None:
        """Load the adapters of a directory `save` wrote (the fp32 masters when it holds them; UAQ's factor taken out
        again); raises naming what is off."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        path = adapter_dir / MASTER_FILE
        if not path.is_file():
            path = adapter_dir / ADAPTER_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{adapter_dir}: no {ADAPTER_FILE} (not a LoRA checkpoint of model.lora.rank > 0)")
        state = {name: value / _uaq_factor(name, self.uaq_scale) for name, value in load_file(str(path)).items()}
        result = set_peft_model_state_dict(model, state, adapter_name=ADAPTER)
        expected = {name for name, _ in model.named_parameters() if "lora_" in name}
        missing = sorted(expected & set(result.missing_keys))
        if result.unexpected_keys or missing:
            raise ValueError(f"{path} does not fit the adapters of model.lora.*: unexpected "
                             f"{list(result.unexpected_keys)[:3]}, missing {missing[:3]}")  # fmt: skip
