"""The `asyncrl` command line. Parses config before importing torch or ray, so bad input fails in well under a second.

asyncrl up CONFIG [key=value ...]     train (local processes, or Ray when ray.address is set or ray.launcher=ray)
asyncrl up --resume RUN [key=value]   continue runs/<name> from its latest checkpoint
asyncrl up --resume auto CONFIG [...]  continue the newest run of CONFIG if it holds a checkpoint, else start afresh
asyncrl status [RUN] [--json]         a running job: step, workers and their versions, buffer, staleness, errors
asyncrl scale rollout=N [--run RUN]   add or remove rollout workers live
asyncrl set key=value ... [--run RUN] change live keys (common.config.LIVE_KEYS) at the next step boundary
asyncrl down [RUN]                    stop gracefully: workers stop, final checkpoint, journal flushed
asyncrl bench NAME [--json PATH]      run a benchmark, print its table, write {"name", "metrics", "ratios"}
asyncrl config CONFIG [key=value ...] print the fully merged, validated config as YAML
asyncrl probe MODEL [key=value ...]   per quant scheme: sampled mismatch, worst layers, recommended loss.cap
asyncrl keys DIR                      write CurveZMQ keys for a buffer bound beyond loopback (common/curve.py)
asyncrl serve MODEL [--port N ...]    the embedded engine behind SGLang's HTTP API (rollout_workers/sglang_api)
asyncrl study STUDY.yaml [--quick]    cells x seeds of `up` runs compared: results.json, table.md, PNGs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from common.config import Config

MAX_SCALE = 10_000
"""Most rollout workers `asyncrl scale` accepts (each is a Ray actor: more would only wait for resources)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncrl", description="Asynchronous RL for LLMs with quantized rollout.")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a training run (or continue one: --resume runs/<name>)")
    up.add_argument("config", nargs="?", help="YAML file of overrides (see configs/); not with --resume")
    up.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. train.steps=10 loss.weighting=acr")
    up.add_argument("--resume", metavar="RUN", default=None,
                    help="run directory to continue (latest checkpoint); `auto` with CONFIG: the newest run of "
                         "CONFIG if it holds a checkpoint, else a fresh run (re-run the same command)")  # fmt: skip
    status = sub.add_parser("status", help="state of a running job (RUN: default the one running under runs/)")
    status.add_argument("run", nargs="?", default=None)
    status.add_argument("--json", action="store_true", help="print the raw status as JSON")
    scale = sub.add_parser("scale", help="change the number of rollout workers of a running job: rollout=N")
    scale.add_argument("target", help="rollout=N")
    scale.add_argument("--run", default=None, help="run directory (default: the one running under runs/)")
    live = sub.add_parser("set", help="change live-tunable keys of a running job at its next step boundary")
    live.add_argument("items", nargs="+", help="key=value, e.g. staleness.max_lag=0 loss.cap=3")
    live.add_argument("--run", default=None, help="run directory (default: the one running under runs/)")
    down = sub.add_parser("down", help="stop a running job gracefully (workers, checkpoint, journal)")
    down.add_argument("run", nargs="?", default=None)
    down.add_argument("--no-wait", action="store_true", help="return once the driver accepted the request")
    show = sub.add_parser("config", help="print the merged, validated config")
    show.add_argument("config")
    show.add_argument("overrides", nargs="*")
    plot = sub.add_parser("plot", help="PNGs comparing runs (reward, accuracy, mismatch, staleness, lr, ...)")
    plot.add_argument("runs", nargs="+", help="run directories (runs/<name>)")
    plot.add_argument("--out", default="runs/plots", help="directory for the PNGs")
    keys = sub.add_parser("keys", help="write CurveZMQ keys for the buffer (needed when buffer.host is not loopback)")
    keys.add_argument("dir", help="new directory for the keys; then run with buffer.curve_keys_dir=DIR")
    serve = sub.add_parser("serve", help="a model behind SGLang's HTTP API (`asyncrl serve --help`)", add_help=False)
    serve.add_argument("args", nargs=argparse.REMAINDER)
    study = sub.add_parser("study", help="run a study: cells x seeds of `asyncrl up`, compared in a table (resumable)")
    study.add_argument("study_file", help="study YAML (configs/studies/*.yaml; format in asyncrl/study_spec.py)")
    study.add_argument("--quick", action="store_true", help="two cells, one seed, a few steps (the machinery, CI)")
    study.add_argument("--parallel", type=int, default=1, help="runs side by side (local processes; default 1)")
    study.add_argument("--root", default="runs/studies", help="parent of the study's directory (runs/studies)")
    study.add_argument("--plan", action="store_true", help="validate every run's config and list the runs; run none")
    study.add_argument("--report", action="store_true", help="only rewrite results.json, table.md and the PNGs")
    bench = sub.add_parser("bench", help="run a benchmark")
    bench.add_argument("name", help="benchmark name (`asyncrl bench list` lists them)")
    bench.add_argument("--json", dest="json_path", default=None, help="write the result as JSON here")
    bench.add_argument("--quick", action="store_true", help="a short run (smoke test), same metrics")
    bench.add_argument(
        "--seeds", type=int, default=None, help="seeds of the accuracy comparisons (bench e2e and chaos)"
    )
    bench.add_argument("--workloads", default=None, help="bench e2e only: comma-separated, of builtin,decode,smol "
                       "(default builtin,decode; smol: SmolLM2-135M-Instruct against TRL, issue 26)")  # fmt: skip
    bench.add_argument("--steps", type=int, default=None, help="bench e2e only: steps of every workload")
    bench.add_argument("--contenders", default=None,
                       help="bench e2e only: only these (trl,trl_malloc,async,sync,fp32,best,lora)")  # fmt: skip
    bench.add_argument("--learner-device", dest="learner_device", default=None,
                       help="bench e2e only: where every side trains, cpu (default) or cuda[:N] (a GPU machine: "
                       "our learner there, rollout workers on the CPUs; untested on GPU)")  # fmt: skip
    bench.add_argument("--set", dest="asyncrl_set", nargs="+", default=None, metavar="KEY=VALUE",
                       help="bench e2e only: config overrides of every asyncrl contender, after the workload's "
                       "(an experiment off the issue's pins; recorded in the JSON)")  # fmt: skip
    probe = sub.add_parser("probe", help="measure each quant scheme's rollout mismatch on a model, before training")
    from asyncrl.probe import add_arguments as probe_arguments  # torch-free: argparse only

    probe_arguments(probe)
    return parser


