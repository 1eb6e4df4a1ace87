"""The measurements of `asyncrl probe` (asyncrl/probe.py): sample with the quantized engine, score with the learner.

    fp32 HF model --export_rollout_tensors(scheme)--> EmbeddedEngine --generate--> responses, behav log-probs lb
                  --learner token_logp (fp32, no grad)--> lp on the same tokens --mismatch_metrics--> the row
    one decoder layer quantized at a time (learner/aligned.py, the rollout's own operands), the rest fp32
                  --token_logp on a fixed subset of those responses--> kl_k3 per layer --> the ranking

Every piece is the one training runs: the exporter and quantizers of quant_sync, the embedded engine as a rollout
worker sets it up (`SamplingParams` from `rollout.*`, prompts tokenized as the worker does), the learner's response
log-probs (`learner.batch.token_logp`) and its metrics (`learner.losses.mismatch_metrics`). Only the orchestration
is here.

The per-layer scan runs the learner's rollout-aligned forward (QaRL, `learner.aligned`) with every layer but one
switched back to fp32: a single teacher-forced forward scores all the fixed responses at once, where the engine
would need a decode step per token. The aligned linears are the engine's arithmetic on the same quantized operands
(exact integer products for int8), so the ranking is the engine's; the row `aligned_all_kl_k3` (all layers
quantized that way) lets one check that against the engine's own kl_k3.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

from common.wire import Trajectory
from learner.aligned import AlignedLinear, aligned_layers, make_rollout_aligned
from learner.batch import Batch, collate, micro_batches, token_logp
from learner.losses import mismatch_metrics
from quant_sync.export import export_rollout_tensors
from quant_sync.update import WeightUpdate
from rollout_workers.embedded.engine import EmbeddedEngine
from rollout_workers.engine import SamplingParams

QUANTILES = (0.0, 0.001, 0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99, 0.999, 1.0)
"""Quantiles of the per-token log-ratio `lp - lb` and of the weight `w = exp(lp - lb)` reported per scheme."""
FLOOR_ROWS = 32
"""Responses the learner scores a second time, one row per forward, to measure its own fp32 rounding floor."""
TIS_MAX_KL_K1 = 1e-3
"""Recommend `tis` below this KL(behav || prox) (the larger of `kl_k1` and `kl_k3`), `acr` from it on. QuRL
(sec. 4.2) finds TIS sufficient while that KL stays near its early 0.002 and sees it grow 12x over long runs, which
its Adaptive Clipping Range fixes; we switch a little earlier, at 1e-3, since the probe measures version 0 only."""
FP32_FLOOR_LOG_RATIO = 1e-4
"""A scheme whose largest |lp - lb| is below this (or below FLOOR_MARGIN times the learner's own floor, if that is
larger) has no mismatch beyond fp32 rounding: no quantization correction is needed. Measured: fp32 rollout against
the learner 3.6e-6 (built-in tiny) and 3.4e-5 (SmolLM2-135M, 32 new tokens); the learner against itself (its floor,
`learner_floor`) 6.2e-6 and 8.6e-6; the closest quantized scheme, w8a16, 0.06 and 0.78."""
FLOOR_MARGIN = 10.0


@dataclass(slots=True)
class EngineSettings:
    """How the probe's engine is set up and samples: the `rollout.*` and `precision.rollout` keys of the config."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    max_batch: int
    max_seq_len: int
    precision: str
    device: str
    seed: int


@dataclass(slots=True)
class Sampled:
    """The responses one scheme's engine produced, collated as a learner batch, and how long sampling took."""

    batch: Batch
    seconds: float
    tokens: int
    finish_stop: int


@dataclass(slots=True)
class SchemeReport:
    scheme: str
    metrics: dict[str, float]
    """`learner.losses.mismatch_metrics` of the sampled tokens (keys without the `mismatch/` prefix)."""
    log_ratio_quantiles: dict[str, float]
    weight_quantiles: dict[str, float]
    max_abs_log_ratio: float
    exact_tokens: float
    """Share of tokens whose behavior and learner log-probs are bit-identical."""
    recommend: dict[str, Any]
    tokens: int
    responses: int
    sample_s: float
    score_s: float
    layers: list[dict[str, float | int]] = field(default_factory=list)
    aligned_all_kl_k3: float | None = None
    """kl_k3 of the rollout-aligned learner forward with every layer quantized, on the scan's rows."""
    engine_kl_k3_on_rows: float | None = None
    """kl_k3 of the engine's behavior log-probs on the same rows: what `aligned_all_kl_k3` should match."""
    layers_s: float = 0.0


