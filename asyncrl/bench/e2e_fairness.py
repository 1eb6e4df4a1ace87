"""The fairness check of `asyncrl bench e2e`: every contender trained on the dumped prompts, scored by our reward.

Read from what each side recorded, not from what it was told:

- TRL: the reward function's log (`rewards.jsonl`, one row per step's generation batch);
- asyncrl: the buffer's journal (`buffer.journal`): each trained group's `PushGroup` (prompt index, prompt and
  response token ids, the reward the worker computed) and the `consume` record naming the step that trained it.

For every trained sample the check recomputes the reward with `make_source(data).reward` on the decoded response
and compares it with the recorded one, and compares the prompt with the dumped row of its index (asyncrl's as the
tokenizer shows both: the trained prompt ids and the row's text, encoded, decoded without special tokens, so that a
prompt rendered with a chat template, whose markers are special tokens, compares as its text). Prompts per step:
TRL's step k must be dumped rows k*G .. k*G+G-1, each `group_size` times, in order; a synchronous asyncrl run
(max_lag 0) trains exactly those G problems at step k; an asynchronous one trains problems leased up to max_lag
steps ahead, so only "each index once, from the dumped stream" holds there.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.bench.e2e_runs import TRL_CONTENDERS, Run
from asyncrl.bench.e2e_workloads import Workload
from common.config import DataConfig


class FairnessError(AssertionError):
    """A contender trained on other prompts, or scored a sample differently, than the shared ones."""


@dataclass(slots=True)
class TrainedSample:
    step: int
    prompt_index: int
    """Index in the dumped stream (-1 when the side does not record it: TRL)."""
    prompt: str
    answer: str
    response: str
    reward: float


def trl_samples(out_dir: str) -> list[TrainedSample]:
    """Every sample TRL scored, from its reward log, in generation order."""
    from asyncrl.bench.e2e_runs import _jsonl

    samples = []
    for batch in _jsonl(Path(out_dir) / "rewards.jsonl"):
        for prompt, answer, text, reward in zip(batch["prompts"], batch["answers"], batch["completions"],
                                                batch["rewards"]):  # fmt: skip
            samples.append(TrainedSample(batch["step"], -1, prompt, answer, text, reward))
    return samples


def asyncrl_samples(run_dir: str, tokenizer: Any, answers: dict[int, str]) -> list[TrainedSample]:
    """Every sample asyncrl trained, from the buffer journal: (step, prompt index, decoded prompt and response)."""
    from buffer.journal import read_records
    from common.wire import decode

    admitted: dict[str, Any] = {}
    trained: list[TrainedSample] = []
    for record in read_records(Path(run_dir) / "buffer.journal"):
        if record["k"] == "admit":
            push = decode(bytes(record["m"]))
            admitted[push.group] = push
        elif record["k"] == "consume":
            for group in record["g"]:
                for traj in admitted.pop(group).trajectories:
                    prompt = tokenizer.decode(traj.prompt_ids.tolist(), skip_special_tokens=True)
                    response = tokenizer.decode(traj.response_ids.tolist(), skip_special_tokens=True)
                    answer = answers.get(traj.prompt_index, "")
                    trained.append(TrainedSample(record["s"], traj.prompt_index, prompt, answer, response, traj.reward))
    return trained


OWN_CONFIG = "best"
"""The contender with asyncrl's own best config (not pinned to TRL's shape): it may train problems past the dump."""


class _StreamAnswers(dict):
    """Answers by problem index: the dump's, and past it the training stream's own (what `dump_prompts` writes)."""

    def __init__(self, known: dict[int, str], source: Any):
        super().__init__(known)
        self.source = source

    def __missing__(self, index: int) -> str:
        self[index] = str(self.source.train(index).answer)
        return self[index]

    def get(self, index: int, default: str = "") -> str:  # type: ignore[override] - a missing index is computed
        return self[index] if index >= 0 else default


def check_run(run: Run, workload: Workload, rows: list[dict[str, Any]], data: DataConfig, tokenizer: Any) -> int:
    """Raise FairnessError unless `run` trained on the dumped prompts and its rewards are ours; samples checked."""
    from common.tasks import make_source

    source = make_source(data)
    by_index = {int(row["index"]): row for row in rows}
    if run.contender in TRL_CONTENDERS:
        samples = trl_samples(run.out_dir)
    else:
        answers = {i: str(row["answer"]) for i, row in by_index.items()}
        if run.contender == OWN_CONFIG:  # its dynamic sampling and screening read past the dump: the stream's rows
            answers = _StreamAnswers(answers, source)
        samples = asyncrl_samples(run.out_dir, tokenizer, answers)
    where = f"{run.workload}/{run.contender}/seed {run.seed}"
    if not samples:
        raise FairnessError(f"{where}: no trained samples recorded")
    shown: dict[int, str] = {}
    for sample in samples:
        if sample.prompt_index >= 0:
            row = by_index.get(sample.prompt_index)
            if row is None and run.contender == OWN_CONFIG:  # its dynamic sampling and screening read past the dump
                problem = source.train(sample.prompt_index)  # the row the dump would hold (`dump_prompts`)
                row = by_index[sample.prompt_index] = {"index": problem.index, "prompt": problem.prompt,
                                                       "answer": problem.answer}  # fmt: skip
            if row is not None and sample.prompt_index not in shown:
                ids = tokenizer(row["prompt"])["input_ids"]
                shown[sample.prompt_index] = tokenizer.decode(ids, skip_special_tokens=True)
            if row is None or shown[sample.prompt_index] != sample.prompt:
                raise FairnessError(f"{where}: problem {sample.prompt_index} was {sample.prompt!r}, not the dump's")
        if source.reward(sample.response, sample.answer) != sample.reward:
            raise FairnessError(f"{where}: reward {sample.reward} for {sample.response!r} (answer {sample.answer!r})")
    _check_order(run, workload, rows, samples, where)
    return len(samples)


def _check_order(run: Run, workload: Workload, rows: list[dict[str, Any]], samples: list[TrainedSample],
                 where: str) -> None:  # fmt: skip
    groups, size = workload.groups_per_step, workload.group_size
    per_step: dict[int, list[TrainedSample]] = {}
    for sample in samples:
        per_step.setdefault(sample.step, []).append(sample)
    if sorted(per_step) != list(range(workload.steps)):
        raise FairnessError(f"{where}: trained steps {sorted(per_step)[:8]}..., expected 0..{workload.steps - 1}")
    if run.contender in TRL_CONTENDERS:
        for step, batch in per_step.items():
            expected = [rows[step * groups + g] for g in range(groups) for _ in range(size)]
            if [(s.prompt, s.answer) for s in batch] != [(r["prompt"], r["answer"]) for r in expected]:
                raise FairnessError(f"{where}: step {step} prompts differ from dumped rows {step * groups}..")
        return
    counts = Counter(s.prompt_index for s in samples)
    if any(count != size for count in counts.values()):
        raise FairnessError(f"{where}: a problem was trained {max(counts.values())} times x samples")
    if run.contender == "sync":
        for step, batch in per_step.items():
            if {s.prompt_index for s in batch} != set(range(step * groups, (step + 1) * groups)):
                raise FairnessError(f"{where}: step {step} trained other problems than {step * groups}..")
