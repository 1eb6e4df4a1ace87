"""The rollout worker loop: lease prompts, generate G responses each, score them, push the groups. Never waits
for the learner: new weight versions arrive on a subscriber thread and the engine swaps them in between two
decode steps.

    buffer --lease--> worker --generate (engine, versions staged from quant_sync)--> reward --push group--> buffer

One `RolloutWorker` per process (a Ray actor in `asyncrl up`); `start()` runs the loop on a thread so that
`stats()` and `stop()` stay callable. A group the buffer refuses for backpressure is retried, never dropped.
While the loop runs, a heartbeat thread (its own socket) tells the buffer every `buffer.worker_timeout_s / 6`
seconds that the worker is alive, even in the middle of a long batch; if the process or its loop dies, the beats
stop and the buffer returns the worker's leases after `buffer.worker_timeout_s`; a worker that stops (`stop()`: scaled
away, or the run ends) tells the buffer so, and what it leased and did not push returns at once.

With `env.fn` set, each sample is a multi-turn episode with an environment (rollout_workers/episodes.py): the
environment makes the prompt and the reward, and the trajectories carry a loss mask (0 on observation tokens).

A worker reads only its config sections (`rollout_workers.sections.WorkerSections`), never the root config, and
uses its engine only through the `Engine` protocol (rollout_workers/engine.py).
"""

from __future__ import annotations

import math
import threading
import time
import traceback
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np

from buffer.client import BufferClient, BufferRequestError, BufferUnavailable, Heartbeat
from common.curve import client_keys
from common.tasks import problem_row
from common.train_gate import TrainGate
from common.wire import PromptLease, Trajectory
from rollout_workers.cpu_priority import lower_to_idle
from rollout_workers.sections import WorkerSections

if TYPE_CHECKING:
    from quant_sync.transport import WeightSubscriber
    from rollout_workers.engine import Engine
    from rollout_workers.screening import AnswerScreen


LEAVE_TIMEOUT_S = 2.0
"""How long a stopping worker waits for the buffer to take its WorkerLeaving."""
MAX_REFILLS = 4
"""Most extra lease requests the loop makes to refill a batch that predictive selective rollout screened."""
MAX_REFILL_FACTOR = 8
"""A refill asks for at most this many times the missing groups (the missing ones over the share of screened prompts
kept lately), so that prompts are screened several per engine step rather than one or two."""


