"""`asyncrl probe MODEL [key=value ...]`: how much each rollout quantization scheme bites, before training.

For each scheme (`--schemes`, default none,int8,fp8,w8a16,w4a16) the embedded engine samples `train.group_size`
responses to each of `--prompts` prompts of the configured task with that scheme's weights (version 0 of the model),
and the learner's fp32 forward scores the same tokens. Per scheme it reports:

- the mismatch metrics the learner logs every step (`learner.losses.mismatch_metrics`: kl_k3, kl_k1, w_max, w_p99,
  log_ppl_abs_diff, acrl_d, ...) and the per-token distribution of the log-ratio `lp - lb` and of `w = exp(lp - lb)`;
- the decoder layers whose quantization costs most: each layer quantized alone, the rest fp32, ranked by kl_k3 on a
  fixed subset of the sampled responses (`--layer-rows`; the top `--layers-top` shown, 0 skips the scan);
- a recommended `loss.weighting` and `loss.cap`: the cap is the (1 - `--clip-share`) quantile of w, so that that
  share of tokens is clipped (probe_measure.recommend says how the weighting is chosen).

`none` (fp32 rollout) is compared against the learner's own rounding floor: the same responses scored again with
another batch shape (`floor` in the output). fp32 GEMMs sum in a shape-dependent order, so the engine's decode and
the learner's forward agree to about 1e-6 in log-prob, not bit for bit (docs/probe.md).

MODEL is a `model.path` value (a Hugging Face model directory or `builtin:<name>`); `key=value` overrides and
`--config FILE` select the task and sampling settings like `asyncrl up`'s. `--json PATH` writes the whole result.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from common.fsutil import output_file_problem, write_failure

DEFAULT_SCHEMES = ("none", "int8", "fp8", "w8a16", "w4a16")
DEFAULT_PROMPTS = 32
DEFAULT_CLIP_SHARE = 0.01
DEFAULT_LAYERS_TOP = 5
DEFAULT_LAYER_ROWS = 32
MAX_PROMPTS = 4096


class ProbeError(ValueError):
    """Input the probe cannot run on (model, scheme, data, options); the message names what is wrong."""


@dataclass(slots=True)
class ProbeOptions:
    model: str
    """`model.path`: a Hugging Face model directory or `builtin:<name>`."""
    overrides: list[str]
    config: str | None = None
    schemes: tuple[str, ...] = DEFAULT_SCHEMES
    prompts: int = DEFAULT_PROMPTS
    clip_share: float = DEFAULT_CLIP_SHARE
    layers_top: int = DEFAULT_LAYERS_TOP
    layer_rows: int = DEFAULT_LAYER_ROWS
    layer_schemes: tuple[str, ...] | None = None
    """Schemes whose layers are scanned; None: every quantized scheme of `schemes`."""
    json_path: str | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The probe's arguments (the `asyncrl probe` subcommand)."""
    parser.add_argument("model", help="model.path: a Hugging Face model directory or builtin:<name>")
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. data.task=jsonl data.path=FILE")
    parser.add_argument("--config", default=None, help="YAML file of overrides (as for asyncrl up)")
    parser.add_argument("--schemes", default=",".join(DEFAULT_SCHEMES), help="comma-separated quant schemes")
    parser.add_argument("--prompts", type=int, default=DEFAULT_PROMPTS, help="prompts sampled (x train.group_size)")
    parser.add_argument("--clip-share", type=float, default=DEFAULT_CLIP_SHARE,
                        help="share of tokens the recommended loss.cap clips (its quantile of w)")  # fmt: skip
    parser.add_argument("--layers-top", type=int, default=DEFAULT_LAYERS_TOP,
                        help="layers shown per scheme, worst first (0: skip the per-layer scan)")  # fmt: skip
    parser.add_argument("--layer-rows", type=int, default=DEFAULT_LAYER_ROWS,
                        help="sampled responses the per-layer scan scores")  # fmt: skip
    parser.add_argument("--layer-schemes", default="",
                        help="schemes whose layers are scanned (default: every quantized one probed)")  # fmt: skip
    parser.add_argument("--json", dest="json_path", default=None, help="write the result as JSON here")


