"""One learner update on a collated batch: proximal forward, decoupled PPO minibatches, AdamW, skip on non-finite.

    batch (every rank holds all rows)
      -> advantages (DAPO overlong shaping first)       -> proximal log-probs: no-grad forward (or lb; or, with
                                                           one minibatch, that minibatch's forward: same values;
                                                           or `loglinear`: AReaL's interpolation between lb and
                                                           each micro-batch's own detached lc, by token version)
      -> for each PPO minibatch: this rank's rows, in micro-batches of at most `learner.micro_batch_tokens`
         (whole groups, each group's shared prompt computed once: `learner.share_prefix`, learner/packing.py)
           loss of a micro-batch = policy_loss(micro) * its share of the minibatch's normalizer
           backward(loss * loss_scale * world_size)   (FSDP2 averages over ranks; the factor makes it a sum)
         unscale, clip the global grad norm, AdamW step, unless the loss or the gradient is not finite

The minibatch's gradient is therefore the gradient of `policy_loss` over all its rows, whatever the micro-batching
and the number of ranks. A non-finite loss or gradient skips the whole train step: the step's earlier minibatch
updates (parameters and AdamW state) are undone, the loss scale halves (fp16), and the caller must not publish.
Ranks run the same number of forwards (FSDP2's collectives): a rank with fewer micro-batches runs zero-weight ones.
Each function takes the config sections it reads; `minibatch_backward` and `train_on_batch`, which read most of
them, take the bundle (`learner.sections.UpdateSections`).
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from common.config import AlgoConfig, LearnerConfig, LossConfig, PrecisionConfig, QuantConfig, RolloutConfig
from common.config_rules import head_quantized
from learner import native_ops
from learner.acrl import AcrlReference
from learner.batch import Batch, micro_batch_budget, micro_batches, overlong_shaping, rank_rows, token_logp
from learner.devices import model_device
from learner.distributed import SINGLE, Dist, all_reduce_, local, to_float
from learner.fp32_gemm import packed_weights
from learner.logprobs import entropy_with_grad
from learner.losses import LossInputs, LossOutputs, advantages, group_discrepancy, loss_normalizer, policy_loss
from learner.memory import TRIM_BELOW_AVAILABLE, available_memory_bytes, trim_heap
from learner.packing import model_row_layout
from learner.precision import LossScaler, autocast
from learner.sections import LearnerSections, UpdateSections
from quant_sync.export import base_weight_name, is_quantized_linear


@dataclass(slots=True)
class StepInputs:
    """What the loss needs beyond the batch, computed once per train step over the whole batch."""

    prox_logp: torch.Tensor  # (B, T) lp
    adv: torch.Tensor  # (B,) advantages (after DAPO overlong shaping)
    acrl_x: float | None = None  # ACRL reference X; acrl only
    acrl_y: torch.Tensor | None = None  # (n_groups,) ACRL Y_g over whole groups; acrl only
    prox_entropy: torch.Tensor | None = None  # (B, T): set when lp comes from the minibatch's forward (see below)
    prox_version: int | None = None  # the step's weight version when lp is `loglinear_prox` of that forward
    prox_progress: float = 0.0  # loglinear: optimizer steps taken this step over minibatches (the forward's weights)
    ref_logp: torch.Tensor | None = None  # (B, T) lref of the frozen reference (learner.reference); loss.kl.coef > 0


@dataclass(slots=True)
class UpdateResult:
    skipped: bool
    prox_logp: torch.Tensor  # (B, T)
    entropy: torch.Tensor  # (B, T), zeros with learner.prox = behav
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall seconds of the step's phases (`PHASES`): kept apart from `metrics`, which equal steps reproduce."""


PHASES = ("proximal", "reference", "forward", "backward", "optimizer", "metrics")
"""proximal: the no-grad lp forward; reference: the KL reference's no-grad forward (loss.kl.coef > 0); forward:
log-probs and loss of the micro-batches; backward; optimizer: unscale, clip and AdamW (with one minibatch, and
norm_update's sums, parameter by parameter); metrics: norm_update and norm_update/quantized (and, with several
minibatches, the parameter snapshot they and a skip need)."""


