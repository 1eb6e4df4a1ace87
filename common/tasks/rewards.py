"""Reward functions: exact match (built-in tasks) and the math reward (datasets). Both return 1.0 or 0.0.

As `reward.fn` specs (common/reward_fns.py) they are `asyncrl:arith` (`arith_reward`) and `asyncrl:math`
(`math_reward`), called as every reward function is: `fn(response, answer, row)`.

`math_verify_reward(response, reference)` reads the response's FINAL ANSWER and never evaluates what the response
(or the reference) writes as an expression: `13 + 13` is not an answer to "What is 13 + 13?" (reference 26).

1. Final-answer text (`final_answer_text`): the content of the response's last `\\boxed{...}`; else the text after
   its last `####` (GSM8K's convention); else the whole response.
2. Numeric reference (`numeric_reference`): a reference that is one number, optionally inside `$...$` or
   `\\boxed{}`: an integer or decimal (`-3`, `0.5`, `.5`), with thousands commas (`1,000`, `1,234.5`), a fraction
   (`3/4`, `\\frac{3}{4}`, `\\dfrac`, `\\tfrac`), or a percentage (`50%`, `50\\%`). Scored by NUMBER:
   - the final answer is the LAST number of the final-answer text (`last_number`), compared with the reference by
     exact rational equality (`26` = `26.0` = `\\frac{52}{2}` as a reference; `0.5` = `1/2` = `\\frac{1}{2}`);
   - a number is ASCII digits with an optional unary minus (`-5`, not the binary minus of `13-5`), a decimal
     part, and commas that count as thousands separators only in groups of three (`1,000`, LaTeX's `1{,}000` and
     `1\\,000` read 1000; in `1,2,3` or `12,34` the last group is the number: 3, 34). Text around it is ignored:
     `$26`, `26 apples`, `26.`, `26!`;
   - a percent sign is a unit: `50%` reads 50, never 0.5, in the response and in the reference alike;
   - a fraction `a/b` or `\\frac{a}{b}` counts as ONE number only in lowest terms with b > 1 (`1/2`, `-\\frac{3}{4}`);
     otherwise it is a division, and its last number is the denominator: `52/2` (and `52 / 2`) reads 2, so
     restating "What is 52 / 2?" never scores for 26. A reduced fraction matches any equal reference (`1/2` = `0.5`);
   - a number right after `^` or `_` is an exponent or subscript, not an answer (`26 cm^2` reads 26);
   - a number of more than `_MAX_NUMBER_CHARS` characters is no answer (no huge integer is ever built).
   Consequences, by design: `13 + 13`, `13 + 13 = ?`, `The answer is 2+24` and `26 ... 13 + 13` score 0 for 26
   (their last number is 13 or 24); `26`, `The answer is 26.`, `\\boxed{26}` (even followed by more text),
   `#### 26`, `26.0` and `The sum is 26!` score 1. A response that answers and then restates the question
   (`26 = 13 + 13`) scores 0: a policy learns to end with its answer, `\\boxed{}` it, or write `#### answer`.
   Scientific notation (`2.6e1`) and numbers in words are not read.
3. Any other reference (`\\frac{\\sqrt{3}}{2}`, `x^2+1`, `(1, 2)`, `[1, 2)`, `\\{1,2,3\\}`, `\\pi`) goes to
   math-verify, which is what it is for: equivalent forms of LaTeX math. Both sides are extracted with
   `LatexExtractionConfig` only, so math must be written in `$...$`, `\\(...\\)`, `\\[...\\]` or `\\boxed{}`
   (a `####` answer is wrapped in `$...$`). Symbolic equivalence is the contract there: an expression equal to
   the reference scores 1, so prefer numeric references wherever the answer is a number.

Untrusted text is data. The numeric path uses regular expressions, `int` and `fractions.Fraction` only. math-verify's
default extraction includes `ExprExtractionConfig`, whose matches go to `sympy.parse_expr` (Python `eval` on
transformed text); it is never used here, for the response or the reference. Its LaTeX path builds sympy objects from
an ANTLR parse tree; the one place it still reaches sympy's string parser is `sympy.Number(token)` on a lexer number
token (digits, one `.`, an optional `E` exponent: `Integer (26 )`), which holds no name and no call
(`tests/unit/common/test_reward_safety.py` records every string that reaches the parser).

`math_verify_reward` runs in any thread: math-verify's own timeouts use `signal.alarm`, which only works in the main
thread, so they are disabled (`parsing_timeout=None`, `timeout_seconds=None`). What they guarded against is a
prediction whose exact value is astronomically large (`\\boxed{9^{9^{9^{9}}}}` makes sympy compute forever);
`_too_large` rejects those before comparing. Any exception inside math-verify scores 0.0: a bad response must
never stop the caller. math-verify (and sympy) are imported on first use, so importing this module stays cheap.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from functools import lru_cache
from typing import Any

# A prediction whose estimated size exceeds this many decimal digits scores 0 without being compared.
_MAX_DIGITS = 10_000.0
# A number token longer than this (characters) is not an answer: no huge integer is ever converted.
_MAX_NUMBER_CHARS = 1_000
# sympy evaluates a binomial while parsing (\binom{200000}{100000}: 3 s; ten times larger: minutes), before
# `_too_large` can look at it: a binomial with an argument of 5 digits or more scores 0 unparsed.
_HUGE_BINOMIAL = re.compile(r"\\[dt]?binom\s*\{[^{}]*\d{5}|\\[dt]?binom\s*\{[^{}]*\}\s*\{[^{}]*\d{5}")
THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
"""A comma between digits that separates thousands (`1,000`), not a decimal or list comma (`12,34`, `1,2`)."""

# One number of a text. Alternatives, in order: a LaTeX fraction, a slash fraction, a plain number (digits and
# commas, then an optional decimal part). The minus is unary only where it does not follow an operand (`13-5` is a
# subtraction, `is -5` a negative number). Every part is a simple loop over a character class: linear time.
_NUMBER = re.compile(
    r"(?P<minus>(?<![\w)\]}])[-\u2212])?"
    r"(?:\\[dt]?frac\s*\{\s*(?P<frac_num>-?[0-9]+)\s*\}\s*\{\s*(?P<frac_den>[0-9]+)\s*\}"
    r"|(?P<num>[0-9]+)/(?P<den>[0-9]+)"
    r"|(?P<plain>[0-9][0-9,]*(?:\.[0-9]+)?|\.[0-9]+))"
)
_THOUSANDS_GROUPS = re.compile(r"[0-9]{1,3}(?:,[0-9]{3})+")
_LATEX_THOUSANDS = re.compile(r"(?<=[0-9])(?:\{,\}|\\,)(?=[0-9]{3})")  # `1{,}000`, `1\,000`: LaTeX's separators
_BOXED = re.compile(r"\\boxed\s*\{")
_BRACE = re.compile(r"[{}]")
_PERCENT_SUFFIX = re.compile(r"\s*\\?%\Z")
_LATEX_DELIMITERS = ("$", "\\(", "\\[", "\\boxed")


def exact_match_reward(response_text: str, answer: str) -> float:
    """1.0 if the response, stripped of surrounding whitespace, is exactly `answer`; else 0.0."""
    return 1.0 if response_text.strip() == answer else 0.0


# --- numbers --------------------------------------------------------------------------------------------------------


def _last_boxed_content(text: str) -> str | None:
    """What the last `\\boxed{` of `text` encloses (to its matching brace, or to the end if unclosed); None if none."""
    starts = [match.end() for match in _BOXED.finditer(text)]
    if not starts:
        return None
    depth = 1
    for brace in _BRACE.finditer(text, starts[-1]):
        depth += 1 if brace[0] == "{" else -1
        if depth == 0:
            return text[starts[-1] : brace.start()]
    return text[starts[-1] :]


def final_answer_text(response_text: str) -> str:
    """The part of a response that holds its final answer: the content of its last `\\boxed{...}`, else the text after
    its last `####` (GSM8K's convention), else the whole response."""
    boxed = _last_boxed_content(response_text)
    if boxed is not None:
        return boxed
    if "####" in response_text:
        return response_text.rsplit("####", 1)[1]
    return response_text


def _plain_value(token: str, *, strict: bool) -> Fraction | None:
    """The value of a plain number token (`1,000`, `12.5`, `.5`). Commas are thousands separators only in groups of
    three; otherwise the token is a list and its last item is the number, or (`strict`, for a reference) no number."""
    integer_part, dot, decimals = token.rstrip(",").partition(".")
    if "," in integer_part and not _THOUSANDS_GROUPS.fullmatch(integer_part):
        if strict:
            return None
        integer_part = integer_part.rsplit(",", 1)[1]
    return Fraction(integer_part.replace(",", "") + dot + decimals) if integer_part or decimals else None


def _match_value(match: re.Match[str], *, strict: bool) -> Fraction | None:
    """The number one `_NUMBER` match stands for (see the module docstring); None if it is none.

    `strict` (a reference): any fraction counts with its value and a comma must separate thousands. Otherwise (a
    response): a fraction counts as one number only in lowest terms with a denominator above 1, else it is a division
    whose last number is the denominator."""
    if len(match[0]) > _MAX_NUMBER_CHARS:
        return None
    sign = -1 if match["minus"] else 1
    numerator, denominator = match["frac_num"] or match["num"], match["frac_den"] or match["den"]
    if numerator is None:
        value = _plain_value(match["plain"], strict=strict)
        return None if value is None else sign * value
    top, bottom = int(numerator), int(denominator)
    if strict:
        return None if bottom == 0 else sign * Fraction(top, bottom)
    if bottom > 1 and math.gcd(top, bottom) == 1:
        return sign * Fraction(top, bottom)
    return Fraction(bottom)  # a division: its last number is the denominator


def last_number(text: str) -> Fraction | None:
    """The last number written in `text` (the final answer of a response's final-answer text); None if none.

    Exponents and subscripts (a number right after `^` or `_`, `^{` or `_{`) are skipped."""
    text = _LATEX_THOUSANDS.sub(",", text)
    last: re.Match[str] | None = None
    for match in _NUMBER.finditer(text):
        before = text[max(0, match.start() - 2) : match.start()]
        if not (before.endswith(("^", "_")) or before in ("^{", "_{")):
            last = match
    return None if last is None else _match_value(last, strict=False)


def _unwrapped(reference: str) -> str:
    """A reference without the math delimiters around it: `$...$`, `$$...$$`, `\\boxed{...}`, surrounding space."""
    text = reference.strip()
    for opening, closing in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(text) > len(opening) + len(closing) and text.startswith(opening) and text.endswith(closing):
            text = text[len(opening) : -len(closing)].strip()
            break
    boxed = _BOXED.match(text)
    if boxed and text.endswith("}") and _last_boxed_content(text) == text[boxed.end() : -1]:
        text = text[boxed.end() : -1].strip()
    return text


@lru_cache(maxsize=4096)
def numeric_reference(reference: str) -> Fraction | None:
    """The value of a reference that is one number (integer, decimal, thousands commas, fraction, percentage; see the
    module docstring), or None if the reference is anything else and so is math-verify's to judge."""
    text = _LATEX_THOUSANDS.sub(",", _PERCENT_SUFFIX.sub("", _unwrapped(reference)))
    match = _NUMBER.fullmatch(text)
    return None if match is None else _match_value(match, strict=True)


def numeric_reward(response_text: str, reference_value: Fraction) -> float:
    """1.0 if the last number of the response's final-answer text equals `reference_value` exactly; else 0.0."""
    return 1.0 if last_number(final_answer_text(response_text)) == reference_value else 0.0


# --- math-verify, for references that are not one number ------------------------------------------------------------


def _latex_parse(text: str) -> list[Any]:
    """math-verify's parse of `text` with LaTeX extraction only (never `ExprExtractionConfig`, whose matches reach
    `sympy.parse_expr`)."""
    from math_verify import LatexExtractionConfig, parse

    return parse(text, extraction_config=[LatexExtractionConfig()], parsing_timeout=None)


@lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> list[Any]:
    # A bare reference such as `x^2+1` or `(1, 2)` is extracted as LaTeX only inside math delimiters.
    return _latex_parse(answer if any(d in answer for d in _LATEX_DELIMITERS) else f"${answer}$")


def _math_verify_text(response_text: str) -> str:
    """The response text math-verify extracts from: after its last `####` (in `$...$` when it has no LaTeX
    delimiters), else the whole response (math-verify picks its final `\\boxed{}` or math environment itself)."""
    if "####" not in response_text:
        return response_text
    answer = response_text.rsplit("####", 1)[1].strip()
    return answer if any(d in answer for d in _LATEX_DELIMITERS) else f"${answer}$"


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


def latex_equivalence_reward(response_text: str, answer: str) -> float:
    """1.0 if math-verify finds the response's final LaTeX answer equivalent to the LaTeX reference `answer`."""
    from math_verify import verify

    try:
        if _HUGE_BINOMIAL.search(response_text) or _HUGE_BINOMIAL.search(answer):
            return 0.0
        gold = _parse_gold(answer)
        predicted = _latex_parse(_math_verify_text(response_text))
        if not gold or not predicted or _too_large(predicted) or _too_large(gold):
            return 0.0
        return 1.0 if verify(gold, predicted, timeout_seconds=None) else 0.0
    except Exception:  # a process boundary for untrusted model output: score it wrong, never crash the caller
        return 0.0


def math_verify_reward(response_text: str, answer: str) -> float:
    """The math reward of a dataset row: 1.0 if the response answers the reference `answer`, else 0.0.

    A numeric reference (`72`, `1,000`, `0.5`, `3/4`, `\\frac{3}{4}`, `50%`) is matched by the response's final
    answer as a number (`numeric_reward`): `The answer is 72`, `\\boxed{72}`, `#### 72` score 1; `70 + 2` does not.
    Any other reference (`\\frac{\\sqrt{3}}{2}`, `(1, 2)`) is compared by math-verify on LaTeX only
    (`latex_equivalence_reward`). See the module docstring for the exact rules.
    """
    reference_value = numeric_reference(answer)
    if reference_value is not None:
        return numeric_reward(response_text, reference_value)
    return latex_equivalence_reward(response_text, answer)


# --- as reward functions (`reward.fn`: `asyncrl:arith`, `asyncrl:math`; common/reward_fns.py) -----------------------


def arith_reward(response: str, answer: str, row: dict[str, Any]) -> float:
    """`asyncrl:arith`: the `arith` task's exact-match reward as a reward function (`row` is not read)."""
    return exact_match_reward(response, answer)


def math_reward(response: str, answer: str, row: dict[str, Any]) -> float:
    """`asyncrl:math`: the datasets' math reward (`math_verify_reward`) as a reward function (`row` is not read)."""
    return math_verify_reward(response, answer)


def reward_warm_up() -> None:
    """Import math-verify and sympy (about a second cold) by scoring one LaTeX answer: a reward process calls this
    at load (common/reward_fns.py: `warm_up`), so no first call spends its timeout on imports."""
    latex_equivalence_reward("$\\frac{\\sqrt{3}}{2}$", "\\frac{\\sqrt{3}}{2}")
