"""Verifiable tasks: where prompts come from and how a response is scored.

A `PromptSource` hands out `Problem`s by index, so the buffer service, rollout workers and a resumed run all agree
on what problem `i` is without sharing state:

    train(i)      deterministic in (seed, i); built-in tasks are infinite, datasets repeat with a per-epoch shuffle
    eval_set()    `data.eval_size` held-out problems, always the same ones
    reward(r, a)  1.0 if the response text `r` answers reference `a`, else 0.0

Sources: `arith` (built-in procedurally generated arithmetic, exact-match reward; `common.tasks.arith`),
`arith_tool` (the same problems; the calculator environment `env.fn=asyncrl:arith_tool` scores the episodes),
`jsonl` (a dataset file scored with math-verify; `common.tasks.jsonl`) and `dataset` (jsonl/json/parquet files or
`datasets` directories, chat-message prompts, nested keys; `common.tasks.dataset`). Prompts become token ids through
`common.tasks.chat.PromptEncoder` (chat templates) in every process. A dataset is parsed and validated by the first
process that builds its source; the rows kept are cached under `$ASYNCRL_CACHE/datasets/` and every later process
memory-maps them (`common.tasks.rowcache`). This package must stay cheap to import
(no torch; numpy and math-verify are imported only by the sources that need them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from common.config import DataConfig


@dataclass(frozen=True, slots=True)
class Problem:
    index: int
    """Position in the training stream (or in the eval set)."""
    prompt: str
    """Text given to the model."""
    answer: str
    """Reference answer text."""


def problem_row(index: int, prompt: str, answer: str, record: dict | None = None, *, record_wins: bool) -> dict:
    """The `row` user code gets for a problem: its index, prompt and reference answer, and the dataset's own record
    (every field) where the source has one. A reward function's row lets the record win (it is the user's row); an
    environment's lets index, prompt and answer win (docs/multiturn.md)."""
    lease = {"index": index, "prompt": prompt, "answer": answer}
    fields = record or {}
    return {**lease, **fields} if record_wins else {**fields, **lease}


class DatasetError(ValueError):
    """Bad dataset rows (or a missing/empty file); the message names the file, 1-based line numbers and problems."""


class PromptSource(Protocol):
    def train(self, index: int) -> Problem:
        """Training problem `index`, a pure function of (seed, index)."""
        ...

    def epoch_size(self) -> int | None:
        """Rows per epoch of a dataset; None for infinite generated streams."""
        ...

    def eval_set(self) -> list[Problem]:
        """The held-out problems (`data.eval_size` of them), deterministic."""
        ...

    def reward(self, response_text: str, answer: str) -> float:
        """1.0 if `response_text` answers `answer` correctly, else 0.0."""
        ...


def make_source(data_cfg: DataConfig) -> PromptSource:
    """The prompt source for `data.task` (`arith`, `jsonl` or `dataset`); a dataset is loaded and validated here."""
    if data_cfg.task in ("arith", "arith_tool"):  # arith_tool: the same problems, episodes with a calculator
        from common.tasks.arith import ArithSource

        return ArithSource(seed=data_cfg.seed, digits=data_cfg.digits, ops=data_cfg.ops, eval_size=data_cfg.eval_size)
    if data_cfg.task == "jsonl":
        from common.tasks.jsonl import JsonlSource

        return JsonlSource(
            path=data_cfg.path,
            prompt_key=data_cfg.prompt_key,
            answer_key=data_cfg.answer_key,
            seed=data_cfg.seed,
            eval_size=data_cfg.eval_size,
        )
    if data_cfg.task == "dataset":
        from common.tasks.dataset import DatasetSource

        return DatasetSource(data_cfg)
    raise ValueError(f"unknown `data.task` {data_cfg.task!r}; valid values: arith, arith_tool, jsonl, dataset")


# Re-exported for the model warm-up recipe; imported last because arith needs `Problem` defined above.
from common.tasks.arith import arith_problem  # noqa: E402

__all__ = ["DatasetError", "Problem", "PromptSource", "arith_problem", "make_source"]
