"""The learner's load of a model directory fails naming the tensors that do not fit config.json (transformers filled
a missing one with random values and dropped an extra one, saying so only in a log line)."""

from __future__ import annotations

import json
import shutil

import pytest

from common.builtin_model import resolve_model_path
from learner.pretrained import WeightsMismatch, load_causal_lm


@pytest.fixture
def tiny(tmp_path):
    target = tmp_path / "tiny"
    shutil.copytree(resolve_model_path("builtin:tiny", log=lambda *a: None), target)
    return target


def _with_config(model_dir, **changes) -> str:
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, **changes}))
    return str(model_dir)


def test_a_whole_model_loads(tiny):
    assert sum(p.numel() for p in load_causal_lm(str(tiny)).parameters()) > 0


@pytest.mark.parametrize(
    ("changes", "words", "more"),
    [
        ({"num_hidden_layers": 8}, "36 tensor(s) missing from the weight files (transformers would train random", 32),
        ({"num_hidden_layers": 2}, "18 tensor(s) in the weight files but not in the model config.json describes", 14),
        ({"hidden_size": 64}, "model.embed_tokens.weight ([16, 128] in the files, [16, 64] by config.json)", 34),
    ],
)
def test_weights_that_do_not_fit_config_json_are_named(tiny, changes, words, more):
    with pytest.raises(WeightsMismatch) as caught:
        load_causal_lm(_with_config(tiny, **changes))
    message = str(caught.value)
    assert message.startswith(f"model.path={tiny}: the weights do not fit config.json: ") and "\n" not in message
    assert words in message and message.endswith(f" and {more} more")


def test_weights_holding_nan_are_refused(tiny):
    """A NaN row was published to the workers, where int8 (scale 1, q 0) and fp8's kernels turned it into finite
    log-probs: silently wrong rollouts from version 0."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(tiny / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"][5, 7] = float("nan")
    save_file(tensors, tiny / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightsMismatch, match=r"model.layers.0.mlp.down_proj.weight holds 1 NaN or infinite value"):
        load_causal_lm(str(tiny))