def load_learner_model(model_dir: str, trust_remote_code: bool) -> torch.nn.Module:
    """The learner's fp32 model (as `learner.trainer.Learner` loads it), in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, trust_remote_code=trust_remote_code)
    return model.eval()


def sample(
    model_dir: str,
    state_dict: dict[str, torch.Tensor],
    scheme: str,
    prompt_ids: list[list[int]],
    group_size: int,
    settings: EngineSettings,
    pad_id: int,
    quantize_head: bool = False,
) -> Sampled:
    """`group_size` responses to each prompt from an embedded engine serving `scheme`'s weights (version 0), the LM
    head quantized too where `quantize_head` (`quant.lm_head`, as training publishes it)."""
    engine = EmbeddedEngine(
        model_dir, max_batch=settings.max_batch, seed=settings.seed, max_seq_len=settings.max_seq_len,
        precision=settings.precision, device=settings.device,
    )  # fmt: skip
    tensors = export_rollout_tensors(state_dict, scheme, quantize_head=quantize_head)
    engine.stage_weights(WeightUpdate(version=0, tensors=tensors, scheme=scheme))
    params = SamplingParams(
        max_new_tokens=settings.max_new_tokens, temperature=settings.temperature, top_p=settings.top_p,
        top_k=settings.top_k, stop_token_ids=engine.stop_token_ids, seed=settings.seed,
    )  # fmt: skip
    batch_ids = [ids for ids in prompt_ids for _ in range(group_size)]
    started = time.perf_counter()
    completions = engine.generate(batch_ids, params)
    seconds = time.perf_counter() - started
    engine.close()
    groups = []
    for g in range(len(prompt_ids)):
        group = []
        for i in range(group_size):
            done = completions[g * group_size + i]
            group.append(
                Trajectory(
                    uid=f"{g}/{i}",
                    group=str(g),
                    prompt_index=g,
                    prompt_ids=np.asarray(prompt_ids[g], dtype=np.int32),
                    response_ids=np.asarray(done.response_ids, dtype=np.int32),
                    behav_logp=np.asarray(done.behav_logp, dtype=np.float32),
                    versions=np.asarray(done.versions, dtype=np.int32),
                    reward=0.0,
                    correct=False,
                    finish=done.finish,
                    worker="probe",
                    t_start=0.0,
                    t_end=0.0,
                )  # fmt: skip
            )
        groups.append(group)
    tokens = sum(len(done.response_ids) for done in completions)
    stops = sum(done.finish == "stop" for done in completions)
    return Sampled(batch=collate(groups, pad_id), seconds=seconds, tokens=tokens, finish_stop=stops)


@torch.no_grad()
def score(model: torch.nn.Module, batch: Batch, temperature: float, micro_batch_tokens: int) -> torch.Tensor:
    """The learner's log-probs lp (B, T) of the batch's response tokens, in `learner.micro_batch_tokens` pieces (as
    `learner.update.proximal_logp` splits them)."""
    prox = torch.zeros_like(batch.behav_logp)
    for lo, hi in micro_batches(batch, 0, batch.rows, micro_batch_tokens):
        prox[lo:hi] = token_logp(model, batch.select(lo, hi), temperature)[0]
    return prox


@torch.no_grad()
def learner_floor(model: torch.nn.Module, batch: Batch, prox: torch.Tensor, temperature: float) -> dict[str, float]:
    """The learner against itself: up to FLOOR_ROWS responses scored again one row per forward (no padding, another
    batch shape). fp32 GEMMs sum in an order that depends on the shape, so this is the rounding floor below which
    no two fp32 implementations (the engine's decode and the learner's forward) can be expected to agree."""
    rows = min(FLOOR_ROWS, batch.rows)
    alone = torch.zeros_like(prox[:rows])
    for row in range(rows):
        alone[row : row + 1] = token_logp(model, batch.select(row, row + 1), temperature)[0]
    mask = batch.mask[:rows].bool()
    diff = (alone - prox[:rows])[mask]
    metrics = mismatch_metrics(alone, prox[:rows], batch.mask[:rows], cap=2.0)
    return {
        "rows": rows,
        "max_abs_log_ratio": float(diff.abs().max()) if diff.numel() else 0.0,
        "exact_tokens": float((diff == 0).float().mean()) if diff.numel() else 1.0,
        "kl_k3": metrics["mismatch/kl_k3"],
    }


def _quantiles(values: torch.Tensor) -> dict[str, float]:
    q = torch.quantile(values.double(), torch.tensor(QUANTILES, dtype=torch.float64))
    return {f"q{level:g}": float(v) for level, v in zip(QUANTILES, q)}


def recommend(
    weights: torch.Tensor,
    kl: float,
    max_abs_log_ratio: float,
    clip_share: float,
    floor_log_ratio: float = 0.0,
) -> dict[str, Any]:
    """The weighting and `loss.cap` for this weight distribution: cap = the (1 - clip_share) quantile of w (at least
    1.0, the lowest `loss.cap`), so that `clip_share` of the tokens are clipped; `tis` or `acr` by `kl`, the larger of
    the sample's two estimates of KL(behav || prox), kl_k1 and kl_k3 (TIS_MAX_KL_K1: kl_k1 alone can come out
    negative where kl_k3 reads well above the threshold); `decoupled` (no quantization correction) at fp32 rounding
    level (FP32_FLOOR_LOG_RATIO, or FLOOR_MARGIN x `floor_log_ratio`, the learner's own largest |dlogp| from
    `learner_floor`)."""
    # "higher": an observed w at or above the interpolated quantile, so at most clip_share of the tokens lie above it
    cap = max(1.0, float(torch.quantile(weights.double(), 1.0 - clip_share, interpolation="higher")))
    cap = math.ceil(cap * 1000) / 1000  # rounded up: never clips more than the share asked for
    clipped = float((weights > cap).float().mean())
    if max_abs_log_ratio < max(FP32_FLOOR_LOG_RATIO, FLOOR_MARGIN * floor_log_ratio):
        weighting, reason = "decoupled", "no mismatch beyond fp32 rounding: only staleness needs correcting"
    elif kl < TIS_MAX_KL_K1:
        weighting, reason = "tis", f"KL {kl:.2g} < {TIS_MAX_KL_K1:g}: truncation alone bounds it (QuRL eq. 5)"
    else:
        weighting, reason = "acr", f"KL {kl:.2g} >= {TIS_MAX_KL_K1:g}: QuRL's adaptive clipping range (eq. 9)"
    return {"weighting": weighting, "cap": cap, "clip_share": clip_share, "clipped_at_cap": clipped, "reason": reason}


def scheme_report(
    scheme: str,
    sampled: Sampled,
    prox: torch.Tensor,
    cap: float,
    clip_share: float,
    score_s: float,
    floor_log_ratio: float = 0.0,
) -> SchemeReport:
    """Metrics, per-token distribution and recommendation of one scheme's sample (lb from the engine, lp given)."""
    batch = sampled.batch
    metrics = mismatch_metrics(batch.behav_logp, prox, batch.mask, cap)
    mask = batch.mask.bool()
    log_w = (prox - batch.behav_logp)[mask]
    weights = log_w.exp()
    max_abs = float(log_w.abs().max())
    return SchemeReport(
        scheme=scheme,
        metrics={key.removeprefix("mismatch/"): value for key, value in metrics.items()},
        log_ratio_quantiles=_quantiles(log_w),
        weight_quantiles=_quantiles(weights),
        max_abs_log_ratio=max_abs,
        exact_tokens=float((log_w == 0).float().mean()),
        recommend=recommend(
            weights, max(metrics["mismatch/kl_k1"], metrics["mismatch/kl_k3"]), max_abs, clip_share, floor_log_ratio
        ),
        tokens=int(mask.sum()),
        responses=batch.rows,
        sample_s=sampled.seconds,
        score_s=score_s,
    )


