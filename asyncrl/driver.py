"""`asyncrl up`: start the services, then loop {take a batch, train, publish weights, log, checkpoint}.

    buffer (process, ZMQ) <--lease / push-- rollout workers (Ray actors, always generating)
          |                                        ^
          | FetchBatch(step k)                     | quantized weights, version k+1 (quant_sync, ZMQ)
          v                                        |
    learner (Ray actor) --train step k------------+

| loop | waits for | unblocked by |
|---|---|---|
| rollout worker | a lease: at most (k + max_lag + 1) * B groups by step k | the learner's fetch of step k |
| rollout worker | nothing else: weights are staged by a subscriber thread and swapped between decode steps | - |
| learner step k | `groups_per_step` admissible groups in the buffer | workers pushing groups |
| driver | the learner's step metrics | the learner finishing step k |

The driver starts step k + 1 as soon as step k returns and logs step k while it runs, unless the boundary needs the
learner idle (a checkpoint, an evaluation, live changes, a stop, the last step: `_boundary_work`). Ray starts on a
thread while the driver starts the buffer (`raycluster.connect_in_background`); the start-up's milestones are the
`startup` event in metrics.jsonl (`asyncrl/startup.py`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from functools import partial
from pathlib import Path
from typing import Any

from asyncrl import checkpoint, raycluster
from asyncrl.metrics import MetricsLogger
from asyncrl.operations import Operations, OperationsSections
from asyncrl.startup import StartupClock
from asyncrl.supervise import WorkerPool
from common.config import Config, live_update, to_dict
from learner.sections import LearnerSections
from rollout_workers.reward_pool import RewardMetrics
from rollout_workers.sections import WorkerSections

WAIT_SLICE_S = 0.05
"""The driver waits on a train step in slices this long, serving control requests and supervising between them; the
wait returns as soon as the step is done (a step's result used to wait for a 100 ms poll of the control socket)."""


class StartupError(RuntimeError):
    """Bad input found before any service started (dataset rows, model directory): the message names it."""


def new_run_dir(cfg: Config) -> Path:
    """runs/<name>, or runs/<name>-2, -3, ... if that one holds an earlier run (never mixed with a new one)."""
    base = Path(cfg.logging.dir) / cfg.logging.name
    run_dir, n = base, 1
    while run_dir.exists() and any(run_dir.iterdir()):
        n += 1
        run_dir = base.with_name(f"{base.name}-{n}")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def check_inputs(cfg: Config, model_dir: str) -> None:
    """Load the dataset, the model's config and the buffer's CurveZMQ keys here, so that bad rows, a bad model dir
    or a missing key fail before anything starts."""
    from common.curve import CurveKeyError, client_keys, server_keys
    from common.tasks import DatasetError, make_source
    from rollout_workers.embedded.arch import ArchConfig, ModelDirError

    if cfg.data.max_prompt_tokens and not cfg.data.tokenizer:
        cfg.data.tokenizer = model_dir  # every process counts prompt tokens with the model's tokenizer
    try:
        source = make_source(cfg.data)
    except DatasetError as err:
        raise StartupError(f"data.path: {err}") from None
    try:
        server_keys(cfg.buffer.curve_keys_dir)
        client_keys(cfg.buffer.curve_keys_dir)
    except CurveKeyError as err:
        raise StartupError(str(err)) from None
    check_model_code(model_dir, cfg.model.trust_remote_code)
    try:
        ArchConfig.from_model_dir(model_dir)
    except ModelDirError as err:
        raise StartupError(f"model.path: {err}") from None
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (Path(model_dir) / name).is_file():
            break
    else:
        raise StartupError(f"model.path: {model_dir} has no tokenizer (tokenizer.json or tokenizer_config.json)")
    from common.tasks.chat import check_prompts_fit

    try:  # prompts that cannot fit the model (or that it cannot encode) fail here, not as a silent hang
        warning = check_prompts_fit(source, cfg, model_dir, ArchConfig.from_model_dir(model_dir).max_positions)
    except DatasetError as err:
        raise StartupError(f"data: {err}") from None
    if warning:
        print(f"warning: data: {warning}", flush=True)


def check_model_code(model_dir: str, trust_remote_code: bool) -> None:
    """A model directory is data: one whose config.json names its own Python code (`auto_map`) is refused unless
    `model.trust_remote_code` says to run that code (docs/security.md)."""
    try:
        auto_map = json.loads((Path(model_dir) / "config.json").read_text()).get("auto_map")
    except (OSError, ValueError, AttributeError):
        return  # ArchConfig.from_model_dir names what is wrong with config.json
    if auto_map and not trust_remote_code:
        raise StartupError(
            f"model.path: {model_dir} ships its own code (auto_map in config.json: {', '.join(auto_map)}); asyncrl "
            "loads model directories as data. Set model.trust_remote_code=true to run that code"
        )


def run(cfg: Config, resume: Path | None = None) -> dict[str, Any]:
    """Run a whole training job, or continue `resume` (a run directory) from its latest checkpoint; returns a summary
    (also written to runs/<name>/summary.json)."""
    from common.builtin_model import resolve_model_path

    if resume is not None and not cfg.buffer.journal:
        raise StartupError(f"--resume {resume} needs `buffer.journal=true`: the buffer's queue is rebuilt from it")
    clock = StartupClock()
    clock.mark("driver_imports")
    quiet_libraries()
    model_dir = str(resolve_model_path(cfg.model.path, cfg.model.cache_dir))
    check_inputs(cfg, model_dir)
    clock.mark("inputs_checked")
    run_dir = resume if resume is not None else new_run_dir(cfg)
    checkpoint_dir = checkpoint.latest(run_dir) if resume is not None else None
    start_step = checkpoint.read_meta(checkpoint_dir)["step"] if checkpoint_dir is not None else 0
    (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    logger = MetricsLogger(cfg.logging, run_dir)
    if resume is not None:
        logger.event("resume", step=start_step, checkpoint=str(checkpoint_dir) if checkpoint_dir else None)
        logger.info(f"resuming {run_dir} at step {start_step} from {checkpoint_dir or 'the initial model'}")
    from buffer.launcher import start_service

    signals = StopSignals(logger)
    buffer_proc, ray_start = None, raycluster.RayStart()
    try:
        # Ray starts on a thread while this one starts the buffer and imports the actors' classes (both ~1 s)
        ray_start = raycluster.connect_in_background(cfg.ray, warn=logger.info)
        buffer_proc, buffer_endpoint = start_service(
            to_dict(cfg), run_dir, resume_step=start_step if resume is not None else None
        )
        clock.mark("buffer_ready")
        import learner.trainer  # noqa: F401  (torch: the driver pickles the actor classes by reference)
        import rollout_workers.worker  # noqa: F401

        ray_start.wait()
        clock.mark("ray_ready")
        signals.install()  # again: ray.init on the main thread (a cluster joined) replaces the SIGTERM handler
        return _train(cfg, run_dir, model_dir, buffer_endpoint, logger, checkpoint_dir, start_step, signals, clock)
    finally:
        signals.restore()
        import ray

        ray_start.settle()  # a start still under way ends first, or its cluster would be left behind
        if ray.is_initialized():
            ray.shutdown()
        ray_start.close()
        if buffer_proc is not None:
            _shutdown(buffer_proc)
        logger.close()


class StopSignals:
    """Ctrl-C or SIGTERM to `asyncrl up`: the first stops the run as `asyncrl down` does (the step in progress
    finishes, workers stop, a checkpoint is written); a second one stops it at once (KeyboardInterrupt)."""

    def __init__(self, logger: MetricsLogger) -> None:
        self.logger = logger
        self.requested = ""
        self._previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        self.install()

    def install(self) -> None:
        for sig in self._previous:
            signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            raise KeyboardInterrupt(f"{name} again: stopping now, without a checkpoint")
        self.requested = name
        self.logger.info(f"{name}: stopping after this step (workers stop, then a checkpoint); {name} again: now")


def quiet_libraries() -> None:
    """No progress bars or advisory warnings from transformers / HF hub in this process or the actors it starts."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("PYTHONWARNINGS", "ignore::UserWarning,ignore::FutureWarning")


def _train(
    cfg: Config,
    run_dir: Path,
    model_dir: str,
    buffer_endpoint: str,
    logger: MetricsLogger,
    checkpoint_dir: Path | None,
    start_step: int,
    signals: StopSignals,
    clock: StartupClock,
) -> dict[str, Any]:
    import ray

    from learner.group import LearnerGroup

    resume_dir = str(checkpoint_dir) if checkpoint_dir is not None else ""
    # Each part is given its own config sections: the root's very objects, so a live change applied to one shows in cfg
    learner = LearnerGroup(LearnerSections.pick(cfg), cfg.ray, model_dir, buffer_endpoint, resume_dir, start_step)
    # Workers start up (imports, tokenizer, engine) while the learner does; they subscribe once it has published.
    worker_sections, weights_endpoint = WorkerSections.pick(cfg), learner.weights_endpoint_ref()
    pool = WorkerPool(worker_sections, cfg.ray, model_dir, buffer_endpoint, weights_endpoint, logger.event)
    check_live = partial(live_update, cfg)  # a live change is validated against the whole config
    ops = Operations(
        OperationsSections.pick(cfg), check_live, run_dir, pool, learner, buffer_endpoint, logger, start_step
    )
    ops.buffer.set_max_lag(cfg.staleness.max_lag)  # the config wins over a max_lag the journal replayed
    clock.mark("actors_created")
    pool.start(cfg.rollout.num_workers, meanwhile=lambda: (learner.weights_endpoint(), clock.mark("learner_ready")))
    clock.mark("workers_running")
    logger.info(f"run {cfg.logging.name}: {cfg.rollout.num_workers} rollout workers, buffer {buffer_endpoint}, "
                f"weights {learner.weights_endpoint()}, model {model_dir}, control {ops.control.endpoint}")  # fmt: skip
    last_time = time.monotonic()
    buffer_totals: dict[str, float] = {}  # the buffer's counters at the previous step (`_buffer_metrics`)
    reward_view = RewardMetrics()  # reward/errors, reward/timeouts, reward/<key>; logs the first reward failure
    reward_failed = lambda message: (logger.event("reward_error", error=message), logger.info(message))  # noqa: E731
    step = start_step
    refs: list[Any] = []  # the train step in flight (rank 0's result first), [] when none
    with ops.control, logger.live_view():
        while refs or (step < cfg.train.steps and not ops.stop_requested(signals.requested)):
            refs = refs or learner.train_step_async(step)
            while True:  # serve the control socket and supervise while the step runs (at least once a step)
                ops.control.poll(ops.handle)
                pool.poll()
                if ray.wait(refs[:1], timeout=WAIT_SLICE_S)[0]:  # returns as soon as the step is done
                    break
            metrics, refs = ray.get(refs)[0], []
            step += 1
            if not _boundary_work(cfg, ops, signals, step):  # the learner trains the next step during the logging
                refs = learner.train_step_async(step)
            pool.refresh()
            metrics.update(_rollout_metrics(pool, ops.last_totals, time.monotonic() - last_time))
            metrics.update(_buffer_metrics(ops.buffer, buffer_totals))
            metrics.update(reward_view.update([w.stats for w in pool.workers.values()], pool.totals(), reward_failed))
            last_time = time.monotonic()
            logger.log_step(metrics)
            if step == start_step + 1:
                clock.mark("first_step")
                logger.event("startup", **clock.fields())
                logger.info(f"start-up {clock.marks['first_step']:.1f} s: {clock.summary()}")
            ops.step_done(step, metrics)
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < cfg.train.steps:
                ops.save_checkpoint(step)
            every = cfg.train.eval_every
            if cfg.data.eval_size and every and step % every == 0 and step < cfg.train.steps:
                _evaluate(cfg, learner, logger, step)  # the rollout workers keep generating meanwhile
        summary: dict[str, Any] = {"steps": step, "run_dir": str(run_dir), "stopped_early": ops.stopping}
        summary["workers"] = pool.stop_all()  # each finishes and pushes its batch in progress
        if cfg.data.eval_size and not ops.stopping:
            summary["eval/acc_greedy"] = _evaluate(cfg, learner, logger, step)
        if cfg.checkpoint.every or ops.stopping:
            summary["checkpoint"] = str(ops.save_checkpoint(step))
        if cfg.checkpoint.final:
            summary["final_checkpoint"] = learner.save(str(run_dir / "final"))
        summary["buffer"] = ops.buffer.stats()
        learner.close()
    ops.buffer.close()
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    logger.info(f"done: {step} steps; metrics in {run_dir / 'metrics.jsonl'}")
    return summary


def _boundary_work(cfg: Config, ops: Operations, signals: StopSignals, step: int) -> bool:
    """Whether the boundary before train step `step` needs the learner idle: the last step done, a stop asked for,
    live changes to apply (`Operations.step_done`), a checkpoint or an evaluation due. Otherwise the driver starts step
    `step` before it logs the step just done, so that the learner does not wait on the driver's logging (worker stats,
    buffer stats, metrics.jsonl: about 0.05-0.1 s a step on 2 cores). Control requests are served only while a step
    runs, so nothing can become pending between this check and `step_done`."""
    if step >= cfg.train.steps or ops.stop_requested(signals.requested) or ops.pending:
        return True
    every_ckpt, every_eval = cfg.checkpoint.every, cfg.train.eval_every
    return bool(
        (every_ckpt and step % every_ckpt == 0) or (cfg.data.eval_size and every_eval and step % every_eval == 0)
    )


def _evaluate(cfg: Config, learner: Any, logger: MetricsLogger, step: int) -> float:
    """Greedy accuracy of the learner's full-precision weights on the held-out prompts, logged as an `eval` event."""
    from common.tasks import make_source

    held_out = make_source(cfg.data).eval_set()
    prompts, answers = [p.prompt for p in held_out], [p.answer for p in held_out]
    accuracy = learner.evaluate(prompts, answers, cfg.rollout.max_new_tokens)
    logger.event("eval", after_steps=step, acc_greedy=accuracy, problems=len(prompts))
    logger.info(f"held-out greedy accuracy (full precision) after {step} steps: {accuracy:.3f} on {len(prompts)}")
    return accuracy


def _rollout_metrics(pool: WorkerPool, last: dict[str, float], seconds: float) -> dict[str, float]:
    """Rollout-side metrics over the interval since the previous step; `last` holds (and is updated to) totals.

    `acc/mean` and `reward/mean` cover every response generated in the interval, including groups the dynamic-
    sampling filter drops, so they measure the policy rather than the (filtered) training batch. Totals include
    workers that were removed or crashed (`WorkerPool.totals`).
    """
    worker_stats = [w.stats for w in pool.workers.values() if w.stats]
    all_totals = pool.totals()
    totals = {key: all_totals[key] for key in last}
    delta = {key: totals[key] - last[key] for key in last}
    last.update(totals)
    samples = max(delta["samples"], 1)
    return {
        "acc/mean": delta["correct"] / samples if delta["samples"] else float("nan"),
        "reward/mean": delta["reward_sum"] / samples if delta["samples"] else float("nan"),
        "rollout/samples": float(delta["samples"]),
        "perf/rollout_tok_s": delta["tokens"] / max(seconds, 1e-9),
        "perf/step_s": seconds,
        "rollout/min_worker_version": float(min((s["version"] for s in worker_stats), default=-1)),
        "rollout/errors": all_totals["errors"],
        "rollout/workers": float(len(pool.active())),
        "rollout/restarts": float(pool.crashes),
        **_sglang_metrics(worker_stats),
    }


def _buffer_metrics(buffer: Any, last: dict[str, float]) -> dict[str, float]:
    """The buffer's counters over the interval since the previous step: `rollout/filtered_share` and
    `rollout/skipped_prompts` (buffer/selective.py); none for a step whose stats request failed (a dead buffer is
    reported by the learner's fetch)."""
    from buffer.client import BufferRequestError, BufferUnavailable
    from buffer.selective import rollout_metrics

    try:
        return rollout_metrics(buffer.stats(), last)
    except (BufferUnavailable, BufferRequestError):
        return {}


def _sglang_metrics(worker_stats: list[dict[str, Any]]) -> dict[str, float]:
    """SGLang backend: the longest generation pause of a weight update (last one per worker) and server restarts."""
    if not worker_stats or "sglang_pause_s_last" not in worker_stats[0]:
        return {}
    return {
        "rollout/weight_pause_s": max(float(s["sglang_pause_s_last"]) for s in worker_stats),
        "rollout/server_restarts": float(sum(s["sglang_server_restarts"] for s in worker_stats)),
    }


def _shutdown(proc: subprocess.Popen) -> None:
    from buffer.launcher import stop_service

    stop_service(proc, timeout_s=10)
