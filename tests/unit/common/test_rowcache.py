"""The dataset row cache (common/tasks/rowcache.py): the rows a later process maps are the rows the first one parsed;
a cache hit reads no dataset file; a changed file, a damaged or foreign entry and an unwritable cache all give the
file's rows."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from common.config import DataConfig
from common.tasks import DatasetError, make_source, rowcache

AN_HOUR_AGO_NS = 3600 * 10**9
TEXT_ROWS = [
    {"prompt": "Combien font 2 + 3 ? ✓", "answer": 5},
    {"prompt": "计算 10 - 4", "answer": "6"},
    {"prompt": "Half of 3? 🙂", "answer": 1.5},
    {"prompt": "Natalia sold 48 clips...", "answer": "She sold 72.\n#### 1,072"},
    {"prompt": "Cosine of 30 degrees?", "answer": "$\\frac{\\sqrt{3}}{2}$"},
    {"prompt": "Big?", "answer": 9007199254740993},
    {"prompt": "Fixed point", "answer": 1e16},
]


def _chat_rows(count: int) -> list[dict]:
    return [
        {
            "messages": [{"role": "system", "content": "Réponds."}, {"role": "user", "content": f"{i} + 1 = ? ∑"}],
            "meta": {"answer": i + 1, "tags": ["x", None, 0.5], "note": "é\u2028"},
        }
        for i in range(count)
    ]


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "datasets"


def _write(path: Path, rows: list[dict], *, aged: bool = True) -> Path:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    if aged:  # older than rowcache.RACY_S: cacheable
        stat = path.stat()
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns - AN_HOUR_AGO_NS))
    return path


def _view(source) -> tuple:
    """Everything a process reads from a source: epoch size, three epochs of training problems, the eval set."""
    n = source.epoch_size()
    return n, [source.train(i) for i in range(3 * n + 1)], source.eval_set()


def _entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.rows")) if cache.is_dir() else []


def _jsonl(path: Path, eval_size: int = 4) -> DataConfig:
    return DataConfig(task="jsonl", path=str(path), seed=7, eval_size=eval_size)


def test_jsonl_rows_from_the_cache_are_the_rows_parsed(tmp_path: Path, cache: Path) -> None:
    parsed = make_source(_jsonl(_write(tmp_path / "fresh.jsonl", TEXT_ROWS, aged=False)))
    assert _entries(cache) == []  # just written: not cached (racy)
    path = _write(tmp_path / "rows.jsonl", TEXT_ROWS)
    first, second = make_source(_jsonl(path)), make_source(_jsonl(path))
    assert len(_entries(cache)) == 1
    assert isinstance(second._rows, rowcache.PairColumn)
    assert _view(first) == _view(second) == _view(parsed)
    answers = {second.train(i).answer for i in range(len(TEXT_ROWS))}
    assert answers == {"5", "6", "1.5", "1072", "$\\frac{\\sqrt{3}}{2}$", "9007199254740993", "10000000000000000"}


def test_a_cache_hit_reads_no_file_and_a_changed_file_is_read_again(tmp_path: Path, cache: Path) -> None:
    path = _write(tmp_path / "rows.jsonl", [{"prompt": "one plus one", "answer": 2}])
    assert make_source(_jsonl(path)).train(0).prompt == "one plus one"
    stat = path.stat()
    path.write_text(json.dumps({"prompt": "two plus two", "answer": 4}) + "\n")  # same size, same inode
    assert path.stat().st_size == stat.st_size
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert make_source(_jsonl(path)).train(0).prompt == "one plus one"  # the entry, not the file
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert make_source(_jsonl(path)).train(0).prompt == "two plus two"
    assert len(_entries(cache)) == 1  # the stale entry was removed when the new one was written


@pytest.mark.parametrize("damage", ["truncated", "garbage", "flipped", "foreign"])
def test_a_damaged_entry_is_rebuilt(tmp_path: Path, cache: Path, damage: str) -> None:
    path = _write(tmp_path / "rows.jsonl", TEXT_ROWS)
    expected = _view(make_source(_jsonl(path)))
    (entry,) = _entries(cache)
    good = entry.read_bytes()
    if damage == "truncated":
        entry.write_bytes(good[: len(good) // 2])
    elif damage == "garbage":
        entry.write_bytes(os.urandom(len(good)))
    elif damage == "flipped":  # a byte of a prompt: sizes and header still fine, the digest is not
        at = good.index("计算".encode())
        entry.write_bytes(good[:at] + bytes([good[at] ^ 1]) + good[at + 1 :])
    else:  # another dataset's entry under this name
        other = make_source(_jsonl(_write(tmp_path / "other.jsonl", TEXT_ROWS[:2])))
        assert other.epoch_size() == 2
        foreign = next(e for e in _entries(cache) if e != entry)
        shutil.copyfile(foreign, entry)
    assert _view(make_source(_jsonl(path))) == expected
    assert entry.read_bytes() == good  # rewritten


def test_an_unwritable_cache_gives_the_rows_and_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")  # the cache root is a file: mkdir fails, even for root
    monkeypatch.setenv("ASYNCRL_CACHE", str(blocker))
    monkeypatch.setattr(rowcache, "_warned", False)  # a fresh process
    parsed = make_source(_jsonl(_write(tmp_path / "fresh.jsonl", TEXT_ROWS, aged=False)))
    path = _write(tmp_path / "rows.jsonl", TEXT_ROWS)
    assert _view(make_source(_jsonl(path))) == _view(make_source(_jsonl(path))) == _view(parsed)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "warning: dataset rows not cached" in err


def test_bad_rows_fail_as_before_and_are_not_cached(tmp_path: Path, cache: Path) -> None:
    path = _write(tmp_path / "bad.jsonl", [*TEXT_ROWS, {"prompt": "", "answer": 1}])
    for _ in range(2):
        with pytest.raises(DatasetError, match=r"bad.jsonl:8: field 'prompt' \(data.prompt_key\) is empty"):
            make_source(_jsonl(path))
    assert _entries(cache) == []


def _dataset(path: Path, eval_path: Path | None = None) -> DataConfig:
    return DataConfig(
        task="dataset",
        path=str(path),
        eval_path=str(eval_path or ""),
        prompt_key="messages",
        answer_key="meta.answer",
        seed=3,
        eval_size=5,
    )


def test_dataset_chat_rows_records_and_eval_rows_from_the_cache(tmp_path: Path, cache: Path) -> None:
    rows, held_out = _chat_rows(9), _chat_rows(12)[9:]
    parsed = make_source(
        _dataset(_write(tmp_path / "fresh.jsonl", rows, aged=False), _write(tmp_path / "e.jsonl", held_out))
    )
    path, eval_path = _write(tmp_path / "train.jsonl", rows), _write(tmp_path / "eval.jsonl", held_out)
    first, second = make_source(_dataset(path, eval_path)), make_source(_dataset(path, eval_path))
    assert len(_entries(cache)) == 1 and isinstance(second._records, rowcache.JsonColumn)
    for source in (first, second):
        assert _view(source) == _view(parsed)
        assert [source.row(i) for i in range(20)] == [parsed.row(i) for i in range(20)]
        assert (source.messages, source.dropped, source.eval_dropped) == (True, 0, 0)
    assert json.loads(second.train(0).prompt)[0] == {"role": "system", "content": "Réponds."}
    assert second.row(0)["meta"]["note"] == "é\u2028" and second.row(0) is not second.row(0)
    assert {p.answer for p in second.eval_set()} <= {"10", "11", "12"}


def test_dataset_without_eval_file_shares_the_jsonl_eval_rule(tmp_path: Path, cache: Path) -> None:
    parsed = make_source(_dataset(_write(tmp_path / "fresh.jsonl", _chat_rows(6), aged=False)))
    path = _write(tmp_path / "train.jsonl", _chat_rows(6))
    make_source(_dataset(path))
    cached = make_source(_dataset(path))
    assert cached._eval_rows is None and _view(cached) == _view(parsed)


def test_json_exact() -> None:
    assert rowcache.json_exact({"a": [1, 2.5, None, True, "x", {"b": float("nan")}]})
    assert not rowcache.json_exact({"a": (1, 2)}) and not rowcache.json_exact({"a": b"x"})
    assert not rowcache.json_exact({1: "a"})


def _age_tree(root: Path) -> Path:
    for file in root.rglob("*"):
        stat = file.stat()
        os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns - AN_HOUR_AGO_NS))
    return root


def test_dataset_max_prompt_tokens_drops_are_cached_with_their_counts(tmp_path: Path, cache: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(tmp_path / "tok")
    rows = [{"prompt": " ".join(["word"] * (i % 5 + 1)), "answer": i} for i in range(20)]
    held_out = [{"prompt": " ".join(["word"] * (i % 4 + 1)), "answer": i} for i in range(8)]

    def data(path: Path, eval_path: Path) -> DataConfig:
        return DataConfig(
            task="dataset",
            path=str(path),
            eval_path=str(eval_path),
            max_prompt_tokens=3,
            tokenizer=str(tmp_path / "tok"),
        )

    parsed = make_source(
        data(_write(tmp_path / "fresh.jsonl", rows, aged=False), _write(tmp_path / "e.jsonl", held_out))
    )
    assert (parsed.epoch_size(), parsed.dropped, parsed.eval_dropped) == (12, 8, 2)
    _age_tree(tmp_path / "tok")
    path, eval_path = _write(tmp_path / "train.jsonl", rows), _write(tmp_path / "eval.jsonl", held_out)
    make_source(data(path, eval_path))
    cached = make_source(data(path, eval_path))
    assert len(_entries(cache)) == 1 and isinstance(cached._rows, rowcache.PairColumn)
    assert (cached.dropped, cached.eval_dropped, cached.messages) == (8, 2, False)
    assert _view(cached) == _view(parsed)
    assert [cached.row(i) for i in range(24)] == [parsed.row(i) for i in range(24)]
