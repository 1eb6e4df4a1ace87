"""`builtin:tiny-outliers`: the function is tiny's in fp32, but per-token INT8 activation quantization bites."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asyncrl.probe import ProbeOptions, run_probe
from common.builtin_model import (
    OUTLIER_RECIPES,
    OutlierRecipe,
    build_outliers,
    outlier_fingerprint,
    resolve_model_path,
)
from common.models_registry import BUILTIN_MODELS


def _quiet(*_args) -> None:
    pass


def _logp(model_dir: Path, input_ids: torch.Tensor) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=input_ids).logits, -1)


def test_the_outlier_variant_is_named_like_the_other_builtins() -> None:
    assert set(OUTLIER_RECIPES) <= set(BUILTIN_MODELS)
    recipe = OUTLIER_RECIPES["tiny-outliers"]
    assert outlier_fingerprint(recipe) != outlier_fingerprint(OutlierRecipe(alpha=recipe.alpha * 2))
    with pytest.raises(ValueError, match="builtin:tiny-outliers"):  # the error lists the variant among the valid
        resolve_model_path("builtin:tiny-outlier", log=_quiet)


def test_reparametrization_preserves_the_function_and_makes_the_outlier_channels(tmp_path: Path) -> None:
    base_dir = resolve_model_path("builtin:micro", log=_quiet)
    ids = torch.randint(3, 16, (4, 12), generator=torch.Generator().manual_seed(0))  # token ids of the alphabet
    for alpha in (64.0, 10.0):  # a power of two scales exactly in fp32; any other alpha to fp32 rounding
        out_dir = tmp_path / f"alpha{alpha:g}"
        report = build_outliers(OutlierRecipe(base="micro", channels=2, alpha=alpha), base_dir, out_dir)
        change = float((_logp(out_dir, ids) - _logp(base_dir, ids)).abs().max())
        assert change == 0.0 if alpha == 64.0 else change < 1e-4
        assert report["fp32_max_abs_logp_change"] == (0.0 if alpha == 64.0 else pytest.approx(0, abs=1e-4))
    from safetensors.torch import load_file

    before, after = load_file(base_dir / "model.safetensors"), load_file(out_dir / "model.safetensors")
    channels = report["channels"]
    assert len(channels) == 2
    norm = "model.layers.1.post_attention_layernorm.weight"
    torch.testing.assert_close(after[norm][channels], before[norm][channels] * 10.0)
    others = [c for c in range(after[norm].numel()) if c not in channels]
    assert torch.equal(after[norm][others], before[norm][others])
    up = "model.layers.1.mlp.up_proj.weight"
    torch.testing.assert_close(after[up][:, channels], before[up][:, channels] / 10.0)
    assert torch.equal(after["model.layers.1.mlp.down_proj.weight"], before["model.layers.1.mlp.down_proj.weight"])


@pytest.mark.slow
def test_int8_rollout_of_the_outlier_variant_mismatches_far_more_than_tiny_and_fp32_not_at_all() -> None:
    variant_dir = resolve_model_path("builtin:tiny-outliers", log=_quiet)
    record = json.loads((variant_dir / "asyncrl_recipe.json").read_text())
    assert record["fp32_max_abs_logp_change"] == 0.0  # alpha 64: bit-identical in fp32
    results = {}
    for model in ("builtin:tiny", "builtin:tiny-outliers"):
        options = ProbeOptions(model=model, overrides=["rollout.max_new_tokens=8"], schemes=("none", "int8"),
                               prompts=12, layers_top=0)  # fmt: skip
        rows = {row["scheme"]: row["metrics"] for row in run_probe(options, log=_quiet)["schemes"]}
        results[model] = rows
        assert rows["none"]["kl_k3"] < 1e-8 and rows["none"]["w_max"] < 1.0001  # fp32 rollout: rounding only
    tiny, variant = results["builtin:tiny"]["int8"], results["builtin:tiny-outliers"]["int8"]
    # measured: tiny kl_k3 ~3e-5, the variant ~0.05 (a real 135M instruct model: 0.03-0.07)
    assert variant["kl_k3"] > 0.005 and variant["kl_k3"] > 30 * tiny["kl_k3"]
    assert variant["w_max"] > tiny["w_max"] and variant["log_ppl_abs_diff"] > 5 * tiny["log_ppl_abs_diff"]
