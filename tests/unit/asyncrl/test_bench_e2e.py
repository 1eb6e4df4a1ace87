"""`asyncrl bench e2e` in its --quick form: both sides saw the same prompts, scored by the same reward, and every
ratio is written. No timing assertions (the figures are whatever this machine gives)."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.bench import write_json
from asyncrl.bench.e2e_fairness import FairnessError, asyncrl_samples, check_run, trl_samples
from asyncrl.bench.e2e_metrics import PIPELINE_FILL_STEPS, RATIO_NAMES, ratios, rolling_accuracy, run_figures
from asyncrl.bench.e2e_runs import Run, StepRow
from asyncrl.bench.e2e_workloads import data_config
from common.tasks import make_source

GROUPS, GROUP_SIZE = 16, 8
"""configs/dapo_int8.yaml's shape, which the built-in workload copies."""


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory):
    from asyncrl.bench.e2e_bench import run

    work = tmp_path_factory.mktemp("e2e")
    return run(True, work_dir=str(work)), work


def _run(result, key: str) -> dict:
    return result.details["runs"][key][0]


@pytest.mark.slow
@pytest.mark.timeout(1500)  # 6 asyncrl start-ups and 3 TRL ones on a shared 2-core machine
def test_quick_writes_every_ratio_and_the_trl_settings(quick, tmp_path: Path) -> None:
    result, _ = quick
    assert set(result.ratios) == set(RATIO_NAMES)
    throughput = [name for name in RATIO_NAMES if name != "e2e_vs_trl_time_to_acc"  # the target needs > 4 steps
                  and name != "generated_per_trained"]  # fmt: skip  # asyncrl's own config: not run by --quick
    assert math.isnan(result.ratios["generated_per_trained"])
    assert all(math.isfinite(result.ratios[name]) and result.ratios[name] > 0 for name in throughput)
    write_json(result, str(tmp_path / "e2e.json"))
    written = json.loads((tmp_path / "e2e.json").read_text())
    assert set(written["ratios"]) == set(RATIO_NAMES)
    trl = written["details"]["trl_settings"]["builtin_trl"]
    resolved = trl["resolved"]
    assert trl["set"]["num_generations"] == GROUP_SIZE and resolved["num_generations"] == GROUP_SIZE
    assert resolved["per_device_train_batch_size"] == GROUPS * GROUP_SIZE
    assert resolved["max_completion_length"] == 8 and resolved["temperature"] == 1.0
    assert resolved["learning_rate"] == 1e-4 and resolved["loss_type"] == "dapo" and resolved["beta"] == 0.0
    assert (resolved["epsilon"], resolved["epsilon_high"]) == (0.2, 0.28)
    assert resolved["bf16"] is False and resolved["use_vllm"] is False and resolved["shuffle_dataset"] is False
    assert trl["torch_threads"] == written["metrics"]["cores"]
    assert trl["reward_funcs"] == ["task_reward", "soft_overlong_punishment(8, 4)"]  # the config's algo.overlong
    from learner.group import LEARNER_MALLOC

    assert trl["malloc"] == {} and written["details"]["trl_settings"]["decode_trl"]["malloc"] == {}
    assert written["details"]["trl_settings"]["decode_trl_malloc"]["malloc"] == LEARNER_MALLOC  # every one took
    assert written["metrics"]["decode_async_vs_trl_malloc_samples_s"] > 0
    async_argv = written["details"]["asyncrl_argv"]
    assert "staleness.max_lag=0" in async_argv["decode_sync"] and "quant.scheme=none" in async_argv["decode_fp32"]
    assert all("algo.filter_groups=false" in argv for argv in async_argv.values())
    from asyncrl.bench.engine_bench import int8_kernel, lora_int8_kernel

    kernels = {"int8": int8_kernel(), "lora_int8": lora_int8_kernel()}
    assert written["details"]["kernel_by_scheme"] == kernels and "cpu_isa" in written["details"]
    metrics = written["metrics"]
    assert metrics["decode_train_floor_s"] > 0 and metrics["decode_fp32_gemm_gflops"] > 0
    assert metrics["decode_ceiling_vs_trl_samples_s"] > 0 and metrics["decode_ceiling_async_vs_sync"] > 0
    assert metrics["decode_gen_core_s_per_step_fp32"] > 0 and metrics["decode_gen_core_s_per_step_int8"] > 0
    assert metrics["decode_ceiling_int8_vs_fp32"] > 0 and metrics["decode_ceiling_int8_free_vs_fp32"] > 0


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_quick_both_sides_trained_the_same_prompts_with_our_reward(quick) -> None:
    result, _ = quick
    source = make_source(data_config())
    steps = result.details["workloads"][0]["steps"]
    trl = trl_samples(_run(result, "builtin_trl")["out_dir"])
    assert len(trl) == steps * GROUPS * GROUP_SIZE
    for k, sample in enumerate(trl):  # TRL's step s: problems s*16 .. s*16+15 of our stream, 8 samples each
        problem = source.train(k // GROUP_SIZE)
        assert (sample.step, sample.prompt, sample.answer) == (k // (GROUPS * GROUP_SIZE), problem.prompt,
                                                                problem.answer)  # fmt: skip
        assert sample.reward == source.reward(sample.response, problem.answer)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(result.details["workloads"][0]["model_dir"])
    answers = {i: source.train(i).answer for i in range(4 * steps * GROUPS)}
    ours = asyncrl_samples(_run(result, "builtin_async")["out_dir"], tokenizer, answers)
    assert len(ours) == len(trl)
    assert {s.step for s in ours} == {s.step for s in trl}
    for sample in ours:
        assert sample.prompt == source.train(sample.prompt_index).prompt
        assert sample.reward == source.reward(sample.response, sample.answer)
    assert {s.reward for s in ours} == {0.0, 1.0} and {s.reward for s in trl} == {0.0, 1.0}
    checked = result.metrics
    assert checked["builtin_trl_samples_checked"] == checked["builtin_async_samples_checked"] == len(trl)
    assert checked["decode_trl_malloc_samples_checked"] == checked["decode_trl_samples_checked"] > 0
    sync = asyncrl_samples(_run(result, "decode_sync")["out_dir"], tokenizer, answers)
    decode_groups = result.details["workloads"][1]["groups_per_step"]
    for sample in sync:  # synchronous: step s trains exactly problems s*G .. s*G+G-1
        assert sample.prompt_index // decode_groups == sample.step


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_fairness_check_fails_on_another_reward_or_prompt(quick, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from asyncrl.bench.e2e_workloads import Workload

    result, work = quick
    workload = Workload(**result.details["workloads"][0])
    rows = [json.loads(line) for line in (work / "builtin_prompts.jsonl").read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(workload.model_dir)
    trl_run = Run(**{**_run(result, "builtin_trl"), "rows": [], "out_dir": str(tmp_path / "trl")})
    shutil.copytree(_run(result, "builtin_trl")["out_dir"], tmp_path / "trl", ignore=shutil.ignore_patterns("final"))
    log = tmp_path / "trl" / "rewards.jsonl"
    batches = [json.loads(line) for line in log.read_text().splitlines()]
    assert check_run(trl_run, workload, rows, data_config(), tokenizer) == len(batches) * GROUPS * GROUP_SIZE
    batches[-1]["rewards"][0] = 1.0 - batches[-1]["rewards"][0]
    log.write_text("".join(json.dumps(batch) + "\n" for batch in batches))
    with pytest.raises(FairnessError, match="reward"):
        check_run(trl_run, workload, rows, data_config(), tokenizer)
    async_run = Run(**{**_run(result, "builtin_async"), "rows": []})
    shifted = [{**row, "prompt": "1+1="} if row["index"] == 3 else row for row in rows]
    with pytest.raises(FairnessError, match="problem 3"):
        check_run(async_run, workload, shifted, data_config(), tokenizer)
    cut = rows[: workload.groups_per_step]  # a dump that ends before the problems of the run's later steps
    with pytest.raises(FairnessError, match="not the dump's"):  # a pinned contender must train the dump's problems
        check_run(async_run, workload, cut, data_config(), tokenizer)
    own = Run(**{**_run(result, "builtin_async"), "rows": [], "contender": "best"})  # asyncrl's own config reads on
    assert check_run(own, workload, cut, data_config(), tokenizer) == checked_async(result)
    with pytest.raises(FairnessError, match="problem 3"):  # past the dump it reads the stream, before it the dump
        check_run(own, workload, shifted, data_config(), tokenizer)


def checked_async(result) -> int:  # noqa: ANN001 - a BenchResult
    return int(result.metrics["builtin_async_samples_checked"])


def test_time_to_accuracy_uses_a_rolling_mean_fixed_before_the_run() -> None:
    accuracies = [0.5, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]
    rolling = rolling_accuracy(accuracies)
    assert all(math.isnan(value) for value in rolling[:4]) and rolling[4:] == pytest.approx([0.82, 0.9, 0.9])
    rows = [StepRow(step=k, end_s=10.0 + k, accuracy=a, trained_samples=128, generated_samples=128,
                    generated_tokens=512) for k, a in enumerate(accuracies)]  # fmt: skip
    run = Run(workload="builtin", contender="trl", seed=0, out_dir="", rows=rows, total_generated_samples=896,
              gen_core_s_per_sample=0.01)  # fmt: skip
    figures = run_figures(run)
    assert figures["steps_to_acc"] == 6 and figures["time_to_acc_s"] == 15.0  # (0.5 + 4 * 0.9) / 5 = 0.82 < 0.85
    assert figures["launch_s"] == 10.0 and figures["steady_step_s"] == 1.0 and figures["gen_per_trained"] == 1.0


def test_a_run_that_misses_the_target_bounds_the_time_to_it_by_its_end() -> None:
    """A seed that never reaches the target has no time to it (nan, so the ratio is nan) but a censored one, its
    run's end; where TRL missed in some seed and ours reached it in all, TRL's censored mean over ours bounds the
    ratio from below. Nothing is claimed where ours missed, or where TRL reached it everywhere."""
    from asyncrl.bench.e2e_metrics import contender_figures, time_to_acc_bound

    def run(accuracies: list[float], contender: str, step_s: float) -> Run:
        rows = [StepRow(step=k, end_s=4.0 + step_s * (k + 1), accuracy=a, trained_samples=128, generated_samples=128,
                        generated_tokens=512) for k, a in enumerate(accuracies)]  # fmt: skip
        return Run(workload="builtin", contender=contender, seed=0, out_dir="", rows=rows,
                   total_generated_samples=128 * len(rows), gen_core_s_per_sample=0.01)  # fmt: skip

    missed, learned = [0.5] * 10, [0.5, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]
    figures = run_figures(run(missed, "trl", 1.0))
    assert math.isnan(figures["time_to_acc_s"]) and figures["reached_acc"] == 0.0
    assert figures["time_to_acc_censored_s"] == 14.0  # the run's last step ends at 4 + 10 * 1
    assert run_figures(run(learned, "trl", 1.0))["time_to_acc_censored_s"] == 10.0  # reached at step 6: its time
    trl = contender_figures([run(missed, "trl", 1.0), run(learned, "trl", 1.0)])
    ours = contender_figures([run(learned, "async", 0.5), run(learned, "async", 0.5)])
    assert trl["reached_acc"] == 0.5 and math.isnan(trl["time_to_acc_s_mean"])
    bound = time_to_acc_bound({"builtin_trl": trl, "builtin_async": ours})
    assert bound == {"builtin_time_to_acc_vs_trl_at_least": pytest.approx((14.0 + 10.0) / 2 / 7.0)}  # ours 4 + 6 * 0.5
    assert math.isnan(ratios({"builtin_trl": trl, "builtin_async": ours}, math.nan)["e2e_vs_trl_time_to_acc"])
    ours_missed = contender_figures([run(learned, "async", 0.5), run(missed, "async", 0.5)])
    assert time_to_acc_bound({"builtin_trl": trl, "builtin_async": ours_missed}) == {}
    assert time_to_acc_bound({"builtin_trl": ours, "builtin_async": ours}) == {}  # reached everywhere: the ratio


def test_the_steady_window_starts_after_the_run_ahead_has_filled() -> None:
    # the decode workload's fp32 contender as measured: long waits while the run-ahead fills, then 19.6 s a step
    step_s = [24.4, 35.7, 22.8, 22.3] + [19.6] * 12
    ends = [sum(step_s[: k + 1]) for k in range(len(step_s))]
    rows = [StepRow(step=k, end_s=end, accuracy=0.0, trained_samples=32, generated_samples=32,
                    generated_tokens=4096) for k, end in enumerate(ends)]  # fmt: skip
    run = Run(workload="decode", contender="fp32", seed=0, out_dir="", rows=rows, total_generated_samples=512,
              gen_core_s_per_sample=1.3)  # fmt: skip
    assert PIPELINE_FILL_STEPS == 4
    assert run_figures(run)["steady_step_s"] == pytest.approx(19.6)  # not (35.7 + 22.8 + 22.3 + 19.6 * 12) / 15
    short = dataclasses.replace(run, rows=rows[:3])  # shorter than the filling: its last step is the window
    assert run_figures(short)["steady_step_s"] == pytest.approx(22.8)


def test_a_step_without_an_accuracy_is_left_out_of_the_rolling_mean() -> None:
    # a fast learner can train two steps with no response generated between them: acc/mean is null
    rolling = rolling_accuracy([0.8, math.nan, 0.8, 0.9, 0.9, math.nan, math.nan, math.nan, math.nan, math.nan])
    assert all(math.isnan(value) for value in rolling[:4])
    assert rolling[4:9] == pytest.approx([0.85, 2.6 / 3, 2.6 / 3, 0.9, 0.9])
    assert math.isnan(rolling[9])  # a whole window without one: no figure, not a made-up one


def test_bench_refuses_without_trl_and_names_the_extra() -> None:
    code = "import sys; sys.modules['trl'] = None; from asyncrl.cli import main; sys.exit(main(['bench', 'e2e']))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2  # refused input (it was 1, a failed run's code)
    assert "needs trl" in done.stderr and "pip install 'asyncrl[bench]'" in done.stderr


def test_a_gpu_learner_device_is_refused_here_before_anything_runs_and_moves_trl_too(tmp_path: Path) -> None:
    from asyncrl.bench.e2e_bench import _trl_settings
    from asyncrl.bench.e2e_workloads import Workload
    from common.config import load_config

    code = ("import sys, torch; torch.cuda.is_available = lambda: False; from asyncrl.cli import main; "
            "sys.exit(main(['bench', 'e2e', '--quick', '--learner-device', 'cuda']))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and "--learner-device cuda: this machine sees no GPU" in done.stderr
    assert not (tmp_path / "runs").exists()  # refused before the bench made its work directory
    done = subprocess.run([sys.executable, "-m", "asyncrl.cli", "bench", "e2e", "--learner-device", "tpu"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2 and "--learner-device must be cpu, cuda or cuda:N, got 'tpu'" in done.stderr
    workload = Workload(name="builtin", model_dir="m", steps=2, groups_per_step=2, group_size=2, max_new_tokens=4,
                        learns=True)  # fmt: skip
    for device, use_cpu in (("cpu", True), ("cuda", False)):  # TRL generates and trains where our learner trains
        config = load_config(None, [f"learner.device={device}"])
        assert _trl_settings(workload, 0, tmp_path / "trl", config)["use_cpu"] is use_cpu


def test_a_bad_set_is_refused_before_anything_runs(tmp_path: Path) -> None:
    for args, message in (
        (["--set", "nonsense.key=1"], "--set: config error: override 'nonsense.key=1': unknown"),
        (["--set", "precision.train"], "--set takes KEY=VALUE config overrides, got precision.train"),
    ):
        done = subprocess.run([sys.executable, "-m", "asyncrl.cli", "bench", "e2e", "--quick", *args],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)  # fmt: skip
        assert done.returncode == 2 and message in done.stderr, done.stderr
        assert not (tmp_path / "runs").exists()  # refused before the bench made its work directory


@pytest.mark.slow
def test_set_reaches_every_asyncrl_contender_and_the_json(tmp_path: Path) -> None:
    from asyncrl.bench.e2e_bench import run

    result = run(True, work_dir=str(tmp_path), workloads="builtin", contenders="async", steps=2,
                 asyncrl_set=["learner.threads=1", "precision.train=bf16"])  # fmt: skip
    argv = result.details["asyncrl_argv"]["builtin_async"]
    at = argv.index("learner.threads=1")  # after the workload's own overrides, before the contender's
    assert argv[at + 1] == "precision.train=bf16" and "algo.filter_groups=false" in argv[at:]
    config = json.loads(next((tmp_path / "runs").glob("*/config.json")).read_text())
    assert config["learner"]["threads"] == 1 and config["precision"]["train"] == "bf16"
    assert list(result.details["workloads"][0]["overrides"][-2:]) == ["learner.threads=1", "precision.train=bf16"]


def test_bench_json_is_strict_with_null_for_a_figure_never_reached(tmp_path: Path) -> None:
    from asyncrl.bench import BenchResult

    result = BenchResult(
        name="e2e",
        metrics={"builtin_trl_time_to_acc_s_mean": math.nan, "launch_s": 4.0, "over": math.inf},
        ratios={"e2e_vs_trl_time_to_acc": math.nan, "e2e_launch_vs_trl": 1.25},
        details={"runs": {"builtin_trl": [{"heldout_acc": math.nan, "load_1m": (0.5, -math.inf)}]}},
    )
    path = tmp_path / "e2e.json"
    write_json(result, str(path))
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text

    def refuse(token: str) -> float:
        raise ValueError(f"not strict JSON: {token}")

    written = json.loads(text, parse_constant=refuse)  # a strict reader: NaN / Infinity would raise
    assert written["ratios"] == {"e2e_vs_trl_time_to_acc": None, "e2e_launch_vs_trl": 1.25}
    assert written["metrics"] == {"builtin_trl_time_to_acc_s_mean": None, "launch_s": 4.0, "over": None}
    assert written["details"]["runs"]["builtin_trl"][0] == {"heldout_acc": None, "load_1m": [0.5, None]}


def test_the_learners_core_share_follows_the_threads_it_logged_per_step() -> None:
    from asyncrl.bench.e2e_runs import _learner_threads

    config = {"learner": {"threads": 1}}
    steps = [{"step": 0, "learner/threads": 1}, {"step": 1, "learner/threads": 2}, {"event": "eval"}]
    assert _learner_threads(steps, config) == 1.5  # the measured policy changed it between steps
    assert _learner_threads([{"step": 0}], config) == 1.0  # a run that logged none: the configured count


def test_generated_per_trained_is_asyncrls_own_config_on_the_builtin_workload() -> None:
    rows = [StepRow(step=k, end_s=1.0 + k, accuracy=0.5, trained_samples=128, generated_samples=170,
                    generated_tokens=512) for k in range(5)]  # fmt: skip
    runs = {  # asyncrl's own config generated 1.33 samples per trained one; the pinned async contender 1.0
        "builtin_best": Run(workload="builtin", contender="best", seed=0, out_dir="", rows=rows,
                            total_generated_samples=851.2, gen_core_s_per_sample=0.1),
        "builtin_async": Run(workload="builtin", contender="async", seed=0, out_dir="", rows=rows,
                             total_generated_samples=640, gen_core_s_per_sample=0.1),
    }  # fmt: skip
    written = ratios({key: run_figures(run) for key, run in runs.items()}, math.nan)
    assert written["generated_per_trained"] == pytest.approx(851.2 / 640)
    assert math.isnan(ratios({"builtin_async": run_figures(runs["builtin_async"])}, math.nan)["generated_per_trained"])


def test_a_failed_fairness_check_still_writes_the_json_and_exits_nonzero(tmp_path: Path, monkeypatch, capsys) -> None:
    """The bench's figures are kept on disk with the failure named in them; the command fails."""
    import asyncrl.bench as bench_module
    from asyncrl.bench import BenchResult
    from asyncrl.cli import main

    failed = BenchResult(
        "e2e",
        {"builtin_async_samples_checked": math.nan},
        {"e2e_launch_vs_trl": 0.8},
        {"fairness_errors": ["builtin/async/seed 0: step 1 trained other problems than 16.."]},
    )
    monkeypatch.setattr(bench_module, "resolve", lambda name: lambda quick, **options: failed)
    path = tmp_path / "e2e.json"
    assert main(["bench", "e2e", "--quick", "--json", str(path)]) == 1
    written = json.loads(path.read_text())
    assert written["ratios"] == {"e2e_launch_vs_trl": 0.8} and written["details"]["fairness_errors"]
    assert "fairness check failed: builtin/async/seed 0" in capsys.readouterr().err


def test_the_lora_contender_is_configs_dapo_int8_lora_with_dynamic_sampling_off() -> None:
    from asyncrl.bench.e2e_bench import CONFIG_PATH, _contenders, _lora_vs_full
    from asyncrl.bench.e2e_runs import ASYNCRL_CONTENDERS, LORA_OVERRIDES
    from common.config import load_config

    lora_path = CONFIG_PATH.with_name("dapo_int8_lora.yaml")
    shipped, built = load_config(str(lora_path), []), load_config(str(CONFIG_PATH), list(LORA_OVERRIDES))
    built.logging.name = shipped.logging.name  # the run's default name follows the config file's
    assert built == shipped  # the contender runs the shipped LoRA config, nothing else changed
    assert "algo.filter_groups=false" in ASYNCRL_CONTENDERS["lora"]  # a throughput row, as `async`
    assert "lora" in _contenders("builtin", False, None) and "lora" not in _contenders("decode", False, None)
    figures = {key: {"steady_samples_s": s, "final_train_acc_mean": a, "heldout_acc_mean": h}
               for key, s, a, h in (("builtin_lora", 3.0, 0.9, 0.95), ("builtin_async", 2.0, 0.8, 0.99))}  # fmt: skip
    out = _lora_vs_full(figures)
    assert out["builtin_lora_vs_async_steady_samples_s"] == 1.5
    assert out["builtin_lora_minus_async_final_train_acc"] == pytest.approx(0.1)
    assert out["builtin_lora_minus_async_heldout_acc"] == pytest.approx(-0.04)
    assert _lora_vs_full({"builtin_async": figures["builtin_async"]}) == {}


def test_trl_s_overlong_punishment_is_our_overlong_shaping() -> None:
    """Both sides' advantages come from the same shaped reward: TRL's soft overlong punishment at the config's
    lengths equals `learner.batch.overlong_shaping` at every response length, a truncated one included (-1)."""
    import torch
    from trl.rewards import get_soft_overlong_punishment

    from learner.batch import overlong_shaping

    max_len, cache_len = 8, 4  # configs/dapo_int8.yaml: rollout.max_new_tokens, algo.overlong.len
    lengths = list(range(1, max_len + 1)) + [max_len]
    truncated = [False] * max_len + [True]  # the last: cut at max_len without an EOS
    theirs = get_soft_overlong_punishment(max_len, cache_len)([[1] * n for n in lengths])
    ours = overlong_shaping(torch.tensor(lengths), torch.tensor(truncated), max_len, cache_len).tolist()
    assert ours == pytest.approx(theirs, abs=1e-7)
    assert ours[:4] == [0.0] * 4 and ours[4] == pytest.approx(-0.25) and ours[-1] == -1.0


def _decode_run(contender: str, step_s: float, train_s: float, gen_core_s_per_sample: float) -> Run:
    rows = [StepRow(step=k, end_s=step_s * (k + 1), accuracy=0.0, trained_samples=32, generated_samples=32,
                    generated_tokens=32 * 128, train_s=train_s, wait_s=step_s - train_s) for k in range(5)]  # fmt: skip
    settings = {"argv": [], "learner_core_s_per_train_s": 2.0}
    return Run(workload="decode", contender=contender, seed=0, out_dir="", rows=rows, total_generated_samples=160,
               gen_core_s_per_sample=gen_core_s_per_sample, settings=settings)  # fmt: skip


def test_the_decode_ceilings_are_written_from_the_runs_that_ran(tmp_path: Path) -> None:
    from asyncrl.bench.e2e_bench import _result
    from asyncrl.bench.e2e_workloads import Workload

    workload = Workload(name="decode", model_dir="", steps=5, groups_per_step=4, group_size=8, max_new_tokens=128,
                        learns=False)  # fmt: skip
    runs = {"decode_async": [_decode_run("async", 16.0, 14.4, 0.1)],
            "decode_sync": [_decode_run("sync", 16.0, 14.0, 0.1)],  # training 28 core-s, generation 3.2 a step
            "decode_fp32": [_decode_run("fp32", 20.0, 14.0, 0.4)]}  # fmt: skip
    floor = {"decode_train_floor_s": 12.0, "decode_gen_core_s_per_step_int8": 3.0,
             "decode_gen_core_s_per_step_fp32": 11.0}  # fmt: skip
    metrics = _result([workload], runs, floor, 100_000_000, {"decode": 1}, tmp_path).metrics
    assert metrics["decode_ceiling_int8_vs_fp32"] == pytest.approx((28.0 + 11.0) / (28.0 + 3.0))
    assert metrics["decode_ceiling_async_vs_sync"] == pytest.approx(16.0 / ((28.0 + 3.2) / 2))
    assert metrics["decode_ceiling_int8_free_vs_fp32"] == pytest.approx(20.0 / 14.4)  # fp32 step / INT8 training
    assert "decode_async_vs_trl_malloc_samples_s" not in metrics  # no such contender ran
    runs["decode_trl_malloc"] = [_decode_run("trl_malloc", 30.0, 17.0, 0.8)]
    metrics = _result([workload], runs, floor, 100_000_000, {"decode": 1}, tmp_path).metrics
    assert metrics["decode_async_vs_trl_malloc_samples_s"] == pytest.approx(30.0 / 16.0)
    assert metrics["decode_ceiling_int8_vs_fp32"] == pytest.approx((28.0 + 11.0) / (28.0 + 3.0))
    del runs["decode_sync"]  # without the synchronous run: no packing bound, but the free-INT8 ceiling stands
    metrics = _result([workload], runs, floor, 100_000_000, {"decode": 1}, tmp_path).metrics
    assert metrics["decode_ceiling_int8_free_vs_fp32"] == pytest.approx(20.0 / 14.4)
    assert "decode_ceiling_int8_vs_fp32" not in metrics and "decode_ceiling_async_vs_sync" not in metrics