@contextlib.contextmanager
def timed(seconds: dict[str, float] | None, phase: str) -> Iterator[None]:
    """Add the wall time of the block to `seconds[phase]` (nothing when `seconds` is None)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        if seconds is not None:
            seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - started


def _plan(
    model: torch.nn.Module,
    batch: Batch,
    lo: int,
    hi: int,
    learner: LearnerConfig,
    ranks: Dist,
    budget: int,
) -> tuple[list[tuple[int, int]], int]:
    """This rank's micro-batches of rows lo..hi-1 within `budget` tokens each (`micro_batch_budget`) and the number
    every rank runs (the max over ranks)."""
    mine = rank_rows(lo, hi, ranks.rank, ranks.world)
    plan = micro_batches(batch, *mine, budget, learner.share_prefix, model_row_layout(model))
    count = int(all_reduce_(torch.tensor([len(plan)]), ranks, op="max"))
    return plan, count


@torch.no_grad()
def proximal_logp(
    model: torch.nn.Module,
    batch: Batch,
    learner: LearnerConfig,
    precision: PrecisionConfig,
    rollout: RolloutConfig,
    ranks: Dist,
) -> tuple[torch.Tensor, torch.Tensor]:
    """lp and entropy (B, T) with the weights at the start of the step; each rank computes its rows, then a sum."""
    prox = torch.zeros_like(batch.behav_logp)
    entropy = torch.zeros_like(batch.behav_logp)
    plan, count = _plan(
        model, batch, 0, batch.rows, learner, ranks, micro_batch_budget(learner.micro_batch_tokens, model)
    )
    for i in range(count):
        lo, hi = plan[i] if i < len(plan) else (0, 1)  # past this rank's rows: a forward for FSDP's collectives
        with autocast(precision.train, model_device(model).type):
            logp, ent = token_logp(model, batch.select(lo, hi), rollout.temperature, learner.share_prefix)
        if i < len(plan):
            prox[lo:hi], entropy[lo:hi] = logp, ent
    return all_reduce_(prox, ranks), all_reduce_(entropy, ranks)


def prox_from_training_forward(learner: LearnerConfig, loss: LossConfig) -> bool:
    """Whether the step's lp comes from its only minibatch's forward instead of an extra no-grad forward.

    With `learner.minibatches = 1` that forward runs at the weights the step starts from, on the same micro-batches
    and under the same autocast as the extra forward would, so its detached log-probs and entropies are lp itself:
    the extra forward is skipped (a third of the step's forward and backward work). Not for `acrl`, whose Y_g needs
    lp of whole groups before the first micro-batch.
    """
    return learner.prox == "recompute" and learner.minibatches == 1 and loss.weighting != "acrl"


def loglinear_alpha(versions: torch.Tensor, version: int, progress: float = 0.0) -> torch.Tensor:
    """AReaL's interpolation weight (B, T) of each token for `learner.prox = loglinear` (docs/algorithms.md,
    "Proximal log-probs: details").

    `alpha = clamp((v_prox - v_behav) / (v_theta - v_behav), 0, 1)` with `v_prox = version` (the weights the step
    starts from: lp's definition) and `v_theta = version + progress`, the weights the forward giving lc ran at
    (`progress`: optimizer steps taken this step over `learner.minibatches`). The first minibatch's lc is at `v_prox`
    itself: alpha 1 for every token (lp = lc, exact); a later one's interpolates by version, a token of `v_prox` then
    getting lb. (AReaL takes v_prox = v_theta - 1 with v_theta the version being trained towards.)
    """
    v_behav = versions.to(torch.float64)
    v_prox = float(version)
    gap = v_prox + progress - v_behav
    alpha = torch.where(gap > 0, (v_prox - v_behav) / gap.clamp_min(1e-9), torch.ones_like(v_behav))
    return alpha.clamp(0.0, 1.0).to(torch.float32)


def loglinear_prox(behav_logp: torch.Tensor, cur_logp: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """lp = lb + alpha * (lc - lb), in log space, with lc detached (AReaL's `loglinear` proximal approximation)."""
    return behav_logp + alpha * (cur_logp.detach() - behav_logp)


def _snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


NORM_CHUNK_ELEMENTS = 2**20
"""Elements per float64 chunk of `_update_sums` (8 MiB): a whole parameter in float64 is twice its fp32 size."""


@torch.no_grad()
def _param_sums(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """(sum of (new - old)^2, sum of old^2) of one local tensor, in float64, on the CPU (the step's bookkeeping
    device, `learner.devices`): one pass of the learner's library for fp32 CPU tensors (`native_ops.update_sums`),
    else torch's float64 ops a chunk at a time, where the tensor is."""
    native = native_ops.update_sums(new, old)
    if native is not None:
        return native
    sums = torch.zeros(2, dtype=torch.float64, device=new.device)
    new_flat, old_flat = new.reshape(-1), old.reshape(-1)
    for lo in range(0, new_flat.numel(), NORM_CHUNK_ELEMENTS):
        chunk = slice(lo, lo + NORM_CHUNK_ELEMENTS)
        prior = old_flat[chunk].double()
        delta = new_flat[chunk].double().sub_(prior)
        sums += torch.stack((torch.dot(delta, delta), torch.dot(prior, prior)))  # fewer ops than pow + sum
    return sums.cpu()


def quantized_parameter_ids(model: torch.nn.Module, quant: QuantConfig, rollout: RolloutConfig) -> frozenset[int]:
    """`id`s of the parameters that quant_sync publishes quantized under `quant` (the tensors `norm_quant_err` is over).

    The selection is quant_sync's own (`quant_sync.export.is_quantized_linear`, with the LM head when
    `common.config_rules.head_quantized`): the decoder linears, not the norms or the embedding; a tied LM head that
    travels quantized is the embedding parameter. Empty with `quant.scheme = none`. A peft model's names are mapped
    to the base model's first (`base_weight_name`): its frozen base linears count, its adapters do not.
    """
    if quant.scheme == "none":
        return frozenset()
    head = head_quantized(quant, rollout)
    return frozenset(
        id(param)
        for name, param in model.named_parameters(remove_duplicate=False)  # a tied head under its own name too
        if is_quantized_linear(base_weight_name(name), head)
    )


def _add_sums(sums: torch.Tensor, param_sums: torch.Tensor, param: torch.Tensor, quantized: frozenset[int]) -> None:
    """Add one parameter's (2,) sums to `sums` (all parameters), and to `sums[2:]` when it is in `quantized`."""
    sums[:2] += param_sums
    if id(param) in quantized:
        sums[2:] += param_sums


@torch.no_grad()
def _update_sums(
    model: torch.nn.Module, before: list[torch.Tensor], quantized: frozenset[int] | None = None
) -> torch.Tensor:
    """(sum of (new - old)^2, sum of old^2) over this rank's parameters, in float64, parameter by parameter.

    With `quantized` (`quantized_parameter_ids`), (4,): the same two sums over those parameters follow, from the
    same per-parameter pass (norm_update/quantized).
    """
    sums = torch.zeros(2 if quantized is None else 4, dtype=torch.float64)
    for param, old in zip(model.parameters(), before):
        _add_sums(sums, _param_sums(local(param.detach()), local(old)), param, quantized or frozenset())
    return sums


SNAPSHOT_MAX_BYTES = 64 * 2**20
"""Weights up to this size take norm_update's snapshot and one optimizer step instead of `step_measuring_update`: the
copy costs little memory, and one step call per parameter costs more than the copy (builtin:tiny's optimizer phase:
10.9 against 7.0 CPU ms). A 135M model's 0.54 GB of weights steps per parameter (no snapshot alongside AdamW)."""
PER_PARAMETER_OPTIMIZERS = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)
"""Optimizers whose update of a parameter reads only that parameter's gradient and state, stepped one parameter at a
time by `step_measuring_update` (exact types: a subclass may override `step`)."""


def steps_per_parameter(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `step_measuring_update` may step `optimizer`: a per-parameter optimizer, in its per-tensor loop or
    fused (`learner/optimizer.py`: the fused kernel, too, updates each parameter from its own gradient and state)."""
    return type(optimizer) in PER_PARAMETER_OPTIMIZERS


@torch.no_grad()
def step_measuring_update(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module, quantized: frozenset[int] | None = None
) -> torch.Tensor:
    """`optimizer.step()`, one parameter at a time; returns `_update_sums` of that step without a model snapshot.

    Each parameter with a gradient is copied just before its own update and compared right after it, so the largest
    temporary is one parameter (a snapshot of the model costs as much as its weights: 0.54 GB for a 135M model). For
    a per-parameter optimizer (AdamW, Adam, SGD: a parameter's update reads its own gradient and state only) the
    updates are those of one `step()` over all parameters, bit for bit; the optimizer's step hooks run once per
    parameter. A parameter without a gradient is not stepped (AdamW skips it too) and counts as unchanged. The
    per-parameter sums are added in `model.parameters()` order, as `_update_sums` adds them: the same float64 values
    (with `quantized`, the (4,) sums of `_update_sums(..., quantized)`).
    """
    per_param: dict[int, torch.Tensor] = {}
    for group in optimizer.param_groups:
        params = group["params"]
        try:
            for param in params:
                if param.grad is None or id(param) in per_param:
                    continue
                old = local(param.detach()).clone()
                group["params"] = [param]
                optimizer.step()
                per_param[id(param)] = _param_sums(local(param.detach()), old)
                del old
        finally:
            group["params"] = params
    sums = torch.zeros(2 if quantized is None else 4, dtype=torch.float64)
    for param in model.parameters():
        value = local(param.detach())
        param_sums = per_param[id(param)] if id(param) in per_param else _param_sums(value, value)
        _add_sums(sums, param_sums, param, quantized or frozenset())
    return sums


@torch.no_grad()
def _restore(model: torch.nn.Module, before: list[torch.Tensor]) -> None:
    for param, old in zip(model.parameters(), before):
        param.copy_(old)


def step_inputs(
    batch: Batch,
    prox_logp: torch.Tensor,
    rollout: RolloutConfig,
    algo: AlgoConfig,
    loss: LossConfig,
    acrl_reference: AcrlReference,
) -> StepInputs:
    """Advantages (DAPO overlong shaping first) and, for ACRL, Y_g over whole groups and the reference X."""
    lengths = batch.mask.sum(-1)
    shaped = batch.rewards + overlong_shaping(lengths, batch.truncated, rollout.max_new_tokens, algo.overlong.len)
    inputs = StepInputs(prox_logp=prox_logp, adv=advantages(shaped, batch.group_index, algo.adv))
    if loss.weighting == "acrl":  # Y_g over whole groups, before minibatches split them (ACRL eq. 9)
        inputs.acrl_y = group_discrepancy(batch.behav_logp, prox_logp, batch.mask, batch.group_index)
        inputs.acrl_x = acrl_reference.update_and_get(inputs.acrl_y)
    return inputs


def micro_loss(
    micro: Batch,
    rows: tuple[int, int],
    cur_logp: torch.Tensor,
    inputs: StepInputs,
    rollout: RolloutConfig,
    loss: LossConfig,
    cur_entropy: torch.Tensor | None = None,
) -> LossOutputs:
    """`policy_loss` of micro-batch `micro` = rows lo..hi-1 of the step's batch, given its lc (B_micro, T) (and its
    entropies with grad, for `loss.entropy_coef`)."""
    lo, hi = rows
    return policy_loss(
        LossInputs(
            behav_logp=micro.behav_logp,
            prox_logp=inputs.prox_logp[lo:hi],
            cur_logp=cur_logp,
            advantages=inputs.adv[lo:hi],
            mask=micro.mask,
            max_len=rollout.max_new_tokens,
            group_index=micro.group_index,
            acrl_x=inputs.acrl_x,
            acrl_y=inputs.acrl_y,
            ref_logp=None if inputs.ref_logp is None else inputs.ref_logp[lo:hi],
            cur_entropy=cur_entropy,
        ),
        loss,
    )


def skips_zero_adv(sections: UpdateSections, ranks: Dist) -> bool:
    """Whether rows with a zero advantage may skip their backward (`learner.skip_zero_adv`): one rank (FSDP2's
    ranks must run alike), and no loss term that survives a zero advantage (KL penalty, entropy bonus)."""
    loss = sections.loss
    return sections.learner.skip_zero_adv and ranks.world == 1 and loss.kl.coef <= 0 and loss.entropy_coef <= 0


def forward_only_order(
    adv: torch.Tensor, group_index: torch.Tensor, bounds: list[int]
) -> tuple[torch.Tensor | None, list[int]]:
    """The rows that need no backward (`learner.skip_zero_adv`) moved last within their minibatch
    (`bounds[i]..bounds[i + 1] - 1`): the rows of every group whose advantages there are all exactly 0, the others
    first, each part in its order (groups stay contiguous). Returns the row order (None where no row moves: the batch
    stays as it is) and, per minibatch, the end of the rows that need a backward."""
    order, grad_ends = [], []
    live = torch.zeros(int(group_index.max()) + 1 if group_index.numel() else 1, dtype=torch.bool)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        groups = group_index[lo:hi]
        live.zero_()
        live[groups[adv[lo:hi] != 0]] = True
        needs = live[groups]  # (hi - lo,) a row of a group with a nonzero advantage in this minibatch
        rows = torch.arange(lo, hi)
        order += [rows[needs], rows[~needs]]
        grad_ends.append(lo + int(needs.sum()))
    if grad_ends == bounds[1:]:
        return None, grad_ends
    return torch.cat(order), grad_ends


def _reorder_inputs(inputs: StepInputs, order: torch.Tensor) -> None:
    """`inputs`' per-row tensors in `order` (the batch's new row order); ACRL's Y_g are per group, kept."""
    inputs.prox_logp = inputs.prox_logp.index_select(0, order)
    inputs.adv = inputs.adv.index_select(0, order)
    if inputs.prox_entropy is not None:
        inputs.prox_entropy = inputs.prox_entropy.index_select(0, order)
    if inputs.ref_logp is not None:
        inputs.ref_logp = inputs.ref_logp.index_select(0, order)


def minibatch_backward(
    model: torch.nn.Module,
    batch: Batch,
    rows: tuple[int, int],
    inputs: StepInputs,
    sections: UpdateSections,
    scaler: LossScaler,
    ranks: Dist = SINGLE,
    seconds: dict[str, float] | None = None,
    grad_end: int | None = None,
    available_bytes: int | None = None,
) -> tuple[float, dict[str, float]]:
    """Forward, loss and backward of PPO minibatch `rows` on this rank (gradients accumulate in the parameters).
    `available_bytes` (an update after the first): the micro-batches' budget may grow with it (`micro_batch_budget`).

    `grad_end` (one rank only): rows grad_end..hi-1 have a zero advantage (`forward_only_order`): their forward runs
    without grad, their loss counts in the loss and its metrics, and they get no backward (their gradient is 0).
    Returns the minibatch's loss and its loss metrics, reduced over ranks; adds its phases' time to `seconds`.
    """
    loss_cfg = sections.loss
    normalizer = max(loss_normalizer(batch.mask[rows[0] : rows[1]], loss_cfg), 1.0)
    grad_end = rows[1] if grad_end is None else grad_end
    if grad_end < rows[1] and ranks.world > 1:
        raise ValueError("minibatch_backward: rows without a backward need one rank (FSDP2's ranks run alike)")
    budget = micro_batch_budget(sections.learner.micro_batch_tokens, model, available_bytes)
    plan, count = (
        _plan(model, batch, rows[0], grad_end, sections.learner, ranks, budget) if grad_end > rows[0] else ([], 0)
    )
    padding = (min(rows[0], batch.rows - 1), min(rows[0], batch.rows - 1) + 1)  # a rank short of micro-batches
    passes = [(bounds, True, False) for bounds in plan] + [(padding, False, False)] * (count - len(plan))
    passes += [(bounds, True, True) for bounds in micro_batches(batch, grad_end, rows[1], budget,
                                                                sections.learner.share_prefix,
                                                                model_row_layout(model))]  # fmt: skip
    loss_sum = torch.zeros(())
    parts = MetricMeans(loss_cfg.weighting)
    device_type = model_device(model).type  # autocast's: `cpu`, or `cuda` for a GPU learner (learner.devices)
    for (lo, hi), real, no_grad in passes:  # real: rows of the minibatch; no_grad: forward-only rows
        micro = batch.select(lo, hi)
        entropy_grad = entropy_with_grad(loss_cfg.entropy_coef > 0)  # the entropy bonus needs H's gradient
        grad_mode = torch.no_grad() if no_grad else contextlib.nullcontext()
        with timed(seconds, "forward"), autocast(sections.precision.train, device_type), entropy_grad, grad_mode:
            cur_logp, entropy = token_logp(model, micro, sections.rollout.temperature, sections.learner.share_prefix)
        if not real:  # zero-weight pass so that FSDP2's reduce-scatter sees every rank
            with timed(seconds, "backward"):
                (scaler.scale_loss(cur_logp.nan_to_num(0.0, 0.0, 0.0).sum()) * 0.0).backward()
            continue
        if inputs.prox_entropy is not None:  # lp is this forward's (prox_from_training_forward), or AReaL's loglinear
            if inputs.prox_version is None:
                inputs.prox_logp[lo:hi] = cur_logp.detach()
            else:
                alpha = loglinear_alpha(micro.versions, inputs.prox_version, inputs.prox_progress)
                inputs.prox_logp[lo:hi] = loglinear_prox(micro.behav_logp, cur_logp, alpha)
            inputs.prox_entropy[lo:hi] = entropy.detach()
        with timed(seconds, "forward"), grad_mode:
            out = micro_loss(micro, (lo, hi), cur_logp, inputs, sections.rollout, loss_cfg, entropy)
        share = loss_normalizer(micro.mask, loss_cfg) / normalizer  # this micro-batch's part of the mean
        if not no_grad:
            with timed(seconds, "backward"):
                scaler.scale_loss(out.loss * (share * ranks.world)).backward()
        loss_sum += out.loss.detach() * share
        parts.add(out.metrics, share, micro.mask)
    if count == 0:  # every row forward-only: the zero gradient a backward would have left, for AdamW alike
        for param in model.parameters():
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)
    # Fixed per weighting; with several ranks, one without real micro-batches still reports every key (as zeros).
    keys = metric_names(loss_cfg) if ranks.world > 1 else sorted(parts.sums)
    sums, units = parts.totals(keys)
    packed = all_reduce_(torch.tensor([float(loss_sum), *sums, *units]), ranks).tolist()
    return float(packed[0]), parts.means_of(keys, packed[1 : 1 + len(keys)], packed[1 + len(keys) :])


_ROW_SHARES = {
    "mis_seq": ("mis_masked",),
    "tbpo": ("tbpo_dropped",),
    "gspo": ("ppo_clip_high", "ppo_clip_low"),
    "pg_tis": ("tis_trunc",),
    "pg_mis": ("mis_masked",),
}
_TOKEN_SHARES = ("ppo_clip_high", "ppo_clip_low", "tis_trunc", "mis_masked")


def metric_unit(weighting: str, key: str) -> str:
    """What a micro-batch's metric `key` is a mean over, so that micro-batches combine into the minibatch's figure
    however it was split: `rows` (a share of responses), `tokens` (a share of loss-mask tokens), or `loss` (weighed as
    the loss weighs rows, `loss.agg`: the regularizers and ACRL's `loss_share_mean` figures)."""
    if key in _ROW_SHARES.get(weighting, ()):
        return "rows"
    return "tokens" if key in _TOKEN_SHARES else "loss"


class MetricMeans:
    """Loss metrics of parts of a batch (micro-batches of a minibatch, or minibatches of a step) combined into the
    whole's figures however it was cut: each part weighed by its `metric_unit` (its part of the loss's normalizer
    `share`, its loss-mask tokens or its rows), a share metric divided by the tokens or rows behind it."""

    def __init__(self, weighting: str) -> None:
        self.weighting = weighting
        self.sums: dict[str, float] = {}
        self.units: dict[str, float] = {}  # tokens or rows behind a share metric's sum

    def add(self, metrics: dict[str, float], share: float, mask: torch.Tensor) -> None:
        """One part's metrics (`mask`: its rows')."""
        for key, value in metrics.items():
            unit = metric_unit(self.weighting, key)
            weight = share if unit == "loss" else float(mask.sum()) if unit == "tokens" else float(mask.shape[0])
            self.sums[key] = self.sums.get(key, 0.0) + value * weight
            if unit != "loss":
                self.units[key] = self.units.get(key, 0.0) + weight

    def totals(self, keys: list[str]) -> tuple[list[float], list[float]]:
        """The sums and units of `keys` (0 for a key no part had), for an all-reduce over ranks."""
        return [self.sums.get(key, 0.0) for key in keys], [self.units.get(key, 0.0) for key in keys]

    def means_of(self, keys: list[str], sums: list[float], units: list[float]) -> dict[str, float]:
        """The figures of `keys` from their (reduced) sums and units."""
        return {key: total if metric_unit(self.weighting, key) == "loss" else total / count if count > 0 else 0.0
                for key, total, count in zip(keys, sums, units)}  # fmt: skip

    def means(self) -> dict[str, float]:
        keys = list(self.sums)
        return self.means_of(keys, *self.totals(keys))


class StepFigures:
    """The step's loss and loss metrics over its minibatches, each weighed as one minibatch weighs its micro-batches
    (`MetricMeans`), so that they are the whole batch's figures however it was cut; `grad_norm` is the minibatches'
    mean (each clipped against `optim.grad_clip` on its own)."""

    def __init__(self, loss: LossConfig, mask: torch.Tensor, minibatches: int) -> None:
        self.loss_cfg, self.minibatches = loss, minibatches
        self.normalizer = max(loss_normalizer(mask, loss), 1.0)
        self.loss = self.grad_norm = 0.0
        self.parts = MetricMeans(loss.weighting)

    def add(self, mask: torch.Tensor, loss_value: float, grad_norm: float, metrics: dict[str, float]) -> None:
        """One minibatch's figures (`mask`: its rows')."""
        share = loss_normalizer(mask, self.loss_cfg) / self.normalizer
        self.loss += loss_value * share
        self.grad_norm += grad_norm / self.minibatches
        self.parts.add(metrics, share, mask)

    def means(self) -> dict[str, float]:
        return {"loss": self.loss, "grad_norm": self.grad_norm, **self.parts.means()}


_METRIC_NAMES: dict[tuple[str, bool, bool], list[str]] = {}


def metric_names(loss: LossConfig) -> list[str]:
    """The metric keys `policy_loss` reports for this weighting and these regularizers (a one-token dummy call, cached):
    `loss/kl` with `loss.kl.coef > 0`, `loss/entropy` with `loss.entropy_coef > 0`."""
    cache_key = (loss.weighting, loss.kl.coef > 0, loss.entropy_coef > 0)
    if cache_key in _METRIC_NAMES:
        return _METRIC_NAMES[cache_key]
    one = torch.zeros((1, 1))
    out = policy_loss(
        LossInputs(
            behav_logp=one, prox_logp=one, cur_logp=one, advantages=torch.ones(1), mask=torch.ones((1, 1)),
            max_len=1, group_index=torch.zeros(1, dtype=torch.long), acrl_x=1.0, acrl_y=torch.zeros(1),
            ref_logp=one, cur_entropy=one,
        ),
        loss,
    )  # fmt: skip
    _METRIC_NAMES[cache_key] = sorted(out.metrics)
    return _METRIC_NAMES[cache_key]


def train_on_batch(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: LossScaler,
    batch: Batch,
    sections: UpdateSections,
    acrl_reference: AcrlReference,
    ranks: Dist = SINGLE,
    version: int | None = None,
    reference: torch.nn.Module | None = None,
) -> UpdateResult:
    """One train step on `batch` (every rank passes the same batch). Returns metrics; on skip, nothing changed.

    `version`: the weight version the step starts from (the latest published); `learner.prox = loglinear` needs it.
    `reference`: the frozen initial model (`learner.reference.initial_reference`); `loss.kl.coef > 0` needs it.
    """
    learner, optim = sections.learner, sections.optim
    seconds = dict.fromkeys(PHASES, 0.0)
    allocates_state = not optimizer.state  # the first update: AdamW's state comes on top of the freed activations
    loglinear = learner.prox == "loglinear"
    if loglinear and version is None:
        raise ValueError("`learner.prox=loglinear` needs the step's weight version: pass train_on_batch(version=...)")
    if loglinear and sections.loss.weighting == "acrl":
        raise ValueError(
            "`learner.prox=loglinear` cannot serve `loss.weighting=acrl` (Y_g needs lp before any forward)"
        )
    from_forward = prox_from_training_forward(learner, sections.loss) or loglinear
    if from_forward:  # filled in, micro-batch by micro-batch, by the minibatch's own forward
        prox_logp, entropy = torch.zeros_like(batch.behav_logp), torch.zeros_like(batch.behav_logp)
    elif learner.prox == "recompute":
        with timed(seconds, "proximal"):
            prox_logp, entropy = proximal_logp(model, batch, learner, sections.precision, sections.rollout, ranks)
    else:
        prox_logp, entropy = batch.behav_logp.clone(), torch.zeros_like(batch.behav_logp)
    acrl_before = acrl_reference.state_dict()  # a skipped step leaves the reference X as it found it, too
    inputs = step_inputs(batch, prox_logp, sections.rollout, sections.algo, sections.loss, acrl_reference)
    inputs.prox_entropy = entropy if from_forward else None
    inputs.prox_version = version if loglinear else None
    if sections.loss.kl.coef > 0:  # lref: the proximal pass (same micro-batches, autocast, ranks) on the reference
        if reference is None:
            raise ValueError("`loss.kl.coef > 0` needs the frozen reference: pass train_on_batch(reference=...)")
        with timed(seconds, "reference"):
            inputs.ref_logp, _ = proximal_logp(reference, batch, learner, sections.precision, sections.rollout, ranks)
    # With several minibatches, the weights and AdamW state the step starts from (to undo the step when a later
    # minibatch is not finite, and for norm_update), taken before the first optimizer step changes them: after the
    # first backward, never alongside its activations. With one, a skip comes before any change and norm_update's
    # sums come from the optimizer step itself (`step_measuring_update`; other optimizers, small models: the snapshot).
    before: list[torch.Tensor] | None = None
    optim_before: dict | None = None
    update_sums: torch.Tensor | None = None  # (4,) this rank's sums of norm_update (all, quantized), one-minibatch step
    # norm_update/quantized: over the weights quant_sync quantizes; a learner's bundle carries `quant`
    quant = sections.quant if isinstance(sections, LearnerSections) else None
    quantized = frozenset() if quant is None else quantized_parameter_ids(model, quant, sections.rollout)
    # FSDP2 ranks keep the snapshot: it is of their shards only, and the per-parameter step is not tested on DTensors;
    # so does a small model (`SNAPSHOT_MAX_BYTES`), whose snapshot costs less than a step call per parameter
    measure_step = learner.minibatches == 1 and ranks.world == 1 and steps_per_parameter(optimizer)
    measure_step = measure_step and sum(p.numel() * p.element_size() for p in model.parameters()) > SNAPSHOT_MAX_BYTES
    params = [p for p in model.parameters() if p.requires_grad]
    clip = optim.grad_clip if optim.grad_clip > 0 else math.inf
    metrics: dict[str, float] = {"loss_scale": scaler.scale}
    bounds = torch.linspace(0, batch.rows, learner.minibatches + 1).long().tolist()
    if loglinear:  # the mean interpolation weight over the batch's tokens, each minibatch's own (1: lp = lc)
        alphas = torch.cat([
            loglinear_alpha(batch.versions[lo:hi], version, index / learner.minibatches)  # type: ignore[arg-type]
            for index, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))
        ])  # fmt: skip
        metrics["prox/loglinear_alpha"] = float((alphas * batch.mask).sum() / batch.mask.sum().clamp_min(1.0))
    order, grad_ends = (None, bounds[1:])
    if skips_zero_adv(sections, ranks):  # zero-advantage rows last in each minibatch: forward only
        order, grad_ends = forward_only_order(inputs.adv, batch.group_index, bounds)
        metrics["learner/forward_only_share"] = 1.0 - sum(e - lo for e, lo in zip(grad_ends, bounds)) / batch.rows
    if order is not None:
        batch = batch.take(order)
        _reorder_inputs(inputs, order)
    skipped = False
    step_figures = StepFigures(sections.loss, batch.mask, learner.minibatches)
    for index, ((lo, hi), grad_end) in enumerate(zip(zip(bounds[:-1], bounds[1:]), grad_ends)):
        optimizer.zero_grad(set_to_none=True)
        inputs.prox_progress = index / learner.minibatches  # loglinear: the weights this minibatch's lc runs at
        # oneDNN's weight copies, freed before the optimizer step, and micro-batches as large as the memory allows;
        # not in the first update, whose peak and page faults they would raise (its activations, then AdamW's state
        # on their pages)
        # (the machine's memory: a GPU learner's activations are not there, so it keeps the first update's budget)
        available = None if allocates_state or model_device(model).type != "cpu" else available_memory_bytes()
        with packed_weights(model, available) as packing:
            loss_value, loss_metrics = minibatch_backward(
                model, batch, (lo, hi), inputs, sections, scaler, ranks, seconds, grad_end, available
            )
        metrics["learner/packed_weights"] = float(packing)
        with timed(seconds, "optimizer"):
            scaler.unscale_(params)
            grad_norm = to_float(torch.nn.utils.clip_grad_norm_(params, clip))  # global over ranks: all agree
        metrics["loss"], metrics["grad_norm"] = loss_value, grad_norm  # a skipped step reports the non-finite ones
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
            scaler.update(finite=False)
            skipped = True
            break
        if before is None and not measure_step:  # norm_update's reference; what a later minibatch's skip restores
            with timed(seconds, "metrics"):
                before = _snapshot(model)
                optim_before = copy.deepcopy(optimizer.state_dict()) if learner.minibatches > 1 else None
        with timed(seconds, "optimizer"):
            if measure_step:  # the only step: norm_update's sums come with it, no snapshot
                update_sums = step_measuring_update(optimizer, model, quantized)
            else:
                optimizer.step()
        scaler.update(finite=True)
        step_figures.add(batch.mask[lo:hi], loss_value, grad_norm, loss_metrics)
    if not skipped:
        metrics.update(step_figures.means())
    optimizer.zero_grad(set_to_none=True)
    # the activations', gradients' and AdamW temporaries' pages, before the caller publishes: only when the machine
    # is short of memory (memory.py; the first update too since the publication quantizes in blocks of rows)
    trim_heap(below_available_share=TRIM_BELOW_AVAILABLE)
    if from_forward:  # each rank filled its own rows (in the batch's order, restored if it was changed)
        if order is not None:
            restore = torch.argsort(order)
            prox_logp, entropy = inputs.prox_logp[restore], inputs.prox_entropy[restore]  # type: ignore[index]
        prox_logp, entropy = all_reduce_(prox_logp, ranks), all_reduce_(entropy, ranks)
    if skipped:
        if before is not None:
            _restore(model, before)
        if optim_before is not None:
            optimizer.load_state_dict(optim_before)
        acrl_reference.load_state_dict(acrl_before)
        metrics["skipped_nonfinite"] = 1.0
    with timed(seconds, "metrics"):
        if update_sums is None:  # several minibatches (against the snapshot), or no step at all (unchanged)
            olds = before if before is not None else [p.detach() for p in model.parameters()]
            update_sums = _update_sums(model, olds, quantized)
        delta, base, delta_quantized, base_quantized = all_reduce_(update_sums, ranks).tolist()
    if not math.isfinite(delta):  # finite loss and gradients, yet the step wrote inf or NaN into the weights
        raise FloatingPointError(
            "the weights are not finite after the optimizer step, though the loss and gradient norm were: the "
            "optimizer's state is damaged (a training_state.pt whose data changed on disk?); resume from an earlier "
            "checkpoint"
        )
    metrics["norm_update"] = delta / max(base, 1e-30)
    if quantized:  # the same ratio over the quantized weights (QuRL eq. 13's theta); absent with quant.scheme=none
        metrics["norm_update/quantized"] = delta_quantized / max(base_quantized, 1e-30)
    return UpdateResult(skipped=skipped, prox_logp=prox_logp, entropy=entropy, metrics=metrics, seconds=seconds)
