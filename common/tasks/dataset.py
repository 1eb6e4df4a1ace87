"""Task `dataset`: a user dataset file or `datasets` directory, scored by the math reward.

`data.path` is a `.jsonl`, `.json` or `.parquet` file, or a directory written by `Dataset.save_to_disk` (a
`DatasetDict` directory must hold a `train` split). JSON files (one object per line, or one list of objects) are read
with Python's `json`, line by line as task `jsonl` reads them (`common.tasks.jsonl.json_lines`): a number keeps its
value as the file writes it (`9007199254740993` stays that integer, `0.5` that float; `datasets`' JSON reader would
type a column as int64 / float64 and round it), and a line that is not JSON is named by its number and cause. Parquet
files and saved directories are read with the `datasets` library, their columns typed as stored (a float64 column
answers `5.0`, which the math reward scores as `5`). `data.prompt_key` names a string prompt or a list of
`{role, content}` chat messages; `data.answer_key` a string or number answer. Both may be dotted paths into nested
fields (`reward_model.ground_truth`, `extra_info.question`); a column whose own name holds the dot wins.

Every row is checked when the source is built; bad rows fail in one `DatasetError` naming the file, the 1-based row
(`line N` in a JSON-lines file) and the key (answers follow `common.tasks.jsonl`'s rules: GSM8K `####` answers,
numbers, LaTeX that math-verify reads). All rows of one file hold the same prompt kind (text or messages).

A message-list prompt travels through the buffer as its JSON text (`json.dumps` of the list); `common.tasks.chat`
turns it back into messages and renders it with the tokenizer's chat template, the same way in the rollout worker,
the learner and the start-up checks.

`data.max_prompt_tokens` > 0 drops rows whose encoded prompt is longer (the tokenizer is `data.tokenizer`, which the
driver sets to the model's); `dropped` counts them. `data.eval_path` is a separate held-out file: the eval set is
the first `data.eval_size` rows of a fixed permutation of it (else of `data.path`, as `jsonl` does). `datasets` and
the tokenizer are imported on first use: importing this module stays cheap.

The rows kept (after `data.max_prompt_tokens`), the records behind them and the eval rows are cached as task `jsonl`
caches its rows (`common.tasks.rowcache`, under `<cache>/datasets/`): the first process of a run parses, validates and
filters; every later process maps the entry and neither reads the files nor loads the tokenizer. A dataset whose
records would not come back from JSON unchanged (a parquet column of bytes or dates) is not cached.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.tasks import DatasetError, Problem, rowcache
from common.tasks.jsonl import (
    _EVAL_STREAM,
    _TRAIN_STREAM,
    JsonlSource,
    _permutation,
    answer_problem,
    check_rows,
    check_text,
    json_lines,
)

if TYPE_CHECKING:
    from common.config import DataConfig

_ROLES = ("system", "user", "assistant", "tool")
_FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_SAVED_MARKERS = ("state.json", "dataset_dict.json")  # what `save_to_disk` writes: a Dataset's, a DatasetDict's


def load_table(path: str, key: str = "data.path") -> list[tuple[str, dict[str, Any] | str]]:
    """(where, the row or what is wrong with it) of every row of a dataset file or saved directory; `where` is
    `line N` in a JSON-lines file, else `row N` (1-based). DatasetError naming the path if it cannot be read at all.

    .jsonl / .json files are read with Python's `json` (`common.tasks.jsonl.json_lines`, as task `jsonl` reads them):
    numbers keep their value exactly as the file writes it (`datasets`' JSON reader types them as int64 / float64,
    rounding `9007199254740993`), rows need not share one type per column, and a bad line is named by its number."""
    target = Path(path).expanduser()
    if not target.exists():
        raise DatasetError(f"dataset {path!r} does not exist ({key})")
    if target.is_file() and _FILE_FORMATS.get(target.suffix.lower()) == "json":
        return _json_rows(target, path)
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        if target.is_dir():
            if not any((target / name).is_file() for name in _SAVED_MARKERS):
                raise DatasetError(
                    f"{path} is a directory but not one written by `datasets` save_to_disk (it holds no "
                    f"{' or '.join(_SAVED_MARKERS)}) ({key}): point it at a .jsonl, .json or .parquet file, or at "
                    "a save_to_disk directory"
                )
            table = datasets.load_from_disk(str(target))
            if isinstance(table, datasets.DatasetDict):
                if "train" not in table:
                    raise DatasetError(
                        f"{path}: a DatasetDict without a `train` split (it has: {', '.join(table)}); "
                        f"save the split you want with `save_to_disk` and point {key} at it"
                    )
                table = table["train"]
        else:
            kind = _FILE_FORMATS.get(target.suffix.lower())
            if kind is None:
                raise DatasetError(
                    f"{path}: unknown dataset format {target.suffix or '(no suffix)'!r} ({key}); valid: "
                    ".jsonl, .json, .parquet, or a directory written by `datasets` save_to_disk"
                )
            table = datasets.load_dataset(kind, data_files=str(target), split="train")
        records = table.to_list()  # decodes the strings: a file whose text is not UTF-8 fails here
    except DatasetError:
        raise
    except Exception as err:  # noqa: BLE001  (pyarrow/datasets raise many types for unreadable files)
        first = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
        raise DatasetError(f"{path}: `datasets` cannot read it ({type(err).__name__}: {first})") from None
    return [(f"row {number}", record) for number, record in enumerate(records, start=1)]


def _json_rows(target: Path, path: str) -> list[tuple[str, dict[str, Any] | str]]:
    """The rows of a .jsonl / .json file: one JSON object per line (`line N`), or one JSON list of objects (`row N`),
    as `datasets` also accepts; a UTF-8 byte order mark at the start is skipped."""
    with target.open("rb") as stream:
        head = stream.read(4096).removeprefix(codecs.BOM_UTF8).lstrip()
        stream.seek(0)
        if not head.startswith(b"["):
            rows = [(f"line {number}", row) for number, row in json_lines(stream)]
            if not (rows and isinstance(rows[0][1], str) and head.startswith(b"{")):
                return rows
            stream.seek(0)
            try:  # one object written over several lines: the rows are missing, not the lines broken
                whole = json.loads(stream.read().removeprefix(codecs.BOM_UTF8).decode("utf-8"))
            except (ValueError, RecursionError):
                return rows
            raise DatasetError(
                f"{path}: one JSON object over several lines (keys: {', '.join(map(str, whole))[:200]}), not rows: "
                "write one object per line, or a JSON list of objects"
            )
        data = stream.read().removeprefix(codecs.BOM_UTF8)
    try:
        items = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise DatasetError(f"{path}: line {line}: not valid UTF-8 (byte 0x{data[err.start]:02x})") from None
    except json.JSONDecodeError as err:
        raise DatasetError(f"{path}: line {err.lineno}: invalid JSON ({err.msg} at column {err.colno})") from None
    except (ValueError, RecursionError) as err:  # an integer of thousands of digits, nesting thousands deep
        raise DatasetError(f"{path}: unreadable JSON ({type(err).__name__}: {str(err)[:80]})") from None
    if not isinstance(items, list):
        raise DatasetError(f"{path}: expected a JSON list of objects, got {type(items).__name__}")
    return [
        (f"row {number}", item if isinstance(item, dict) else f"expected a JSON object, got {type(item).__name__}")
        for number, item in enumerate(items, start=1)
    ]


def field_value(row: dict[str, Any], key: str) -> tuple[bool, Any]:
    """(True, value) of `key` in `row` (a column name, else a dotted path into nested dicts), or (False, None)."""
    if key in row:
        return True, row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _messages_problem(value: list, field: str) -> tuple[list[dict[str, str]], str | None]:
    """Normalized {role, content} messages of a prompt list, or ([], what is wrong with it)."""
    if not value:
        return [], f"field {field} is an empty message list"
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return [], f"field {field}: message {i} must be an object with string `role` and `content`"
        content = message.get("content")
        if not isinstance(content, str):
            return [], f"field {field}: message {i} has no string `content` (got {type(content).__name__})"
        if message["role"] not in _ROLES:
            return [], f"field {field}: message {i} has role {message['role']!r}; valid: {', '.join(_ROLES)}"
        try:
            content.encode("utf-8")
        except UnicodeEncodeError:
            return [], f"field {field}: message {i} holds an unpaired surrogate escape: not text"
        messages.append({"role": message["role"], "content": content})
    if not any(m["content"].strip() for m in messages):
        return [], f"field {field}: every message is empty"
    if messages[-1]["role"] == "assistant":  # the template would append a new assistant turn after this answer
        return [], (f"field {field}: its last message is the assistant's: a prompt ends where the model answers "
                    "(a conversation with its answer in it is SFT data)")  # fmt: skip
    return messages, None


def load_dataset_rows(
    path: str, prompt_key: str, answer_key: str, key: str = "data.path", records: list[dict] | None = None
) -> tuple[list, bool]:
    """(rows of (prompt, reference answer), whether prompts are message lists) of a dataset; DatasetError listing the
    bad rows (file, 1-based row, key) if any. A message-list prompt is kept as its JSON text. `records`, if given,
    receives each kept row as the dataset has it (every field), in the order of the rows returned."""
    table = load_table(path, key)
    prompt_field, answer_field = f"{prompt_key!r} (data.prompt_key)", f"{answer_key!r} (data.answer_key)"
    rows: list[tuple[str, str]] = []
    errors: list[str] = []
    kind: str | None = None  # "text" or "messages": fixed by the first good row
    for where, row in table:
        if isinstance(row, str):  # a line that is no JSON object
            errors.append(f"{path}: {where}: {row}")
            continue
        found, prompt = field_value(row, prompt_key)
        problem: str | None = None
        if not found:
            problem = f"missing field {prompt_field}; the row has: {', '.join(map(str, row)) or 'no fields'}"
        elif isinstance(prompt, str):
            problem = check_text(prompt, prompt_field)
            row_kind = "text"
        elif isinstance(prompt, list):
            messages, problem = _messages_problem(prompt, prompt_field)
            prompt, row_kind = json.dumps(messages, ensure_ascii=False), "messages"
        else:
            problem = f"field {prompt_field} must be a string or a list of messages, got {type(prompt).__name__}"
        if problem is None and kind is not None and row_kind != kind:
            problem = f"field {prompt_field} holds {row_kind} but earlier rows hold {kind}: use one kind per file"
        answer = ""
        if problem is None:
            found, raw_answer = field_value(row, answer_key)
            if not found:
                problem = f"missing field {answer_field}; the row has: {', '.join(map(str, row)) or 'no fields'}"
            else:
                answer, problem = answer_problem(raw_answer, answer_field)
        if problem is not None:
            errors.append(f"{path}: {where}: {problem}")
            continue
        kind = row_kind
        rows.append((prompt, answer))
        if records is not None:
            records.append(row)
    check_rows(path, rows, errors)
    return rows, kind == "messages"


def _cache_settings(data_cfg: DataConfig) -> dict[str, Any]:
    """What decides a `dataset` source's rows besides its files (`common.tasks.rowcache` keys its entry by them)."""
    settings: dict[str, Any] = {
        "task": "dataset",
        "layout": 2,  # the entry's columns: 2 added data.eval_path's records (`eval_record`)
        "prompt_key": data_cfg.prompt_key,
        "answer_key": data_cfg.answer_key,
        "max_prompt_tokens": data_cfg.max_prompt_tokens,
    }
    if data_cfg.max_prompt_tokens > 0:  # the prompts are counted with this tokenizer (its files: a source), rendered so
        settings |= {
            "tokenizer": data_cfg.tokenizer,
            "chat_template": data_cfg.chat_template,
            "system_prompt": data_cfg.system_prompt,
        }
    return settings


