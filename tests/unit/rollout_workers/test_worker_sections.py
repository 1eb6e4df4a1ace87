"""The rollout worker's config bundles: picked from the root config, sent as a dict, rebuilt with the config's
checks."""

from __future__ import annotations

import pytest

from common.config import ConfigError, load_config, to_dict
from rollout_workers.sections import EngineSections, WorkerSections


def test_sections_travel_as_a_dict_and_come_back_equal():
    cfg = load_config(None, ["rollout.max_new_tokens=12", "train.group_size=4", "quant.scheme=fp8"])
    picked = WorkerSections.pick(cfg)
    assert picked.rollout is cfg.rollout  # the root's own section objects
    values = to_dict(picked)
    sections = ["algo", "buffer", "data", "env", "model", "precision", "quant", "reward", "rollout", "staleness"]
    sections.append("train")
    assert sorted(values) == sections
    rebuilt = WorkerSections.load(values)
    assert isinstance(rebuilt, EngineSections) and to_dict(rebuilt) == values


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda v: v.update(loss={}), "`loss`: Key 'loss' not in 'WorkerSections'"),  # the root is refused
        (lambda v: v["rollout"].update(swap_mode="pause"), "invalid value 'pause' for `rollout.swap_mode`"),
        (lambda v: v["rollout"]["sglang"].update(tp=0), "value 0 for `rollout.sglang.tp` is out of range"),
        (lambda v: v["buffer"].update(host="0.0.0.0"), "buffer.curve_keys_dir"),  # BufferConfig's own rule
    ],
)
def test_a_bad_section_value_is_refused_naming_the_key(change, message):
    values = to_dict(WorkerSections.pick(load_config(None)))
    change(values)
    with pytest.raises(ConfigError, match=message):
        WorkerSections.load(values)
