"""`asyncrl bench e2e`: asyncrl against TRL's `GRPOTrainer` and against itself run synchronously, end to end.

What a user decides on: given the same model, prompts, reward and batch, which reaches the accuracy sooner and
trains more samples per second? Each contender runs as its own process, one after the other, on all the machine's
cores (`asyncrl.bench.e2e_runs`): TRL `GRPOTrainer` (`asyncrl.bench.e2e_trl`); asyncrl asynchronous (the config's
`staleness.max_lag`), synchronous (`max_lag=0`) and with fp32 rollout (`quant.scheme=none`), all with dynamic
sampling off; on the built-in workload also asyncrl's own best config (dynamic sampling on) and LoRA (issue 20:
`configs/dapo_int8_lora.yaml`'s adapters and learning rate, dynamic sampling off; `builtin_lora_vs_async_*` set
it against full fine-tuning, `e2e_runs.LORA_OVERRIDES`). The contender order
rotates with the seed so that a noisy neighbour does not always land on the same one.

Pinned for fairness (`asyncrl.bench.e2e_workloads`): the same model directory, the same prompts in the same order
(dumped from our task; TRL reads the dump), the same reward (ours, called by TRL), group size, prompts per step,
max new tokens, temperature, learning rate, clipping and token-mean loss, no KL, fp32 training; every TRL setting is
in the JSON's `details.trl_settings`. After the runs, `asyncrl.bench.e2e_fairness` re-reads what every contender
actually trained on (TRL's reward log, asyncrl's buffer journal) and fails the bench on any other prompt or reward.

Workloads (`workloads`, default `DEFAULT_WORKLOADS`): `builtin` (the built-in task and model: overhead-bound;
accuracy over `seeds` seeds, held-out greedy accuracy of every final model by one shared evaluation), `decode` (a
random ~100M-parameter Llama, 128 new tokens: throughput only) and, opt-in (`asyncrl bench e2e --workloads smol`),
`smol`: issue 26's real-model run, SmolLM2-135M-Instruct on 345 chat-rendered "What is a ± b?" problems (8 prompts
x 8 samples, 16 new tokens, lr 2e-5, 20 steps, one seed unless `seeds` is given; `asyncrl.bench.e2e_smol`), the
held-out split scored by the math reward and by a last-number check. It downloads and converts the model once
(93 MB, ~30 s) and takes about 15 minutes a contender on 2 cores. `quick` (CI) runs a few steps, one seed, a small
decode model, the smol workload with a tiny random model (no download), and on the built-in and smol workloads only
the contenders the ratios need (TRL, asyncrl asynchronous); `steps` sets every workload's steps, `contenders`
keeps only the named ones. The figures and the bound are defined in `asyncrl.bench.e2e_metrics`; the ratios carry
the issues' names (`e2e_metrics.RATIO_NAMES`, `SMOL_RATIO_NAMES`), those of the workloads that ran. On the decode
workload the fp32 floor of a training step and the ceilings it sets (`asyncrl.bench.e2e_floor`) are measured after
the runs, on the idle cores.

`asyncrl_set` (`--set KEY=VALUE ...`): config overrides every asyncrl contender applies after the workload's, for
an experiment off the pins (the learner in bf16 autocast, another thread split); TRL's side is unchanged, the
overrides are in the JSON's `details.workloads` and `asyncrl_argv`, and the ratios compare that configuration.

`learner_device` (`--learner-device cuda`, for a machine with a GPU): every training side on the GPU, as
`learner.device` puts our learner there (rollout workers stay on the CPUs) and TRL (`use_cpu` off) its generation
and training. The CPU floor, the bound and the ceilings are not measured then (they bound a learner on these cores:
`e2e_fraction_of_bound_decode` is null). Written to the libraries' APIs and untested on GPU: no GPU was lent; a
machine without one is refused before anything runs.
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.bench import BenchInputError, BenchResult
from asyncrl.bench import e2e_metrics as figures_of
from asyncrl.bench.e2e_floor import ceilings as floor_ceilings
from asyncrl.bench.e2e_floor import decode_floor, generation_core_s, int8_free_ceiling
from asyncrl.bench.e2e_runs import (
    ASYNCRL_CONTENDERS,
    CONTENDERS,
    TRL_CONTENDERS,
    Run,
    load_asyncrl_config,
    run_asyncrl,
    run_trl,
)
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

if TYPE_CHECKING:
    from common.config import Config

CONFIG_PATH = Path(__file__).resolve().parents[2] / "configs" / "dapo_int8.yaml"
"""The asyncrl job every contender is shaped after (16 prompts x 8 samples, 8 new tokens, DAPO, INT8 rollout)."""
INSTALL_HINT = "pip install 'asyncrl[bench]'"
DECODE_NEW_TOKENS = 128
DECODE_GROUPS = 4
"""Prompts per step on the decode workload: x 8 samples x 128 tokens."""
BUILTIN_STEPS = 120
"""Steps of each contender on the built-in workload: room for every contender to reach the fixed target (train
accuracy 0.85, `e2e_metrics.TARGET_ACC`). On Zen 4 TRL reached it at step 41.7 ± 1.5, on the AMX Xeon at 81.3 ±
4.0 (the task learns slower there on every side; 2026-12-06): the earlier 60 steps left TRL short of it in every seed
there, and `e2e_vs_trl_time_to_acc` nan."""
DECODE_STEPS = 16
"""Steps of each contender on the full decode workload: 4 warm-up (start-up, then the run-ahead filling:
`e2e_metrics.PIPELINE_FILL_STEPS`) and 12 steady. A step takes 15-30 s on 2 cores, and consecutive steady steps of
one run differ by up to 0.7 s (Zen 4, 2026-12-05). The earlier 8-step run (1 warm-up, 7 steady) counted the filling
as steady: its `int8_vs_fp32_e2e` read 1.37-1.45 where the steady state is 1.31 (2026-12-06, 20 steps of each).
About 25 minutes for the four contenders."""
DECODE_OVERRIDES = ("learner.skip_zero_adv=false",)
"""The random decode model earns no reward, so every advantage is 0 and `learner.skip_zero_adv` would skip every
backward: the workload then measures no training at all. Off, the learner trains every row, as TRL does."""
RUN_TIMEOUT_S = {True: 900.0, False: 3600.0}
WORKLOADS = ("builtin", "decode", "smol")
DEFAULT_WORKLOADS = ("builtin", "decode")
"""What `asyncrl bench e2e` runs without `--workloads` (smol is opt-in: a download and about an hour)."""
SMOL_SHAPE = {"steps": 20, "groups_per_step": 8, "group_size": 8, "max_new_tokens": 16}
"""Issue 26's run: 8 prompts x 8 samples, 16 new tokens, 20 steps (T = 1 and the rest from the config)."""
SMOL_LR = 2e-5
SMOL_QUICK_STEPS = 3