class DatasetSource(JsonlSource):
    """The `dataset` prompt source: `jsonl`'s shuffled epochs and math reward over rows read with `datasets`."""

    def __init__(self, data_cfg: DataConfig) -> None:
        self.path, self.seed, self.eval_size = data_cfg.path, data_cfg.seed, data_cfg.eval_size
        sources = [rowcache.path_identity(data_cfg.path)]
        if data_cfg.eval_path:
            sources.append(rowcache.path_identity(data_cfg.eval_path))
        if data_cfg.max_prompt_tokens > 0 and data_cfg.tokenizer and Path(data_cfg.tokenizer).expanduser().is_dir():
            sources.append(rowcache.path_identity(data_cfg.tokenizer))  # its files count the prompts' tokens
        key = rowcache.entry_key(sources, _cache_settings(data_cfg))
        cached = rowcache.load(key)
        if cached is None:
            self._parse(data_cfg)
            columns = self._cache_columns()
            if columns is not None and rowcache.store(key, columns, sources, self._cache_extra()):
                cached = rowcache.load(key)  # this process, too, keeps the mapped rows rather than the lists
        if cached is not None:
            self._open_cached(cached)

    def _open_cached(self, cached: rowcache.RowCache) -> None:
        self._rows = cached.pairs("prompt", "answer")
        self._records = rowcache.JsonColumn(cached.columns["record"])
        self._eval_rows = cached.pairs("eval_prompt", "eval_answer") if "eval_prompt" in cached.columns else None
        self._eval_records = rowcache.JsonColumn(cached.columns["eval_record"]) if self._eval_rows is not None else None
        self.messages = bool(cached.extra["messages"])
        self.dropped, self.eval_dropped = int(cached.extra["dropped"]), int(cached.extra["eval_dropped"])

    def _cache_columns(self) -> dict[str, Iterator[str]] | None:
        """The columns of this source's cache entry; None (no entry) when a record would not come back from JSON
        as it is (a `datasets` column of bytes, dates or decimals)."""
        if not all(rowcache.json_exact(record) for record in [*self._records, *(self._eval_records or [])]):
            return None
        columns = {
            "prompt": (row[0] for row in self._rows),
            "answer": (row[1] for row in self._rows),
            "record": (json.dumps(record, ensure_ascii=False) for record in self._records),
        }
        if self._eval_rows is not None:
            columns["eval_prompt"] = (row[0] for row in self._eval_rows)
            columns["eval_answer"] = (row[1] for row in self._eval_rows)
            columns["eval_record"] = (json.dumps(record, ensure_ascii=False) for record in self._eval_records or [])
        return columns

    def _cache_extra(self) -> dict[str, Any]:
        return {"messages": self.messages, "dropped": self.dropped, "eval_dropped": self.eval_dropped}

    def _parse(self, data_cfg: DataConfig) -> None:
        records: list[dict] = []
        self._rows, self.messages = load_dataset_rows(
            data_cfg.path, data_cfg.prompt_key, data_cfg.answer_key, records=records
        )
        self._records: Sequence[dict] = records  # the dataset's own rows, every field: what user reward functions get
        self._eval_rows: Sequence[tuple[str, str]] | None = None
        self._eval_records: Sequence[dict] | None = None  # data.eval_path's own rows, as `_records` for data.path
        if data_cfg.eval_path:
            eval_records: list[dict] = []
            self._eval_rows, eval_messages = load_dataset_rows(
                data_cfg.eval_path, data_cfg.prompt_key, data_cfg.answer_key, key="data.eval_path",
                records=eval_records,
            )  # fmt: skip
            self._eval_records = eval_records
            if eval_messages != self.messages:
                raise DatasetError(
                    f"{data_cfg.eval_path}: its prompts are {'messages' if eval_messages else 'text'} but those of "
                    f"{data_cfg.path} are {'messages' if self.messages else 'text'} (data.eval_path, data.path)"
                )
        self.dropped = 0
        """Rows of data.path dropped by data.max_prompt_tokens."""
        self.eval_dropped = 0
        if data_cfg.max_prompt_tokens > 0:
            self._drop_long_prompts(data_cfg)

    def _drop_long_prompts(self, data_cfg: DataConfig) -> None:
        from common.tasks.chat import prompt_encoder

        if not data_cfg.tokenizer:
            raise DatasetError("data.max_prompt_tokens needs a tokenizer to count tokens: set data.tokenizer")
        try:  # its own code is not run to count tokens (the data section does not carry model.trust_remote_code)
            encode = prompt_encoder(data_cfg.tokenizer, data_cfg, messages=self.messages, trust_remote_code=False)
        except (OSError, ValueError) as err:
            raise DatasetError(
                f"data.max_prompt_tokens: cannot load the tokenizer {data_cfg.tokenizer!r} to count prompt tokens "
                f"({str(err).splitlines()[0][:300]}); a tokenizer that needs trust_remote_code cannot count them: "
                "set data.max_prompt_tokens=0"
            ) from None
        limit = data_cfg.max_prompt_tokens
        keep = [0 < len(encode(row[0])) <= limit for row in self._rows]
        kept = [row for row, ok in zip(self._rows, keep, strict=True) if ok]
        self._records = [record for record, ok in zip(self._records, keep, strict=True) if ok]
        self.dropped = len(self._rows) - len(kept)
        if not kept:
            lengths = sorted(len(encode(row[0])) for row in self._rows[:1000])
            raise DatasetError(
                f"{data_cfg.path}: every one of its {len(self._rows)} prompts is longer than data.max_prompt_tokens="
                f"{limit} tokens (the shortest of the first {len(lengths)} has {lengths[0]})"
            )
        self._rows = kept
        if self._eval_rows is not None:
            eval_keep = [0 < len(encode(row[0])) <= limit for row in self._eval_rows]
            eval_kept = [row for row, ok in zip(self._eval_rows, eval_keep, strict=True) if ok]
            records = self._eval_records or []
            self._eval_records = [record for record, ok in zip(records, eval_keep, strict=True) if ok]
            self.eval_dropped = len(self._eval_rows) - len(eval_kept)
            if not eval_kept:
                raise DatasetError(
                    f"{data_cfg.eval_path}: every prompt is longer than data.max_prompt_tokens={limit} tokens"
                )
            self._eval_rows = eval_kept

    def row(self, index: int) -> dict:
        """The dataset row behind training problem `index` (the `row` a user reward function gets: every field)."""
        epoch, position = divmod(index, len(self._rows))
        return self._records[int(_permutation(len(self._rows), self.seed, _TRAIN_STREAM, epoch)[position])]

    def eval_row(self, index: int) -> dict:
        """The dataset row behind held-out problem `index` of `eval_set` (every field, as `row` gives for training)."""
        if self._eval_rows is None:
            return self._records[int(_permutation(len(self._rows), self.seed, _EVAL_STREAM, 0)[index])]
        assert self._eval_records is not None
        return self._eval_records[int(_permutation(len(self._eval_rows), self.seed, _EVAL_STREAM, 0)[index])]

    @property
    def eval_in_training(self) -> bool:  # type: ignore[override]
        """Whether eval rows are also trained on: rows of `data.path` (no `data.eval_path`), or rows of a
        `data.eval_path` that `data.path` holds too (`eval_overlap`)."""
        return self._eval_rows is None or self.eval_overlap > 0

    @property
    def eval_overlap(self) -> int:
        """Rows of `data.eval_path` whose prompt and answer are a row of `data.path` too (0 without an eval_path):
        the same file given twice, or an eval split cut from the training file, was called held-out."""
        if self._eval_rows is None:
            return 0
        if getattr(self, "_overlap", None) is None:
            trained = {_row_key(row) for row in self._rows}
            self._overlap = sum(_row_key(row) in trained for row in self._eval_rows)
        return self._overlap

    def eval_set(self) -> list[Problem]:
        if self._eval_rows is None:
            return super().eval_set()
        rows = self._eval_rows
        order = _permutation(len(rows), self.seed, _EVAL_STREAM, 0)[: self.eval_size]
        return [Problem(index=i, prompt=rows[row][0], answer=rows[row][1]) for i, row in enumerate(order)]


def _row_key(row: tuple[Any, Any]) -> str:
    """A (prompt, answer) row as one string: prompts may be message lists."""
    return json.dumps([row[0], row[1]], ensure_ascii=False, sort_keys=True)
