"""`asyncrl bench e2e`: asyncrl against TRL's `GRPOTrainer` and against itself run synchronously, end to end.

What a user decides on: given the same model, prompts, reward and batch, which reaches the accuracy sooner and
trains more samples per second? Each contender runs as its own process, one after the other, on all the machine's
cores (`asyncrl.bench.e2e_runs`): TRL `GRPOTrainer` (`asyncrl.bench.e2e_trl`); asyncrl asynchronous (the config's
`staleness.max_lag`), synchronous (`max_lag=0`) and with fp32 rollout (`quant.scheme=none`), all with dynamic
sampling off; on the built-in workload also asyncrl's own best config (dynamic sampling on). The contender order
rotates with the seed so that a noisy neighbour does not always land on the same one.

Pinned for fairness (`asyncrl.bench.e2e_workloads`): the same model directory, the same prompts in the same order
(dumped from our task; TRL reads the dump), the same reward (ours, called by TRL), group size, prompts per step,
max new tokens, temperature, learning rate, clipping and token-mean loss, no KL, fp32 training; every TRL setting is
in the JSON's `details.trl_settings`. After the runs, `asyncrl.bench.e2e_fairness` re-reads what every contender
actually trained on (TRL's reward log, asyncrl's buffer journal) and fails the bench on any other prompt or reward.

Workloads: `builtin` (the built-in task and model: overhead-bound; accuracy over `seeds` seeds, held-out greedy
accuracy of every final model by one shared evaluation) and `decode` (a random ~100M-parameter Llama, 128 new
tokens: throughput only). `quick` (CI) runs a few steps, one seed, a small decode model, and on the built-in
workload only the contenders the ratios need (TRL, asyncrl asynchronous). The figures and the bound are defined
in `asyncrl.bench.e2e_metrics`; the ratios carry the issue's names (`e2e_metrics.RATIO_NAMES`).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from asyncrl.bench import BenchResult
from asyncrl.bench import e2e_metrics as figures_of
from asyncrl.bench.e2e_runs import ASYNCRL_CONTENDERS, Run, load_asyncrl_config, run_asyncrl, run_trl
from asyncrl.bench.e2e_workloads import (
    FULL_DECODE_SHAPE,
    QUICK_DECODE_SHAPE,
    Workload,
    build_decode_model,
    builtin_model_dir,
    data_config,
    dump_prompts,
    heldout_greedy_accuracy,
    parameter_count,
)

CONFIG_PATH = Path(__file__).resolve().parents[2] / "configs" / "dapo_int8.yaml"
"""The asyncrl job every contender is shaped after (16 prompts x 8 samples, 8 new tokens, DAPO, INT8 rollout)."""
INSTALL_HINT = "pip install 'asyncrl[bench]'"
DECODE_NEW_TOKENS = 128
DECODE_GROUPS = 4
"""Prompts per step on the decode workload: x 8 samples x 128 tokens, a 100M-model step takes a minute or more on 2
cores (the learner's backward alone 50-70 s), so the full run takes 4 steps (1 warm-up, 3 steady) of each."""
RUN_TIMEOUT_S = {True: 900.0, False: 3600.0}


def missing_packages() -> list[str]:
    """The `asyncrl[bench]` packages this bench needs that cannot be imported here."""
    missing = []
    for name in ("trl", "datasets"):
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a module blocked in sys.modules has no spec
            found = False
        if not found:
            missing.append(name)
    return missing


def _workloads(quick: bool, work: Path) -> list[Workload]:
    config = load_asyncrl_config(str(CONFIG_PATH))
    builtin = Workload(
        name="builtin", model_dir=builtin_model_dir(), steps=4 if quick else 60,
        groups_per_step=config.train.groups_per_step, group_size=config.train.group_size,
        max_new_tokens=config.rollout.max_new_tokens, learns=True,
    )  # fmt: skip
    shape = QUICK_DECODE_SHAPE if quick else FULL_DECODE_SHAPE
    decode_dir = build_decode_model(work / "decode_model", shape, DECODE_NEW_TOKENS)
    decode = Workload(
        name="decode", model_dir=decode_dir, steps=3 if quick else 4, groups_per_step=DECODE_GROUPS,
        group_size=config.train.group_size, max_new_tokens=DECODE_NEW_TOKENS, learns=False,
    )  # fmt: skip
    return [builtin, decode]


def _contenders(workload: Workload, quick: bool) -> list[str]:
    if workload.name == "builtin":
        return ["trl", "async"] if quick else ["trl", *ASYNCRL_CONTENDERS]
    return ["trl", "async", "sync", "fp32"]  # `best` filters zero-variance groups: a random model has only those


def _trl_settings(workload: Workload, seed: int, out_dir: Path) -> dict[str, Any]:
    from asyncrl.bench.e2e_trl import trl_settings

    config = load_asyncrl_config(str(CONFIG_PATH))
    if config.loss.agg != "token_mean" or config.algo.adv != "grpo":
        raise ValueError(f"{CONFIG_PATH}: TRL's shape is set for loss.agg=token_mean and algo.adv=grpo")
    return trl_settings(
        out_dir=str(out_dir), seed=seed, steps=workload.steps, groups_per_step=workload.groups_per_step,
        group_size=workload.group_size, max_new_tokens=workload.max_new_tokens,
        temperature=config.rollout.temperature, lr=config.optim.lr, eps_low=config.loss.eps_low,
        eps_high=config.loss.eps_high, grad_clip=config.optim.grad_clip, weight_decay=config.optim.weight_decay,
        betas=tuple(config.optim.betas),
    )  # fmt: skip


def _run_one(workload: Workload, contender: str, seed: int, work: Path, prompts_path: Path, quick: bool) -> Run:
    timeout_s = RUN_TIMEOUT_S[quick]
    if contender == "trl":
        settings = _trl_settings(workload, seed, work / "trl" / f"{workload.name}-trl-s{seed}")
        return run_trl(settings, workload, data_config(), seed, work, prompts_path, timeout_s)
    return run_asyncrl(str(CONFIG_PATH), workload, contender, seed, work, timeout_s)


def _run_all(workloads: list[Workload], seeds: int, work: Path, quick: bool) -> dict[str, list[Run]]:
    """Every contender of every workload, one process at a time; runs keyed `<workload>_<contender>`."""
    from rich.console import Console

    console = Console(stderr=True)
    runs: dict[str, list[Run]] = {}
    for workload in workloads:
        steps_dumped = 3 * workload.steps + 8  # asyncrl runs ahead, and `best` drops zero-variance groups
        dumped = Workload(**{**asdict(workload), "steps": steps_dumped})
        prompts_path = work / f"{workload.name}_prompts.jsonl"
        dump_prompts(dumped, data_config(), prompts_path)
        contenders = _contenders(workload, quick)
        for seed in range(seeds if workload.learns else 1):
            for contender in contenders[seed % len(contenders) :] + contenders[: seed % len(contenders)]:
                started, load_before = time.monotonic(), os.getloadavg()[0]
                console.print(f"bench e2e: {workload.name} {contender} seed {seed} (load {load_before:.1f}) ...")
                run = _run_one(workload, contender, seed, work, prompts_path, quick)
                run.load_1m = (load_before, os.getloadavg()[0])
                runs.setdefault(f"{workload.name}_{contender}", []).append(run)
                console.print(f"bench e2e: {workload.name} {contender} seed {seed}: {len(run.rows)} steps in "
                              f"{time.monotonic() - started:.0f} s, first step at {run.launch_s:.1f} s")  # fmt: skip
    return runs


def _check_and_evaluate(workloads: list[Workload], runs: dict[str, list[Run]], work: Path) -> dict[str, float]:
    """The fairness check of every run, then the shared held-out evaluation of every final model."""
    import json

    from transformers import AutoTokenizer

    from asyncrl.bench.e2e_fairness import check_run

    checked: dict[str, float] = {}
    for workload in workloads:
        tokenizer = AutoTokenizer.from_pretrained(workload.model_dir)
        rows = [json.loads(line) for line in (work / f"{workload.name}_prompts.jsonl").read_text().splitlines()]
        for key in [k for k in runs if k.startswith(f"{workload.name}_")]:
            checked[f"{key}_samples_checked"] = float(
                sum(check_run(run, workload, rows, data_config(), tokenizer) for run in runs[key])
            )
            for run in runs[key]:
                if workload.learns and run.final_dir:
                    run.heldout_acc = heldout_greedy_accuracy(
                        run.final_dir, workload.model_dir, data_config(), workload.max_new_tokens
                    )
    return checked


def run(quick: bool, seeds: int | None = None, work_dir: str | None = None) -> BenchResult:
    """The whole bench (see the module doc); `seeds` defaults to 3 (1 with `quick`); runs are kept in `work_dir`."""
    missing = missing_packages()
    if missing:
        raise SystemExit(f"asyncrl bench e2e needs {' and '.join(missing)}: {INSTALL_HINT}")
    seeds = seeds or (1 if quick else 3)
    Path("runs").mkdir(exist_ok=True)
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="bench-e2e-", dir="runs")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    workloads = _workloads(quick, work)
    decode_params = parameter_count(workloads[1].model_dir)
    try:
        runs = _run_all(workloads, seeds, work, quick)
        checked = _check_and_evaluate(workloads, runs, work)
    finally:
        shutil.rmtree(workloads[1].model_dir, ignore_errors=True)  # 400 MB of random weights
    return _result(workloads, runs, checked, decode_params, seeds, work)


