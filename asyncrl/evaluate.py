"""Held-out evaluation through the rollout engine (`train.eval_every`, and once at the end of a run).

    learner --version k (quant_sync, the workers' own stream)--> evaluator: a RolloutWorker that runs no rollout loop
    driver, at a boundary where the learner idles: evaluator.evaluate(k, held-out prompts) -> eval/* (an `eval` event)

The evaluator is a Ray actor of its own, built like a rollout worker (the same engine and quantization, tokenizer,
chat template and reward functions), so the numbers are those of the policy that generates the training data. It
asks Ray for no CPU: it works only at evaluation boundaries, while the learner waits.

| metric | meaning |
|---|---|
| `eval/acc_greedy` | the learner's greedy decode in full precision (`learner.evaluate`), as before |
| `eval/acc_greedy_rollout` | greedy decode (top-k 1) on the rollout engine |
| `eval/mean@k` | mean over prompts of the share of k draws at `rollout.temperature` that are correct (`eval.samples`) |
| `eval/pass@k` | share of prompts with at least one correct draw among the k |
| `eval/reward_mean@k` | mean reward of the draws |
| `eval/skipped` | held-out prompts that do not fit the engine (too long, or no tokens): scored 0 |

A response is correct when its reward is at least 1, as in training (`acc/mean`).

With `env.fn` (multi-turn, tool-using episodes, issue 21) every held-out prompt is an episode with the environment,
run by the worker's own `EpisodeRunner` (rollout_workers/episodes.py) exactly as in training: the greedy episode
(top-k 1 every turn) gives `eval/acc_greedy_rollout`, the `eval.samples` episodes at the training temperature give
`eval/mean@k`, `eval/pass@k`, `eval/reward_mean@k`, and the environment's counters give, per greedy episode,

| metric | meaning |
|---|---|
| `eval/tool_calls` | tool calls (the environment's `info["tool_calls"]`) per greedy episode |
| `eval/turns_mean` | model turns per greedy episode |
| `eval/env_errors` | greedy and sampled episodes ended by an environment that raised or timed out (scored 0) |

`eval/skipped` counts greedy episodes with no model token (the environment failed before the first turn, or the
prompt left no room). `eval/acc_greedy`, the learner's single-turn decode, is not computed: it cannot call a tool.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

from common.tasks import problem_row
from rollout_workers.worker import RolloutWorker

EVAL_WORKER_ID = "evaluator"
WEIGHTS_TIMEOUT_S = 300.0


def sample_metrics(correct: list[list[bool]], rewards: list[list[float]]) -> dict[str, float]:
    """`eval/mean@k`, `eval/pass@k` and `eval/reward_mean@k` of k draws per prompt (`correct[prompt][draw]`)."""
    if not correct or not correct[0]:
        return {}
    k = len(correct[0])
    if any(len(row) != k for row in correct):
        raise ValueError("every prompt needs the same number of draws")
    return {
        f"eval/mean@{k}": sum(sum(row) / k for row in correct) / len(correct),
        f"eval/pass@{k}": sum(any(row) for row in correct) / len(correct),
        f"eval/reward_mean@{k}": sum(sum(row) for row in rewards) / (k * len(rewards)),
    }


class EvalWorker(RolloutWorker):
    """A rollout worker without a rollout loop: it follows the learner's weight versions and answers `evaluate`."""

    _reward_failure_said = False  # the first reward-function failure is printed once (`_say_first_reward_failure`)

    def subscribe(self, weights_endpoint: str) -> bool:
        from quant_sync.transport import WeightSubscriber

        self.subscriber = WeightSubscriber(
            weights_endpoint,
            self.engine.stage_weights,
            curve=self.curve,
            keep_int8_adapters=getattr(self.engine, "runs_int8_adapters", False),
        )
        return True

    def evaluate(self, version: int, prompts: list[str], answers: list[str], samples: int) -> dict[str, float]:
        """Greedy and `samples` draws per prompt with weight version `version` (waits for it); the eval/* metrics."""
        if self.subscriber is None:
            raise RuntimeError("evaluator: `subscribe` to the learner's weights before `evaluate`")
        if not self.subscriber.wait_for(version, timeout_s=WEIGHTS_TIMEOUT_S):
            raise RuntimeError(f"evaluator: weight version {version} did not arrive within {WEIGHTS_TIMEOUT_S:.0f} s")
        if self.episodes is not None:
            return {**self._evaluate_episodes(prompts, answers, samples), "eval/version": float(self.engine.version)}
        limit, max_new = self.engine.max_seq_len, self.params.max_new_tokens
        prompt_ids = [self.encode_prompt(prompt) for prompt in prompts]
        fits = [bool(ids) and (limit is None or len(ids) + max_new <= limit) for ids in prompt_ids]
        kept = [i for i, ok in enumerate(fits) if ok]
        rows = self.problem_rows(prompts, answers)
        failures_before = self.rewards.errors + self.rewards.timeouts
        greedy = self._scores([prompt_ids[i] for i in kept], [answers[i] for i in kept], [rows[i] for i in kept], 1,
                              top_k=1) if kept else []  # fmt: skip
        correct_greedy = sum(reward >= 1.0 for (reward,) in greedy)
        metrics = {
            "eval/acc_greedy_rollout": correct_greedy / max(len(prompts), 1),
            "eval/skipped": float(len(prompts) - len(kept)),
            "eval/version": float(self.engine.version),
        }
        if samples and kept:
            draws = self._scores([prompt_ids[i] for i in kept], [answers[i] for i in kept], [rows[i] for i in kept],
                                 samples)  # fmt: skip
            missing = [[0.0] * samples] * (len(prompts) - len(kept))  # a prompt that does not fit scores 0
            rewards = [list(row) for row in draws] + missing
            metrics.update(sample_metrics([[r >= 1.0 for r in row] for row in rewards], rewards))
        metrics["eval/reward_errors"] = float(self.rewards.errors + self.rewards.timeouts - failures_before)
        self._say_first_reward_failure()
        return metrics

    def problem_rows(self, prompts: list[str], answers: list[str], episodes: bool = False) -> list[dict[str, Any]]:
        """The `row` a reward function (or, `episodes`, an environment) gets for each held-out problem, as in
        training: `index`, `prompt`, `answer` and the dataset's own fields where the source has them (`eval_row`;
        they win over the first three for a reward function, rollout_workers/worker.py, and lose for an environment,
        rollout_workers/episodes.py), plus `eval: True`."""
        eval_row = getattr(self.source, "eval_row", None)
        return [
            {
                **problem_row(i, prompt, answer, eval_row(i) if eval_row else None, record_wins=not episodes),
                "eval": True,
            }
            for i, (prompt, answer) in enumerate(zip(prompts, answers, strict=True))
        ]

    def _say_first_reward_failure(self) -> None:
        """The first reward-function failure of an evaluation, once (it scored 0: eval/reward_errors counts them)."""
        if self.rewards.first_error and not self._reward_failure_said:
            self._reward_failure_said = True
            print(f"evaluator: {self.rewards.first_error}", file=sys.stderr, flush=True)

    def _evaluate_episodes(self, prompts: list[str], answers: list[str], samples: int) -> dict[str, float]:
        """Multi-turn: one greedy episode and `samples` sampled ones per held-out problem (see the module docstring)."""
        runner = self.episodes
        assert runner is not None
        counters = runner.counters
        before = {name: counters[name] for name in ("env_episodes", "env_turns", "env_tool_calls")}
        failures_before = counters["env_errors"] + counters["env_timeouts"]
        greedy = self._episodes(prompts, answers, 1, top_k=1)
        episodes = max(counters["env_episodes"] - before["env_episodes"], 1)
        metrics = {
            "eval/acc_greedy_rollout": sum(e.reward >= 1.0 for (e,) in greedy) / max(len(prompts), 1),
            "eval/tool_calls": (counters["env_tool_calls"] - before["env_tool_calls"]) / episodes,
            "eval/turns_mean": (counters["env_turns"] - before["env_turns"]) / episodes,
            "eval/skipped": float(sum(sum(e.loss_mask) == 0 for (e,) in greedy)),
        }
        if samples and prompts:
            rewards = [[e.reward for e in row] for row in self._episodes(prompts, answers, samples)]
            metrics.update(sample_metrics([[r >= 1.0 for r in row] for row in rewards], rewards))
        metrics["eval/env_errors"] = float(counters["env_errors"] + counters["env_timeouts"] - failures_before)
        return metrics

    def _episodes(self, prompts: list[str], answers: list[str], draws: int, top_k: int = 0) -> list[list[Any]]:
        """`draws` episodes per held-out problem (top_k 1: greedy), one list per problem (rollout_workers/episodes.py
        `Episode`: `reward`, `loss_mask`, ...). The problem rows hold `index`, `prompt`, `answer` and `eval: True`."""
        from common.wire import PromptLease

        runner = self.episodes
        assert runner is not None
        leases = [PromptLease(f"eval/{i}", i, prompt, answer, 0.0) for i, (prompt, answer) in
                  enumerate(zip(prompts, answers, strict=True))]  # fmt: skip
        rows = self.problem_rows(prompts, answers, episodes=True)
        trained = runner.params  # the evaluator runs no rollout loop: nothing else uses its runner meanwhile
        runner.params = replace(trained, top_k=top_k) if top_k else trained
        try:
            return runner.run(leases, rows, draws)
        finally:
            runner.params = trained

    def _scores(
        self, prompt_ids: list[list[int]], answers: list[str], rows: list[dict[str, Any]], draws: int, top_k: int = 0
    ) -> list[tuple]:
        """The rewards of `draws` responses per prompt (top_k 1: greedy), one tuple per prompt (`rows`: its
        `problem_rows`)."""
        params = replace(self.params, top_k=top_k) if top_k else self.params
        batch = [ids for ids in prompt_ids for _ in range(draws)]
        completions = self.engine.generate(batch, params)
        items, ids = [], []
        for g, (answer, row) in enumerate(zip(answers, rows, strict=True)):
            for d in range(draws):
                response_ids = completions[g * draws + d].response_ids
                items.append((self.tokenizer.decode(response_ids, skip_special_tokens=True), answer, row))
                ids.append(response_ids)
        rewards = self.rewards.score(items, ids)
        return [tuple(rewards[g * draws : (g + 1) * draws]) for g in range(len(rows))]


