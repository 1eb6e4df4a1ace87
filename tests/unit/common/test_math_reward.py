"""The math reward cannot be gamed (issue 26): a numeric reference is matched by the response's final answer as a
number, never by an expression the grader evaluates; LaTeX references keep math-verify's equivalence."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest

from common.config import DataConfig
from common.tasks import DatasetError, make_source
from common.tasks.rewards import final_answer_text, last_number, math_verify_reward, numeric_reference

# "What is 13 + 13?" (reference 26): a response that restates the question or writes an expression scores 0.
GAMING_RESPONSES = [
    "13 + 13",  # the question restated
    "13 + 13 = ?",
    "13+13",  # the expression with no result
    "26 ... 13 + 13",  # a number, then an expression: the final answer is the last number, 13
    "26. Check: 13 + 13",
    "26 = 13 + 13",  # answering then restating ends on 13
    "The answer is 2+24",  # another expression equal to 26: its last number is 24
    "\\boxed{13+13}",
    "\\boxed{2 \\times 13}",
    "#### 13 + 13",
    "52/2",  # a division is not a fraction: its last number is the denominator
    "\\frac{52}{2}",
    "26/1",
    "-26",
    "2.6e1",  # scientific notation is not read
    "no idea",
    "",
]
RIGHT_RESPONSES = [
    "26",
    "The answer is 26.",
    "\\boxed{26}",
    "\\boxed{26} because 13 + 13 = 26, and not 25.",  # the boxed answer wins over later text
    "#### 26",
    "so 13 + 13 = 26\n#### 26",
    "26.0",
    "The sum is 26!",
    "$26$ apples",
    "13 + 13 = 26",
    "The area is 26 cm^2.",  # an exponent is not an answer
    "x = 26",
    "25, no: 26",
]


@pytest.mark.parametrize("response", GAMING_RESPONSES)
def test_expressions_and_restated_questions_score_0(response: str) -> None:
    assert math_verify_reward(response, "26") == 0.0


@pytest.mark.parametrize("response", RIGHT_RESPONSES)
def test_a_final_answer_of_26_scores_1(response: str) -> None:
    assert math_verify_reward(response, "26") == 1.0


def test_final_answer_text_prefers_the_last_box_then_the_last_hash_mark() -> None:
    assert final_answer_text("\\boxed{1} then \\boxed{\\frac{1}{2}} then #### 3") == "\\frac{1}{2}"
    assert final_answer_text("a \\boxed{ {x} + 2 } b") == " {x} + 2 "
    assert final_answer_text("unclosed \\boxed{26 and more") == "26 and more"
    assert final_answer_text("a #### 1 #### 2") == " 2"
    assert final_answer_text("plain 7") == "plain 7"


def test_last_number_reads_signs_commas_decimals_and_reduced_fractions() -> None:
    assert last_number("is -5") == -5 and last_number("x=\u22125") == -5 and last_number("13-5") == 5
    assert last_number("13 - 5") == 5 and last_number("(-5)") == -5
    assert last_number("1,000 dollars") == 1000 and last_number("1,234,567.5") == Fraction(2469135, 2)
    assert last_number("\\boxed{1{,}000}") == 1000 and last_number("1\\,000 m") == 1000 and last_number("5\\,cm") == 5
    assert last_number("1,2,3") == 3 and last_number("12,34") == 34 and last_number("done: 26,") == 26
    assert last_number("$.5$") == Fraction(1, 2) and last_number("26.") == 26
    assert last_number("1/2") == Fraction(1, 2) and last_number("-\\frac{3}{4}") == Fraction(-3, 4)
    assert last_number("\\dfrac{ -3 }{ 4 }") == Fraction(-3, 4)
    assert last_number("4/8") == 8 and last_number("\\frac{6}{3}") == 3  # not in lowest terms: a division
    assert last_number("10^{10}") == 10 and last_number("9^{9^{9}}") == 9 and last_number("x_1 = 3") == 3
    assert last_number("50%") == 50 and last_number("no number") is None
    assert last_number("1" * 2_000) is None  # too long to be an answer: never converted


def test_numeric_references_and_what_is_left_to_math_verify() -> None:
    assert numeric_reference("26") == 26 and numeric_reference(" -3 ") == -3 and numeric_reference("\u22123") == -3
    assert numeric_reference("1,000") == 1000 and numeric_reference("0.5") == Fraction(1, 2)
    assert numeric_reference(".5") == Fraction(1, 2) and numeric_reference("4/8") == Fraction(1, 2)
    assert numeric_reference("\\frac{1}{2}") == Fraction(1, 2) and numeric_reference("$5$") == 5
    assert numeric_reference("\\boxed{7}") == 7 and numeric_reference("50%") == 50
    assert numeric_reference("$50\\%$") == 50 and numeric_reference("$1{,}000$") == 1000
    for latex_or_bad in ("12,34", "18 dollars", "x^2+1", "\\frac{\\sqrt{3}}{2}", "(1, 2)", "1/0", "13 + 13", "2^{10}"):
        assert numeric_reference(latex_or_bad) is None, latex_or_bad


def test_equivalent_number_forms_match_exactly() -> None:
    assert math_verify_reward("$\\frac{1}{2}$", "0.5") == 1.0
    assert math_verify_reward("1/2", "0.5") == 1.0
    assert math_verify_reward("0.5", "\\frac{1}{2}") == 1.0
    assert math_verify_reward("\\boxed{0.50}", "1/2") == 1.0
    assert math_verify_reward("1,000", "1000") == 1.0 and math_verify_reward("1000", "1,000") == 1.0
    assert math_verify_reward("0.3333333", "1/3") == 0.0  # exact equality, no rounding
    assert math_verify_reward("0.5", "0.50000001") == 0.0


def test_a_percent_sign_is_a_unit() -> None:
    """`50%` reads 50 on both sides; a response of 0.5 does not answer a reference of 50%."""
    assert math_verify_reward("50%", "50") == 1.0
    assert math_verify_reward("50", "50%") == 1.0
    assert math_verify_reward("\\boxed{50\\%}", "50\\%") == 1.0
    assert math_verify_reward("0.5", "50%") == 0.0
    assert math_verify_reward("50%", "0.5") == 0.0


def test_latex_references_keep_math_verify_equivalence() -> None:
    root3 = "\\frac{\\sqrt{3}}{2}"
    assert math_verify_reward(f"The answer is ${root3}$.", root3) == 1.0
    assert math_verify_reward("\\boxed{\\frac{\\sqrt{3}}{2}}", root3) == 1.0
    assert math_verify_reward("#### \\frac{\\sqrt{3}}{2}", root3) == 1.0  # a `####` answer is read as LaTeX
    assert math_verify_reward("\\boxed{\\frac{\\sqrt{2}}{2}}", root3) == 0.0
    assert math_verify_reward("\\frac{\\sqrt{3}}{2}", root3) == 0.0  # LaTeX outside delimiters is not extracted
    assert math_verify_reward("The interval is $[1, 2)$", "[1, 2)") == 1.0
    assert math_verify_reward("The interval is $(1, 2)$", "[1, 2)") == 0.0
    assert math_verify_reward("\\boxed{\\{3, 1, 2\\}}", "\\{1,2,3\\}") == 1.0
    assert math_verify_reward("$x^2 + 1$", "x^2+1") == 1.0 and math_verify_reward("$x^2 - 1$", "x^2+1") == 0.0


def test_latex_rows_load_when_delimited_and_units_stay_rejected(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    rows = [{"prompt": "p1", "answer": "$\\frac{\\sqrt{3}}{2}$"}, {"prompt": "p2", "answer": "3/4"}]
    rows.append({"prompt": "p3", "answer": "50%"})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    source = make_source(DataConfig(task="jsonl", path=str(path)))
    assert source.reward("\\boxed{\\frac{\\sqrt{3}}{2}}", "$\\frac{\\sqrt{3}}{2}$") == 1.0
    assert source.reward("It is 0.75.", "3/4") == 1.0 and source.reward("\\boxed{50}", "50%") == 1.0
    path.write_text(json.dumps({"prompt": "p", "answer": "18 dollars"}) + "\n", encoding="utf-8")
    with pytest.raises(DatasetError, match="does not read as math"):
        make_source(DataConfig(task="jsonl", path=str(path)))
