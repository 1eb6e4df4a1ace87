"""data.task=dataset: jsonl/json files read as task jsonl reads them (numbers exact), parquet files and save_to_disk
directories read with `datasets`, message prompts, dotted keys, a separate eval file, and bad rows named by file, row
(or line) and key."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from common.config import ConfigError, DataConfig, load_config
from common.tasks import DatasetError, make_source

GSM8K = Path(__file__).resolve().parents[4] / "shared" / "data" / "gsm8k" / "test.jsonl"
ROWS = [
    {"question": "What is 2 + 3?", "extra": {"id": 0}, "reward_model": {"ground_truth": "5", "style": "rule"}},
    {"question": "What is 10 - 4?", "extra": {"id": 1}, "reward_model": {"ground_truth": "6", "style": "rule"}},
    {"question": "Half of 3?", "extra": {"id": 2}, "reward_model": {"ground_truth": "1.5", "style": "rule"}},
]


def _chat_rows() -> list[dict]:
    return [
        {
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": row["question"]}],
            "reward_model": {"ground_truth": str(row["reward_model"]["ground_truth"])},
        }
        for row in ROWS
    ]


def _write(tmp_path: Path, name: str, rows: list[dict]) -> Path:
    path = tmp_path / name
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif name.endswith(".json"):
        path.write_text(json.dumps(rows))
    elif name.endswith(".parquet"):
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def _source(path: Path, **keys):
    return make_source(DataConfig(task="dataset", path=str(path), eval_size=2, **keys))


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.json", "rows.parquet", "saved_dir"])
def test_every_format_loads_the_same_rows_with_a_nested_answer_key(tmp_path: Path, name: str) -> None:
    source = _source(_write(tmp_path, name, ROWS), prompt_key="question", answer_key="reward_model.ground_truth")
    assert source.epoch_size() == 3 and not source.messages
    rows = sorted((source.train(i).prompt, source.train(i).answer) for i in range(3))
    assert rows == sorted([("What is 2 + 3?", "5"), ("What is 10 - 4?", "6"), ("Half of 3?", "1.5")])
    assert source.reward("so the answer is \\boxed{5}", "5") == 1.0


def test_the_row_of_a_training_problem_is_the_dataset_row_with_every_field(tmp_path: Path) -> None:
    rows = [*ROWS, {"question": "Too long", "extra": {"id": 3}, "reward_model": {"ground_truth": "7"}}]
    source = _source(
        _write(tmp_path, "rows.parquet", rows), prompt_key="question", answer_key="reward_model.ground_truth"
    )
    for index in range(8):  # across epochs: each epoch is its own shuffle
        problem, row = source.train(index), source.row(index)
        assert row["question"] == problem.prompt and row["reward_model"]["ground_truth"] == problem.answer
        assert row["extra"]["id"] == [r["question"] for r in rows].index(problem.prompt)


def test_a_message_list_prompt_travels_as_json_messages(tmp_path: Path) -> None:
    source = _source(_write(tmp_path, "chat.parquet", _chat_rows()), answer_key="reward_model.ground_truth")
    assert source.messages
    messages = json.loads(source.train(0).prompt)
    assert [m["role"] for m in messages] == ["system", "user"] and messages[0]["content"] == "Be brief."
    assert {json.loads(p.prompt)[1]["content"] for p in source.eval_set()} <= {row["question"] for row in ROWS}


def test_the_dataset_task_reads_gsm8k_as_the_jsonl_task_does() -> None:
    keys = {"path": str(GSM8K), "prompt_key": "question", "answer_key": "answer", "eval_size": 5}
    jsonl, dataset = make_source(DataConfig(task="jsonl", **keys)), make_source(DataConfig(task="dataset", **keys))
    assert dataset.epoch_size() == jsonl.epoch_size() == 1319
    assert [dataset.train(i) for i in range(0, 3000, 97)] == [jsonl.train(i) for i in range(0, 3000, 97)]
    assert dataset.eval_set() == jsonl.eval_set()


def test_bad_rows_are_named_by_file_row_and_key(tmp_path: Path) -> None:
    rows = [
        {"q": "ok", "a": {"gt": "1"}},
        {"q": "no answer", "a": {"other": "1"}},
        {"q": "", "a": {"gt": "1"}},
        {"q": "words", "a": {"gt": "eighteen dollars"}},
    ]
    path = _write(tmp_path, "bad.jsonl", rows)
    with pytest.raises(DatasetError) as err:
        _source(path, prompt_key="q", answer_key="a.gt")
    text = str(err.value)
    assert "3 invalid row(s)" in text
    assert f"{path}: line 2: missing field 'a.gt' (data.answer_key)" in text
    assert f"{path}: line 3: field 'q' (data.prompt_key) is empty" in text
    assert f"{path}: line 4: the reference answer 'eighteen dollars' does not read as math" in text


def test_bad_messages_and_mixed_prompt_kinds_are_refused(tmp_path: Path) -> None:
    chat = _chat_rows()
    chat[1]["prompt"] = [{"role": "narrator", "content": "hi"}]
    chat[2]["prompt"] = [{"role": "user", "content": None}]
    with pytest.raises(DatasetError) as err:
        _source(_write(tmp_path, "bad_chat.jsonl", chat), answer_key="reward_model.ground_truth")
    assert "line 2: field 'prompt' (data.prompt_key): message 0 has role 'narrator'" in str(err.value)
    assert "line 3: field 'prompt' (data.prompt_key): message 0 has no string `content`" in str(err.value)
    sft = _chat_rows()
    sft[0]["prompt"] = [*sft[0]["prompt"], {"role": "assistant", "content": "5"}]  # the answer inside the prompt
    with pytest.raises(DatasetError, match="line 1: field 'prompt' .*: its last message is the assistant's"):
        _source(_write(tmp_path, "sft.jsonl", sft), answer_key="reward_model.ground_truth")
    mixed = [{"p": "text", "a": "1"}, {"p": [{"role": "user", "content": "hi"}], "a": "2"}]
    with pytest.raises(DatasetError, match="line 2: field 'p' .* holds messages but earlier rows hold text"):
        _source(_write(tmp_path, "mixed.jsonl", mixed), prompt_key="p", answer_key="a")


def test_missing_unknown_and_unreadable_paths_fail_with_their_name(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"does not exist \(data.path\)"):
        _source(tmp_path / "nope.parquet")
    (tmp_path / "rows.csv").write_text("prompt,answer\n1+1,2\n")
    with pytest.raises(DatasetError, match=r"unknown dataset format '.csv'"):
        _source(tmp_path / "rows.csv")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match=r"broken.parquet: `datasets` cannot read it"):
        _source(tmp_path / "broken.parquet")
    datasets.DatasetDict({"test": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DatasetError, match=r"a DatasetDict without a `train` split \(it has: test\)"):
        _source(tmp_path / "dict", prompt_key="question")


def test_a_separate_eval_file_gives_the_eval_set(tmp_path: Path) -> None:
    train_rows = [{"prompt": f"{i} + 1 =", "answer": i + 1} for i in range(20)]
    train = _write(tmp_path, "train.jsonl", train_rows)
    held_out = _write(tmp_path, "test.parquet", [{"prompt": f"{i} * 2 =", "answer": 2 * i} for i in range(6)])
    source = make_source(DataConfig(task="dataset", path=str(train), eval_path=str(held_out), eval_size=4))
    eval_set = source.eval_set()
    assert len(eval_set) == 4 and all("*" in p.prompt for p in eval_set)
    assert [p.index for p in eval_set] == [0, 1, 2, 3] and eval_set == source.eval_set()
    assert source.epoch_size() == 20 and all("+" in source.train(i).prompt for i in range(40))
    assert source.eval_in_training is False  # held out: the evaluator calls it so
    shared = make_source(DataConfig(task="dataset", path=str(train), eval_size=4))
    trained = {shared.train(i).prompt for i in range(20)}  # one epoch: every row
    assert all(p.prompt in trained for p in shared.eval_set()) and shared.eval_in_training is True  # said, not hidden
    assert getattr(make_source(DataConfig()), "eval_in_training", False) is False  # the arithmetic task's slice
    assert source.eval_overlap == 0
    cut = _write(tmp_path, "cut.jsonl", [*train_rows[:5], {"prompt": "7 * 2 =", "answer": 14}])  # a split gone wrong
    for eval_path, overlap in ((train, 20), (cut, 5)):  # the training file itself, or 5 of its rows
        again = make_source(DataConfig(task="dataset", path=str(train), eval_path=str(eval_path), eval_size=4))
        assert again.eval_overlap == overlap and again.eval_in_training is True  # was called held-out
    chat = _write(tmp_path, "chat.jsonl", [{"prompt": [{"role": "user", "content": "1+1"}], "answer": 2}])
    with pytest.raises(DatasetError, match="its prompts are messages but those of .* are text"):
        make_source(DataConfig(task="dataset", path=str(train), eval_path=str(chat)))


def test_the_row_of_a_held_out_problem_is_its_dataset_row_parsed_or_cached(tmp_path: Path) -> None:
    """`eval_row(i)` is the row behind `eval_set()[i]` with every field (what a reward function gets in evaluation,
    as `row` gives in training): from data.path's held-out rows, or from data.eval_path's; the same from the row
    cache as from the first parse."""
    rows = [{**row, "extra": {"id": i}} for i, row in enumerate(ROWS)]
    train = _write(tmp_path, "rows.jsonl", rows)
    held_out = _write(tmp_path, "test.parquet", [{"q": f"{i} * 2 =", "a": 2 * i, "id": i} for i in range(6)])
    for _ in range(2):  # parsed, then from the cache entry the first made
        source = _source(train, prompt_key="question", answer_key="reward_model.ground_truth")
        for i, problem in enumerate(source.eval_set()):
            row = source.eval_row(i)
            assert row["question"] == problem.prompt and row["reward_model"]["ground_truth"] == problem.answer
            assert row["extra"]["id"] == [r["question"] for r in rows].index(problem.prompt)
        separate = make_source(DataConfig(task="dataset", path=str(held_out), eval_path=str(held_out), eval_size=4,
                                          prompt_key="q", answer_key="a"))  # fmt: skip
        eval_set = separate.eval_set()
        assert len(eval_set) == 4
        for i, problem in enumerate(eval_set):
            row = separate.eval_row(i)
            assert row["q"] == problem.prompt and str(row["a"]) == problem.answer and row["id"] == row["a"] // 2


def test_config_rules_for_the_dataset_keys() -> None:
    with pytest.raises(ConfigError, match="data.task=dataset needs `data.path`"):
        load_config(None, ["data.task=dataset"])
    with pytest.raises(ConfigError, match=r"^`data.max_prompt_tokens` needs data.task=dataset \(it is arith\)$"):
        load_config(None, ["data.max_prompt_tokens=10"])  # only the key set is named (it named both)
    for overrides, keys in (
        (["data.path=rows.jsonl"], "`data.path`"),
        (["data.prompt_key=q", "data.answer_key=a"], "`data.prompt_key`, `data.answer_key`"),
    ):
        with pytest.raises(ConfigError, match=f"^{keys} set, but data.task=arith generates its own problems"):
            load_config(None, overrides)  # ignored: the run trained on arithmetic and said nothing
    with pytest.raises(ConfigError, match="chat_template"):
        load_config(None, ["data.chat_template=maybe"])


def _lines(tmp_path: Path, name: str, lines: list[str | bytes]) -> Path:
    path = tmp_path / name
    path.write_bytes(b"".join((line if isinstance(line, bytes) else line.encode()) + b"\n" for line in lines))
    return path


def _answers(path: Path, task: str = "dataset") -> list[str]:
    source = make_source(DataConfig(task=task, path=str(path), eval_size=1))
    return sorted(source.train(i).answer for i in range(source.epoch_size()))


@pytest.mark.parametrize("name", ["big.jsonl", "big.json"])
def test_json_numbers_keep_their_exact_value_as_the_jsonl_task_reads_them(tmp_path: Path, name: str) -> None:
    lines = [
        '{"prompt": "a", "answer": 12345678901234567890123}',
        '{"prompt": "b", "answer": 9007199254740993}',
        '{"prompt": "c", "answer": 0.5}',
        '{"prompt": "d", "answer": 1e16}',
        '{"prompt": "e", "answer": -7}',
    ]
    path = _lines(tmp_path, name, lines if name.endswith(".jsonl") else ["[" + ",\n".join(lines) + "]"])
    exact = sorted(["12345678901234567890123", "9007199254740993", "0.5", "10000000000000000", "-7"])
    assert _answers(path) == exact
    if name.endswith(".jsonl"):
        assert _answers(path, task="jsonl") == exact  # both tasks give the same reference for the same row
    source = _source(path)
    row = next(source.row(i) for i in range(5) if source.train(i).answer == "9007199254740993")
    assert row["answer"] == 9007199254740993 and isinstance(row["answer"], int)  # the reward function's row too
    assert source.reward("\\boxed{12345678901234567890123}", "12345678901234567890123") == 1.0


def test_a_float_column_of_whole_numbers_scores_as_the_jsonl_integers(tmp_path: Path) -> None:
    parquet = _write(tmp_path, "floats.parquet", [{"prompt": "a", "answer": 5.0}, {"prompt": "b", "answer": 0.1}])
    jsonl = _lines(tmp_path, "ints.jsonl", ['{"prompt": "a", "answer": 5}', '{"prompt": "b", "answer": 0.1}'])
    typed, written = _answers(parquet), _answers(jsonl)
    assert typed == ["0.1", "5.0"] and written == ["0.1", "5"]  # the column's type shows, the value does not change
    source = _source(jsonl)
    for response in ("\\boxed{5}", "5.0", "0.1", "4"):
        assert [source.reward(response, a) for a in typed] == [source.reward(response, a) for a in written]


def test_unreadable_json_lines_are_named_by_file_line_and_cause(tmp_path: Path) -> None:
    path = _lines(
        tmp_path,
        "bad.jsonl",
        [
            '{"prompt": "fine", "answer": 1}',
            '{"prompt": "broken", ',
            "",
            b'{"prompt": "caf\xe9", "answer": 2}',
            '["not", "an", "object"]',
            '{"prompt": "mixed type", "answer": "3"}',
            '{"prompt": "list answer", "answer": [4]}',
        ],
    )
    with pytest.raises(DatasetError) as err:
        _source(path)
    text = str(err.value)
    assert "`datasets` cannot read it" not in text and "4 invalid row(s)" in text
    assert f"{path}: line 2: invalid JSON (Expecting property name enclosed in double quotes at column 1)" in text
    assert f"{path}: line 4: not valid UTF-8 (byte 0xe9 at byte 16 of the line)" in text
    assert f"{path}: line 5: expected a JSON object, got list" in text
    assert f"{path}: line 7: field 'answer' (data.answer_key) must be a string or a number, got list" in text
    assert f"{path}: line 6" not in text and f"{path}: line 1" not in text  # rows of other types are fine


def test_a_bad_json_list_file_names_the_line_and_cause(tmp_path: Path) -> None:
    broken = _lines(tmp_path, "broken.json", ['[{"prompt": "a", "answer": 1},', '{"prompt": "b" "answer": 2}]'])
    with pytest.raises(
        DatasetError, match=r"broken.json: line 2: invalid JSON \(Expecting ',' delimiter at column 16\)"
    ):
        _source(broken)
    latin = _lines(tmp_path, "latin.json", ["[", b'{"prompt": "\xff", "answer": 1}]'])
    with pytest.raises(DatasetError, match=r"latin.json: line 2: not valid UTF-8 \(byte 0xff\)"):
        _source(latin)
    items = _lines(tmp_path, "items.json", ['[{"prompt": "a", "answer": 1}, 7]'])
    with pytest.raises(DatasetError, match=r"items.json: row 2: expected a JSON object, got int"):
        _source(items)
    one = _lines(tmp_path, "one.json", ["{", '  "prompt": "a",', '  "answer": 1', "}"])
    with pytest.raises(DatasetError, match=r"one.json: one JSON object over several lines \(keys: prompt, answer\)"):
        _source(one)


def test_a_directory_is_named_as_a_directory(tmp_path: Path) -> None:
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "rows.jsonl").write_text('{"prompt": "a", "answer": 1}\n')
    with pytest.raises(
        DatasetError,
        match=r"folder is a directory but not one written by `datasets` save_to_disk \(it holds no state.json",
    ):
        _source(folder)
    with pytest.raises(DatasetError, match=r"dataset file '.*folder' is a directory, not a JSONL file \(data.path\)"):
        make_source(DataConfig(task="jsonl", path=str(folder)))
    parquet = _write(tmp_path, "rows.parquet", ROWS)  # read as JSON lines: "N invalid row(s): not valid UTF-8"
    with pytest.raises(DatasetError, match=r"rows.parquet' is a .parquet file, not JSONL: data.task=dataset reads it"):
        make_source(DataConfig(task="jsonl", path=str(parquet)))


def test_a_pipe_as_data_path_is_named_as_such_not_as_missing(tmp_path: Path) -> None:
    import os

    from common.tasks.jsonl import load_rows

    os.mkfifo(tmp_path / "rows.jsonl")
    with pytest.raises(DatasetError, match=r"is not a regular file \(a pipe or a device"):
        load_rows(tmp_path / "rows.jsonl", "prompt", "answer")


def test_counting_prompt_tokens_with_a_tokenizer_that_ships_code_is_a_clear_error(tmp_path: Path) -> None:
    """data.max_prompt_tokens loads the tokenizer without running its code: one that needs it is named, with the
    way out, instead of transformers' traceback."""
    import shutil

    from common.builtin_model import resolve_model_path

    tokenizer_dir = tmp_path / "tok"
    shutil.copytree(resolve_model_path("builtin:micro", log=lambda *a: None), tokenizer_dir)
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config |= {"tokenizer_class": "MyTokenizer", "auto_map": {"AutoTokenizer": [None, "my_tokenizer.MyTokenizer"]}}
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config))
    rows = _write(tmp_path, "rows.jsonl", [{"prompt": "1+1=", "answer": "2"}] * 4)
    with pytest.raises(DatasetError, match="data.max_prompt_tokens: cannot load the tokenizer .* set data.max_prompt"):
        make_source(DataConfig(task="dataset", path=str(rows), max_prompt_tokens=8, tokenizer=str(tokenizer_dir)))