def missing_packages(gguf: bool = False) -> list[str]:
    """The `asyncrl[bench]` packages this bench needs that cannot be imported here (`gguf`: also the GGUF reader
    that the smol workload's model conversion needs)."""
    missing = []
    for name in ("trl", "datasets", *(("gguf",) if gguf else ())):
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a module blocked in sys.modules has no spec
            found = False
        if not found:
            missing.append(name)
    return missing


def _workloads(quick: bool, work: Path, names: Sequence[str], steps: int | None) -> list[Workload]:
    config = load_asyncrl_config(str(CONFIG_PATH))
    workloads = []
    for name in names:
        if name == "builtin":
            workloads.append(Workload(
                name="builtin", model_dir=builtin_model_dir(), steps=4 if quick else BUILTIN_STEPS,
                groups_per_step=config.train.groups_per_step, group_size=config.train.group_size,
                max_new_tokens=config.rollout.max_new_tokens, learns=True,
            ))  # fmt: skip
        elif name == "decode":
            shape = QUICK_DECODE_SHAPE if quick else FULL_DECODE_SHAPE
            workloads.append(Workload(
                name="decode", model_dir=build_decode_model(work / "decode_model", shape, DECODE_NEW_TOKENS),
                steps=3 if quick else DECODE_STEPS, groups_per_step=DECODE_GROUPS, group_size=config.train.group_size,
                max_new_tokens=DECODE_NEW_TOKENS, learns=False, overrides=DECODE_OVERRIDES,
            ))  # fmt: skip
        else:
            workloads.append(_smol_workload(quick, work))
    return [replace(workload, steps=steps) for workload in workloads] if steps else workloads