def parse_schemes(text: str) -> tuple[str, ...]:
    """'none,int8' -> ('none', 'int8'); an unknown or repeated scheme is a ProbeError naming the valid ones."""
    from common.config import QUANT_SCHEMES

    schemes = tuple(part.strip() for part in text.split(",") if part.strip())
    if not schemes:
        raise ProbeError(f"--schemes is empty; valid schemes: {', '.join(QUANT_SCHEMES)}")
    unknown = [scheme for scheme in schemes if scheme not in QUANT_SCHEMES]
    if unknown:
        raise ProbeError(f"--schemes: unknown scheme {unknown[0]!r}; valid schemes: {', '.join(QUANT_SCHEMES)}")
    if len(set(schemes)) != len(schemes):
        raise ProbeError(f"--schemes names a scheme twice: {text!r}")
    return schemes


def options_from_args(args: argparse.Namespace) -> ProbeOptions:
    if not 1 <= args.prompts <= MAX_PROMPTS:
        raise ProbeError(f"--prompts must be in [1, {MAX_PROMPTS}], got {args.prompts}")
    if not 0.0 < args.clip_share < 1.0:
        raise ProbeError(f"--clip-share must be in (0, 1), got {args.clip_share}")
    schemes = parse_schemes(args.schemes)
    layer_schemes = parse_schemes(args.layer_schemes) if args.layer_schemes else None
    if layer_schemes is not None and not set(layer_schemes) <= set(schemes) - {"none"}:
        raise ProbeError(f"--layer-schemes {args.layer_schemes!r}: scan only quantized schemes named in --schemes")
    if args.json_path is not None and (problem := output_file_problem(args.json_path)):
        raise ProbeError(f"--json {args.json_path}: {problem}")
    if args.layers_top < 0 or args.layer_rows < 1:
        raise ProbeError(f"--layers-top must be >= 0 and --layer-rows >= 1 (got {args.layers_top}, {args.layer_rows})")
    return ProbeOptions(
        model=args.model, overrides=list(args.overrides), config=args.config, schemes=schemes,
        prompts=args.prompts, clip_share=args.clip_share, layers_top=args.layers_top, layer_rows=args.layer_rows,
        json_path=args.json_path, layer_schemes=layer_schemes,
    )  # fmt: skip


def _config(options: ProbeOptions):
    from common.config import ConfigError, load_config

    if any(item.split("=", 1)[0].strip() == "model.path" for item in options.overrides):
        raise ProbeError("give the model as MODEL, not as a model.path override")
    try:
        cfg = load_config(options.config, options.overrides)
    except ConfigError as err:
        raise ProbeError(f"config: {err}") from None
    cfg.model.path = options.model
    return cfg


def _model_dir(cfg) -> str:  # noqa: ANN001 - common.config.Config, imported lazily
    from asyncrl.driver import StartupError, check_model_code
    from common.builtin_model import resolve_model_path
    from rollout_workers.embedded.arch import ArchConfig, ModelDirError

    try:
        model_dir = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    except ValueError as err:  # an unknown builtin:<name>
        raise ProbeError(f"MODEL: {err}") from None
    if not model_dir.is_dir():
        raise ProbeError(f"MODEL: {cfg.model.path} is not a directory (a Hugging Face model directory or builtin:...)")
    try:
        ArchConfig.from_model_dir(model_dir)
        check_model_code(str(model_dir), cfg.model.trust_remote_code)
    except (ModelDirError, StartupError) as err:
        raise ProbeError(f"MODEL: {err}") from None
    if not any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ProbeError(f"MODEL: {model_dir} has no tokenizer (tokenizer.json or tokenizer_config.json)")
    return str(model_dir)


