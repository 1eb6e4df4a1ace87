"""norm_update/quantized: QuRL eq. 13's ratio over exactly the weights quant_sync publishes quantized (micro)."""

from __future__ import annotations

import pytest
import torch
from tiny_learner import random_groups, with_behavior
from transformers import AutoModelForCausalLM

from common.builtin_model import resolve_model_path
from common.config import load_config
from common.config_rules import head_quantized
from learner.acrl import AcrlReference
from learner.batch import collate
from learner.precision import LossScaler
from learner.sections import LearnerSections
from learner.update import quantized_parameter_ids, train_on_batch
from quant_sync.export import export_rollout_tensors
from quant_sync.uaq import apply_uaq

MICRO_VOCAB = 16  # builtin:micro's vocabulary


def _micro(uaq_scale: float) -> torch.nn.Module:
    model_dir = resolve_model_path("builtin:micro", log=lambda *_: None)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    apply_uaq(model, uaq_scale)
    return model


def _sections(*overrides: str) -> LearnerSections:
    base = ("model.path=builtin:micro", "rollout.max_new_tokens=8", "optim.lr=1e-3", "loss.weighting=tis")
    return LearnerSections.pick(load_config(None, [*base, *overrides]))


def _ratio(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], names: list[str]) -> float:
    """||new - old||^2 / ||old||^2 over `names`, in float64, computed directly on whole tensors."""
    delta = sum(float((after[n].double() - before[n].double()).pow(2).sum()) for n in names)
    base = sum(float(before[n].double().pow(2).sum()) for n in names)
    return delta / base


def _step(model: torch.nn.Module, sections: LearnerSections) -> dict[str, float]:
    batch = with_behavior(collate(random_groups(MICRO_VOCAB, n_groups=3), pad_id=0), model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=sections.optim.lr)
    result = train_on_batch(
        model, optimizer, LossScaler(enabled=False), batch, sections, AcrlReference(sections.loss.acrl)
    )
    assert not result.skipped
    return result.metrics


@pytest.mark.parametrize(
    ("scheme", "minibatches", "uaq_scale"),
    [("int8", 1, 1.0), ("int8", 2, 1.5), ("w4a16", 1, 1.5)],  # per-parameter step; snapshot; weight-only, no head
)
def test_norm_update_quantized_is_the_ratio_over_the_published_quantized_weights(scheme, minibatches, uaq_scale):
    sections = _sections(f"quant.scheme={scheme}", f"learner.minibatches={minibatches}")
    model = _micro(uaq_scale)
    head = head_quantized(sections.quant, sections.rollout)
    published = export_rollout_tensors(model.state_dict(), scheme, quantize_head=head)
    names = sorted(name for name in published if name + "_scale" in published)  # what norm_quant_err is over
    assert ("lm_head.weight" in names) == head == (scheme == "int8")  # micro ties its head: int8 quantizes it
    assert len(names) == 7 * 2 + head and not any("norm" in name for name in names)
    before = {name: value.detach().clone() for name, value in model.state_dict().items()}
    metrics = _step(model, sections)
    after = model.state_dict()
    assert metrics["norm_update/quantized"] == pytest.approx(_ratio(before, after, names), rel=1e-9)
    assert metrics["norm_update"] == pytest.approx(_ratio(before, after, [n for n, _ in model.named_parameters()]))
    assert metrics["norm_update/quantized"] != pytest.approx(metrics["norm_update"], rel=1e-3)  # a different set


def test_the_selection_follows_quant_sync_and_is_empty_without_quantization():
    model = _micro(1.0)
    tied = model.get_input_embeddings().weight
    int8 = _sections("quant.scheme=int8")
    assert id(tied) in quantized_parameter_ids(model, int8.quant, int8.rollout)  # the tied head travels quantized
    fp32_head = _sections("quant.scheme=int8", "quant.lm_head=fp32")
    ids = quantized_parameter_ids(model, fp32_head.quant, fp32_head.rollout)
    assert id(tied) not in ids and len(ids) == 14
    none = _sections("quant.scheme=none")
    assert quantized_parameter_ids(model, none.quant, none.rollout) == frozenset()
    metrics = _step(model, none)
    assert "norm_update/quantized" not in metrics and metrics["norm_update"] > 0
