"""`data.task=arith_tool`: the calculator environment's two syntaxes, the task's config rule and source, and the
built-in tool model's recipe (vocabulary, warm-up examples, fingerprint); building it is the integration test's."""

from __future__ import annotations

import pytest

from common.builtin_model import ARITH_ALPHABET, RECIPES, make_tokenizer, recipe_fingerprint
from common.builtin_tool import TOOL_ALPHABET, TOOL_RECIPES, ToolRecipe, _example, calc_text, tool_fingerprint
from common.config import ConfigError, load_config
from common.envs import check_step_result, load_env_factory
from common.models_registry import BUILTIN_MODELS
from common.tasks import make_source
from common.tasks.arith import ArithSource
from common.tasks.arith_tool import CalculatorEnv


def test_brackets_syntax_calls_the_calculator_and_scores_the_final_answer():
    env = load_env_factory("asyncrl:arith_tool", {"syntax": "brackets"})()
    assert env.stop_strings == ("]",)
    assert env.reset({"prompt": "12345+678=", "answer": "13023"}) == "12345+678="
    call = check_step_result(env.step("[12345+678]"))
    assert (call.observation, call.reward, call.done, call.info["tool_calls"]) == ("{13023}", 0.0, False, 1)
    bad = check_step_result(env.step("[12345+]"))
    assert bad.observation == "{error}" and not bad.done
    right = check_step_result(env.step("13023"))
    assert (right.observation, right.reward, right.done) == (None, 1.0, True)
    env.reset({"prompt": "1+2=", "answer": "3"})
    assert env.step("4").reward == 0.0 and env.step("{3}").reward == 1.0  # the result's braces are not digits


def test_calls_past_max_calls_are_a_final_answer():
    env = CalculatorEnv(syntax="brackets", max_calls=1)
    env.reset({"prompt": "1+2=", "answer": "3"})
    assert not env.step("[1+2]").done
    last = env.step("[1+2]")
    assert last.done and last.reward == 0.0


def test_bad_environment_arguments_are_named():
    with pytest.raises(ValueError, match="env.args.syntax must be one of tags, brackets, got 'xml'"):
        CalculatorEnv(syntax="xml")
    with pytest.raises(ValueError, match="env.args.max_calls"):
        CalculatorEnv(max_calls=-1)


def test_arith_tool_task_needs_the_environment_and_reads_arith_problems():
    with pytest.raises(ConfigError, match="data.task=arith_tool .* `env.fn=asyncrl:arith_tool`"):
        load_config(None, ["data.task=arith_tool"])
    with pytest.raises(ConfigError, match="data.ops"):
        load_config(None, ["data.task=arith_tool", "env.fn=asyncrl:arith_tool", "data.ops=*"])
    cfg = load_config(None, ["data.task=arith_tool", "env.fn=asyncrl:arith_tool", "data.digits=5", "data.ops=+"])
    source = make_source(cfg.data)
    assert isinstance(source, ArithSource)
    problem = source.train(3)
    assert "+" in problem.prompt and problem.prompt.endswith("=")
    a, b = problem.prompt.rstrip("=").split("+")
    assert int(problem.answer) == int(a) + int(b)


def test_shipped_config_loads():
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parents[3] / "configs" / "arith_tool.yaml", [])
    assert (cfg.model.path, cfg.data.task, cfg.env.fn, cfg.env.args) == (
        "builtin:tiny-tool", "arith_tool", "asyncrl:arith_tool", {"syntax": "brackets"}
    )  # fmt: skip


def test_tool_vocabulary_extends_the_arithmetic_one_and_writes_one_token_per_character():
    base, tool = make_tokenizer(), make_tokenizer(ARITH_ALPHABET + TOOL_ALPHABET)
    assert len(tool) == len(base) + len(TOOL_ALPHABET)
    assert base("12+3=")["input_ids"] == tool("12+3=")["input_ids"]  # the base characters keep their ids
    ids = tool("[12+3]{15}", add_special_tokens=False)["input_ids"]
    assert len(ids) == 10 and tool.decode(ids) == "[12+3]{15}"


def test_warm_up_examples_mask_the_calculator_result():
    tokenizer = make_tokenizer(ARITH_ALPHABET + TOOL_ALPHABET)
    assert calc_text("12+3=") == "[12+3]"
    row, labels = _example(tokenizer, "12+3=", "15", use_tool=True)
    assert tokenizer.decode(row, skip_special_tokens=True) == "12+3=[12+3]{15}15"
    learned = tokenizer.decode([t for t, label in zip(row, labels) if label != -100], skip_special_tokens=True)
    assert learned == "[12+3]15"  # the prompt and the `{15}` observation carry no loss
    row, labels = _example(tokenizer, "12+3=", "15", use_tool=False)
    assert tokenizer.decode(row, skip_special_tokens=True) == "12+3=15" and labels[-1] == tokenizer.eos_token_id


def test_tool_variant_is_registered_without_touching_the_other_recipes():
    assert "tiny-tool" in BUILTIN_MODELS and "tiny-tool" in TOOL_RECIPES
    assert tool_fingerprint(TOOL_RECIPES["tiny-tool"]) != tool_fingerprint(ToolRecipe(tool_share=0.5))
    # the cached tiny and micro models stay valid: their fingerprints are fixed by their recipes alone
    assert recipe_fingerprint(RECIPES["tiny"]) == "dfb62fee4292"
    assert recipe_fingerprint(RECIPES["micro"]) == "b6c6b4e34bd0"
