"""Task `jsonl`: a user dataset file, one JSON object per line, scored by the math reward (`common.tasks.rewards`).

Each row needs a non-empty string prompt (`data.prompt_key`) and an answer (`data.answer_key`) that is a string or
a number. The whole file is read and validated when the source is built; every bad row is reported by 1-based line
number in one `DatasetError`. Blank lines are skipped.

GSM8K convention: when an answer string contains `####`, the reference is the text after the last `####`,
stripped, with thousands separators removed from numbers (`...\\n#### 1,000` -> `1000`). Other answers are used
as they are (stripped); numbers are written in fixed point (`1e16` -> `10000000000000000`). A reference that is one
number (`72`, `1,000`, `0.5`, `3/4`, `50%`) is scored by the response's final answer as a number; any other reference
goes to math-verify as LaTeX, and a row whose reference does not score 1 against itself (`18 dollars`, `12,34`, or
LaTeX without delimiters: write `$\\frac{\\sqrt{3}}{2}$`) is a bad row: every reward of it would be 0. Rows are data:
nothing in them is evaluated (see `common.tasks.rewards`).

The rows kept are cached: the first process of a run to build the source parses and validates the file and writes
them to `<cache>/datasets/` ($ASYNCRL_CACHE, else ~/.cache/asyncrl); every later process maps that file and decodes
only the rows it asks for (`common.tasks.rowcache`; a changed file, or a damaged cache entry, is parsed again).

Training stream: index i is row `permutation(seed, epoch)[i % n]` with epoch = i // n, a fresh shuffle per epoch.
Eval set: the first `data.eval_size` rows of a separate fixed permutation. These rows are NOT removed from the
training stream (a dataset has no spare split here): the eval set may overlap the problems trained on.
"""

from __future__ import annotations

import codecs
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from decimal import Decimal
from functools import lru_cache
from pathlib import Path

import numpy as np

from common.tasks import DatasetError, Problem, rowcache
from common.tasks.rewards import THOUSANDS_COMMA, math_verify_reward, numeric_reference

_MAX_REPORTED = 10
_TRAIN_STREAM, _EVAL_STREAM = 0, 1


def reference_answer(raw: str | int | float) -> str:
    """The reference answer of a row: numbers as text, GSM8K `#### answer` extracted, surrounding space stripped."""
    if isinstance(raw, float):  # fixed point: `1e+16` would read as Euler's number plus 16
        return format(Decimal(repr(raw)), "f")
    if not isinstance(raw, str):
        return str(raw)
    if "####" in raw:
        return THOUSANDS_COMMA.sub("", raw.rsplit("####", 1)[1].strip())
    return raw.strip()


def parse_line(line: bytes) -> dict | str:
    """The JSON object one line holds, or a description of what is wrong with it (the cause, with its column).

    Python's `json` reads the numbers: an integer of any length stays exact (`9007199254740993`), a decimal is a float
    (`0.5`). Shared by the `jsonl` and `dataset` tasks, so both read a line the same way."""
    try:
        row = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as err:
        return f"not valid UTF-8 (byte 0x{line[err.start]:02x} at byte {err.start + 1} of the line)"
    except json.JSONDecodeError as err:
        return f"invalid JSON ({err.msg} at column {err.colno})"
    except (ValueError, RecursionError) as err:  # an integer of thousands of digits, nesting thousands deep
        return f"unreadable JSON ({type(err).__name__}: {str(err)[:80]})"
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    return row


def json_lines(lines: Iterable[bytes]) -> Iterator[tuple[int, dict | str]]:
    """(1-based line number, its JSON object or what is wrong with it) of every non-blank line of a JSONL stream; a
    UTF-8 byte order mark at the start is skipped."""
    for line_number, line in enumerate(lines, start=1):
        if line_number == 1:
            line = line.removeprefix(codecs.BOM_UTF8)
        if line.strip():
            yield line_number, parse_line(line)


def _row_problem(row: dict, prompt_key: str, answer_key: str) -> tuple[str, str] | str:
    """(prompt, reference answer) of one row, or a description of what is wrong with it."""
    prompt_field, answer_field = f"{prompt_key!r} (data.prompt_key)", f"{answer_key!r} (data.answer_key)"
    if prompt_key not in row:
        return f"missing field {prompt_field}; the row has: {', '.join(map(str, row)) or 'no fields'}"
    if answer_key not in row:
        return f"missing field {answer_field}; the row has: {', '.join(map(str, row)) or 'no fields'}"
    prompt, raw_answer = row[prompt_key], row[answer_key]
    if not isinstance(prompt, str):
        return f"field {prompt_field} must be a string, got {type(prompt).__name__}"
    problem = check_text(prompt, prompt_field)
    if problem is not None:
        return problem
    answer, problem = answer_problem(raw_answer, answer_field)
    return (prompt, answer) if problem is None else problem


def check_text(text: str, field: str) -> str | None:
    """What is wrong with a prompt text (empty, unpaired surrogates), or None."""
    if not text.strip():
        return f"field {field} is empty"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return f"field {field} holds an unpaired surrogate escape (\\ud800-\\udfff): not text"
    return None


