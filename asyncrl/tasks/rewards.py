"""Reward functions: exact match (built-in tasks) and math-verify equivalence (datasets). Both return 1.0 or 0.0.

`math_verify_reward` runs in any thread: math-verify's own timeouts use `signal.alarm`, which only works in the main
thread, so they are disabled (`parsing_timeout=None`, `timeout_seconds=None`). What they guarded against is a
prediction whose exact value is astronomically large (`\\boxed{9^{9^{9^{9}}}}` makes sympy compute forever);
`_too_large` rejects those before comparing. Any exception inside math-verify scores 0.0: a bad response must
never stop the caller. math-verify (and sympy) are imported on first use, so importing this module stays cheap.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

# A prediction whose estimated size exceeds this many decimal digits scores 0 without being compared.
_MAX_DIGITS = 10_000.0


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
    expression or `\\boxed{...}` is extracted (`The answer is 72`, `\\boxed{72}` both match `72`).
    """
    from math_verify import parse, verify

    try:
        gold = _parse_gold(answer)
        predicted = parse(response_text, parsing_timeout=None)
        if not gold or not predicted or _too_large(predicted):
            return 0.0
        return 1.0 if verify(gold, predicted, timeout_seconds=None) else 0.0
    except Exception:  # a process boundary for untrusted model output: score it wrong, never crash the caller
        return 0.0