def _prompt_ids(cfg, tokenizer, count: int, max_seq_len: int) -> tuple[list[list[int]], int]:  # noqa: ANN001
    """The first `count` training prompts that fit the engine, encoded as a rollout worker encodes them (chat
    template per `data.chat_template`); and how many were skipped (empty, or too long for rollout.max_new_tokens)."""
    from common.tasks import DatasetError, make_source
    from common.tasks.chat import PromptEncoder

    try:
        source = make_source(cfg.data)
        encode = PromptEncoder.for_source(tokenizer, cfg.data, source)
    except (DatasetError, OSError) as err:
        raise ProbeError(f"data: {err}") from None
    if cfg.rollout.max_new_tokens >= max_seq_len:  # no prompt can fit: an endless task would be scanned for ever
        raise ProbeError(f"data: no prompt fits the engine's {max_seq_len} positions with rollout.max_new_tokens "
                         f"{cfg.rollout.max_new_tokens}")  # fmt: skip
    size = source.epoch_size()
    ids: list[list[int]] = []
    skipped = 0
    index = 0
    while len(ids) < count and (size is None or index < size) and skipped < count + MAX_SKIPPED_PROMPTS:
        tokens = encode(source.train(index).prompt)
        index += 1
        if tokens and len(tokens) + cfg.rollout.max_new_tokens <= max_seq_len:
            ids.append(list(tokens))
        else:
            skipped += 1
    if not ids:
        raise ProbeError(f"data: no prompt fits the engine's {max_seq_len} positions with rollout.max_new_tokens "
                         f"{cfg.rollout.max_new_tokens} ({skipped} skipped)")  # fmt: skip
    return ids, skipped


MAX_SKIPPED_PROMPTS = 10_000
"""Prompts that do not fit the probe passes over (besides `--prompts` more) before it says none fits."""


def run_probe(options: ProbeOptions, log=print) -> dict[str, Any]:  # noqa: ANN001 - log: print-like
    """Run the probe (see the module docstring); returns the JSON-ready result."""
    cfg = _config(options)
    model_dir = _model_dir(cfg)
    import torch
    from transformers import AutoTokenizer

    from asyncrl import probe_measure as pm
    from common.config_rules import head_quantized
    from rollout_workers.embedded.arch import ArchConfig

    started = time.perf_counter()
    arch = ArchConfig.from_model_dir(model_dir)
    max_seq_len = min(cfg.rollout.max_seq_len, arch.max_positions)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    prompt_ids, skipped = _prompt_ids(cfg, tokenizer, options.prompts, max_seq_len)
    model = pm.load_learner_model(model_dir, cfg.model.trust_remote_code)
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    # the KV cache holds max_batch x max_seq_len positions per layer: sized to these prompts, not to the config's
    # bound (rollout.max_seq_len 2048 x 256 slots is 24 GB for a 135M model)
    needed = max(len(ids) for ids in prompt_ids) + cfg.rollout.max_new_tokens
    settings = pm.EngineSettings(
        max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k, max_batch=cfg.rollout.max_batch, max_seq_len=min(max_seq_len, needed),
        precision=cfg.precision.rollout, device=cfg.rollout.device, seed=cfg.train.seed,
    )  # fmt: skip
    temperature, budget, cap = cfg.rollout.temperature, cfg.learner.micro_batch_tokens, cfg.loss.effective_cap
    scanned = set(options.schemes) - {"none"} if options.layer_schemes is None else set(options.layer_schemes)
    scanner = pm.LayerScanner(model) if options.layers_top > 0 and scanned else None
    reports: list[pm.SchemeReport] = []
    floor: dict[str, Any] | None = None
    for scheme in options.schemes:
        head = head_quantized(replace(cfg.quant, scheme=scheme), cfg.rollout)  # quant.lm_head, resolved
        sampled = pm.sample(model_dir, state, scheme, prompt_ids, cfg.train.group_size, settings, pad_id, head)
        scored_at = time.perf_counter()
        prox = pm.score(model, sampled.batch, temperature, budget)
        score_s = time.perf_counter() - scored_at
        if floor is None:  # the learner's own rounding floor, on the first scheme's responses
            floor = pm.learner_floor(model, sampled.batch, prox, temperature)
        report = pm.scheme_report(
            scheme, sampled, prox, cap, options.clip_share, score_s, floor_log_ratio=floor["max_abs_log_ratio"]
        )
        if scanner is not None and scheme in scanned:
            scan_at = time.perf_counter()
            rows = pm.subset(sampled.batch, options.layer_rows)
            report.layers, report.aligned_all_kl_k3, report.engine_kl_k3_on_rows = scanner.scan(
                scheme, rows, temperature, budget, cap
            )
            report.layers_s = time.perf_counter() - scan_at
        reports.append(report)
        log(f"probe: {scheme}: {report.tokens} tokens, kl_k3 {report.metrics['kl_k3']:.3g}, "
            f"{report.sample_s + report.score_s + report.layers_s:.1f} s")  # fmt: skip
    return {
        "model": options.model,
        "model_dir": model_dir,
        "task": cfg.data.task,
        "prompts": len(prompt_ids),
        "prompts_skipped": skipped,
        "group_size": cfg.train.group_size,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "temperature": temperature,
        "precision_rollout": cfg.precision.rollout,
        "loss_cap": cap,
        "clip_share": options.clip_share,
        "layers_top": options.layers_top,
        "layer_rows": min(options.layer_rows, len(prompt_ids) * cfg.train.group_size) if scanner is not None else 0,
        "torch_threads": torch.get_num_threads(),
        "floor": floor,
        "schemes": [asdict(report) for report in reports],
        "seconds": time.perf_counter() - started,
    }


