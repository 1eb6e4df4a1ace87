"""`asyncrl up`: start the services, then loop {take a batch, train, publish weights, log, checkpoint}.

    buffer (process, ZMQ) <--lease / push-- rollout workers (actors, always generating)
          |                                        ^
          | FetchBatch(step k)                     | quantized weights, version k+1 (quant_sync, ZMQ)
          v                                        |
    learner (actor) --train step k----------------+

| loop | waits for | unblocked by |
|---|---|---|
| rollout worker | a lease: at most (k + max_lag + 1) * B groups by step k | the learner's fetch of step k |
| rollout worker | nothing else: weights are staged by a subscriber thread and swapped between decode steps | - |
| learner step k | `groups_per_step` admissible groups in the buffer | workers pushing groups |
| driver | the learner's step metrics | the learner finishing step k |

The driver starts step k + 1 as soon as step k returns and logs step k while it runs, unless the boundary needs the
learner idle (a checkpoint, an evaluation, live changes, a stop, the last step: `_boundary_work`). The actors are
Ray actors or child processes of the driver (`ray.launcher`, `common.actors`: `local` needs no Ray on one machine);
under Ray, Ray starts on a thread while the driver starts the buffer (`raycluster.connect_in_background`). The
start-up's milestones are the `startup` event in metrics.jsonl (`asyncrl/startup.py`).

While a step runs (`_wait_step`) the driver serves the control socket, restarts dead workers and a dead buffer process
(`asyncrl/supervise.py`) and runs the stall watchdog (`asyncrl/watchdog.py`); whatever ends the run early, its last
line names the process, how it ended, the step and the command that resumes (`watchdog.failure`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl import checkpoint, raycluster, run_lock
from asyncrl.console import one_time_work
from asyncrl.metrics import EnvMetrics, MetricsLogger
from asyncrl.operations import Operations, OperationsSections
from asyncrl.startup import StartupClock, quiet_libraries
from asyncrl.supervise import BufferSupervisor, WorkerPool
from asyncrl.watchdog import RunFailed, Watchdog, actor_death, failure
from common import actors, train_gate
from common.config import Config, live_update, to_dict
from common.config_rules import worker_cpu_priority
from learner.group import get_ranks
from learner.sections import LearnerSections
from rollout_workers.reward_pool import RewardMetrics
from rollout_workers.sections import WorkerSections

if TYPE_CHECKING:
    from rollout_workers.embedded.arch import ArchConfig

WAIT_SLICE_S = 0.05
"""The driver waits on a train step in slices this long, serving control requests and supervising between them; the
wait returns as soon as the step is done (a step's result used to wait for a 100 ms poll of the control socket)."""


class StartupError(RuntimeError):
    """Bad input found before any service started (dataset rows, model directory): the message names it."""


ABANDONED_STOP_WAIT_S = 2.0
"""How long a run stopped without finishing its step (`Watchdog.stop_now`) waits for its workers' batches."""


def _train_gate(cfg: Config, run_dir: Path, launcher: str) -> Path | None:
    """The train gate's file (`common.train_gate`), named in the environment the local actors start with, when this
    machine's embedded CPU workers should pause while the learner trains on every core
    (`rollout.pause_during_training`); None otherwise (a Ray cluster's workers run elsewhere)."""
    rollout = cfg.rollout
    own_cpu_workers = launcher == "local" and (rollout.backend, rollout.device) == ("embedded", "cpu")
    if not (rollout.pause_during_training and own_cpu_workers):
        return None
    path = run_dir / ".train_gate"
    try:
        path.unlink(missing_ok=True)  # a resumed run's old gate: open again
        train_gate.TrainGate(path)  # made here: a full disk is a start-up error, not a learner's death
    except OSError as err:
        raise StartupError(f"cannot make the train gate {path}: {err.strerror or err}") from None
    os.environ[train_gate.ENV_VAR] = str(path)
    return path


def new_run_dir(cfg: Config) -> tuple[Path, run_lock.RunLock]:
    """runs/<name>, or runs/<name>-2, -3, ... if that one holds an earlier run (never mixed with a new one), with its
    run lock held (two drivers started together get two directories)."""
    base = Path(cfg.logging.dir) / cfg.logging.name
    run_dir, n = base, 1
    try:
        while True:
            while run_dir.exists() and any(run_dir.iterdir()):
                n += 1
                run_dir = base.with_name(f"{base.name}-{n}")
            run_dir.mkdir(parents=True, exist_ok=True)
            try:
                lock = run_lock.acquire(run_dir)
            except run_lock.RunLocked:  # another driver took it after this one looked: the next name
                continue
            (run_dir / "config.json").touch()  # writable: the run's files go here
            return run_dir, lock
    except OSError as err:
        raise StartupError(f"logging.dir={cfg.logging.dir}: cannot make the run directory {run_dir}: "
                           f"{err.strerror or err} ({err.filename})") from None  # fmt: skip


def _resume_lock(run_dir: Path) -> run_lock.RunLock:
    """`--resume`: the run's lock, before anything is written there; a run that another driver runs is refused."""
    try:
        return run_lock.acquire(run_dir)
    except run_lock.RunLocked as err:
        raise StartupError(
            f"--resume {run_dir}: the run is running (its driver is pid {err.pid or '?'}); stop it "
            f"first (`asyncrl down {run_dir}`) or wait for it to end"
        ) from None
    except OSError as err:
        raise StartupError(f"--resume {run_dir}: cannot lock the run: {err.strerror or err} ({err.filename})") from None


def check_inputs(cfg: Config, model_dir: str) -> ArchConfig:
    """Load the dataset, the model's config and the buffer's CurveZMQ keys here, so that bad rows, a bad model dir
    or a missing key fail before anything starts; returns the model's config (`ArchConfig`)."""
    from common.curve import CurveKeyError, client_keys, server_keys
    from common.tasks import DatasetError, make_source
    from rollout_workers.embedded.arch import ArchConfig, ModelDirError

    if cfg.data.max_prompt_tokens and not cfg.data.tokenizer:
        cfg.data.tokenizer = model_dir  # every process counts prompt tokens with the model's tokenizer
    try:
        source = make_source(cfg.data)
    except DatasetError as err:
        raise StartupError(f"data.path: {err}") from None
    if overlap := int(getattr(source, "eval_overlap", 0)):
        print(f"warning: data.eval_path: {overlap} of its rows (prompt and answer) are rows of data.path too: the "
              "evaluation is not held out", flush=True)  # fmt: skip
    try:
        server_keys(cfg.buffer.curve_keys_dir)
        client_keys(cfg.buffer.curve_keys_dir)
    except CurveKeyError as err:
        raise StartupError(str(err)) from None
    check_model_code(model_dir, cfg.model.trust_remote_code)
    try:
        arch = ArchConfig.from_model_dir(model_dir)
        if cfg.rollout.backend == "embedded":
            arch.check_embedded(model_dir)
    except ModelDirError as err:
        raise StartupError(f"model.path: {err}") from None
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (Path(model_dir) / name).is_file():
            break
    else:
        raise StartupError(f"model.path: {model_dir} has no tokenizer (tokenizer.json or tokenizer_config.json)")
    from common.model_files import ModelFilesError, check_model_files

    try:  # truncated or missing weights or shards, a tokenizer of another model: before the learner or workers start
        check_model_files(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    except ModelFilesError as err:
        raise StartupError(str(err)) from None
    _check_reward_fns(cfg)
    from common.tasks.chat import check_prompts_fit

    try:  # prompts that cannot fit the model (or that it cannot encode) fail here, not as a silent hang
        window = arch.sliding_window if cfg.rollout.backend == "embedded" else 0  # the engine's context stops there
        warning = check_prompts_fit(source, cfg, model_dir, min(arch.max_positions, window or arch.max_positions))
    except DatasetError as err:
        raise StartupError(f"data: {err}") from None
    if warning:
        print(f"warning: data: {warning}", flush=True)
    return arch


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
    quiet_libraries()  # first: transformers reads it at import, and the fork server imports it for every local actor
    launcher = actors.resolve_launcher(cfg.ray)
    actors.use(launcher)  # `local`: the fork server imports torch while the driver goes on
    if launcher != "local":
        from common import zygote

        zygote.discard()  # `asyncrl up` started it before it knew (`asyncrl.startup.start_fork_server_early`)
    with one_time_work(cfg.logging.console) as log:  # a bar on a terminal while a built-in model is built
        try:
            model_dir = str(resolve_model_path(cfg.model.path, cfg.model.cache_dir, log=log))
        except ValueError as err:  # an unknown built-in, or one that cannot be built where the cache is
            raise StartupError(str(err)) from None
    arch = check_inputs(cfg, model_dir)
    from asyncrl.kernels import compile_kernels  # the workers' C++ kernels, once per machine (a bar on a terminal)

    compile_kernels(cfg)
    clock.mark("inputs_checked")
    run_dir, lock = (resume, _resume_lock(resume)) if resume is not None else new_run_dir(cfg)
    try:
        return _run_in(cfg, run_dir, resume is not None, model_dir, arch, clock)
    finally:
        lock.release()


def _run_in(cfg: Config, run_dir: Path, resume: bool, model_dir: str, arch: ArchConfig, clock: StartupClock
            ) -> dict[str, Any]:  # fmt: skip
    """`run` from the point its run directory is chosen and locked (`resume`: an earlier run's, to continue)."""
    passed_over: list[str] = []  # damaged checkpoints newer than the one resumed from
    checkpoint_dir = checkpoint.latest_whole(run_dir, say=passed_over.append) if resume else None
    start_step = checkpoint.read_meta(checkpoint_dir)["step"] if checkpoint_dir is not None else 0
    (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    logger = MetricsLogger(cfg.logging, run_dir)
    for line in passed_over:
        logger.info(line)
    if resume:
        logger.event("resume", step=start_step, checkpoint=str(checkpoint_dir) if checkpoint_dir else None,
                     passed_over=passed_over)  # fmt: skip
        logger.info(f"resuming {run_dir} at step {start_step} from {checkpoint_dir or 'the initial model'}")
    signals = StopSignals(logger)
    resume_step = start_step if resume else None
    ray_start, launcher = raycluster.RayStart(), actors.launcher()
    gate = _train_gate(cfg, run_dir, launcher)
    run_keys = _use_run_keys(cfg)  # after config.json is written: a resume makes new ones
    buffers = BufferSupervisor(to_dict(cfg), run_dir, logger.event, logger.info, resume_step, arch.vocab_size)
    try:
        # Ray starts on a thread while this one starts the buffer and imports the actors' classes (both ~1 s)
        if launcher == "ray":
            ray_start = raycluster.connect_in_background(cfg.ray, warn=logger.info)
        buffers.start()
        clock.mark("buffer_ready")
        import learner.group  # noqa: F401  (the actors' classes, pickled by reference; neither imports torch here)
        import rollout_workers.worker  # noqa: F401

        ray_start.wait()
        clock.mark("ray_ready")  # at once under `ray.launcher=local`
        signals.install()  # again: ray.init on the main thread (a cluster joined) replaces the SIGTERM handler
        watchdog = Watchdog(cfg.train.stall_timeout_s, start_step, logger.event, logger.info,
                            cfg.train.max_nonfinite_steps)  # fmt: skip
        for restarts in range(cfg.learner.max_restarts + 1):
            parts: dict[str, Any] = {}  # the learner and the worker pool of this attempt, for `_restart_learner`
            try:
                return _train(cfg, run_dir, model_dir, buffers, logger, checkpoint_dir, signals, clock, watchdog, parts)
            except (Exception, KeyboardInterrupt) as err:  # the last line names the process, the step and the resume
                # no restart for a learner whose first start raised in its constructor either: a config or machine
                # error raises again (Ray never restarts such an actor); after a death it may be a passing fault
                first_start_raised = restarts == 0 and actors.init_failed(err)
                last = restarts == cfg.learner.max_restarts or signals.requested or first_start_raised
                if not _learner_died(err) or last:
                    raise failure(err, watchdog.step, run_dir, resumable=not first_start_raised) from err
                checkpoint_dir, watchdog = _restart_learner(cfg, run_dir, buffers, logger, watchdog, parts, err)
        raise AssertionError("unreachable: the last attempt returns or raises")
    finally:
        signals.tearing_down()  # a signal now would cut the clean-up short: said and ignored until it ends
        actors.shutdown()  # local actors still there (a failed run); none under Ray
        if gate is not None:
            os.environ.pop(train_gate.ENV_VAR, None)
            gate.unlink(missing_ok=True)
        ray_start.settle()  # a start still under way ends first, or its cluster would be left behind
        if launcher == "ray":
            import ray

            if ray.is_initialized():
                ray.shutdown()
        ray_start.close()
        ray_start.remove_files(keep_logs=sys.exc_info()[0] is not None)  # a failed run keeps Ray's logs
        buffers.stop()
        _sweep_weight_files()
        if run_keys is not None:
            shutil.rmtree(run_keys, ignore_errors=True)
        signals.restore()
        logger.close()


def _use_run_keys(cfg: Config) -> Path | None:
    """`buffer.run_keys`: fresh CurveZMQ keys for a run without `buffer.curve_keys_dir`, set on `cfg` for every
    process it starts (the buffer, the learner's weight publisher, the workers, the driver's own clients), so that
    no other local user's process gets through the loopback ports (docs/security.md). Returns the directory to remove
    when the run ends, or None."""
    if cfg.buffer.curve_keys_dir or not cfg.buffer.run_keys:
        return None
    from common.curve import make_run_keys

    try:
        keys_dir = make_run_keys()
    except OSError as err:
        raise StartupError(f"buffer.run_keys: cannot write the run's CurveZMQ keys: {err}") from None
    cfg.buffer.curve_keys_dir = str(keys_dir)
    return keys_dir


def _check_reward_fns(cfg: Config) -> None:
    """Load the user's reward functions once, in a reward process as a worker does (`rollout_workers/reward_pool.py`):
    a module that fails to import, exits, or names something that is not a function fails here, not as every rollout
    worker's death after start-up."""
    specs = cfg.reward.specs()
    if all(spec.startswith("asyncrl:") for spec in specs):  # none, or built-ins only: they load (a cold math-verify
        return  # import would cost the start seconds)
    from common.reward_fns import RewardFnError
    from rollout_workers.reward_pool import RewardPool

    key = cfg.reward.specs_key()
    try:
        RewardPool(specs, cfg.reward.timeout_s, key=key).close()
    except (RewardFnError, RuntimeError) as err:  # RuntimeError: the process died or hung while loading them
        raise StartupError(f"{key}: {err}" if not str(err).startswith(f"`{key}") else str(err)) from None


def _sweep_weight_files() -> None:
    """Unlink the /dev/shm weight files of publishers that have ended: a learner killed with a failed or stopped
    run (local actors are reaped by now) leaves its versions there, memory a later run's first publication would
    otherwise be the first to free (`quant_sync/shm_owner.py`)."""
    from quant_sync.shm_owner import SHM_DIR, sweep_stale

    sweep_stale(SHM_DIR)


REPEAT_WINDOW_S = 0.05
"""A second SIGTERM this soon after the first is the same request: timeout(1), like other supervisors, signals the
child and then its process group, microseconds apart."""


class StopSignals:
    """Ctrl-C, SIGTERM or SIGHUP (the terminal closed) to `asyncrl up`: the first stops the run as `asyncrl down`
    does (the step in progress finishes, workers stop, a checkpoint is written); a second one stops it at once
    (KeyboardInterrupt), except a SIGTERM within REPEAT_WINDOW_S of the first."""

    def __init__(self, logger: MetricsLogger) -> None:
        self.logger = logger
        self.requested = ""
        self._first_at = 0.0
        self._previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        self.install()

    def install(self) -> None:
        for sig in self._previous:
            signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def tearing_down(self) -> None:
        """The run's work is saved (its summary written) or it failed, and its processes and files are being ended: a
        signal now is said and ignored (the clean-up's waits are bounded), so that a stopped run's keys, gate file and
        local actors still go (a second Ctrl-C right after "stopped after ..." skipped all of it, exit 130)."""
        for sig in self._previous:
            signal.signal(sig, self._handle_in_teardown)

    def _handle_in_teardown(self, signum: int, frame: object) -> None:
        self.logger.info(f"{signal.Signals(signum).name}: the run is being cleaned up; it ends in a few seconds")

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.requested:
            if name == self.requested == "SIGTERM" and now - self._first_at < REPEAT_WINDOW_S:
                return  # the same stop, delivered to the driver and to its process group
            raise KeyboardInterrupt(f"{name} again: stopping now, without a checkpoint")
        self.requested, self._first_at = name, now
        if signum == signal.SIGHUP:
            _detach_from_terminal()  # it is gone: the lines below and the stop's would fail writing to it
        self.logger.info(f"{name}: stopping after this step (workers stop, then a checkpoint); {name} again: now")


def _detach_from_terminal() -> None:
    """Point stdout and stderr that are a terminal at /dev/null (metrics.jsonl keeps every event)."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            if os.isatty(fd):
                os.dup2(null, fd)
    finally:
        os.close(null)


def _train(
    cfg: Config,
    run_dir: Path,
    model_dir: str,
    buffers: BufferSupervisor,
    logger: MetricsLogger,
    checkpoint_dir: Path | None,
    signals: StopSignals,
    clock: StartupClock,
    watchdog: Watchdog,
    parts: dict[str, Any],
) -> dict[str, Any]:
    from asyncrl.evaluate import Evaluator
    from learner.group import LearnerGroup

    start_step = watchdog.step
    resume_dir = str(checkpoint_dir) if checkpoint_dir is not None else ""
    buffer_endpoint = buffers.endpoint  # a restarted buffer listens on the same one
    # Each part is given its own config sections: the root's very objects, so a live change applied to one shows in cfg
    learner = LearnerGroup(LearnerSections.pick(cfg), cfg.ray, model_dir, buffer_endpoint, resume_dir, start_step)
    # Workers start up (imports, tokenizer, engine) while the learner does; they subscribe once it has published.
    # `rollout.cpu_priority=auto` is resolved here: a worker built outside a run (auto left as is) keeps its priority
    cfg.rollout.cpu_priority = worker_cpu_priority(cfg.rollout, cfg.staleness)
    worker_sections, weights_endpoint = WorkerSections.pick(cfg), learner.weights_endpoint_ref()
    pool = WorkerPool(worker_sections, cfg.ray, model_dir, buffer_endpoint, weights_endpoint, logger.event)
    evaluator = Evaluator(cfg, learner, model_dir, buffer_endpoint, weights_endpoint)  # started at its first use
    parts.update(learner=learner, pool=pool, evaluator=evaluator)
    check_live = partial(live_update, cfg)  # a live change is validated against the whole config
    ops = Operations(
        OperationsSections.pick(cfg), check_live, run_dir, pool, learner, buffer_endpoint, logger, start_step
    )
    try:  # from here on, `with ops.control` removes control.json; before it, this does (`asyncrl status` waited)
        ops.buffer.while_waiting = buffers.poll  # a buffer that dies while the driver asks it something is restarted
        ops.buffer.set_max_lag(cfg.staleness.max_lag)  # the config wins over a max_lag the journal replayed
        clock.mark("actors_created")
        pool.start(cfg.rollout.num_workers, meanwhile=lambda: (learner.weights_endpoint(), clock.mark("learner_ready")))
        clock.mark("workers_running")
    except BaseException:
        ops.control.close()
        raise
    logger.info(f"run {cfg.logging.name}: {cfg.rollout.num_workers} rollout workers, buffer {buffer_endpoint}, "
                f"weights {learner.weights_endpoint()}, model {model_dir}, control {ops.control.endpoint}")  # fmt: skip
    last_time = time.monotonic()
    buffer_totals: dict[str, float] = {}  # the buffer's counters at the previous step (`_buffer_metrics`)
    if start_step > 0:  # resumed: the buffer's counters continue the run's, so the first interval starts from them
        _buffer_metrics(ops.buffer, buffer_totals)
    reward_view = RewardMetrics()  # reward/errors, reward/timeouts, reward/<key>; logs the first reward failure
    env_view = EnvMetrics()  # env/turns_mean, env/tool_calls, ... of multi-turn episodes (env.fn)
    reward_failed = lambda message: (logger.event("reward_error", error=message), logger.info(message))  # noqa: E731
    step = start_step
    refs: list[Any] = []  # the train step in flight (rank 0's result first), [] when none
    abandoned = False  # a stop that could not wait for the step in flight (`Watchdog.stop_now`)
    watchdog.last_step_at = time.monotonic()
    with ops.control, logger.live_view(cfg.train.steps, start_step):
        while refs or (step < cfg.train.steps and not ops.stop_requested(signals.requested)):
            refs = refs or learner.train_step_async(step)
            if abandoned := not _wait_step(refs, ops, pool, buffers, watchdog, signals):
                logger.info(f"stopping now, without finishing step {step} (no step for "
                            f"{time.monotonic() - watchdog.last_step_at:.0f} s)")  # fmt: skip
                break
            metrics, refs = get_ranks(refs)[0], []  # a rank's death first: its peers fail at once in a collective
            step += 1
            if not _boundary_work(cfg, ops, signals, step):  # the learner trains the next step during the logging
                refs = learner.train_step_async(step)
            pool.refresh()
            now = time.monotonic()  # one clock reading ends this step's interval and starts the next: no gap
            metrics.update(_rollout_metrics(pool, ops.last_totals, now - last_time))
            last_time = now
            metrics.update(_buffer_metrics(ops.buffer, buffer_totals))
            metrics.update(reward_view.update([w.stats for w in pool.workers.values()], pool.totals(), reward_failed))
            metrics.update(env_view.update(pool.totals()))
            logger.log_step(metrics)
            if step == start_step + 1:
                clock.mark("first_step")
                logger.event("startup", **clock.fields())
                logger.info(f"start-up {clock.marks['first_step']:.1f} s: {clock.summary()}")
            ops.step_done(step, metrics)
            watchdog.step_done(step, pool, metrics)
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < cfg.train.steps:
                ops.save_checkpoint(step)
            every = cfg.train.eval_every
            if cfg.data.eval_size and every and step % every == 0 and step < cfg.train.steps:
                evaluator.run(step, logger)  # the rollout workers keep generating meanwhile
        summary: dict[str, Any] = {"steps": step, "run_dir": str(run_dir), "stopped_early": ops.stopping}
        # each finishes and pushes its batch in progress; a stalled run stopped at once does not wait for them (a
        # worker stuck in a slow reward function held the first Ctrl-C up to 120 s): they end with the run
        summary["workers"] = pool.stop_all(timeout_s=ABANDONED_STOP_WAIT_S if abandoned else 120.0)
        if cfg.data.eval_size and not ops.stopping:
            summary.update(evaluator.run(step, logger))  # eval/*: asyncrl/evaluate.py
        evaluator.close()
        if (cfg.checkpoint.every or ops.stopping) and not abandoned:  # an abandoned step keeps the learner busy
            summary["checkpoint"] = str(ops.save_checkpoint(step))
        if cfg.checkpoint.final and not abandoned:
            summary["final_checkpoint"] = learner.save(str(run_dir / "final"))
            if cfg.checkpoint.merge_lora and summary["final_checkpoint"]:  # final-merged/: plain HF safetensors
                from learner.lora import merge_adapters

                trust = cfg.model.trust_remote_code
                summary["final_merged"] = merge_adapters(model_dir, run_dir / "final", run_dir / "final-merged", trust)
        summary["buffer"] = ops.buffer.stats()
        if not abandoned:
            learner.close()
    ops.buffer.close()
    ops.status_buffer.close()
    from asyncrl.bench import strict_json_value

    text = json.dumps(strict_json_value(summary), indent=2, default=str, allow_nan=False)  # a nan eval figure: null
    (run_dir / "summary.json").write_text(text)
    signals.tearing_down()  # the run's work is saved: a signal from here on would only cut the clean-up short
    if abandoned:
        raise RunFailed(f"stopped on {signals.requested or 'down'} without waiting for the step in flight, which did "
                        "not come (no checkpoint of it);", exit_code=130)  # fmt: skip
    if ops.stopping and step < cfg.train.steps:
        logger.info(f"stopped after {step} of {cfg.train.steps} steps ({signals.requested or 'asyncrl down'}); "
                    f"metrics in {run_dir / 'metrics.jsonl'}; resume with `asyncrl up --resume {run_dir}`")  # fmt: skip
    else:
        logger.info(f"done: {step} steps; metrics in {run_dir / 'metrics.jsonl'}")
    return summary


def _wait_step(refs: list[Any], ops: Operations, pool: WorkerPool, buffers: BufferSupervisor, watchdog: Watchdog,
               signals: StopSignals) -> bool:  # fmt: skip
    """Wait for the step in flight, serving the control socket and supervising the workers, the buffer and the
    watchdog in slices (at least once a step); True once it is done, False if a stop cannot wait for it."""
    while True:
        ops.control.poll(ops.handle)
        pool.poll()
        buffers.poll()
        watchdog.check(pool, ops.buffer.stats, buffers.alive)
        if actors.wait(refs[:1], timeout=WAIT_SLICE_S)[0]:  # returns as soon as the step is done
            return True
        if len(refs) > 1:  # a rank that ended (died, or failed in a collective its peer left) ends the step here
            get_ranks(actors.wait(refs[1:], num_returns=len(refs) - 1, timeout=0)[0], among=refs)
        if watchdog.stop_now(ops.stop_requested(signals.requested)):
            return False


def _learner_died(err: BaseException) -> bool:
    return isinstance(err, actors.died_errors()) and "Learner" in str(err)


def _restart_learner(
    cfg: Config,
    run_dir: Path,
    buffers: BufferSupervisor,
    logger: MetricsLogger,
    watchdog: Watchdog,
    parts: dict[str, Any],
    err: BaseException,
) -> tuple[Path | None, Watchdog]:
    """A learner rank died: kill the learner group and the workers, restart the buffer rewound to the latest checkpoint
    (as `--resume` does); the next `_train` starts them again from it. Returns (checkpoint, a fresh watchdog)."""
    failed_step = watchdog.step
    learner, pool, evaluator = parts.get("learner"), parts.get("pool"), parts.get("evaluator")
    workers = [w.handle for w in pool.workers.values()] if pool is not None else []
    evaluators = [evaluator.actor] if evaluator is not None and evaluator.actor is not None else []
    for actor in [*(learner.ranks if learner is not None else []), *workers, *evaluators]:
        actors.kill(actor)  # the workers too: they subscribed to the dead learner's weight publisher
    if learner is not None and learner.store_dir:
        shutil.rmtree(learner.store_dir, ignore_errors=True)
    checkpoint_dir = checkpoint.latest_whole(run_dir, say=logger.info)
    start_step = checkpoint.read_meta(checkpoint_dir)["step"] if checkpoint_dir is not None else 0
    rewound = buffers.restart(resume_step=start_step)
    died = actor_death(str(err))
    logger.event("learner_restarted", step=failed_step, from_step=start_step, steps_redone=failed_step - start_step,
                 checkpoint=str(checkpoint_dir) if checkpoint_dir else None, error=died, **rewound)  # fmt: skip
    logger.info(f"{died}: restarting the learner and the rollout workers from {checkpoint_dir or 'the initial model'} "
                f"(step {start_step}; {failed_step - start_step} steps redone)")  # fmt: skip
    watchdog = Watchdog(cfg.train.stall_timeout_s, start_step, logger.event, logger.info, cfg.train.max_nonfinite_steps)
    return checkpoint_dir, watchdog


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