class RolloutWorker:
    def __init__(
        self,
        section_values: dict[str, Any],
        worker_id: str,
        model_dir: str,
        buffer_endpoint: str,
        weights_endpoint: str = "",
    ):
        """`section_values`: `common.config.to_dict` of a `WorkerSections`. `weights_endpoint` may instead be given
        to `start`: the constructor (imports, tokenizer, engine) can then run while the learner is still starting.
        The tokenizer is `common.tasks.chat.prompt_encoder`'s: without a chat template, `tokenizers` alone (the
        learner's ids; transformers, two CPU-seconds of imports, is not loaded)."""
        import torch

        from common.tasks import make_source
        from common.tasks.chat import prompt_encoder, source_has_messages
        from rollout_workers.embedded.engine import EmbeddedEngine
        from rollout_workers.engine import SamplingParams
        from rollout_workers.reward_pool import RewardScorer

        self.sections = WorkerSections.load(section_values)
        rollout = self.sections.rollout
        if rollout.cpu_priority == "idle":  # as the driver resolved `auto`: the learner's cores stay the learner's
            lower_to_idle()
        torch.set_num_threads(rollout.threads)
        self.worker_id = worker_id
        self.source = make_source(self.sections.data)
        self.encode_prompt = prompt_encoder(
            model_dir, self.sections.data, messages=source_has_messages(self.source),
            trust_remote_code=self.sections.model.trust_remote_code,
        )  # fmt: skip
        self.tokenizer = self.encode_prompt.tokenizer  # decodes responses for the reward
        # user reward functions run in a process of their own (rollout_workers/reward_pool.py); none: the task reward
        self.rewards = RewardScorer(self.sections.reward, self.source.reward)
        seed = self.sections.train.seed * 1_000_003 + zlib.crc32(worker_id.encode())
        self._seed = seed
        self.engine: Engine
        if rollout.backend == "sglang":  # an SGLang server per worker (rollout_workers/sglang_api/backend.py)
            from rollout_workers.sglang_api.backend import SGLangEngine

            self.engine = SGLangEngine(self.sections, model_dir, worker_id=worker_id, seed=seed)
        else:
            self.engine = EmbeddedEngine(
                model_dir, max_batch=rollout.max_batch, seed=seed, swap_mode=rollout.swap_mode,
                max_seq_len=rollout.max_seq_len, precision=self.sections.precision.rollout, device=rollout.device,
                prefix_cache=rollout.prefix_cache,
            )  # fmt: skip
            gate = TrainGate.from_env()  # named by the driver for its own CPU workers only (common.train_gate)
            if gate is not None:
                self.engine.before_step = gate.wait
        self.params = SamplingParams(
            max_new_tokens=rollout.max_new_tokens,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            stop_token_ids=self.engine.stop_token_ids,
        )
        self.buffer_endpoint = buffer_endpoint
        self.curve = client_keys(self.sections.buffer.curve_keys_dir)
        self.heartbeat: Heartbeat | None = None
        self.weights_endpoint = weights_endpoint
        self.subscriber: WeightSubscriber | None = None  # once `start` knows the publisher
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.counters = {
            "tokens": 0, "samples": 0, "correct": 0, "reward_sum": 0.0,
            "groups_pushed": 0, "groups_refused": 0, "errors": 0, "gen_seconds": 0.0, "prompts_skipped": 0,
            "reward_errors": 0, "reward_timeouts": 0,
        }  # fmt: skip
        self.last_error = ""
        self._reward_error_shown = False
        self.episodes = None  # multi-turn episodes (rollout_workers/episodes.py) when `env.fn` names an environment
        if self.sections.env.fn:
            from rollout_workers.episodes import EpisodeRunner

            self.episodes = EpisodeRunner(
                self.sections.env, self.engine, self.tokenizer, self.encode_prompt, self.params, self.counters, seed,
                model_dir=model_dir,
            )  # fmt: skip
        self.screen = self._answer_screen()  # predictive selective rollout (rollout_workers/screening.py), or None
        self._kept_share = 1.0  # share of screened prompts kept for generation, lately (sizes the loop's refills)

    def _answer_screen(self) -> AnswerScreen | None:
        """The predictive selective rollout of `algo.skip_predicted` (null resolved by `skip_predicted_on`), or None."""
        from common.config_rules import skip_predicted_on
        from rollout_workers.embedded.engine import EmbeddedEngine
        from rollout_workers.screening import AnswerScreen

        sections = self.sections
        custom_reward, multi_turn = bool(sections.reward.specs()), bool(sections.env.fn)
        if not skip_predicted_on(sections.algo, sections.rollout.backend, custom_reward, multi_turn):
            return None
        if not isinstance(self.engine, EmbeddedEngine):  # the config rules allow it with the embedded engine only
            raise ValueError("`algo.skip_predicted` needs `rollout.backend=embedded`")
        tokenizer = self.tokenizer
        return AnswerScreen(
            group_size=sections.train.group_size, above=sections.algo.skip_predicted_above,
            min_prob=sections.algo.skip_min_prob, seed=sections.train.seed,
            encode_answer=lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"]),
            reward=self.source.reward,
        )  # fmt: skip

    def start(self, weights_endpoint: str = "") -> bool:
        """Subscribe to the learner's publisher, wait for version 0, then run the rollout loop and the heartbeat."""
        from quant_sync.transport import WeightSubscriber

        self.weights_endpoint = weights_endpoint or self.weights_endpoint
        if not self.weights_endpoint:
            raise ValueError(f"{self.worker_id}: no weights endpoint (pass it to the constructor or to start)")
        self.subscriber = WeightSubscriber(
            self.weights_endpoint,
            self.engine.stage_weights,
            curve=self.curve,
            keep_int8_adapters=getattr(self.engine, "runs_int8_adapters", False),
        )
        if not self.subscriber.wait_for(0, timeout_s=120):
            raise RuntimeError(f"{self.worker_id}: no weights from the publisher at {self.subscriber.endpoint}")
        self._thread = threading.Thread(target=self._loop, name=f"{self.worker_id}-loop", daemon=True)
        self._thread.start()
        if self.sections.buffer.worker_timeout_s > 0:
            interval_s = self.sections.buffer.worker_timeout_s / 6
            alive = self._thread.is_alive  # a dead loop stops the beats, so its leases return
            self.heartbeat = Heartbeat(self.buffer_endpoint, self.worker_id, interval_s, alive, self.curve)
            self.heartbeat.start()
        return True

    def pid(self) -> int:
        """The worker's process id (for supervision tests and `asyncrl status`)."""
        import os

        return os.getpid()

    def node_id(self) -> str:
        """The Ray node this worker runs on ("" outside Ray)."""
        try:
            import ray

            return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        except ImportError:
            return ""

    def stop(self) -> dict[str, Any]:
        """Stop after the batch in progress (its finished groups are still pushed); returns the final stats."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self._leave()
        if self.subscriber is not None:
            self.subscriber.close()
        stats = self.stats()
        self.engine.close()  # the SGLang backend stops its server
        self.rewards.close()
        if self.episodes is not None:
            self.episodes.close()
        return stats

    def _leave(self) -> None:
        """Tell the buffer this worker stops, so that a lease it did not finish returns now, not after
        `buffer.worker_timeout_s`; a buffer that does not answer within LEAVE_TIMEOUT_S (gone, or of a version without
        WorkerLeaving) is left to do that as before."""
        if self._thread is None:
            return
        try:
            with BufferClient(self.buffer_endpoint, self.worker_id, timeout_s=LEAVE_TIMEOUT_S, curve=self.curve) as c:
                c.leave()
        except (BufferUnavailable, BufferRequestError) as err:
            self.last_error = f"leaving: {err}"

    def stats(self) -> dict[str, Any]:
        subscriber = self.subscriber
        return {
            **self.counters,
            "worker": self.worker_id,
            "version": self.engine.version,
            "swaps": self.engine.swaps,
            # a worker whose weight subscriber stopped would generate on stale weights forever: not alive; nor one
            # whose engine cannot generate any more (its loop ends, after telling the buffer it leaves: `_loop`)
            "alive": self._thread is not None and self._thread.is_alive() and (subscriber is None or subscriber.alive),
            "last_error": self.engine.fatal or self.last_error,  # a failed engine says why first
            "weights_rejected": subscriber.rejected if subscriber is not None else 0,
            "weights_error": subscriber.last_error if subscriber is not None else "",
            "build_errors": self.engine.build_errors,
            "reward_metrics": {key: list(total) for key, total in list(self.rewards.metric_sums.items())},
            **(self.screen.stats() if self.screen is not None else {}),
            "reward_first_error": self.rewards.first_error,  # the driver logs the run's first one
            **self.engine.stats(),
        }

    def _loop(self) -> None:
        client = BufferClient(self.buffer_endpoint, identity=self.worker_id, curve=self.curve)
        try:
            if self.sections.rollout.continuous:  # the engine's batch kept full across leases (continuous.py)
                from rollout_workers.continuous import run_continuous

                run_continuous(self, client, self._seed)
                return
            while not self._stop.is_set():
                try:
                    leases, retry_after = client.lease(self.sections.rollout.groups_per_lease)
                except BufferUnavailable:
                    continue
                except BufferRequestError as err:  # the buffer refused the request itself: say so, back off
                    self.counters["errors"] += 1
                    self.last_error = f"lease refused: {err}"
                    self._stop.wait(1.0)
                    continue
                if not leases:
                    self._stop.wait(max(retry_after, 0.01))
                    continue
                try:
                    if self.screen is not None:  # screened prompts resolved at once, the batch refilled
                        leases = self._screen_and_refill(client, leases)
                    groups = self.rollout(leases, screen=False) if leases else []
                except Exception:  # keep the worker alive; the leases expire and return to the pool
                    self._note_error()
                    if self._engine_failed():
                        break
                    continue
                for lease, trajectories in groups:
                    self._push(client, lease, trajectories)
        finally:
            client.close()

    def _note_error(self) -> None:
        """Count the batch (or group) the exception being handled failed, and keep its traceback."""
        self.counters["errors"] += 1
        self.last_error = traceback.format_exc(limit=3)

    def _engine_failed(self) -> bool:
        """Whether the engine can no longer generate (`Engine.fatal`): then every batch would fail, so the loop ends
        (no more leases) after telling the buffer the worker leaves (what it leased returns now); `stats()` says not
        alive and the supervisor restarts the worker."""
        if not (fatal := self.engine.fatal):
            return False
        self.last_error = fatal
        self._leave()
        return True

    def _push(self, client: BufferClient, lease: PromptLease, trajectories: list[Trajectory]) -> None:
        """Push until accepted or refused; when stopping, one attempt (an unpushed group's lease returns)."""
        while True:
            try:
                reply = client.push_group(lease.group, trajectories)
            except BufferUnavailable:
                if self._stop.is_set():
                    return
                continue
            except BufferRequestError as err:  # an invalid group (say a reward that is not finite): dropped
                self.counters["groups_refused"] += 1
                self.last_error = f"group {lease.group} refused: {err}"
                return
            if reply.accepted:
                self.counters["groups_pushed"] += bool(trajectories)  # an empty one: screened, not generated
                return
            if reply.reason != "backpressure":
                self.counters["groups_refused"] += 1
                self.last_error = f"group {lease.group} refused: {reply.reason}"
                return
            if self._stop.wait(0.2):
                return

    def _screen_and_refill(self, client: BufferClient, leases: list[PromptLease]) -> list[PromptLease]:
        """Predictive selective rollout in the loop: screen the leased prompts, resolve the screened ones in the buffer
        at once (empty pushes), and lease again, up to MAX_REFILLS times, until `rollout.groups_per_lease` prompts are
        left to generate or the buffer gives none, so that the engine's batches stay as full as without screening
        (an engine step has a fixed cost: a batch of one group costs nearly what a batch of two does)."""
        wanted = self.sections.rollout.groups_per_lease
        kept: list[PromptLease] = []
        for refill in range(MAX_REFILLS + 1):
            decided = self.rollout_screen(leases)
            for lease, trajectories in decided:
                if trajectories is None:
                    kept.append(lease)
                else:
                    self._push(client, lease, trajectories)
            share = sum(trajectories is None for _, trajectories in decided) / max(len(decided), 1)
            self._kept_share = 0.8 * self._kept_share + 0.2 * share  # of screened prompts, lately
            if len(kept) >= wanted or refill == MAX_REFILLS or self._stop.is_set():
                break
            missing = wanted - len(kept)
            try:
                leases, _ = client.lease(
                    min(math.ceil(missing / max(self._kept_share, 1e-3)), MAX_REFILL_FACTOR * missing)
                )
            except (BufferUnavailable, BufferRequestError):
                break
            if not leases:
                break
        return kept

    def rollout_screen(self, leases: list[PromptLease]) -> list[tuple[PromptLease, list[Trajectory] | None]]:
        """Each lease with None (to generate) or [] (screened out: resolve it with an empty push), in lease order; every
        lease is to generate without `algo.skip_predicted` or when its prompt does not fit the engine (`rollout`
        counts and skips it)."""
        if self.screen is None:
            return [(lease, None) for lease in leases]
        prompt_ids = [self.encode_prompt(lease.prompt) for lease in leases]
        limit, max_new_tokens = self.engine.max_seq_len, self.sections.rollout.max_new_tokens
        fits = [bool(ids) and (limit is None or len(ids) + max_new_tokens <= limit) for ids in prompt_ids]
        kept = iter(self.screen.keep(
            self.engine,  # type: ignore[arg-type]  # an EmbeddedEngine (`_answer_screen`)
            [lease for lease, ok in zip(leases, fits) if ok], [ids for ids, ok in zip(prompt_ids, fits) if ok],
            self.params,
        ) if any(fits) else [])  # fmt: skip
        return [(lease, None if not ok or next(kept) else []) for lease, ok in zip(leases, fits)]

    def _prompt_fits(self, lease: PromptLease, ids: list[int]) -> bool:
        """Whether the engine can generate for this prompt (not empty, room for max_new_tokens); counted if not."""
        limit = self.engine.max_seq_len
        max_new_tokens = self.sections.rollout.max_new_tokens
        room = limit is None or len(ids) + max_new_tokens <= limit
        if ids and room:
            return True
        self.counters["prompts_skipped"] += 1
        self.last_error = (
            f"prompt of group {lease.group} skipped: {len(ids)} tokens + rollout.max_new_tokens "
            f"{max_new_tokens} do not fit the engine's max sequence length {limit}"
            if ids
            else f"prompt of group {lease.group} skipped: it tokenizes to no tokens"
        )
        return False

    def rollout(self, leases: list[PromptLease], screen: bool = True) -> list[tuple[PromptLease, list[Trajectory]]]:
        """Generate `group_size` responses for each leased prompt and score them (all prompts in one batch). With
        `algo.skip_predicted` (and `screen`; the loop screens first itself, `_screen_and_refill`) a prompt screened out
        (rollout_workers/screening.py) comes back with no trajectories, ungenerated: its empty push resolves it in the
        buffer."""
        if self.episodes is not None:  # multi-turn: the environment makes the prompt
            return self._rollout_episodes(leases)
        screened: list[tuple[PromptLease, list[Trajectory]]] = []
        if screen and self.screen is not None:
            decided = self.rollout_screen(leases)
            screened = [(lease, []) for lease, trajectories in decided if trajectories is not None]
            leases = [lease for lease, trajectories in decided if trajectories is None]
            if not leases:
                return screened
        group_size = self.sections.train.group_size
        prompt_ids = [self.encode_prompt(lease.prompt) for lease in leases]  # chat template: common.tasks.chat
        fits = [self._prompt_fits(lease, ids) for lease, ids in zip(leases, prompt_ids)]
        if not all(fits):  # generate the others; a prompt that cannot be generated is left to its lease's expiry
            leases = [lease for lease, ok in zip(leases, fits) if ok]
            prompt_ids = [ids for ids, ok in zip(prompt_ids, fits) if ok]
            if not leases:
                return screened
        batch = [ids for ids in prompt_ids for _ in range(group_size)]
        started = time.time()
        completions = self.engine.generate(batch, self.params)
        ended = time.time()
        self.counters["gen_seconds"] += ended - started
        rewards = self._score(leases, completions, group_size)
        out = []
        for g, lease in enumerate(leases):
            span = slice(g * group_size, (g + 1) * group_size)
            trajectories = self._trajectories(lease, prompt_ids[g], completions[span], rewards[span], started, ended)
            out.append((lease, trajectories))
        return screened + out

    def _trajectories(
        self, lease: PromptLease, prompt_ids: list[int], completions: list[Any], rewards: list[float],
        started: float, ended: float,
    ) -> list[Trajectory]:  # fmt: skip
        """The group of one leased prompt: its samples' completions and rewards as trajectories, counted."""
        trajectories = []
        for i, (completion, reward) in enumerate(zip(completions, rewards, strict=True)):
            self.counters["tokens"] += len(completion.response_ids)
            self.counters["samples"] += 1
            self.counters["correct"] += int(reward >= 1.0)
            self.counters["reward_sum"] += reward
            trajectories.append(
                Trajectory(
                    uid=f"{lease.group}/{i}",
                    group=lease.group,
                    prompt_index=lease.index,
                    prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
                    response_ids=np.asarray(completion.response_ids, dtype=np.int32),
                    behav_logp=np.asarray(completion.behav_logp, dtype=np.float32),
                    versions=np.asarray(completion.versions, dtype=np.int32),
                    reward=reward,
                    correct=reward >= 1.0,
                    finish=completion.finish,
                    worker=self.worker_id,
                    t_start=started,
                    t_end=ended,
                )
            )
        return trajectories

    def _rollout_episodes(self, leases: list[PromptLease]) -> list[tuple[PromptLease, list[Trajectory]]]:
        """Multi-turn: `group_size` episodes per leased prompt (rollout_workers/episodes.py), rewarded by their
        environment; trajectories carry the loss mask (0 on observation tokens)."""
        from rollout_workers.episodes import problem_rows

        assert self.episodes is not None
        group_size = self.sections.train.group_size
        started = time.time()
        grouped = self.episodes.run(leases, problem_rows(self.source, leases), group_size)
        ended = time.time()
        self.counters["gen_seconds"] += ended - started
        if self.episodes.first_error and not self._reward_error_shown:
            self._reward_error_shown = True
            self.last_error = self.episodes.first_error
        out = []
        for lease, episodes in zip(leases, grouped, strict=True):
            if any(sum(e.loss_mask) == 0 for e in episodes):  # an episode with no model token: nothing to train
                self.counters["env_groups_dropped"] += 1
                continue
            trajectories = []
            for i, e in enumerate(episodes):
                self.counters["tokens"] += sum(e.loss_mask)
                self.counters["samples"] += 1
                self.counters["correct"] += int(e.reward >= 1.0)
                self.counters["reward_sum"] += e.reward
                mask = np.asarray(e.loss_mask, dtype=np.uint8)
                trajectories.append(
                    Trajectory(
                        uid=f"{lease.group}/{i}",
                        group=lease.group,
                        prompt_index=lease.index,
                        prompt_ids=np.asarray(e.prompt_ids, dtype=np.int32),
                        response_ids=np.asarray(e.response_ids, dtype=np.int32),
                        behav_logp=np.asarray(e.behav_logp, dtype=np.float32),
                        versions=np.asarray(e.versions, dtype=np.int32),
                        reward=e.reward,
                        correct=e.reward >= 1.0,
                        finish=e.finish,
                        worker=self.worker_id,
                        t_start=started,
                        t_end=ended,
                        loss_mask=None if mask.all() else mask,
                    )  # fmt: skip
                )
            out.append((lease, trajectories))
        return out

    def _score(self, leases: list[PromptLease], completions: list[Any], group_size: int) -> list[float]:
        """The reward of every response of the batch (`group_size` per lease, in order), in one call to the reward
        step (rollout_workers/reward_pool.py). `row`: the source's own row where it has one (`source.row(index)`: a
        `data.task=dataset` row with every field, as the file has it), else the lease's index, prompt and answer."""
        source_row = getattr(self.source, "row", None)
        items, ids = [], []
        for g, lease in enumerate(leases):
            record = source_row(lease.index) if source_row is not None else None
            row = problem_row(lease.index, lease.prompt, lease.answer, record, record_wins=True)
            for i in range(group_size):
                response_ids = completions[g * group_size + i].response_ids
                items.append((self.tokenizer.decode(response_ids, skip_special_tokens=True), lease.answer, row))
                ids.append(response_ids)
        rewards = self.rewards.score(items, ids)
        self.counters["reward_errors"] = self.rewards.errors
        self.counters["reward_timeouts"] = self.rewards.timeouts
        if self.rewards.first_error and not self._reward_error_shown:
            self._reward_error_shown = True
            self.last_error = self.rewards.first_error
        return rewards
