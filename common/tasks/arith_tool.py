"""A calculator environment for arithmetic problems (`env.fn=asyncrl:arith_tool`; issue 21 item 4).

The model may call a calculator by writing a call; the turn ends at the call's closing tag and the environment
answers the result as an observation (loss mask 0). A turn without a call is the final answer: the reward is 1.0
when its last integer equals the problem's answer (exact match), else 0.0, and the episode ends. Two syntaxes
(`env.args.syntax`):

    tags      `<calc>1234+5678</calc>` -> `<result>6912</result>`   (tokenizers that can write the tags)
    brackets  `[1234+5678]` -> `{6912}`                              (builtin:tiny-tool, common/builtin_tool.py)

or any four strings of your own (`env.args.tags: [call_open, call_close, result_open, result_close]`, e.g.
`["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]`), which replace the syntax's.

Problems are the leased rows of the task (`data.task=arith_tool`: the `arith` problems, with `data.digits=5` for
sums the built-in model cannot do in its head): `problem["prompt"]` (e.g. `12345+678=`) and `problem["answer"]`.
`instructions` is put before the prompt (empty by default). A malformed call gets the result `error`; calls past
`max_calls` count as a final answer.
"""

from __future__ import annotations

import re
from typing import Any

from common.envs import StepResult

SYNTAXES: dict[str, tuple[str, str, str, str]] = {
    "tags": ("<calc>", "</calc>", "<result>", "</result>"),
    "brackets": ("[", "]", "{", "}"),
}
"""Call open/close and result open/close strings of each `syntax`."""
_INTEGER = re.compile(r"-?\d+")


def calculate(expression_match: re.Match[str]) -> int:
    """The value of a matched `a op b` (op `+`, `-` or `*`; operands of at most 30 digits)."""
    a, op, b = int(expression_match.group(1)), expression_match.group(2), int(expression_match.group(3))
    return a + b if op == "+" else a - b if op == "-" else a * b


class CalculatorEnv:
    """See the module docstring. One instance per episode."""

    def __init__(
        self, instructions: str = "", syntax: str = "tags", max_calls: int = 4, tags: list[str] | None = None
    ) -> None:
        if tags is not None and (
            isinstance(tags, str) or len(tags) != 4 or not all(isinstance(t, str) and t for t in tags)
        ):
            raise ValueError(f"CalculatorEnv: env.args.tags must be 4 non-empty strings, got {tags!r}"[:300])
        if syntax not in SYNTAXES:
            raise ValueError(f"CalculatorEnv: env.args.syntax must be one of {', '.join(SYNTAXES)}, got {syntax!r}")
        if not isinstance(max_calls, int) or max_calls < 0:
            raise ValueError(f"CalculatorEnv: env.args.max_calls must be an int >= 0, got {max_calls!r}")
        self.instructions, self.max_calls = instructions, max_calls
        self.open, self.close, self.result_open, self.result_close = tuple(tags) if tags else SYNTAXES[syntax]
        self.stop_strings = (self.close,)
        body = r"\s*(-?\d{1,30})\s*([+\-*])\s*(-?\d{1,30})\s*"
        self._call = re.compile(re.escape(self.open) + body + re.escape(self.close) + r"\s*$")
        self.answer = ""
        self.calls = 0

    def reset(self, problem: dict[str, Any]) -> str:
        self.answer = str(problem["answer"]).strip()
        self.calls = 0
        return f"{self.instructions}{problem['prompt']}"

    def step(self, model_text: str) -> StepResult:
        if self.open in model_text and model_text.rstrip().endswith(self.close) and self.calls < self.max_calls:
            self.calls += 1
            match = self._call.search(model_text)
            result = str(calculate(match)) if match else "error"
            return StepResult(f"{self.result_open}{result}{self.result_close}", 0.0, False, {"tool_calls": 1})
        for tag in (self.result_open, self.result_close):
            model_text = model_text.replace(tag, " ")
        numbers = _INTEGER.findall(model_text)
        correct = bool(numbers) and numbers[-1].lstrip("0") == self.answer.lstrip("0")
        return StepResult(None, 1.0 if correct else 0.0, True, {"tool_calls": 0, "correct": correct})
