"""The `asyncrl` command line. Parses config before importing torch or ray, so bad input fails in well under a second.

asyncrl up CONFIG [key=value ...]     train (a local Ray cluster unless ray.address is set)
asyncrl bench NAME [--json PATH]      run a benchmark, print its table, write {"name", "metrics", "ratios"}
asyncrl config CONFIG [key=value ...] print the fully merged, validated config as YAML
asyncrl keys DIR                      write CurveZMQ keys for a buffer bound beyond loopback (buffer/curve.py)
asyncrl serve MODEL [--port N ...]    the embedded engine behind SGLang's HTTP API (rollout_workers/sglang_api)
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncrl", description="Asynchronous RL for LLMs with quantized rollout.")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a training run")
    up.add_argument("config", help="YAML file of overrides (see configs/)")
    up.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. train.steps=10 loss.weighting=acr")
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
    bench = sub.add_parser("bench", help="run a benchmark")
    bench.add_argument("name", help="benchmark name (`asyncrl bench list` lists them)")
    bench.add_argument("--json", dest="json_path", default=None, help="write the result as JSON here")
    bench.add_argument("--quick", action="store_true", help="a short run (smoke test), same metrics")
    return parser


def _load(config: str, overrides: list[str]):
    from asyncrl.config import ConfigError, load_config

    try:
        return load_config(config, overrides)
    except ConfigError as err:
        print(f"asyncrl: config error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # its own parser (rollout_workers/sglang_api/server.py)
        from rollout_workers.sglang_api.server import main as serve

        return serve(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "config":
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.structured(_load(args.config, args.overrides))), end="")
        return 0
    if args.command == "up":
        cfg = _load(args.config, args.overrides)
        from asyncrl.driver import StartupError, run

        try:
            run(cfg)
        except StartupError as err:
            print(f"asyncrl: {err}", file=sys.stderr)
            return 2
        return 0
    if args.command == "plot":
        from asyncrl.plot import plot_runs

        try:
            written = plot_runs(args.runs, args.out)
        except (FileNotFoundError, ValueError) as err:
            print(f"asyncrl: {err}", file=sys.stderr)
            return 2
        for path in written:
            print(path)
        return 0
    if args.command == "keys":
        from buffer.curve import create_keys

        try:
            written = create_keys(args.dir)
        except (FileExistsError, OSError) as err:
            print(f"asyncrl: {err}", file=sys.stderr)
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
        result = bench(args.quick)
        print_table(result)
        if args.json_path:
            write_json(result, args.json_path)
        return 0
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
