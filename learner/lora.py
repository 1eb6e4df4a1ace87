"""LoRA on a frozen base (`model.lora.rank > 0`, ALGORITHMS.md "LoRA on a frozen quantized base").

    HF model --(learner.lora_base=rollout: make_rollout_aligned)--> peft LoRA adapters on `model.lora.targets`
      version 0:   the quantized base + the adapters, pinned at the publisher (late workers fetch it)
      version k+1: the adapters alone (lora_A, lora_B, lora_scaling per adapted linear), based on version 0

The adapters are built with peft (`get_peft_model`): the base parameters are frozen, so only the adapters get
gradients and optimizer state. With `learner.lora_base=rollout` (the default when `quant.scheme` is not none) the
base linears are `learner.aligned.AlignedLinear`s running the published quantized operands (the engine's numerics,
installed from version 0), and peft's adapters run in fp32 on top: `y = Q(W) x + s * B (A x)`, the engine's formula
(`rollout_workers.embedded.linears.low_rank_linear`). The base then adds no training-inference mismatch at all.

Published names are the base model's (`quant_sync.export.base_weight_name`): `<module>.lora_A` (r, in),
`<module>.lora_B` (out, r), both float32, and `<module>.lora_scaling` (1,) float32 = alpha / r.

Saved (`Adapters.save`: checkpoints' `model/` and `final/`): a peft adapter directory for the original base model.
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

from common.config_rules import lora_base
from learner import aligned
from quant_sync.export import LORA_A, LORA_B, LORA_SCALING, base_weight_name, export_rollout_tensors
from quant_sync.uaq import NORM_TO_LINEARS, quant_error_by_type

if TYPE_CHECKING:
    from learner.sections import LearnerSections
    from quant_sync.publisher import WeightPublisher

ADAPTER = "default"
"""The one peft adapter the learner trains."""
ADAPTER_FILE = "adapter_model.safetensors"
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
    if base == "rollout" and not any(True for _ in aligned.aligned_layers(model)):
        aligned.make_rollout_aligned(model, scheme, cache=True, head=quantized_head)
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.targets),
        bias="none",
    )
    peft_model = get_peft_model(model, config)
    adapters = Adapters(scheme, quantized_head, base == "rollout", sections.quant.uaq.scale)
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
        if extra.is_file() and extra.name not in (ADAPTER_FILE, "adapter_config.json", "README.md"):
            shutil.copy2(extra, staging / extra.name)
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)
    return str(target)


def lora_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(base model's module name, peft LoRA layer) of every adapted linear, in module order."""
    from peft.tuners.lora import LoraLayer

    layers = []
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            layers.append((base_weight_name(name), module))
    return layers


@torch.no_grad()
def adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters as published: `<module>.lora_A` (r, in), `.lora_B` (out, r), `.lora_scaling` (1,), fp32 copies."""
    tensors: dict[str, torch.Tensor] = {}
    for name, layer in lora_layers(model):
        tensors[name + LORA_A] = layer.lora_A[ADAPTER].weight.detach().to(torch.float32).contiguous().clone()
        tensors[name + LORA_B] = layer.lora_B[ADAPTER].weight.detach().to(torch.float32).contiguous().clone()
        tensors[name + LORA_SCALING] = torch.tensor([float(layer.scaling[ADAPTER])], dtype=torch.float32)
    if not tensors:
        raise ValueError("model.lora: the model has no LoRA adapters (is model.lora.targets right for it?)")
    return tensors


def base_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The frozen base's weights under the base model's names (peft's wrappers and the adapters left out)."""
    return {base_weight_name(name): value for name, value in model.state_dict().items() if ".lora_" not in name}


@torch.no_grad()
def norm_b(model: torch.nn.Module) -> float:
    """sqrt(sum over adapters of ||B||_F^2): 0 at initialization (peft starts B at zero), the adapters' size after."""
    total = sum(float(layer.lora_B[ADAPTER].weight.double().pow(2).sum()) for _, layer in lora_layers(model))
    return total**0.5


def _uaq_factor(name: str, uaq_scale: float) -> float:
    """`s` for the A of an adapter on a linear whose input UAQ scaled (peft's saved names), else 1."""
    module = name.rsplit(".lora_A", 1)[0] if ".lora_A" in name else ""
    return uaq_scale if module.endswith(UAQ_INPUT_LINEARS) else 1.0


class Adapters:
    """The learner's adapters: publishes the quantized base once (pinned: every later version builds on it) and then
    the adapters alone; saves and loads them as a peft adapter directory."""

    def __init__(self, scheme: str, quantized_head: bool, aligned_base: bool, uaq_scale: float = 1.0):
        self.scheme = scheme
        self.quantized_head = quantized_head
        self.aligned_base = aligned_base
        self.uaq_scale = uaq_scale
        self.base_version: int | None = None
        self.base_quant_err: dict[str, float] = {}

    def publish(self, model: torch.nn.Module, publisher: WeightPublisher, version: int) -> dict[str, float]:
        """Publish `version` (the base and the adapters the first time, the adapters after); returns metrics."""
        started = time.perf_counter()
        adapters = adapter_tensors(model)
        if self.base_version is None:
            state = base_state_dict(model)
            tensors = export_rollout_tensors(state, self.scheme, quantize_head=self.quantized_head)
            if self.aligned_base:  # the base forwards run on exactly the tensors the workers get (QaRL)
                aligned.install_operands(model, tensors, self.scheme)
            self.base_quant_err = quant_error_by_type(state, tensors, self.scheme)
            tensors.update(adapters)
            publisher.publish(version, tensors, self.scheme, pin=True)
            self.base_version = version
        else:
            tensors = adapters
            publisher.publish(version, tensors, self.scheme, base=self.base_version)
        return {
            **self.base_quant_err,  # the frozen base's: the same every version
            "sync/bytes_per_version": float(sum(t.nbytes for t in tensors.values())),
            "sync/publish_s": time.perf_counter() - started,
            "lora/norm_B": norm_b(model),
        }

    @torch.no_grad()
    def save(self, model: torch.nn.Module, out_dir: str | Path) -> None:
        """Write a peft adapter directory (adapter_config.json, adapter_model.safetensors) for the original base."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = get_peft_model_state_dict(model, adapter_name=ADAPTER)
        state = {name: (value * _uaq_factor(name, self.uaq_scale)).contiguous() for name, value in state.items()}
        model.peft_config[ADAPTER].save_pretrained(str(out))
        save_file(state, str(out / ADAPTER_FILE), metadata={"format": "pt"})

    @torch.no_grad()
    def load(self, model: torch.nn.Module, adapter_dir: Path) -> None:
        """Load the adapters of a directory `save` wrote (UAQ's factor taken out again); raises naming what is off."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

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
