"""The calculator environment's own tags (`env.args.tags`, common/tasks/arith_tool.py): a tokenizer that can write
any call syntax uses it literally, through the config, as the built-in model uses `[a+b]` / `{c}`."""

from __future__ import annotations

import pytest

from common.config import load_config
from common.envs import load_env_factory

TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def test_tags_from_the_config_replace_the_syntax() -> None:
    cfg = load_config(None, ["data.task=arith_tool", "env.fn=asyncrl:arith_tool", f"env.args={{tags: {TAGS}}}"])
    env = load_env_factory(cfg.env.fn, cfg.env.args)()
    assert env.stop_strings == ("</tool_call>",)
    assert env.reset({"prompt": "12345+678=", "answer": "13023"}) == "12345+678="
    called = env.step("let me add <tool_call>12345+678</tool_call>")
    assert called.observation == "<tool_response>13023</tool_response>" and not called.done
    assert called.info["tool_calls"] == 1
    answered = env.step("<tool_response> the sum is 13023")
    assert answered.done and answered.reward == 1.0
    assert env.step("<calc>1+2</calc>").reward == 0.0  # the default tags are no call any more: a wrong answer


@pytest.mark.parametrize("tags", [["<a>", "</a>", "<r>"], ["<a>", "", "<r>", "</r>"], "<a></a>"])
def test_malformed_tags_are_refused_naming_the_key(tags) -> None:
    from common.tasks.arith_tool import CalculatorEnv

    with pytest.raises(ValueError, match="env.args.tags"):
        CalculatorEnv(tags=tags)