def _smol_workload(quick: bool, work: Path) -> Workload:
    """Issue 26's shape on SmolLM2-135M-Instruct (quick: a tiny random model), its dataset written into `work`."""
    from asyncrl.bench import e2e_smol

    model_dir = e2e_smol.build_quick_model(work / "smol_model") if quick else e2e_smol.smol_model_dir()
    train_path = e2e_smol.write_dataset(model_dir, work / "smol_data")
    # The prompts are rendered with the chat template already: text prompts and no system prompt are encoded as plain
    # text (data.chat_template=auto), as TRL encodes a text prompt
    overrides = ("data.task=jsonl", f"data.path={train_path}", f"optim.lr={SMOL_LR}")
    shape = {**SMOL_SHAPE, "steps": SMOL_QUICK_STEPS} if quick else SMOL_SHAPE
    return Workload(name="smol", model_dir=model_dir, learns=True, overrides=overrides,
                    heldout_path=str(train_path.with_name("heldout.jsonl")), **shape)  # fmt: skip


def _contenders(workload: str, quick: bool, only: Sequence[str] | None) -> list[str]:
    if workload == "builtin":
        contenders = ["trl", "async"] if quick else ["trl", *ASYNCRL_CONTENDERS]
    elif workload == "smol":
        contenders = ["trl", "async"] if quick else ["trl", "async", "sync", "fp32"]
    else:  # `trl_malloc`: how much of TRL's training is its allocator's page faults (3-4 minutes on the full shape)
        contenders = ["trl", "trl_malloc", "async", "sync", "fp32"]  # no `best`: a random model's groups are all
    return [name for name in contenders if only is None or name in only]


def _trl_settings(workload: Workload, seed: int, out_dir: Path, config: Config) -> dict[str, Any]:
    """TRL's `GRPOConfig` arguments from the asyncrl `config` (with the workload's overrides applied)."""
    from asyncrl.bench.e2e_trl import trl_settings

    if config.loss.agg != "token_mean" or config.algo.adv != "grpo":
        raise ValueError(f"{CONFIG_PATH}: TRL's shape is set for loss.agg=token_mean and algo.adv=grpo")
    return trl_settings(
        use_cpu=config.learner.device == "cpu",  # `--learner-device`: TRL trains where our learner does
        out_dir=str(out_dir), seed=seed, steps=workload.steps, groups_per_step=workload.groups_per_step,
        group_size=workload.group_size, max_new_tokens=workload.max_new_tokens,
        temperature=config.rollout.temperature, lr=config.optim.lr, eps_low=config.loss.eps_low,
        eps_high=config.loss.eps_high, grad_clip=config.optim.grad_clip, weight_decay=config.optim.weight_decay,
        betas=tuple(config.optim.betas),
    )  # fmt: skip


def _run_one(workload: Workload, contender: str, seed: int, work: Path, prompts_path: Path, quick: bool) -> Run:
    timeout_s = RUN_TIMEOUT_S[quick]
    if contender in TRL_CONTENDERS:
        config = load_asyncrl_config(str(CONFIG_PATH), workload.overrides)
        settings = _trl_settings(workload, seed, work / "trl" / f"{workload.name}-{contender}-s{seed}", config)
        data = data_config(overrides=workload.overrides)
        return run_trl(settings, workload, data, seed, work, prompts_path, timeout_s, config.algo.overlong.len,
                       contender)  # fmt: skip
    return run_asyncrl(str(CONFIG_PATH), workload, contender, seed, work, timeout_s)


def _run_all(workloads: list[Workload], seeds: dict[str, int], work: Path, quick: bool,
             only: Sequence[str] | None) -> dict[str, list[Run]]:  # fmt: skip
    """Every contender of every workload, one process at a time; runs keyed `<workload>_<contender>`."""
    from rich.console import Console

    console = Console(stderr=True)
    runs: dict[str, list[Run]] = {}
    for workload in workloads:
        steps_dumped = 3 * workload.steps + 8  # asyncrl runs ahead, and `best` drops zero-variance groups
        dumped = Workload(**{**asdict(workload), "steps": steps_dumped})
        prompts_path = work / f"{workload.name}_prompts.jsonl"
        dump_prompts(dumped, data_config(overrides=workload.overrides), prompts_path)
        contenders = _contenders(workload.name, quick, only)
        for seed in range(seeds[workload.name]):
            for contender in contenders[seed % len(contenders) :] + contenders[: seed % len(contenders)]:
                started, load_before = time.monotonic(), os.getloadavg()[0]
                console.print(f"bench e2e: {workload.name} {contender} seed {seed} (load {load_before:.1f}) ...")
                run = _run_one(workload, contender, seed, work, prompts_path, quick)
                run.load_1m = (load_before, os.getloadavg()[0])
                runs.setdefault(f"{workload.name}_{contender}", []).append(run)
                console.print(f"bench e2e: {workload.name} {contender} seed {seed}: {len(run.rows)} steps in "
                              f"{time.monotonic() - started:.0f} s, first step at {run.launch_s:.1f} s")  # fmt: skip
    return runs


