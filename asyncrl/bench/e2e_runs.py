"""Running the contenders of `asyncrl bench e2e`, each as its own process, and reading back what they did.

Contenders (`CONTENDERS`): `trl` (TRL `GRPOTrainer`, `asyncrl.bench.e2e_trl`), `trl_malloc` (the same with the
glibc malloc settings of an asyncrl learner rank: how much of TRL's time is its allocator's) and asyncrl's
`asyncrl up CONFIG` with overrides: `async` (the config as given, dynamic sampling off), `sync`
(`staleness.max_lag=0`), `fp32` (`quant.scheme=none`: fp32 rollout weights), `best` (the config as given, dynamic
sampling included: asyncrl's own best row, not a throughput row) and `lora` (issue 20's row:
`configs/dapo_int8_lora.yaml`'s rank-16 adapters on every decoder linear with its learning rate, dynamic sampling
off as for `async`; the adapters are merged into `final-merged/` for the shared held-out evaluation).

Every run becomes a `Run`: the wall time from launching its process to the end of each step (`StepRow.end_s`),
the train accuracy of each step's trained batch, the samples and tokens generated, and the phases each contender
reports (TRL: generation and scoring inside the step; asyncrl: the learner's train time, which includes publishing
the weights, and its wait for a batch; asyncrl's generation runs beside them in the workers).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.bench.e2e_workloads import Workload
from common.config import Config, DataConfig

LORA_OVERRIDES = ("model.lora.rank=16", "model.lora.alpha=32.0", "optim.lr=0.0003")
"""What `configs/dapo_int8_lora.yaml` changes of `configs/dapo_int8.yaml` (a test holds the two together)."""
ASYNCRL_CONTENDERS: dict[str, tuple[str, ...]] = {
    "async": ("algo.filter_groups=false",),
    "sync": ("algo.filter_groups=false", "staleness.max_lag=0"),
    "fp32": ("algo.filter_groups=false", "quant.scheme=none"),
    "best": (),
    "lora": ("algo.filter_groups=false", *LORA_OVERRIDES, "checkpoint.merge_lora=true"),
}
"""asyncrl contenders: the overrides each applies to the config (besides the workload's shape)."""
TRL_CONTENDERS: dict[str, bool] = {"trl": False, "trl_malloc": True}
"""TRL contenders: whether each runs with `learner.group.LEARNER_MALLOC` (`e2e_trl`'s spec `malloc`)."""
CONTENDERS = (*TRL_CONTENDERS, *ASYNCRL_CONTENDERS)


@dataclass(slots=True)
class StepRow:
    step: int
    end_s: float
    """Seconds from launching the contender's process to the end of this optimizer step."""
    accuracy: float
    """Train accuracy: the fraction of the step's trained samples whose reward says correct (asyncrl with dynamic
    sampling, which trains only groups of mixed rewards: of every sample generated since the previous step)."""
    trained_samples: int
    generated_samples: float
    """Samples generated since the previous step (asyncrl's workers run ahead; TRL: the step's own batch)."""
    generated_tokens: float
    gen_s: float = math.nan
    """TRL: generation and scoring inside the step (nan for asyncrl: its workers generate beside the learner)."""
    train_s: float = math.nan
    """asyncrl: the learner's step (loss, backward, optimizer, publication); TRL: the step minus its generation."""
    wait_s: float = math.nan
    """asyncrl: the learner's wait for a full batch; nan for TRL."""


@dataclass(slots=True)
class Run:
    workload: str
    contender: str
    seed: int
    out_dir: str
    """The run directory (asyncrl: runs/<name>; TRL: the runner's out_dir)."""
    rows: list[StepRow]
    total_generated_samples: float
    gen_core_s_per_sample: float
    """Core-seconds of generation per generated sample (asyncrl: workers' generation seconds x their threads)."""
    final_dir: str = ""
    """The final model for the shared held-out evaluation ("" when not saved)."""
    heldout_acc: float = math.nan
    """Held-out greedy accuracy of the final model by the workload's reward (the shared evaluation)."""
    heldout_last_number_acc: float = math.nan
    """The same answers scored by a plain last-number check (the smol workload; nan elsewhere)."""
    launched_unix: float = math.nan
    """When the contender's process was launched (unix s): `end_s` is measured from here."""
    load_1m: tuple[float, float] = (math.nan, math.nan)
    """The machine's 1-minute load average before and after the run (other processes slow every contender)."""
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def launch_s(self) -> float:
        """Launch to the end of the first step."""
        return self.rows[0].end_s

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _launch(argv: list[str], log_path: Path, timeout_s: float) -> float:
    """Run `argv` to completion (its own session, output to `log_path`); the unix time just before launching."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log_path.open("w") as log:
        launched = time.time()
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the contender's whole session: it and what it started
            process.wait()
            raise RuntimeError(f"{argv[:4]} ran past {timeout_s:.0f} s; log: {log_path}") from None
    if code != 0:
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"{' '.join(argv[:5])} exited with {code}; log {log_path}:\n{tail}")
    return launched


def asyncrl_overrides(workload: Workload, contender: str, seed: int, runs_dir: Path, name: str) -> list[str]:
    """The `asyncrl up` overrides of a contender on a workload: its shape, its seed, where it writes."""
    return [
        f"model.path={workload.model_dir}",
        f"train.steps={workload.steps}",
        f"train.seed={seed}",
        f"train.groups_per_step={workload.groups_per_step}",
        f"train.group_size={workload.group_size}",
        f"rollout.max_new_tokens={workload.max_new_tokens}",
        "data.eval_size=0",  # the held-out evaluation is the harness's shared one
        f"checkpoint.final={'true' if workload.learns else 'false'}",
        f"logging.dir={runs_dir}",
        f"logging.name={name}",
        *workload.overrides,
        *ASYNCRL_CONTENDERS[contender],
    ]


def run_asyncrl(config_path: str, workload: Workload, contender: str, seed: int, work: Path, timeout_s: float) -> Run:
    name = f"{workload.name}-{contender}-s{seed}"
    overrides = asyncrl_overrides(workload, contender, seed, work / "runs", name)
    argv = [sys.executable, "-m", "asyncrl.cli", "up", config_path, *overrides]
    launched = _launch(argv, work / f"{name}.log", timeout_s)
    run_dir = work / "runs" / name
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    # With dynamic sampling the trained batch holds only mixed groups: its accuracy is not the policy's
    accuracy_key = "acc/batch" if "algo.filter_groups=false" in overrides else "acc/mean"
    rows = [_asyncrl_row(r, launched, workload.samples_per_step, accuracy_key)
            for r in records if "step" in r and "event" not in r]  # fmt: skip
    summary = json.loads((run_dir / "summary.json").read_text())
    config = json.loads((run_dir / "config.json").read_text())
    gen_s = sum(w["gen_seconds"] for w in summary["workers"]) * config["rollout"]["threads"]
    samples = sum(w["samples"] for w in summary["workers"])
    final = run_dir / "final-merged" if (run_dir / "final-merged").is_dir() else run_dir / "final"  # LoRA: merged
    return Run(
        workload=workload.name, contender=contender, seed=seed, out_dir=str(run_dir), rows=rows,
        total_generated_samples=float(samples), gen_core_s_per_sample=gen_s / max(samples, 1),
        final_dir=str(final) if final.is_dir() else "", launched_unix=launched,
        settings={"argv": argv[3:], "learner_core_s_per_train_s": _learner_threads(records, config)
                  * config["learner"]["world_size"]},
    )  # fmt: skip


def _learner_threads(records: list[dict[str, Any]], config: dict[str, Any]) -> float:
    """The learner's mean torch threads over its steps (`learner/threads`: the measured policy changes it per step;
    `learner.threads` where a run logged none)."""
    threads = [r["learner/threads"] for r in records if "learner/threads" in r and "event" not in r]
    return sum(threads) / len(threads) if threads else float(config["learner"]["threads"])


def _asyncrl_row(record: dict[str, Any], launched: float, samples_per_step: int, accuracy_key: str) -> StepRow:
    return StepRow(
        step=int(record["step"]),
        end_s=record["time"] - launched,
        # null: no response was generated since the previous step (a learner faster than its workers)
        accuracy=math.nan if record.get(accuracy_key) is None else record[accuracy_key],
        trained_samples=samples_per_step,
        generated_samples=record["rollout/samples"],
        generated_tokens=record["perf/rollout_tok_s"] * record["perf/step_s"],
        train_s=record["perf/train_s"],
        wait_s=record["perf/fetch_wait_s"],
    )


def run_trl(settings: dict[str, Any], workload: Workload, data: DataConfig, seed: int, work: Path,
            prompts_path: Path, timeout_s: float, overlong_len: int = 0, contender: str = "trl") -> Run:  # fmt: skip
    """A TRL contender (`TRL_CONTENDERS`) in its own process; `overlong_len`: the asyncrl config's
    `algo.overlong.len`, given to TRL as its soft overlong punishment (`e2e_trl`)."""
    name = f"{workload.name}-{contender}-s{seed}"
    out_dir = work / "trl" / name
    spec = {"out_dir": str(out_dir), "model_dir": workload.model_dir, "prompts_path": str(prompts_path),
            "num_prompts": workload.steps * workload.groups_per_step, "trl_settings": settings,
            "data": asdict(data), "save_final": workload.learns,
            "overlong": {"max_completion_len": workload.max_new_tokens, "soft_punish_cache": overlong_len},
            "torch_threads": len(os.sched_getaffinity(0)), "malloc": TRL_CONTENDERS[contender]}  # fmt: skip
    spec_path = work / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    launched = _launch([sys.executable, "-m", "asyncrl.bench.e2e_trl", str(spec_path)], work / f"{name}.log", timeout_s)
    batches = {row["step"]: row for row in _jsonl(out_dir / "rewards.jsonl")}
    rows, previous_end, gen_s, samples = [], 0.0, 0.0, 0
    for timing in _jsonl(out_dir / "steps.jsonl"):
        batch, end_s = batches[timing["step"]], timing["time"] - launched
        correct = [reward >= 1.0 for reward in batch["rewards"]]
        rows.append(StepRow(
            step=timing["step"], end_s=end_s, accuracy=sum(correct) / len(correct), trained_samples=len(correct),
            generated_samples=len(correct), generated_tokens=sum(batch["completion_tokens"]), gen_s=timing["gen_s"],
            train_s=end_s - previous_end - timing["gen_s"] if rows else math.nan,
        ))  # fmt: skip
        previous_end, gen_s, samples = end_s, gen_s + timing["gen_s"], samples + len(correct)
    resolved = json.loads((out_dir / "trl_config.json").read_text())
    final = out_dir / "final"
    return Run(
        workload=workload.name, contender=contender, seed=seed, out_dir=str(out_dir), rows=rows,
        total_generated_samples=float(samples), gen_core_s_per_sample=gen_s * resolved["torch_threads"] / samples,
        final_dir=str(final) if final.is_dir() else "", launched_unix=launched, settings={"set": settings, **resolved},
    )  # fmt: skip


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def load_asyncrl_config(config_path: str, overrides: tuple[str, ...] | list[str] = ()) -> Config:
    from common.config import load_config

    return load_config(config_path, list(overrides))