def subset(batch: Batch, rows: int) -> Batch:
    """`rows` responses spread evenly over the batch (every prompt group represented when rows >= groups)."""
    if rows >= batch.rows:
        return batch
    index = torch.linspace(0, batch.rows - 1, rows).round().long().unique()
    values = {f.name: getattr(batch, f.name)[index] for f in fields(Batch)}
    picked = Batch(**values)
    return picked.select(0, picked.rows)  # trims the padding the dropped rows needed


class _Replay(torch.nn.Module):
    """Stands in for a decoder layer: returns what that layer computed in the reference forward of this micro-batch
    (the layers before the quantized one are fp32 in both forwards, so their outputs are the same bits)."""

    def __init__(self, layer: torch.nn.Module, output: Any):
        super().__init__()
        self.output = output
        if hasattr(layer, "attention_type"):  # read by the decoder of models with per-layer attention types
            self.attention_type = layer.attention_type

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.output


def _recorder(outputs: list[Any], index: int) -> Any:
    """A forward hook that keeps a decoder layer's output in outputs[index]."""

    def hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
        outputs[index] = output

    return hook


@contextlib.contextmanager
def _replaying(decoder_layers: torch.nn.ModuleList, outputs: list[Any], upto: int) -> Iterator[None]:
    """Decoder layers 0..upto-1 replay `outputs` instead of computing."""
    originals = [decoder_layers[j] for j in range(upto)]
    try:
        for j in range(upto):
            decoder_layers[j] = _Replay(originals[j], outputs[j])
        yield
    finally:
        for j, layer in enumerate(originals):
            decoder_layers[j] = layer