def _check_and_evaluate(
    workloads: list[Workload], runs: dict[str, list[Run]], work: Path, fairness_errors: list[str]
) -> dict[str, float]:
    """The fairness check of every run (a failure's message appended to `fairness_errors`, its contender's
    `_samples_checked` nan), then the shared held-out evaluation of every final model."""
    import json

    from transformers import AutoTokenizer

    from asyncrl.bench.e2e_fairness import FairnessError, check_run

    checked: dict[str, float] = {}
    for workload in workloads:
        tokenizer = AutoTokenizer.from_pretrained(workload.model_dir)
        data = data_config(overrides=workload.overrides)
        rows = [json.loads(line) for line in (work / f"{workload.name}_prompts.jsonl").read_text().splitlines()]
        for key in [k for k in runs if k.startswith(f"{workload.name}_")]:
            try:
                checked[f"{key}_samples_checked"] = float(
                    sum(check_run(run, workload, rows, data, tokenizer) for run in runs[key])
                )
            except FairnessError as err:  # the figures are kept (and written), the failure with them
                checked[f"{key}_samples_checked"] = math.nan
                fairness_errors.append(str(err))
            for run in runs[key]:
                if workload.learns and run.final_dir:
                    _evaluate(run, workload, data)
        if workload.heldout_path:  # where the contenders started from
            base = _heldout(workload, workload.model_dir)
            checked[f"{workload.name}_base_heldout_acc"] = base["math"]
            checked[f"{workload.name}_base_heldout_last_number_acc"] = base["last_number"]
    return checked


def _heldout(workload: Workload, model_dir: str) -> dict[str, float]:
    from asyncrl.bench.e2e_smol import heldout_scores, read_heldout

    return heldout_scores(model_dir, workload.model_dir, read_heldout(workload.heldout_path), workload.max_new_tokens)


def _evaluate(run: Run, workload: Workload, data: Any) -> None:
    """The shared held-out evaluation of a run's final model: the workload's held-out file scored twice, or the
    task's own held-out set."""
    if workload.heldout_path:
        scores = _heldout(workload, run.final_dir)
        run.heldout_acc, run.heldout_last_number_acc = scores["math"], scores["last_number"]
    else:
        run.heldout_acc = heldout_greedy_accuracy(run.final_dir, workload.model_dir, data, workload.max_new_tokens)


def _names(given: str | Sequence[str] | None, valid: Sequence[str], default: Sequence[str], what: str) -> list[str]:
    """`given` (a comma-separated string or a sequence of names) checked against `valid`; `default` when None."""
    if given is None:
        return list(default)
    names = [name.strip() for name in (given.split(",") if isinstance(given, str) else given) if name.strip()]
    unknown = [name for name in names if name not in valid]
    if unknown or not names:
        raise BenchInputError(f"asyncrl bench e2e: unknown {what} {', '.join(unknown) or '(none given)'}; "
                         f"valid: {', '.join(valid)}")  # fmt: skip
    return list(dict.fromkeys(names))


