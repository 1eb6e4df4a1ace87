"""The learner's load of a model directory: the weights must be exactly the tensors config.json's model has.

transformers' `from_pretrained` fills a tensor missing from the files with random values, drops a tensor the model
does not have, and raises on a shape of another size with a message pointing at a report it logged (which the run
does not show): a layer deleted from the files, or `num_hidden_layers` raised in config.json, trained random layers
and wrote them out as the run's model. `load_causal_lm` asks for the loading report and fails naming them, and
refuses weights holding NaN or inf (the rollout's quantizers turned a NaN row into finite values: int8 scale 1).
"""

from __future__ import annotations

from typing import Any

import torch

SHOWN_NAMES = 4
"""Tensor names a WeightsMismatch message lists of each kind (then how many more)."""


class WeightsMismatch(ValueError):
    """A model directory whose weight files do not hold the tensors its config.json describes (one line)."""


def load_causal_lm(model_dir: str, trust_remote_code: bool = False, checked: bool = True) -> Any:
    """`AutoModelForCausalLM.from_pretrained(model_dir)` in fp32; WeightsMismatch naming the tensors missing from the
    files, left unused, or of another shape than the config gives. `checked=False`: a directory this process already
    loaded checked (a structure whose weights are about to be replaced), loaded as it is."""
    from transformers import AutoModelForCausalLM

    if not checked:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, trust_remote_code=trust_remote_code)

    model, info = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=torch.float32,
        trust_remote_code=trust_remote_code,
        output_loading_info=True,
        ignore_mismatched_sizes=True,  # reported below with the others, not raised with a pointer to a log
    )
    problems = []
    for key, what in (
        ("missing_keys", "missing from the weight files (transformers would train random values)"),
        ("unexpected_keys", "in the weight files but not in the model config.json describes"),
        ("mismatched_keys", "of another shape in the weight files than config.json gives"),
    ):
        names = sorted(_described(entry) for entry in info.get(key) or ())
        if names:
            more = f" and {len(names) - SHOWN_NAMES} more" if len(names) > SHOWN_NAMES else ""
            problems.append(f"{len(names)} tensor(s) {what}: {', '.join(names[:SHOWN_NAMES])}{more}")
    if problems:
        raise WeightsMismatch(f"model.path={model_dir}: the weights do not fit config.json: {'; '.join(problems)}")
    for name, tensor in model.state_dict().items():  # the rollout's quantizers would turn a NaN row into finite
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):  # garbage (int8: scale 1, q 0)
            bad = int((~torch.isfinite(tensor)).sum())
            raise WeightsMismatch(f"model.path={model_dir}: {name} holds {bad} NaN or infinite value(s) (of "
                                  f"{tensor.numel()}): the weights are damaged")  # fmt: skip
    return model


def _described(entry: Any) -> str:
    """A loading report's entry: a name, or (name, shape in the files, shape the config gives) for a mismatch."""
    if isinstance(entry, tuple | list) and len(entry) == 3:
        name, found, wanted = entry
        return f"{name} ({list(found)} in the files, {list(wanted)} by config.json)"
    return str(entry[0] if isinstance(entry, tuple | list) else entry)