def answer_problem(raw_answer: object, answer_field: str) -> tuple[str, str | None]:
    """(reference answer, None) of a row's raw answer value, or ("", a description of what is wrong with it)."""
    if isinstance(raw_answer, bool) or not isinstance(raw_answer, (str, int, float)):
        return "", f"field {answer_field} must be a string or a number, got {type(raw_answer).__name__}"
    if isinstance(raw_answer, float) and not math.isfinite(raw_answer):
        return "", f"field {answer_field} must be a finite number, got {raw_answer}"
    answer = reference_answer(raw_answer)
    if not answer:
        return "", f"field {answer_field} has an empty reference answer"
    try:
        answer.encode("utf-8")
    except UnicodeEncodeError:
        return "", f"field {answer_field} holds an unpaired surrogate escape (\\ud800-\\udfff): not text"
    if numeric_reference(answer) is None and math_verify_reward(answer, answer) != 1.0:  # ~2 ms a row: not for numbers
        return "", f"the reference answer {answer[:60]!r} does not read as math: every reward of this row would be 0"
    return answer, None


def load_rows(path: str | Path, prompt_key: str, answer_key: str) -> list[tuple[str, str]]:
    """Every (prompt, reference answer) of a JSONL file; DatasetError listing the bad rows if any."""
    file = Path(path).expanduser()
    if file.is_dir():
        raise DatasetError(
            f"dataset file {str(path)!r} is a directory, not a JSONL file (data.path); a directory written by "
            "`datasets` save_to_disk is read by data.task=dataset"
        )
    if not file.is_file():
        what = (
            "does not exist"
            if not file.exists()
            else "is not a regular file (a pipe or a device: every process of a run reads it)"
        )
        raise DatasetError(f"dataset file {str(path)!r} {what} (data.path)")
    if file.suffix.lower() in (".parquet", ".arrow"):  # read line by line as JSON, every line was an invalid row
        raise DatasetError(f"dataset file {str(path)!r} is a {file.suffix} file, not JSONL: data.task=dataset reads it")
    rows: list[tuple[str, str]] = []
    errors: list[str] = []
    with file.open("rb") as lines:
        for line_number, row in json_lines(lines):
            parsed = row if isinstance(row, str) else _row_problem(row, prompt_key, answer_key)
            if isinstance(parsed, str):
                errors.append(f"{path}:{line_number}: {parsed}")
            else:
                rows.append(parsed)
    check_rows(path, rows, errors)
    return rows


def check_rows(path: object, rows: list, errors: list[str]) -> None:
    """Raise DatasetError listing the first invalid rows of `path` (with a count of the rest), or for no rows."""
    if errors:
        shown = "\n  ".join(errors[:_MAX_REPORTED])
        more = f"\n  ... and {len(errors) - _MAX_REPORTED} more" if len(errors) > _MAX_REPORTED else ""
        raise DatasetError(f"{path}: {len(errors)} invalid row(s):\n  {shown}{more}")
    if not rows:
        raise DatasetError(f"{path}: the dataset is empty (no rows)")


@lru_cache(maxsize=4)
def _permutation(size: int, seed: int, stream: int, epoch: int) -> np.ndarray:
    rng = np.random.default_rng(np.random.SeedSequence(seed % 2**64, spawn_key=(stream, epoch)))
    order = rng.permutation(size)
    order.flags.writeable = False
    return order


class JsonlSource:
    """The `jsonl` prompt source: a shuffled-per-epoch dataset, a fixed eval subset, the math reward."""

    eval_in_training = True
    """Its eval rows are rows of the training stream too (the module docstring): the evaluator says so."""

    def __init__(self, *, path: str, prompt_key: str, answer_key: str, seed: int, eval_size: int) -> None:
        self.path, self.seed, self.eval_size = path, seed, eval_size
        sources = [rowcache.path_identity(path)]
        key = rowcache.entry_key(sources, {"task": "jsonl", "prompt_key": prompt_key, "answer_key": answer_key})
        cached = rowcache.load(key)
        if cached is None:
            rows = load_rows(path, prompt_key, answer_key)
            columns = {"prompt": (row[0] for row in rows), "answer": (row[1] for row in rows)}
            self._rows: Sequence[tuple[str, str]] = rows
            if rowcache.store(key, columns, sources, {}):
                cached = rowcache.load(key)  # this process, too, keeps the mapped rows rather than the lists
        if cached is not None:
            self._rows = cached.pairs("prompt", "answer")

    def train(self, index: int) -> Problem:
        if index < 0:
            raise IndexError(f"training index must be non-negative, got {index}")
        epoch, position = divmod(index, len(self._rows))
        prompt, answer = self._rows[int(_permutation(len(self._rows), self.seed, _TRAIN_STREAM, epoch)[position])]
        return Problem(index=index, prompt=prompt, answer=answer)

    def epoch_size(self) -> int | None:
        return len(self._rows)

    def eval_set(self) -> list[Problem]:
        order = _permutation(len(self._rows), self.seed, _EVAL_STREAM, 0)[: self.eval_size]
        return [Problem(index=i, prompt=self._rows[row][0], answer=self._rows[row][1]) for i, row in enumerate(order)]

    def reward(self, response_text: str, answer: str) -> float:
        return math_verify_reward(response_text, answer)