def run(quick: bool, seeds: int | None = None, work_dir: str | None = None,
        workloads: str | Sequence[str] | None = None, steps: int | None = None,
        contenders: str | Sequence[str] | None = None, learner_device: str = "cpu",
        asyncrl_set: Sequence[str] = ()) -> BenchResult:  # fmt: skip
    """The whole bench (see the module doc). `seeds`: of the learning workloads (default 3 on builtin, 1 on smol,
    1 with `quick`); `workloads` (names or "a,b"; default `DEFAULT_WORKLOADS`); `steps`: every workload's steps
    instead of its own; `contenders`: only these (default each workload's); `learner_device`: where every side
    trains (module doc); `asyncrl_set`: config overrides of every asyncrl contender (module doc); runs are kept in
    `work_dir`."""
    _check_learner_device(learner_device)
    _check_set(asyncrl_set)
    names = _names(workloads, WORKLOADS, DEFAULT_WORKLOADS, "workload")
    only = None if contenders is None else _names(contenders, CONTENDERS, CONTENDERS, "contender")
    if steps is not None and steps < 2:
        raise BenchInputError(
            f"asyncrl bench e2e: --steps must be at least 2 (a warm-up and a steady step), got {steps}"
        )
    empty = [name for name in names if not _contenders(name, quick, only)]
    if empty:
        raise BenchInputError(f"asyncrl bench e2e: no contender of --contenders runs on workload {', '.join(empty)} "
                         f"(its contenders: {', '.join(_contenders(empty[0], quick, None))})")  # fmt: skip
    missing = missing_packages(gguf="smol" in names and not quick)
    if missing:
        raise BenchInputError(f"asyncrl bench e2e needs {' and '.join(missing)}: {INSTALL_HINT}")
    per_workload = {"builtin": seeds or (1 if quick else 3), "smol": seeds or 1, "decode": 1}
    Path("runs").mkdir(exist_ok=True)
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="bench-e2e-", dir="runs")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    chosen = _workloads(quick, work, names, steps)
    if learner_device != "cpu":  # our contenders' learner (and, through the config, TRL) on the GPU
        chosen = [replace(w, overrides=(*w.overrides, f"learner.device={learner_device}")) for w in chosen]
    if asyncrl_set:  # after the workload's own: an experiment off the pins (the JSON's `workloads` and argv say so)
        chosen = [replace(w, overrides=(*w.overrides, *asyncrl_set)) for w in chosen]
        print(f"bench e2e: every asyncrl contender runs with --set {' '.join(asyncrl_set)}: off the issue's pins, "
              "the ratios compare that configuration (TRL's side is unchanged)")  # fmt: skip
    decode_dirs = [workload.model_dir for workload in chosen if workload.name == "decode"]
    decode_params = parameter_count(decode_dirs[0]) if decode_dirs else 0
    fairness_errors: list[str] = []
    floor: dict[str, float] = {}
    try:
        runs = _run_all(chosen, per_workload, work, quick, only)
        checked = _check_and_evaluate(chosen, runs, work, fairness_errors)
        for workload in chosen:  # after the runs: the cores are idle again, the model directory still there
            if workload.name == "decode" and learner_device == "cpu":  # a bound of a learner on these cores
                prompts = work / "decode_prompts.jsonl"
                floor = decode_floor(workload.model_dir, prompts, workload.samples_per_step, workload.max_new_tokens)
                config = load_asyncrl_config(str(CONFIG_PATH), [*workload.overrides, *ASYNCRL_CONTENDERS["async"]])
                floor.update(generation_core_s(workload.model_dir, prompts, config, workload.samples_per_step,
                                               workload.max_new_tokens))  # fmt: skip
    finally:
        for model_dir in decode_dirs:
            shutil.rmtree(model_dir, ignore_errors=True)  # 400 MB of random weights
    seeds_run = {workload.name: per_workload[workload.name] for workload in chosen}
    result = _result(chosen, runs, {**checked, **floor}, decode_params, seeds_run, work, learner_device)
    if fairness_errors:  # the CLI writes the JSON, then fails naming them: these figures compare nothing
        result.details["fairness_errors"] = fairness_errors
    return result


def _check_learner_device(device: str) -> None:
    """`--learner-device`: cpu, or a CUDA device this machine has (refused before anything runs)."""
    from common.config_rules import is_device_name

    if not is_device_name(device):
        raise BenchInputError(f"asyncrl bench e2e: --learner-device must be cpu, cuda or cuda:N, got {device!r}")
    if device == "cpu":
        return
    import torch

    if not torch.cuda.is_available():
        raise BenchInputError(f"asyncrl bench e2e --learner-device {device}: this machine sees no GPU "
                         f"(torch {torch.__version__}, torch.cuda.is_available() is False)")  # fmt: skip


def _check_set(asyncrl_set: Sequence[str]) -> None:
    """`--set`: KEY=VALUE config overrides that the config loader accepts (refused before anything runs)."""
    from common.config import ConfigError

    malformed = [item for item in asyncrl_set if "=" not in item]
    if malformed:
        raise BenchInputError(f"asyncrl bench e2e: --set takes KEY=VALUE config overrides, got {', '.join(malformed)}")
    try:
        load_asyncrl_config(str(CONFIG_PATH), list(asyncrl_set))
    except ConfigError as err:
        raise BenchInputError(f"asyncrl bench e2e --set: config error: {err}") from None


