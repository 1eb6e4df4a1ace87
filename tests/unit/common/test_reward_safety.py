"""Untrusted text stays data (issue 23, item 3): no response and no dataset answer is ever evaluated as code.

sympy's string parser (`parse_expr`: Python `eval` on transformed text) is what math-verify's default extraction
falls back to. These tests wrap it, and `builtins.eval`, in tripwires while hostile responses and references are
scored, and check that the code they carry never ran (it would create a file in the test's directory).

The one string parse left on math-verify's LaTeX path is `sympy.Number(token)` on an ANTLR number token (digits,
one `.`, an `E` exponent), which sympy turns into `Integer (3 )` and evaluates. The tripwires let exactly that
through (and count it); anything else raises `Evaluated`. A numeric reference never reaches sympy at all.
"""

from __future__ import annotations

import builtins
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import latex2sympy2_extended.latex2sympy2
import math_verify
import math_verify.parser
import pytest
import sympy.parsing
import sympy.parsing.sympy_parser

from common.config import DataConfig
from common.tasks import DatasetError, make_source
from common.tasks.rewards import _parse_gold, math_verify_reward, numeric_reference

# Code without digits, run in the test's working directory if it ever runs.
HOSTILE = [
    "__import__('os').system('touch pwned')",
    "().__class__.__base__.__subclasses__()",
    "[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == 'Popen'][-a]('touch pwned', shell=True)",
    "().__class__.__base__.__subclasses__()[133]('touch pwned1', shell=1)",  # with digits
]
WRAPPED = [wrap.format(code) for code in HOSTILE for wrap in ("{}", "${}$", "\\boxed{{{}}}", "#### {}", "\\[{}\\]")]
# Plain arithmetic, which math-verify's default extraction (`ExprExtractionConfig`) would hand to `parse_expr`.
ARITHMETIC = ["What is 13 + 13? 13 + 13", "The answer is (2 + 3) * 4", "so 9^9^9^9"]
ROOT3 = "\\frac{\\sqrt{3}}{2}"
NUMBER_TOKEN = re.compile(r"[0-9]*\.?[0-9]+(E[-+]?[0-9]+)?")
NUMBER_CODE = re.compile(r"Integer \([0-9]+ \)|Float \('[0-9]*\.?[0-9]+(E[-+]?[0-9]+)?' \)")
# (module, name, what may pass: None for nothing). sympify(str) looks up sympy_parser.parse_expr at call time.
PARSERS: list[tuple[ModuleType, str, re.Pattern[str] | None]] = [
    (sympy.parsing.sympy_parser, "parse_expr", NUMBER_TOKEN),
    (sympy.parsing.sympy_parser, "eval_expr", NUMBER_CODE),
    (builtins, "eval", NUMBER_CODE),
    (sympy.parsing, "parse_expr", None),
    (math_verify.parser, "parse_expr", None),  # math-verify's ExprExtractionConfig path
    (latex2sympy2_extended.latex2sympy2, "parse_expr", None),
]


class Evaluated(BaseException):
    """Raised by a tripwire: a BaseException, so that no `except Exception` on the way can hide it."""


def _clear_caches() -> None:
    """Cached parses would let a second call skip the parser: every call below parses afresh."""
    for cached in (math_verify.parser.parse_expr_cached, math_verify.parser.parse_latex_cached, _parse_gold):
        cached.cache_clear()
    numeric_reference.cache_clear()


def _warm_up() -> None:
    """Import everything scoring touches before the tripwires go in (a first import runs module code)."""
    for response in WRAPPED + ["\\boxed{26}", f"${ROOT3}$"]:
        for reference in ("26", ROOT3, HOSTILE[0]):
            math_verify_reward(response, reference)


Calls = list[tuple[str, object]]


def _tripwire(name: str, real: Callable[..., object], allowed: re.Pattern[str] | None, calls: Calls) -> object:
    def guarded(*args: object, **kwargs: object) -> object:
        text = args[0] if args else kwargs.get("s", kwargs.get("code"))
        calls.append((name, text))
        if allowed is None or not isinstance(text, str) or not allowed.fullmatch(text):
            raise Evaluated(f"{name}({text!r})")
        return real(*args, **kwargs)

    return guarded