class Evaluator:
    """The driver's end: the evaluator actor, created at the first evaluation (not at start-up, where it would take CPU
    from the learner and the workers), and the `eval` event."""

    def __init__(self, cfg: Any, learner: Any, model_dir: str, buffer_endpoint: str, weights_endpoint: Any) -> None:
        """`cfg`: the root config (data, rollout, eval, ray and the rollout workers' sections are read)."""
        self.cfg, self.learner = cfg, learner
        self.args = (model_dir, buffer_endpoint, weights_endpoint)
        self.actor: Any = None

    def _start(self) -> None:
        from common import actors
        from common.config import to_dict
        from rollout_workers.sections import WorkerSections

        options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 1}
        if self.cfg.ray.worker_resources:  # where the rollout workers run (an SGLang backend's GPU, say)
            options["resources"] = dict(self.cfg.ray.worker_resources)
        model_dir, buffer_endpoint, weights_endpoint = self.args
        sections = to_dict(WorkerSections.pick(self.cfg))
        self.actor = actors.remote(EvalWorker, **options).remote(sections, EVAL_WORKER_ID, model_dir, buffer_endpoint)
        actors.get(self.actor.subscribe.remote(weights_endpoint))

    def run(self, step: int, logger: Any) -> dict[str, float]:
        """Evaluate the weights after `step` train steps (version `step`); logged as an `eval` event and returned."""
        from common import actors
        from common.tasks import make_source

        source = make_source(self.cfg.data)
        held_out, trained_on = source.eval_set(), bool(getattr(source, "eval_in_training", False))
        overlap = int(getattr(source, "eval_overlap", 0))  # rows of data.eval_path that data.path holds too
        prompts, answers = [p.prompt for p in held_out], [p.answer for p in held_out]
        metrics: dict[str, float] = {}
        if not self.cfg.env.fn:  # the learner's single-turn greedy decode; an episode's tool calls need the evaluator
            metrics["eval/acc_greedy"] = self.learner.evaluate(prompts, answers, self.cfg.rollout.max_new_tokens)
        if self.actor is None:
            self._start()
        metrics.update(actors.get(self.actor.evaluate.remote(step, prompts, answers, self.cfg.eval.samples)))
        distinct = len(set(prompts))  # the built-in tasks draw from their held-out slice with replacement
        logger.event("eval", after_steps=step, problems=len(prompts), distinct=distinct, trained_on=trained_on,
                     **({"eval_path_rows_in_training": overlap} if overlap else {}), **metrics)  # fmt: skip
        shown_keys = [key for key in metrics if any(part in key for part in ("@", "acc", "tool"))]
        shown = ", ".join(f"{key[5:]} {metrics[key]:.3f}" for key in shown_keys)
        if overlap:
            what = f"eval ({overlap} rows of data.eval_path are rows of data.path too: not held out) after {step} steps"
        elif trained_on:
            what = f"eval (rows also in the training stream: set data.eval_path for a held-out set) after {step} steps"
        else:
            what = f"held-out eval after {step} steps"
        logger.info(f"{what} on {len(prompts)} prompts ({distinct} distinct): {shown}")
        return metrics

    def close(self) -> None:
        """Stop the evaluator (its engine and reward process), then its actor; nothing if it never started."""
        from common import actors

        if self.actor is None:
            return
        try:
            actors.get(self.actor.stop.remote(), timeout=60)
        finally:
            actors.kill(self.actor)
            self.actor = None