def _lora_vs_full(figures: dict[str, dict[str, float]]) -> dict[str, float]:
    """LoRA against full fine-tuning on the built-in workload (both asynchronous, dynamic sampling off, same seeds):
    steady samples/s over full's, and the accuracy differences (LoRA minus full; read them against the `_std`s)."""
    lora, full = figures.get("builtin_lora"), figures.get("builtin_async")
    if lora is None or full is None:
        return {}
    return {
        "builtin_lora_vs_async_steady_samples_s": lora["steady_samples_s"] / full["steady_samples_s"],
        "builtin_lora_minus_async_final_train_acc": lora["final_train_acc_mean"] - full["final_train_acc_mean"],
        "builtin_lora_minus_async_heldout_acc": lora["heldout_acc_mean"] - full["heldout_acc_mean"],
    }


def _result(workloads: list[Workload], runs: dict[str, list[Run]], checked: dict[str, float], decode_params: int,
            seeds: dict[str, int], work: Path, learner_device: str = "cpu") -> BenchResult:  # fmt: skip
    from asyncrl.bench.e2e_table import print_contenders

    figures = {key: figures_of.contender_figures(key_runs) for key, key_runs in runs.items()}
    cores = len(os.sched_getaffinity(0))
    metrics = {f"{key}_{name}": value for key, values in figures.items() for name, value in values.items()}
    metrics.update(checked)
    metrics["max_load_1m"] = max(max(run.load_1m) for key_runs in runs.values() for run in key_runs)
    metrics.update(target_train_acc=figures_of.TARGET_ACC, cores=float(cores))
    bound_s = math.nan
    decode = next((workload for workload in workloads if workload.name == "decode"), None)
    # the bound packs a learner's core-seconds on these cores: none with the learner on a GPU (`--learner-device`)
    if decode is not None and "decode_sync" in runs and learner_device == "cpu":
        bound_s = figures_of.bound_step_s(runs["decode_sync"][0], decode.samples_per_step, cores)
        trl_step_s = figures.get("decode_trl", {}).get("steady_step_s", math.nan)
        metrics.update(decode_params=float(decode_params), decode_bound_step_s=bound_s,
                       decode_bound_vs_trl_samples_s=trl_step_s / bound_s)  # fmt: skip
        if "decode_train_floor_s" in metrics:
            gen_core_s = runs["decode_sync"][0].gen_core_s_per_sample * decode.samples_per_step
            metrics.update(floor_ceilings(metrics, bound_s, gen_core_s, cores))
    metrics.update(int8_free_ceiling(figures))
    if "decode_trl_malloc" in figures and "decode_async" in figures:  # the decode ratio against TRL given our malloc
        metrics["decode_async_vs_trl_malloc_samples_s"] = (
            figures["decode_async"]["steady_samples_s"] / figures["decode_trl_malloc"]["steady_samples_s"]
        )
    metrics.update(_lora_vs_full(figures))
    metrics.update(figures_of.time_to_acc_bound(figures))
    ratios = figures_of.ratios(figures, bound_s)
    learning = {workload.name for workload in workloads if workload.learns}
    from asyncrl.bench.engine_bench import platform_details

    details = {
        **platform_details(),  # the CPU's ISA and the INT8 kernel the workers ran
        "work_dir": str(work),
        "seeds": seeds,
        "workloads": [asdict(w) for w in workloads],
        "trl_settings": {key: runs[key][0].settings for key in runs if runs[key][0].contender in TRL_CONTENDERS},
        "asyncrl_argv": {
            key: runs[key][0].settings["argv"] for key in runs if runs[key][0].contender not in TRL_CONTENDERS
        },
        "accuracy_curves": {
            key: figures_of.accuracy_curve(r) for key, r in runs.items() if key.split("_", 1)[0] in learning
        },
        "runs": {key: [run.to_json() for run in key_runs] for key, key_runs in runs.items()},
    }
    print_contenders(figures, ratios)
    if metrics["max_load_1m"] > cores / 2:
        print(
            f"bench e2e: the 1-minute load reached {metrics['max_load_1m']:.1f} on {cores} cores during the runs: "
            "other processes shared the cores, and a contender on several torch threads (TRL) suffers most"
        )
    return BenchResult(name="e2e", metrics=metrics, ratios=ratios, details=details)