def _number_literals(calls: Calls) -> bool:
    """Whether every recorded parse was of a number token and every `eval` built an Integer or a Float."""
    return all(
        isinstance(text, str) and (NUMBER_TOKEN.fullmatch(text) or NUMBER_CODE.fullmatch(text)) for _, text in calls
    )


@pytest.fixture
def tripwires(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Calls]:
    """Every call of sympy's string parser or of `eval` is recorded; any but a number literal raises `Evaluated`."""
    monkeypatch.chdir(tmp_path)
    _warm_up()
    _clear_caches()
    calls: Calls = []
    for module, name, allowed in PARSERS:
        monkeypatch.setattr(module, name, _tripwire(f"{module.__name__}.{name}", getattr(module, name), allowed, calls))
    yield calls
    assert not list(tmp_path.glob("pwned*")), "hostile code ran"


def test_the_tripwires_catch_math_verifys_default_extraction(tripwires: Calls) -> None:
    """The control: math-verify's default config hands `13 + 13` to sympy's parser, and the tripwire stops it."""
    with pytest.raises(Evaluated, match="math_verify.parser.parse_expr"):
        math_verify.parse("What is 13 + 13? 13 + 13", parsing_timeout=None)
    with pytest.raises(Evaluated, match="sympy_parser.parse_expr"):
        sympy.sympify("__import__('os').system('touch pwned')")


def test_the_latex_path_parses_number_tokens_only(tripwires: Calls) -> None:
    """What math-verify's LaTeX path hands sympy's parser: number tokens, each evaluated as an Integer or a Float."""
    assert math_verify_reward("\\boxed{\\frac{\\sqrt{3}}{2}}", ROOT3) == 1.0
    assert math_verify_reward("\\boxed{1E5 + 0.5 + 12\\% + \\frac{\\sqrt{3}}{2}}", ROOT3) == 0.0
    evaluated = {text for name, text in tripwires if name == "builtins.eval"}
    assert {"Float ('1E5' )", "Integer (3 )", "Integer (2 )"} <= evaluated and _number_literals(tripwires)


@pytest.mark.parametrize("response", WRAPPED + ARITHMETIC)
def test_hostile_responses_score_0_unevaluated(tripwires: Calls, response: str) -> None:
    assert math_verify_reward(response, "26") == 0.0
    assert tripwires == []  # a numeric reference never reaches sympy
    assert math_verify_reward(response, ROOT3) == 0.0
    assert math_verify_reward(response, "[1, 2)") == 0.0
    assert math_verify_reward(response, "\\{1, 2\\}") == 0.0
    assert _number_literals(tripwires)


@pytest.mark.parametrize("reference", WRAPPED)
def test_hostile_references_score_0_unevaluated(tripwires: Calls, reference: str) -> None:
    assert numeric_reference(reference) is None
    for response in ("\\boxed{26}", f"${ROOT3}$", "#### 26", "26"):
        assert math_verify_reward(response, reference) == 0.0
    assert _number_literals(tripwires)


def test_numeric_references_never_reach_sympy(tripwires: Calls) -> None:
    """Digits and all: a numeric reference is scored with regular expressions and fractions only."""
    assert math_verify_reward("\\boxed{26}", "26") == 1.0
    assert math_verify_reward("$\\frac{1}{2}$", "0.5") == 1.0
    assert math_verify_reward("13 + 13", "26") == 0.0
    assert math_verify_reward("__import__('os').system('touch pwned26'); 26", "26") == 1.0  # text, read as text
    assert math_verify_reward("\\boxed{__import__('os').system('touch pwned') + 13}", "26") == 0.0
    assert tripwires == []


def test_hostile_dataset_rows_load_as_data(tripwires: Calls, tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": "p", "answer": code}) + "\n" for code in WRAPPED), encoding="utf-8")
    with pytest.raises(DatasetError):  # whatever the verdict on each row, none is run
        make_source(DataConfig(task="jsonl", path=str(path)))
