"""Reward functions: exact match (built-in tasks) and math-verify equivalence (datasets). Both return 1.0 or 0.0.

`math_verify_reward` runs in any thread: math-verify's own timeouts use `signal.alarm`, which only works in the main
thread, so they are disabled (`parsing_timeout=None`, `timeout_seconds=None`). What they guarded against is a
prediction whose exact value is astronomically large (`\\boxed{9^{9^{9^{9}}}}` makes sympy compute forever);
`_too_large` rejects those before comparing. Any exception inside math-verify scores 0.0: a bad response must
never stop the caller. math-verify (and sympy) are imported on first use, so importing this module stays cheap.
"""

from __future__ import annotations

import math
import re
from functools import lru_cache
from typing import Any

# A prediction whose estimated size exceeds this many decimal digits scores 0 without being compared.
_MAX_DIGITS = 10_000.0
# sympy evaluates a binomial while parsing (\binom{200000}{100000}: 3 s; ten times larger: minutes), before
# `_too_large` can look at it: a binomial with an argument of 5 digits or more scores 0 unparsed.
_HUGE_BINOMIAL = re.compile(r"\\[dt]?binom\s*\{[^{}]*\d{5}|\\[dt]?binom\s*\{[^{}]*\}\s*\{[^{}]*\d{5}")
THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
"""A comma between digits that separates thousands (`1,000`), not a decimal or list comma (`12,34`, `1,2`)."""


def final_answer_text(response_text: str) -> str:
    """The part of a response that holds its final answer: after its last `####` (GSM8K's convention, with
    thousands separators removed, so `#### 1,000` reads 1000 whatever came before), else the whole response."""
    if "####" not in response_text:
        return response_text
    return THOUSANDS_COMMA.sub("", response_text.rsplit("####", 1)[1].strip())


def exact_match_reward(response_text: str, answer: str) -> float:
    """1.0 if the response, stripped of surrounding whitespace, is exactly `answer`; else 0.0."""
    return 1.0 if response_text.strip() == answer else 0.0


@lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> list[Any]:
    from math_verify import parse

    # A bare reference such as `72`, `x^2+1` or `(1, 2)` parses as intended only inside math delimiters.
    text = answer if "$" in answer or "\\boxed" in answer else f"${answer}$"
    return parse(text, parsing_timeout=None) or parse(answer, parsing_timeout=None)


def _digits(expr: Any) -> float:
    """Rough upper estimate of the decimal digits needed to hold `expr` exactly (inf when out of reach)."""
    from sympy import Add, Float, Integer, Mul, Pow, Rational, factorial

    if isinstance(expr, Integer):
        return math.log10(abs(int(expr))) if expr != 0 else 0.0
    if isinstance(expr, Rational):
        return max(_digits(Integer(expr.p)), _digits(Integer(expr.q)))
    if isinstance(expr, Float):
        value = abs(float(expr))
        return 0.0 if value == 0.0 else abs(math.log10(value))
    if isinstance(expr, Pow):
        base, exponent = _digits(expr.base), _digits(expr.exp)
        if exponent > 7:  # |exponent| above 1e7
            return 0.0 if expr.base in (0, 1, -1) else math.inf
        size = float(expr.exp) if isinstance(expr.exp, (Integer, Rational, Float)) else 10.0**exponent
        return abs(size) * max(base, math.log10(2))
    if isinstance(expr, factorial):
        n = _digits(expr.args[0])
        return math.inf if n > 7 else 10.0**n * max(n, 1.0)
    args = [_digits(arg) for arg in getattr(expr, "args", ())]
    if isinstance(expr, Mul):
        return sum(args)
    if isinstance(expr, Add):
        return max(args, default=0.0) + 1.0
    return max(args, default=0.0)


def _too_large(predictions: list[Any]) -> bool:
    return any(not isinstance(p, str) and _digits(p) > _MAX_DIGITS for p in predictions)


def math_verify_reward(response_text: str, answer: str) -> float:
    """1.0 if math-verify finds the response's final answer equivalent to the reference `answer`; else 0.0.

    The reference is parsed as math (`72`, `\\frac{1}{2}`, `x^2+1`); the response is free text whose last
    expression or `\\boxed{...}` is extracted (`The answer is 72`, `\\boxed{72}` both match `72`), or, when it
    has one, the text after its last `####` (`final_answer_text`).
    """
    from math_verify import parse, verify

    try:
        if _HUGE_BINOMIAL.search(response_text):
            return 0.0
        gold = _parse_gold(answer)
        predicted = parse(final_answer_text(response_text), parsing_timeout=None)
        if not gold or not predicted or _too_large(predicted):
            return 0.0
        return 1.0 if verify(gold, predicted, timeout_seconds=None) else 0.0
    except Exception:  # a process boundary for untrusted model output: score it wrong, never crash the caller
        return 0.0