def _result(workloads: list[Workload], runs: dict[str, list[Run]], checked: dict[str, float], decode_params: int,
            seeds: int, work: Path) -> BenchResult:  # fmt: skip
    from asyncrl.bench.e2e_table import print_contenders

    figures = {key: figures_of.contender_figures(key_runs) for key, key_runs in runs.items()}
    decode = workloads[1]
    cores = len(os.sched_getaffinity(0))
    bound_s = figures_of.bound_step_s(runs["decode_sync"][0], decode.samples_per_step, cores)
    metrics = {f"{key}_{name}": value for key, values in figures.items() for name, value in values.items()}
    metrics.update(checked)
    metrics["max_load_1m"] = max(max(run.load_1m) for key_runs in runs.values() for run in key_runs)
    metrics.update(
        target_train_acc=figures_of.TARGET_ACC, cores=float(cores), decode_params=float(decode_params),
        decode_bound_step_s=bound_s,
        decode_bound_vs_trl_samples_s=figures["decode_trl"]["steady_step_s"] / bound_s,
    )  # fmt: skip
    ratios = figures_of.ratios(figures, bound_s)
    details = {
        "work_dir": str(work),
        "seeds": seeds,
        "workloads": [asdict(w) for w in workloads],
        "trl_settings": {key: runs[key][0].settings for key in runs if key.endswith("_trl")},
        "asyncrl_argv": {key: runs[key][0].settings["argv"] for key in runs if not key.endswith("_trl")},
        "accuracy_curves": {key: figures_of.accuracy_curve(r) for key, r in runs.items() if key.startswith("builtin")},
        "runs": {key: [run.to_json() for run in key_runs] for key, key_runs in runs.items()},
    }
    print_contenders(figures, ratios)
    if metrics["max_load_1m"] > cores / 2:
        print(
            f"bench e2e: the 1-minute load reached {metrics['max_load_1m']:.1f} on {cores} cores during the runs: "
            "other processes shared the cores, and a contender on several torch threads (TRL) suffers most"
        )
    return BenchResult(name="e2e", metrics=metrics, ratios=ratios, details=details)