def _load(config: str, overrides: list[str]):
    from common.config import ConfigError, load_config

    try:
        return load_config(config, overrides)
    except ConfigError as err:
        print(f"asyncrl: config error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt as err:  # Ctrl-C before a command set up its own handling (imports take a second), or
        print(f"asyncrl: {str(err) or 'interrupted'}", file=sys.stderr)  # a SIGTERM in `up`'s start-up: one line
        return 130


def _main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # its own parser (rollout_workers/sglang_api/server.py)
        from rollout_workers.sglang_api.server import main as serve

        return serve(argv[1:])
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # overrides after an option (`asyncrl probe M --schemes none precision.rollout=bf16`): argparse leaves
        overridable = getattr(args, "overrides", None) is not None  # them over; they are overrides all the same
        if not overridable or any(item.startswith("-") or "=" not in item for item in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    if args.command == "config":
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.structured(_load(args.config, args.overrides))), end="")
        return 0
    if args.command == "probe":
        from asyncrl.probe import main as probe_main

        return probe_main(args)
    if args.command == "up":
        return _up(args)
    if args.command in ("status", "scale", "set", "down"):
        try:
            return _control(args)
        except BrokenPipeError:  # `asyncrl status | head -3`: the reader left; no traceback about it
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
    if args.command == "plot":
        from asyncrl.plot import plot_runs

        try:
            written = plot_runs(args.runs, args.out)
        except (OSError, ValueError) as err:  # a missing run, a bad metrics line, an --out that is not a directory
            print(f"asyncrl: {err}", file=sys.stderr)
            return 2
        for path in written:
            print(path)
        return 0
    if args.command == "study":
        from asyncrl.study import study_main

        return study_main(args.study_file, quick=args.quick, parallel=args.parallel, root=args.root, plan=args.plan,
                          report_only=args.report)  # fmt: skip
    if args.command == "keys":
        from common.curve import create_keys

        if not args.dir.strip():
            print("asyncrl keys: DIR is empty: name a new directory for the keys", file=sys.stderr)
            return 2
        try:
            written = create_keys(args.dir)
        except (OSError, ValueError) as err:
            reason = f"{err.strerror} ({err.filename})" if getattr(err, "errno", None) else err  # the system's, or ours
            print(f"asyncrl keys: cannot write CurveZMQ keys in {args.dir}: {reason}", file=sys.stderr)
            return 2
        for path in written:
            print(path)
        print(f"use: buffer.host=0.0.0.0 buffer.curve_keys_dir={args.dir}")
        return 0
    if args.command == "bench":
        from asyncrl.bench import BENCHMARKS, print_table, resolve, write_json

        if args.name == "list":
            for name in sorted(BENCHMARKS):
                print(name)
            return 0
        try:
            bench = resolve(args.name)
        except KeyError as err:
            print(f"asyncrl: {err.args[0]}", file=sys.stderr)
            return 2
        e2e_options = {"seeds": args.seeds, "workloads": args.workloads, "steps": args.steps,
                       "contenders": args.contenders, "learner_device": args.learner_device,
                       "asyncrl_set": args.asyncrl_set}  # fmt: skip
        options = {key: value for key, value in e2e_options.items() if value is not None}
        allowed = set(e2e_options) if args.name == "e2e" else {"seeds"} if args.name == "chaos" else set()
        if set(options) - allowed:
            flags = " ".join("--set" if key == "asyncrl_set" else "--" + key.replace("_", "-")
                             for key in options if key not in allowed)  # fmt: skip
            print(f"asyncrl: {flags}: bench e2e only" + (" (chaos takes --seeds)" if "seeds" in options else ""),
                  file=sys.stderr)  # fmt: skip
            return 2
        if args.seeds is not None and args.seeds < 1:
            print(f"asyncrl: --seeds must be at least 1, got {args.seeds}", file=sys.stderr)
            return 2
        from common.fsutil import output_file_problem, write_failure

        if args.json_path is not None and (problem := output_file_problem(args.json_path)):
            print(f"asyncrl bench: --json {args.json_path}: {problem}", file=sys.stderr)
            return 2
        from asyncrl.bench import BenchInputError

        try:
            result = bench(args.quick, **options)
        except BenchInputError as err:
            print(err, file=sys.stderr)
            return 2
        from asyncrl.bench.engine_bench import platform_details

        for key, value in {**platform_details(), "quick": args.quick}.items():  # every bench's JSON says where
            result.details.setdefault(key, value)  # it ran (ISA, kernels) and whether it was a --quick one
        print_table(result)
        if args.json_path and (failed := write_failure(lambda: write_json(result, args.json_path))):
            print(f"asyncrl bench: --json {args.json_path}: {failed} (the table is above)", file=sys.stderr)
            return 1
        errors = result.details.get("fairness_errors")
        if errors:  # bench e2e: a contender did not see the shared prompts or reward; its figures are not comparable
            print(f"asyncrl: bench {args.name}: fairness check failed: {'; '.join(errors)}", file=sys.stderr)
            return 1
        return 0
    return 2