class LayerScanner:
    """The learner model with its decoder linears turned into rollout-aligned ones (learner.aligned), switched on one
    decoder layer at a time; every other layer computes in fp32 (aligned layers switched off are plain linears, so
    the model scores as before between scans)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._scheme: str | None = None
        self.layers: dict[int, list[AlignedLinear]] = {}

    def set_scheme(self, scheme: str) -> None:
        if self._scheme is None:
            make_rollout_aligned(self.model, scheme, cache=True)
            for name, module in aligned_layers(self.model):
                self.layers.setdefault(int(name.split(".")[2]), []).append(module)  # model.layers.<i>.<...>
        else:
            for modules in self.layers.values():
                for module in modules:
                    module.enable(scheme, cache=True)  # drops the cached operands of the previous scheme
        self._scheme = scheme

    def only(self, layer: int | None) -> None:
        """Quantize decoder layer `layer` alone (None: every layer; -1: none)."""
        for index, modules in self.layers.items():
            for module in modules:
                module.aligned = layer is None or index == layer

    @torch.no_grad()
    def scan(
        self, scheme: str, batch: Batch, temperature: float, micro_batch_tokens: int, cap: float
    ) -> tuple[list[dict[str, float | int]], float, float]:
        """kl_k3 (and w_max) of each decoder layer quantized alone against the fp32 learner, on `batch`; sorted
        worst first. Also returns kl_k3 with every layer quantized (the aligned forward's view of the whole scheme)
        and the engine's kl_k3 on the same rows (its behavior log-probs against the same reference).

        Per micro-batch, one fp32 forward records every decoder layer's output; the forward with layer i quantized
        then replays layers 0..i-1 from it and computes from layer i on (half the work of whole forwards).
        """
        self.set_scheme(scheme)
        decoder_layers = self.model.get_decoder().layers
        reference = torch.zeros_like(batch.behav_logp)
        alone = {layer: torch.zeros_like(reference) for layer in self.layers}
        everything = torch.zeros_like(reference)
        try:
            for lo, hi in micro_batches(batch, 0, batch.rows, micro_batch_tokens):
                part = batch.select(lo, hi)
                self.only(-1)
                outputs: list[Any] = [None] * len(decoder_layers)
                hooks = [layer.register_forward_hook(_recorder(outputs, j)) for j, layer in enumerate(decoder_layers)]
                try:
                    reference[lo:hi] = token_logp(self.model, part, temperature)[0]
                finally:
                    for hook in hooks:
                        hook.remove()
                for layer in sorted(self.layers):
                    self.only(layer)
                    with _replaying(decoder_layers, outputs, layer):
                        alone[layer][lo:hi] = token_logp(self.model, part, temperature)[0]
                self.only(None)
                everything[lo:hi] = token_logp(self.model, part, temperature)[0]
        finally:
            self.only(-1)
        rows: list[dict[str, float | int]] = []
        for layer, logp in alone.items():
            metrics = mismatch_metrics(logp, reference, batch.mask, cap)
            rows.append(
                {
                    "layer": layer,
                    "kl_k3": metrics["mismatch/kl_k3"],
                    "w_max": metrics["mismatch/w_max"],
                    "log_ppl_abs_diff": metrics["mismatch/log_ppl_abs_diff"],
                }
            )
        rows.sort(key=lambda row: -row["kl_k3"])
        aligned_all = mismatch_metrics(everything, reference, batch.mask, cap)["mismatch/kl_k3"]
        engine = mismatch_metrics(batch.behav_logp, reference, batch.mask, cap)["mismatch/kl_k3"]
        return rows, aligned_all, engine