def print_result(result: dict[str, Any], file=None) -> None:  # noqa: ANN001 - a text stream
    """The per-scheme table, the per-layer ranking and the recommendations, with rich."""
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file or sys.stdout, width=160)
    table = Table(title=f"asyncrl probe {result['model']}: {result['prompts']} prompts x {result['group_size']}, "
                  f"{result['task']}, T={result['temperature']:g}, {result['seconds']:.0f} s")  # fmt: skip
    columns = ("scheme", "tokens", "kl_k3", "kl_k1", "w_max", "w_p99", "log_ppl_abs_diff", "acrl_d",
               "max|lp-lb|", "log-ratio p1 / p50 / p99", "cap", "weighting", "s")  # fmt: skip
    for name in columns:
        table.add_column(name, justify="left" if name in ("scheme", "weighting") else "right")
    for row in result["schemes"]:
        metrics, q, rec = row["metrics"], row["log_ratio_quantiles"], row["recommend"]
        table.add_row(
            row["scheme"], str(row["tokens"]), f"{metrics['kl_k3']:.3g}", f"{metrics['kl_k1']:.3g}",
            f"{metrics['w_max']:.4f}", f"{metrics['w_p99']:.4f}", f"{metrics['log_ppl_abs_diff']:.3g}",
            f"{metrics['acrl_d']:.3g}", f"{row['max_abs_log_ratio']:.2g}",
            f"{q['q0.01']:+.2g} / {q['q0.5']:+.2g} / {q['q0.99']:+.2g}", f"{rec['cap']:.3f}", rec["weighting"],
            f"{row['sample_s'] + row['score_s'] + row['layers_s']:.1f}",
        )  # fmt: skip
    console.print(table)
    floor = result["floor"]
    if floor is not None:
        console.print(f"fp32 floor (learner vs itself, {floor['rows']} responses one per forward): max|dlogp| "
                      f"{floor['max_abs_log_ratio']:.2g}, kl_k3 {floor['kl_k3']:.2g}, bit-identical tokens "
                      f"{floor['exact_tokens']:.0%}")  # fmt: skip
    for row in result["schemes"]:
        rec = row["recommend"]
        console.print(f"{row['scheme']}: loss.weighting={rec['weighting']} loss.cap={rec['cap']:.3f} "
                      f"(clips {rec['clipped_at_cap']:.2%} of tokens; {rec['reason']})")  # fmt: skip
        if row["layers"]:
            top = row["layers"][: result["layers_top"]]
            ranked = ", ".join(f"layer {layer['layer']} {layer['kl_k3']:.2g}" for layer in top)
            console.print(f"  layers by kl_k3 alone on {result['layer_rows']} responses (all layers: aligned "
                          f"{row['aligned_all_kl_k3']:.3g}, engine {row['engine_kl_k3_on_rows']:.3g}): "
                          f"{ranked}")  # fmt: skip


def write_json(result: dict[str, Any], path: str) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(result, indent=2) + "\n")


def main(args: argparse.Namespace) -> int:
    """`asyncrl probe`: 0 on success, 2 on bad input (the message on stderr)."""
    try:
        options = options_from_args(args)
        result = run_probe(options, log=lambda line: print(line, file=sys.stderr))
    except ProbeError as err:
        print(f"asyncrl probe: {err}", file=sys.stderr)
        return 2
    print_result(result)
    if options.json_path and (failed := write_failure(lambda: write_json(result, options.json_path))):
        print(f"asyncrl probe: --json {options.json_path}: {failed} (the result is above)", file=sys.stderr)
        return 1
    return 0