def _up(args: argparse.Namespace) -> int:
    from pathlib import Path

    if args.resume is not None and not args.resume.strip():  # `--resume ""`: it read the next word as the config
        print("asyncrl: --resume needs a run directory (or `auto`), got an empty one", file=sys.stderr)
        return 2
    if not args.resume and args.config and "=" in args.config and not Path(args.config).exists():
        print(f"asyncrl: up needs a CONFIG file before its overrides, e.g. `asyncrl up configs/dapo_int8.yaml "
              f"{' '.join([args.config, *args.overrides])}` (or --resume RUN); {args.config!r} is an override",
              file=sys.stderr)  # fmt: skip
        return 2

    import signal

    signal.signal(signal.SIGTERM, _stop_in_start_up)  # until the driver's own (StopSignals) once its run directory is
    try:  # chosen: a SIGTERM before that ended `up` with no line (Python's default), leaving its fork server to notice
        return _up_started(args)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _stop_in_start_up(signum: int, frame: object) -> None:
    raise KeyboardInterrupt("SIGTERM during start-up: stopped before the run began")


def _up_started(args: argparse.Namespace) -> int:
    """`_up` once its arguments are checked, with SIGTERM raising KeyboardInterrupt (`_stop_in_start_up`)."""
    from pathlib import Path

    if args.config is not None or args.resume:
        from asyncrl.startup import start_fork_server_early

        start_fork_server_early()
    if args.resume == "auto":
        if args.config is None or "=" in args.config:
            print("asyncrl: --resume auto needs the CONFIG file of the run (asyncrl up --resume auto CONFIG)",
                  file=sys.stderr)  # fmt: skip
            return 2
        args.resume = _auto_resume(_load(args.config, args.overrides))
        if args.resume == "":
            return 2  # its newest run is running: said
        if args.resume is not None:
            args.config = None  # the run's config.json, its live changes, then the overrides (as --resume RUN)
    resume = Path(args.resume) if args.resume else None
    if resume is not None:
        overrides = ([args.config] if args.config else []) + args.overrides
        if any("=" not in item for item in overrides):
            print("asyncrl: with --resume give only key=value overrides (the config is the run's config.json)",
                  file=sys.stderr)  # fmt: skip
            return 2
        if not (resume / "config.json").is_file():
            print(f"asyncrl: cannot resume {resume}: not a run directory (no config.json)", file=sys.stderr)
            return 2
        from asyncrl import checkpoint
        from common.config import get_key, resume_changes

        latest = checkpoint.latest_whole(resume)  # the driver names any newer one it passes over
        meta = checkpoint.read_meta(latest) if latest is not None else {}
        live = [f"{k}={json.dumps(v)}" for k, v in meta.get("live", {}).items()]  # YAML: a null stays null
        saved, cfg = _load(str(resume / "config.json"), live), _load(str(resume / "config.json"), live + overrides)
        if latest is None and checkpoint.finished_steps(resume):  # with checkpoint.every=0
            print(f"asyncrl: cannot resume {resume}: it finished and holds no checkpoint (checkpoint.every=0 keeps "
                  "none), so a resume would train again from step 0 and replace its final/ model; start a new run "
                  f"from it instead (asyncrl up CONFIG model.path={resume / 'final'}), and set checkpoint.every on a "
                  "run you mean to extend", file=sys.stderr)  # fmt: skip
            return 2
        trained = meta.get("step") if isinstance(meta.get("step"), int) else None
        # Fewer steps than trained: it trained nothing and rewrote config.json with them (as many only finishes it)
        if trained is not None and cfg.train.steps < trained:
            print(f"asyncrl: cannot resume {resume} with train.steps={cfg.train.steps}: its checkpoint "
                  f"{latest.name if latest else ''} has {trained} steps trained already; give train.steps of "
                  f"{trained} or more", file=sys.stderr)  # fmt: skip
            return 2
        changed = resume_changes(saved, cfg)
        if changed:
            listed = ", ".join(f"`{key}` ({get_key(saved, key)!r} -> {get_key(cfg, key)!r})" for key in changed[:3])
            print(f"asyncrl: cannot resume {resume} with {listed}: its checkpoint, buffer journal and prompt stream "
                  "belong to the run's model, data, quantization, environment and group size; start a new run "
                  "(asyncrl up CONFIG ...) for that", file=sys.stderr)  # fmt: skip
            return 2
    elif args.config is None:
        print("asyncrl: up needs a CONFIG file (or --resume RUN)", file=sys.stderr)
        return 2
    else:
        cfg = _load(args.config, args.overrides)
    from asyncrl.driver import StartupError, run
    from asyncrl.raycluster import RayAuthError
    from asyncrl.supervise import SupervisionError
    from asyncrl.watchdog import RunFailed
    from common.config import ConfigError

    try:
        run(cfg, resume=resume)
    except (StartupError, ConfigError, SupervisionError, RayAuthError) as err:  # ConfigError: wandb missing
        print(f"asyncrl: {err}", file=sys.stderr)
        return 1 if isinstance(err, SupervisionError) else 2
    except RunFailed as err:  # the run started and a process of ours ended it: one line, the process, step, resume
        if err.detail:
            print(err.detail.rstrip(), file=sys.stderr)
        print(f"asyncrl: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt as err:  # in start-up, or a second signal once training ended (the driver's own, which
        print(f"asyncrl: {str(err) or 'interrupted during start-up'}", file=sys.stderr)  # says so: StopSignals)
        return 130
    return 0


def _auto_resume(cfg: Config) -> str | None:
    """`--resume auto`: the newest run directory of `cfg` if it holds a checkpoint, else None (a fresh run); "" when
    that run is running (said here)."""
    from pathlib import Path

    from asyncrl import checkpoint, run_lock

    base = Path(cfg.logging.dir) / cfg.logging.name
    newest = checkpoint.newest_run(base)
    running = run_lock.holder(newest) if newest is not None else None
    if running is not None:  # a scheduler's retry while its run still runs: not a second run of the config
        print(f"asyncrl: --resume auto: {newest} is running (its driver is pid {running or '?'}); not starting "
              "another run of the config", file=sys.stderr)  # fmt: skip
        return ""
    latest = checkpoint.latest_whole(newest) if newest is not None else None
    if newest is None or latest is None:
        what = f"{newest} holds no checkpoint" if newest is not None else f"no run of it under {base.parent}"
        print(f"asyncrl: --resume auto: {what}; starting a new run", file=sys.stderr)
        return None
    print(f"asyncrl: --resume auto: resuming {newest} from {latest.name}", file=sys.stderr)
    return str(newest)


def _control(args: argparse.Namespace) -> int:
    import json

    from asyncrl.control import ControlError, RunStopping, find_run, format_status, request, stopping_note

    run_dir = None
    try:
        run_dir = find_run(getattr(args, "run", None))
        if args.command == "status":
            try:
                reply = request(run_dir, "status")
            except RunStopping:  # what control.json says, at once (it waited 10 s, then said "killed?")
                note = stopping_note(run_dir)
                text = f"run {run_dir}: stopping ({note}): it answers no request until it has stopped"
                print(json.dumps({"run": str(run_dir), "stopping": note}) if args.json else text)
                return 0
            print(json.dumps(reply, indent=2, default=str) if args.json else format_status(reply))
        elif args.command == "scale":
            key, _, value = args.target.partition("=")
            count = value.strip()
            if key != "rollout" or not (count.isascii() and count.isdigit()) or int(count) > MAX_SCALE:
                raise ControlError(f"scale takes rollout=N (a whole number up to {MAX_SCALE}), got {args.target!r}")
            reply = request(run_dir, "scale", rollout=int(value))
            added, removed = reply["added"] or "none", reply["removed"] or "none"
            print(f"{run_dir}: rollout workers: added {added}, removing {removed}")
        elif args.command == "set":
            reply = request(run_dir, "set", items=list(args.items))
            changes = ", ".join(f"{k}={v}" for k, v in reply["changes"].items()) or "nothing (values unchanged)"
            print(f"{run_dir}: set {changes}: applies from step {reply['applies_at_step']}")
        else:
            return _down(run_dir, args.no_wait)
    except ControlError as err:
        print(f"asyncrl: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"asyncrl {args.command}: interrupted" + (f" (the run goes on: {run_dir})" if run_dir else ""),
              file=sys.stderr)  # fmt: skip
        return 130
    return 0


def _down(run_dir: Path, no_wait: bool) -> int:
    """`asyncrl down`: ask the driver to stop, then (unless `no_wait`) wait until it has, or until it is gone."""
    import time

    from asyncrl.control import CONTROL_FILE, driver_record, request, stopping_note
    from common.processes import pid_alive

    pid = driver_record(run_dir).get("pid")
    note = stopping_note(run_dir)  # a second `down`: the driver may answer nothing until it has stopped
    print(f"already stopping ({note})" if note else request(run_dir, "down")["message"])
    if no_wait:
        return 0
    try:
        while (run_dir / CONTROL_FILE).exists():
            if isinstance(pid, int) and not pid_alive(pid):
                print(f"asyncrl: the driver of {run_dir} (pid {pid}) exited before it finished stopping: no "
                      f"checkpoint of this step; `asyncrl up --resume {run_dir}` continues from the last one",
                      file=sys.stderr)  # fmt: skip
                return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        print(f"asyncrl down: interrupted; the run is still stopping (asyncrl status {run_dir})", file=sys.stderr)
        return 130
    print(f"{run_dir}: stopped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
