"""Reward function specs (`reward.fn`, `reward.fns`, `reward.weights`): what a spec names, the start-up check that
fails with the name, what a result may be, and how several functions combine."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from common.config import ConfigError, load_config
from common.reward_fns import (
    CallOutcome,
    RewardFnError,
    check_spec,
    combine,
    load_fn,
    parse_spec,
    plain_result,
    spec_names,
    validate_result,
)

USER_FILE = """
import math

def exact(response, answer, row):
    return float(response.strip() == answer)

def with_metrics(response, answer, row):
    return {"score": 0.5, "length": len(response)}

if True:
    def conditional(response, answer, row):
        return 1.0

not_callable = 3
"""


@pytest.fixture
def user_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(USER_FILE, encoding="utf-8")
    return path


def test_specs_name_a_file_a_module_or_a_builtin(user_file):
    assert parse_spec(f"{user_file}:exact").is_file and parse_spec(f"{user_file}:exact").name == "exact"
    module = parse_spec("common.tasks.rewards:math_reward")
    assert not module.is_file and module.location == "common.tasks.rewards"
    builtin = parse_spec("asyncrl:math")
    assert builtin.location == "common.tasks.rewards" and builtin.name == "math_reward"
    assert parse_spec("reward.py:fn").is_file  # a bare file name in the working directory


def test_builtin_rewards_are_reward_functions():
    assert load_fn(parse_spec("asyncrl:arith"))(" 26 ", "26", {}) == 1.0
    assert load_fn(parse_spec("asyncrl:arith"))("25", "26", {}) == 0.0
    assert load_fn(parse_spec("asyncrl:math"))("so \\boxed{26}", "26", {"index": 0}) == 1.0
    assert load_fn(parse_spec("asyncrl:math"))("13 + 13", "26", {}) == 0.0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "is not a reward function spec"),
        ("file.py:", "is not a reward function spec"),
        ("file.py:not-a-name", "is not a reward function spec"),
        ("asyncrl:nope", "no built-in reward function 'nope'"),
        ("bad module:fn", "is neither a .py file nor a dotted module name"),
        ("missing_dir/missing.py:fn", "reward file 'missing_dir/missing.py' does not exist"),
        ("no_such_module_xyz.sub:fn", "cannot import module 'no_such_module_xyz.sub'"),
        ("common.tasks.rewards:no_such_fn", "module 'common.tasks.rewards' has no function 'no_such_fn'"),
        ("common.tasks.rewards:_MAX_DIGITS", "'_MAX_DIGITS' in module 'common.tasks.rewards' is not callable"),
    ],
)
def test_a_bad_spec_fails_naming_it(spec, message):
    with pytest.raises(RewardFnError, match="reward.fn") as err:
        check_spec(spec)
    assert message in str(err.value) and repr(spec) in str(err.value)


def test_a_file_is_checked_without_running_it(user_file, tmp_path):
    for name in ("exact", "with_metrics", "conditional", "math", "not_callable"):
        check_spec(f"{user_file}:{name}")
    with pytest.raises(RewardFnError, match="defines no function 'missing'"):
        check_spec(f"{user_file}:missing")
    side_effect = tmp_path / "ran"
    runs = tmp_path / "runs_at_import.py"
    runs.write_text(f"open({str(side_effect)!r}, 'w').close()\ndef fn(r, a, row):\n    return 1.0\n")
    check_spec(f"{runs}:fn")
    assert not side_effect.exists()
    broken = tmp_path / "broken.py"
    broken.write_text("def fn(:\n")
    with pytest.raises(RewardFnError, match="does not parse"):
        check_spec(f"{broken}:fn")


def test_a_file_check_sees_names_bound_in_except_handlers_and_defers_star_imports(tmp_path):
    fallback = tmp_path / "fallback.py"
    fallback.write_text("try:\n    import not_installed\nexcept ImportError:\n    def reward2(r, a, row):\n"
                        "        return 1.0\n")  # fmt: skip
    check_spec(f"{fallback}:reward2")  # was "defines no function 'reward2'"
    star = tmp_path / "star.py"
    star.write_text("from helpers import *\n")
    check_spec(f"{star}:reward")  # a star import may bind it: the load in a reward process decides
    with pytest.raises(RewardFnError, match="defines no function 'missing'"):
        check_spec(f"{fallback}:missing")


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "raise RuntimeError('no GPU found')\n",
            r"importing module 'usermod_\w+' failed: RuntimeError\('no GPU found'\)",
        ),
        ("import sys\nsys.exit(2)\n", r"importing module 'usermod_\w+' failed: SystemExit\(2\)"),
        ("import time\ntime.sleep(30)\n", r"importing module 'usermod_\w+' did not finish within 0.5 s"),
    ],
)
def test_a_module_spec_whose_import_fails_exits_or_hangs_is_a_clear_error(source, message, tmp_path, monkeypatch):
    """A module spec is imported by the start-up check, in the driver: anything its import does (an exception, a
    sys.exit, a hang) becomes one error naming the key and the module, not a traceback, a silent exit 2 or a hang."""
    import uuid

    from common import reward_fns

    name = f"usermod_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(reward_fns, "MODULE_CHECK_TIMEOUT_S", 0.5)
    with pytest.raises(RewardFnError, match=r"`reward.fn` 'usermod_\w+:f': " + message):
        check_spec(f"{name}:f")


def test_loading_a_file_finds_its_functions_and_says_what_is_missing(user_file):
    assert load_fn(parse_spec(f"{user_file}:exact"))("7", "7", {}) == 1.0
    with pytest.raises(RewardFnError, match="is not callable"):
        load_fn(parse_spec(f"{user_file}:not_callable"))
    with pytest.raises(RewardFnError, match="has no function 'missing'"):
        load_fn(parse_spec(f"{user_file}:missing"))


def test_the_config_check_names_the_key_and_the_spec(user_file):
    cfg = load_config(None, [f"reward.fns=[{user_file}:exact,asyncrl:math]", "reward.weights=[0.5,2.0]"])
    assert cfg.reward.specs() == [f"{user_file}:exact", "asyncrl:math"] and cfg.reward.weight_list() == [0.5, 2.0]
    assert load_config(None, ["reward.fn=asyncrl:arith"]).reward.weight_list() == [1.0]
    assert load_config(None, []).reward.specs() == []  # the default: the task's own reward
    with pytest.raises(ConfigError, match=r"`reward.fns\[1\]` 'common.tasks.rewards:nope'.*no function 'nope'"):
        load_config(None, [f"reward.fns=[{user_file}:exact,common.tasks.rewards:nope]"])
    with pytest.raises(ConfigError, match="gone.py' does not exist"):
        load_config(None, ["reward.fn=gone.py:fn"])
    with pytest.raises(ConfigError, match="2 weights for 1 reward functions"):
        load_config(None, ["reward.fn=asyncrl:arith", "reward.weights=[1.0,2.0]"])
    with pytest.raises(ConfigError, match="not both"):
        load_config(None, ["reward.fn=asyncrl:arith", "reward.fns=[asyncrl:math]"])
    with pytest.raises(ConfigError, match="reward.timeout_s"):
        load_config(None, ["reward.timeout_s=0"])


def test_a_relative_file_is_made_absolute_at_load_so_workers_elsewhere_find_it(user_file, monkeypatch):
    monkeypatch.chdir(user_file.parent)
    cfg = load_config(None, [f"reward.fns=[{user_file.name}:exact,asyncrl:math]"])
    assert cfg.reward.specs() == [f"{user_file}:exact", "asyncrl:math"]
    assert load_config(None, [f"reward.fn={user_file.name}:exact"]).reward.fn == f"{user_file}:exact"


def test_results_are_a_finite_score_or_a_dict_with_one():
    assert validate_result(plain_result(1)) == (1.0, {})
    assert validate_result(plain_result({"score": 0.25, "length": 3, "mean": 1})) == (
        0.25,
        {"length": 3.0, "fn_mean": 1.0},  # `reward/mean` is the run's own: the function's is renamed
    )
    for bad in (None, "1.0", [1.0], True, {"length": 1}, {"score": "1"}, {1: 1.0}):
        plain = plain_result(bad)
        with pytest.raises(ValueError):
            validate_result(plain)
    for bad in (math.nan, math.inf, {"score": math.nan}, {"score": 1.0, "x": math.inf}):
        with pytest.raises(ValueError, match="finite"):
            validate_result(plain_result(bad))


def test_weights_combine_scores_and_a_failed_call_scores_zero():
    outcomes = [CallOutcome(score=1.0, metrics={"length": 4.0}), CallOutcome(score=0.5), CallOutcome(error="boom")]
    reward, metrics = combine(outcomes, [2.0, -1.0, 10.0], ["a", "b", "c"])
    assert reward == 2.0 * 1.0 - 1.0 * 0.5 + 0.0
    assert metrics == {"length": 4.0, "a": 1.0, "b": 0.5, "c": 0.0}
    assert combine([CallOutcome(score=1.0)], [1.0], ["a"]) == (1.0, {})  # one function: no per-function metric
    assert spec_names(["x.py:fn", "y.py:fn", "asyncrl:math"]) == ["fn", "fn_2", "math_reward"]


def test_two_reward_files_importing_their_own_sibling_module_are_refused(tmp_path, monkeypatch):
    """Each file's directory goes on sys.path, but Python keeps one `utils` per process: the second file ran with
    the first one's helpers and scored silently wrong (1.0 instead of 0.25)."""
    import sys

    from common.reward_fns import load_fn

    for name, value in (("a", 1.0), ("b", 0.25)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "utils.py").write_text(f"VALUE = {value}\n")
        (folder / "reward.py").write_text("import utils\ndef fn(r, a, row):\n    return utils.VALUE\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "utils", raising=False)
    try:
        assert load_fn(parse_spec(f"{tmp_path / 'a' / 'reward.py'}:fn"))("", "", {}) == 1.0
        with pytest.raises(RewardFnError, match=r"has a module utils.py beside it, but 'utils' is already imported"):
            load_fn(parse_spec(f"{tmp_path / 'b' / 'reward.py'}:fn"))
    finally:
        sys.modules.pop("utils", None)
