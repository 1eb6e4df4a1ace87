"""The TRL contender of `asyncrl bench e2e`: TRL's `GRPOTrainer` on a workload, in its own process.

Run as `python -m asyncrl.bench.e2e_trl SPEC.json` by `asyncrl.bench.e2e_runs`. The spec (written by the harness)
names the model directory, the dumped prompts (`e2e_workloads.dump_prompts`), the seed and `trl_settings`, the
keyword arguments of `trl.GRPOConfig` (built here with TRL's own field names: a misspelled one fails at once).
TRL generates with Hugging Face `generate` and trains in this one process on all the machine's cores.

TRL trains on the first `num_prompts` dumped rows. What it writes to the spec's `out_dir`:

| file | one row per | fields |
|---|---|---|
| `rewards.jsonl` | reward call (a step's batch) | step, prompts, answers, completions, completion_tokens, rewards |
| `steps.jsonl` | optimizer step | step, time (unix s, step end), gen_s (generation + scoring) |
| `trl_config.json` | - | resolved `GRPOConfig` fields, TRL's version, torch threads, reward functions, `malloc` |
| `final/` | - | the trained model (when `save_final`), for the shared held-out evaluation |

The reward is our task's (`common.tasks.make_source(data).reward`) wrapped in TRL's reward-function signature,
plus, where the asyncrl config shapes overlong responses (`algo.overlong.len` > 0, DAPO's soft overlong punishment:
ALGORITHMS.md), TRL's own `trl.rewards.get_soft_overlong_punishment` with the same lengths, so that both sides'
advantages come from the same shaped reward (TRL sums its reward functions before the group normalisation, as
asyncrl adds the shaping to the reward before it). `rewards.jsonl` logs the task's reward alone, as asyncrl logs
its accuracy; `trl_config.json`'s `reward_funcs` names what TRL was given, its `malloc` the glibc settings that took.

With the spec's `malloc` true (the `trl_malloc` contender) the process first sets the glibc malloc settings an
asyncrl learner rank runs with (`learner.group.LEARNER_MALLOC`, by `mallopt`, before torch allocates): what a TRL
user could set with MALLOC_MMAP_THRESHOLD_ and friends, so that the bench shows how much of TRL's training time is
its allocator's page faults rather than its computation.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def trl_settings(
    *, out_dir: str, seed: int, steps: int, groups_per_step: int, group_size: int, max_new_tokens: int,
    temperature: float, lr: float, eps_low: float, eps_high: float, grad_clip: float, weight_decay: float,
    betas: tuple[float, float], use_cpu: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """`GRPOConfig` keyword arguments for the asyncrl shape: one generation of `groups_per_step * group_size`
    samples and one optimizer step per step, DAPO token-mean loss, no KL, fp32, no vLLM; on the CPU unless `use_cpu`
    is off (`asyncrl bench e2e --learner-device`: then on the GPU accelerate picks)."""
    return {
        "output_dir": out_dir,
        "seed": seed,
        "max_steps": steps,
        "num_generations": group_size,
        "per_device_train_batch_size": groups_per_step * group_size,
        "gradient_accumulation_steps": 1,
        "num_iterations": 1,
        "max_completion_length": max_new_tokens,
        "temperature": temperature,
        "top_p": 1.0,
        "top_k": 0,
        "learning_rate": lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": weight_decay,
        "adam_beta1": betas[0],
        "adam_beta2": betas[1],
        "max_grad_norm": grad_clip,
        "loss_type": "dapo",  # token-mean over the step's whole batch (asyncrl's loss.agg=token_mean)
        "scale_rewards": "group",  # (r - group mean) / group std (asyncrl's algo.adv=grpo)
        "epsilon": eps_low,
        "epsilon_high": eps_high,
        "beta": 0.0,  # no KL, no reference model
        "bf16": False,  # TRL's default is bf16 unless fp16: fp32 training as on every side
        "fp16": False,
        "gradient_checkpointing": False,  # TRL's default recomputes activations; asyncrl does not
        "use_vllm": False,
        "use_cpu": use_cpu,
        "shuffle_dataset": False,  # the dumped prompts in stream order, as asyncrl's buffer hands them out
        "remove_unused_columns": False,  # the reward needs the `answer` column
        "model_init_kwargs": {"dtype": "float32"},
        "report_to": "none",
        "logging_steps": 1,
        "save_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }


def _reward_function(data: dict[str, Any], log_path: Path):
    """Our task's reward in TRL's signature; every call (one step's batch) is logged for the fairness check."""
    from common.config import DataConfig
    from common.tasks import make_source

    source = make_source(DataConfig(**data))
    log = log_path.open("a")

    def task_reward(prompts, completions, completion_ids, answer, trainer_state, **_unused) -> list[float]:
        rewards = [float(source.reward(text, ref)) for text, ref in zip(completions, answer)]
        row = {"step": trainer_state.global_step, "prompts": list(prompts), "answers": list(answer),
               "completions": list(completions), "completion_tokens": [len(ids) for ids in completion_ids],
               "rewards": rewards}  # fmt: skip
        log.write(json.dumps(row) + "\n")
        log.flush()
        return rewards

    return task_reward


def _step_recorder(path: Path, generation_seconds: list[float]):
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        """Writes one row per optimizer step: its end time and the generation seconds within it."""

        def __init__(self) -> None:
            self.log = path.open("a")

        def on_step_end(self, args, state, control, **kwargs):
            gen_s = sum(generation_seconds)
            generation_seconds.clear()
            self.log.write(json.dumps({"step": state.global_step - 1, "time": time.time(), "gen_s": gen_s}) + "\n")
            self.log.flush()

    return StepTimes()


def _timed(method, seconds: list[float]):
    """`method` with its wall time appended to `seconds` (TRL's generate-and-score, timed without subclassing)."""

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - started)

    return timed


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    out_dir = Path(spec["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    malloc: dict[str, int] = {}
    if spec.get("malloc", False):
        from learner.group import apply_malloc_settings

        malloc = apply_malloc_settings()  # before torch's first allocations, as a learner rank does
    import torch

    torch.set_num_threads(spec["torch_threads"])  # the harness gives all the machine's cores, as asyncrl gets
    import trl
    from datasets import Dataset

    rows = [json.loads(line) for line in Path(spec["prompts_path"]).read_text().splitlines()][: spec["num_prompts"]]
    dataset = Dataset.from_list([{"prompt": row["prompt"], "answer": row["answer"]} for row in rows])
    config = trl.GRPOConfig(**spec["trl_settings"])
    reward_funcs, names = [_reward_function(spec["data"], out_dir / "rewards.jsonl")], ["task_reward"]
    overlong = spec["overlong"]
    if overlong["soft_punish_cache"] > 0:  # asyncrl's algo.overlong, in TRL's own implementation
        from trl.rewards import get_soft_overlong_punishment

        reward_funcs.append(get_soft_overlong_punishment(**overlong))
        names.append(f"soft_overlong_punishment({overlong['max_completion_len']}, {overlong['soft_punish_cache']})")
    resolved = {"trl_version": trl.__version__, "torch_threads": torch.get_num_threads(), "reward_funcs": names,
                "malloc": malloc, "resolved": json.loads(config.to_json_string())}  # fmt: skip
    (out_dir / "trl_config.json").write_text(json.dumps(resolved, indent=1))
    generation_seconds: list[float] = []
    trainer = trl.GRPOTrainer(
        model=spec["model_dir"],
        reward_funcs=reward_funcs,
        args=config,
        train_dataset=dataset,
        callbacks=[_step_recorder(out_dir / "steps.jsonl", generation_seconds)],
    )
    trainer._generate_and_score_completions = _timed(trainer._generate_and_score_completions, generation_seconds)
    trainer.train()
    if spec["save_final"]:
        trainer.save_model(str(out_dir / "final"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
