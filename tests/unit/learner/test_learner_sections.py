"""The learner's config bundles: picked from the root config, sent as a dict, rebuilt with the config's checks."""

from __future__ import annotations

import pytest

from common.config import ConfigError, load_config, set_key, to_dict
from learner.sections import LearnerSections, UpdateSections


def test_sections_travel_as_a_dict_and_come_back_equal():
    cfg = load_config(None, ["loss.acrl.gamma=0.5", "optim.lr=3e-4", "train.groups_per_step=4"])
    picked = LearnerSections.pick(cfg)
    assert picked.loss is cfg.loss  # the root's own section objects
    values = to_dict(picked)
    assert sorted(values) == ["algo", "buffer", "data", "learner", "loss", "model", "optim", "precision", "quant",
                              "rollout", "staleness", "train"]  # fmt: skip
    rebuilt = LearnerSections.load(values)
    assert isinstance(rebuilt, UpdateSections) and to_dict(rebuilt) == values
    set_key(rebuilt, "optim.lr", 1e-4)  # a live change, as `asyncrl set` applies it
    assert rebuilt.optim.lr == 1e-4 and cfg.optim.lr == 3e-4


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda v: v.update(logging={}), "`logging`: Key 'logging' not in 'LearnerSections'"),  # root refused
        (lambda v: v.pop("train"), "missing mandatory value: train"),
        (lambda v: v["loss"].update(cap="big"), "loss.cap"),
        (lambda v: v["loss"].update(cap=0.5), "value 0.5 for `loss.cap` is out of range"),
        (lambda v: v["loss"]["acrl"].update(x_mode="q"), "invalid value 'q' for `loss.acrl.x_mode`"),
        (lambda v: v["optim"].update(lr=float("nan")), "value nan for `optim.lr` is not a finite number"),
    ],
)
def test_a_bad_section_value_is_refused_naming_the_key(change, message):
    values = to_dict(LearnerSections.pick(load_config(None)))
    change(values)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        LearnerSections.load(values)
