"""`asyncrl bench learner`: what each mismatch weighting costs, FSDP2 over 2 ranks, bf16 against fp32.

All on one seeded Llama-family model and one seeded batch (groups of responses with behavior log-probs = the
model's plus noise, so every weighting has real work: truncations, masks, clipping):

- `overhead_<weighting>`: the learner's loss+backward step with that weighting over the same step with `none`,
  minus 1. The two steps differ only in the weighting-dependent work (advantages, ACRL's Y_g and X, the loss and
  its backward down to lc: `learner.update.step_inputs` + `micro_loss`); the model's forward and backward are the
  same computation. So the difference is timed directly on that work and divided by the whole `none` step
  (`learner.update.step_inputs` + `minibatch_backward`): whole-step timings on this shared machine have a noise
  floor of a few percent, far above the 0.1% to resolve; they are reported too, as `e2e_overhead_<weighting>`.
  `max_weighting_overhead` is the largest (target <= 0.01; ACRL reports 0.1%).
- `fsdp2_w2_vs_single`: tokens/s of a whole train step (proximal forward, loss, backward, AdamW) on 2 FSDP2 ranks
  (gloo, one thread each, spawned processes) over one process with as many threads: same cores, same batch.
- `bf16_vs_fp32`: tokens/s of the loss+backward step under bf16 autocast over fp32 (fp16 reported as a metric).
  On CPUs without bf16 matrix units this is below 1: autocast adds casts and the GEMMs are not faster.
- The SmolLM row (issue 26): a random-init model of SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads, 3 KV
  heads, intermediate 1536, vocab 49,152, tied embeddings), 8 groups of 8 sequences of 47 prompt (one per group)
  + 16 response tokens, whole learner steps (`train_on_batch`, then the publication and the metrics of
  `Learner.train_step`) on `learner.threads` threads, in a fresh process that does nothing else (`SMOL_OVERRIDES`:
  the learner settings).
  `learner_peak_rss_gb_smol`: that process's `ru_maxrss` after its first step, in GB (1e9 bytes); after its last
  step (the third without --quick), when AdamW's state lives through forward and backward, `smol_peak_rss_gb_steady`.
  `learner_mfu_smol`: model FLOP/s of a step over the FLOP/s of a large fp32 GEMM (the faster of `torch.mm` and
  oneDNN's: `learner.fp32_gemm`, which the row's linears use as a learner's do) on as many threads in that
  process, both per busy second (CPU seconds / threads: on a shared machine, wall seconds include the time other
  processes held the cores; `smol_mfu_wall` is the wall-clock figure). Model FLOPs (`smol_model_flops`): 2 per
  parameter and token forward, 4 backward, the decoder body at every prompt + response token (with
  `learner.share_prefix`, each group's prompt once: the tokens the decoder must run on), the LM head at loss
  positions only; attention scores (2% of the body at 63 tokens) and recomputation are not counted. The step is
  split into proximal pass, forward, backward, optimizer, metrics and publish (`smol_<phase>_s`).
  `bf16_vs_fp32_smol`: busy seconds of the row's step in fp32 over one in bf16 (`precision.train`), same process,
  model, AdamW state and batch: after its steps the row runs one step in the other precision (`smol_step_busy_s_<p>`;
  the row's own is its steady step, with --quick its only one; a row in fp16 has none). Where the CPU has no bf16
  dot-product instructions (AVX512_BF16, AMX) it is below 1 (docs/precision.md).
- The built-in row (issues 26, 27): whole learner steps of builtin:tiny (0.8M parameters) on a batch of the built-in
  task's shape (configs/dapo_int8.yaml: 16 groups x 8 samples of 5-7 prompt and 2-4 response tokens), in this
  process on one thread: `builtin_step_busy_s` (CPU seconds of the best step; `_median_s` the median), its phases
  (`builtin_<phase>_s`, wall), micro-batches and the tokens the decoder ran on (`builtin_model_tokens`, against
  `builtin_padded_tokens` row by row). No ratio: `asyncrl bench e2e` compares the whole loop with TRL.

Contenders alternate within every round and each reports its best round (machines here are noisy; the minimum
is the least disturbed measurement of the same work). `python -m asyncrl.bench.learner_bench --rows smol` runs the
SmolLM row alone (`--smol-set precision.train=bf16` changes its config; `--help`).
"""

from __future__ import annotations

import multiprocessing
import resource
import time
from collections.abc import Callable

import numpy as np
import torch

from asyncrl.bench import BenchResult
from common.config import PRECISIONS, WEIGHTINGS, load_config
from learner.optimizer import adamw
from learner.sections import UpdateSections

HIDDEN, LAYERS, VOCAB = 128, 4, 1024
GROUPS, GROUP_SIZE, PROMPT_LEN, RESPONSE_LEN = 4, 8, 16, 32
FSDP_WORLD = 2
SMOL_SHAPE = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
              "intermediate_size": 1536, "vocab_size": 49152}  # fmt: skip
SMOL_GROUPS, SMOL_GROUP_SIZE, SMOL_PROMPT_LEN, SMOL_RESPONSE_LEN = 8, 8, 47, 16
SMOL_OVERRIDES: tuple[str, ...] = ()
"""The learner settings of the SmolLM row that differ from the defaults: none. Row by row (`learner.share_prefix=false`)
`learner.micro_batch_tokens` measured here (busy-second MFU, first-step / steady RSS in GB): 16384 (one micro-batch)
0.77, 7.7 / 9.8; 1024 0.79, 3.9 / 5.7; 512 0.77, 3.4 / 4.6; 256 0.70, 3.4 / 4.0. The default (0) derives about 510
tokens from this shape (`learner.batch.micro_batch_budget`): with shared prompts, two groups per micro-batch (0.63,
2.8 GB; 256-280 tokens, one group: 0.56, 2.8 GB)."""
PHASES_SMOL = ("proximal", "forward", "backward", "optimizer", "metrics", "publish")
SMOL_COMPARED = {"fp32": "bf16", "bf16": "fp32"}
"""`bf16_vs_fp32_smol`: after its steps the SmolLM row runs one step in the other of these precisions."""
GEMM_SIZE = 2048  # the peak: a (GEMM_SIZE x GEMM_SIZE) @ (GEMM_SIZE x GEMM_SIZE) fp32 torch.mm


def _model(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=3 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=PROMPT_LEN + RESPONSE_LEN,
        tie_word_embeddings=False,
    )  # fmt: skip
    from learner.device_check import seeded_

    return seeded_(LlamaForCausalLM(config), seed, scale=0.08).train()


def _batch(model: torch.nn.Module, seed: int = 0):
    """Responses of 16..32 tokens after 16-token prompts; behavior log-probs = the model's + N(0, 0.3)."""
    from learner.batch import Batch, token_logp

    gen = torch.Generator().manual_seed(seed)
    n = GROUPS * GROUP_SIZE
    resp_len = torch.randint(RESPONSE_LEN // 2, RESPONSE_LEN + 1, (n,), generator=gen)
    seq_len = PROMPT_LEN + RESPONSE_LEN
    input_ids = torch.randint(1, VOCAB, (n, seq_len), generator=gen)
    attention = (torch.arange(seq_len)[None, :] < PROMPT_LEN + resp_len[:, None]).long()
    mask = (torch.arange(RESPONSE_LEN)[None, :] < resp_len[:, None]).float()
    response_pos = (PROMPT_LEN + torch.arange(RESPONSE_LEN))[None, :].expand(n, -1) * mask.long()
    rewards = torch.randint(0, 2, (n,), generator=gen).float()
    batch = Batch(
        input_ids=input_ids * attention,
        attention_mask=attention,
        response_pos=response_pos,
        response_ids=input_ids[:, PROMPT_LEN:] * mask.long(),
        mask=mask,
        behav_logp=torch.zeros((n, RESPONSE_LEN)),
        versions=torch.zeros((n, RESPONSE_LEN), dtype=torch.long),
        rewards=rewards,
        correct=rewards.clone(),
        group_index=torch.arange(GROUPS).repeat_interleave(GROUP_SIZE),
        truncated=resp_len == RESPONSE_LEN,
    )
    with torch.no_grad():
        logp, _ = token_logp(model, batch, 1.0)
    batch.behav_logp = (logp + 0.3 * torch.randn(logp.shape, generator=gen)).clamp_max(0.0) * mask
    return batch


def _config(*overrides: str) -> UpdateSections:
    base = (f"rollout.max_new_tokens={RESPONSE_LEN}", "rollout.temperature=1.0", "algo.overlong.len=8",
            "loss.cap=2.0", "learner.micro_batch_tokens=100000")  # fmt: skip
    return UpdateSections.pick(load_config(None, [*base, *overrides]))


def _best(contenders: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Best (minimum) seconds of each contender over `rounds`; the order rotates every round."""
    names = list(contenders)
    best = {name: float("inf") for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            contenders[name]()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def _loss_step(model: torch.nn.Module, batch, cfg: UpdateSections, prox_logp: torch.Tensor) -> Callable[[], object]:
    """The weighting-dependent part of a train step: step inputs, then forward + loss + backward of the batch."""
    from learner.acrl import AcrlReference
    from learner.precision import LossScaler
    from learner.update import minibatch_backward, step_inputs

    reference, scaler = AcrlReference(cfg.loss.acrl), LossScaler(enabled=False)

    def run() -> object:
        model.zero_grad(set_to_none=True)
        inputs = step_inputs(batch, prox_logp, cfg.rollout, cfg.algo, cfg.loss, reference)
        return minibatch_backward(model, batch, (0, batch.rows), inputs, cfg, scaler)

    return run


def _loss_part(
    batch, cfg: UpdateSections, prox_logp: torch.Tensor, cur_logp: torch.Tensor, repeat: int
) -> Callable[[], object]:
    """What differs between weightings, `repeat` times: step inputs, the loss, and its backward down to lc (B, T).

    The model's forward and backward around it are the same computation whatever the weighting.
    """
    from learner.acrl import AcrlReference
    from learner.update import micro_loss, step_inputs

    reference = AcrlReference(cfg.loss.acrl)

    def run() -> object:
        for _ in range(repeat):
            leaf = cur_logp.detach().requires_grad_()
            inputs = step_inputs(batch, prox_logp, cfg.rollout, cfg.algo, cfg.loss, reference)
            out = micro_loss(batch, (0, batch.rows), leaf, inputs, cfg.rollout, cfg.loss)
            out.loss.backward()
        return out

    return run


def _weightings_and_precision(quick: bool) -> tuple[dict[str, float], dict[str, float]]:
    """overhead_<w> = (loss part of w - loss part of none) / whole loss+backward step of none.

    Both loss parts are timed directly (many repetitions, alternating, best of rounds), so the ratio resolves
    0.1% differences that whole-step timings on a shared machine cannot; the whole steps of every weighting are
    timed too and reported as `e2e_overhead_<w>` metrics (their noise floor is a few percent here).
    """
    from learner.update import proximal_logp

    model = _model()
    batch = _batch(model)
    cfg = _config()
    prox_logp, _ = proximal_logp(model, batch, cfg.learner, cfg.precision, cfg.rollout, _single())
    gen = torch.Generator().manual_seed(1)
    cur_logp = (prox_logp + 0.05 * torch.randn(prox_logp.shape, generator=gen)) * batch.mask  # r != 1: clipping
    configs = {w: _config(f"loss.weighting={w}") for w in WEIGHTINGS}
    repeat = 20
    parts = {w: _loss_part(batch, cfg, prox_logp, cur_logp, repeat) for w, cfg in configs.items()}
    steps = {w: _loss_step(model, batch, cfg, prox_logp) for w, cfg in configs.items()}
    for run in [*parts.values(), *steps.values()]:  # warm-up: allocator, caches
        run()
    part_s = {w: s / repeat for w, s in _best(parts, 10 if quick else 40).items()}
    step_s = _best(steps, 3 if quick else 20)
    metrics = {f"loss_part_us_{w}": 1e6 * s for w, s in part_s.items()}
    metrics.update({f"step_ms_{w}": 1e3 * s for w, s in step_s.items()})
    metrics.update({f"e2e_overhead_{w}": step_s[w] / step_s["none"] - 1.0 for w in WEIGHTINGS})
    metrics["batch_response_tokens"] = float(batch.mask.sum())
    ratios = {f"overhead_{w}": (part_s[w] - part_s["none"]) / step_s["none"] for w in WEIGHTINGS}
    ratios["max_weighting_overhead"] = max(ratios[f"overhead_{w}"] for w in WEIGHTINGS)
    # Precision: few rounds (half-precision GEMMs are emulated, hence slow, on CPUs without bf16/fp16 units).
    contenders = {p: _loss_step(model, batch, _config(f"precision.train={p}"), prox_logp) for p in PRECISIONS}
    seconds = _best(contenders, 2 if quick else 6)  # the first round is the warm-up of the others
    metrics.update({f"step_ms_none_{p}": 1e3 * s for p, s in seconds.items()})
    ratios["bf16_vs_fp32"] = seconds["fp32"] / seconds["bf16"]  # tokens/s ratio on the same batch
    metrics["fp16_vs_fp32"] = seconds["fp32"] / seconds["fp16"]
    return metrics, ratios


def _single():
    from learner.distributed import SINGLE

    return SINGLE


def _train_step_runner(ranks) -> Callable[[], object]:  # noqa: ANN001 - learner.distributed.Dist
    """A whole train step (prox forward, loss, backward, AdamW) on this rank's model; FSDP2-sharded if world > 1."""
    from learner.acrl import AcrlReference
    from learner.distributed import shard_model
    from learner.fp32_gemm import use_fp32_gemm
    from learner.fused_ops import use_fused_ops
    from learner.precision import LossScaler
    from learner.update import train_on_batch

    model = _model()
    batch = _batch(model)
    cfg = _config("loss.weighting=tis", "optim.lr=1e-6")
    use_fp32_gemm(model, cfg.learner.fp32_gemm)  # as the learner does, before sharding
    use_fused_ops(model, cfg.learner.fused_ops)
    if ranks.world > 1:
        shard_model(model)
    optimizer = adamw(model.parameters(), cfg.optim)  # as the learner's: fused on one rank, the loop on FSDP2's shards
    scaler, reference = LossScaler(enabled=False), AcrlReference(cfg.loss.acrl)
    return lambda: train_on_batch(model, optimizer, scaler, batch, cfg, reference, ranks)


def _rank_loop(rank: int, world: int, rendezvous: str, commands, results) -> None:  # noqa: ANN001 - mp queues
    """An FSDP2 rank: on each command, run that many train steps and (rank 0) report the best seconds."""
    from learner.distributed import close, init_distributed

    torch.set_num_threads(1)
    ranks = init_distributed(rank, world, rendezvous)
    step = _train_step_runner(ranks)
    step()  # warm-up
    results.put(("ready", rank))
    while (steps := commands[rank].get()) is not None:
        best = float("inf")
        for _ in range(steps):
            torch.distributed.barrier()
            start = time.perf_counter()
            step()
            best = min(best, time.perf_counter() - start)
        if rank == 0:
            results.put(("best", best))
    close(ranks)


def _fsdp(rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    """FSDP2 world 2 vs one process with FSDP_WORLD threads, alternating blocks of steps (never both at once)."""
    from learner.distributed import start_rendezvous

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers", "learner.update", __name__])
    store, rendezvous = start_rendezvous()
    commands = [ctx.Queue() for _ in range(FSDP_WORLD)]
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_loop, args=(r, FSDP_WORLD, rendezvous, commands, results), daemon=True)
        for r in range(FSDP_WORLD)
    ]
    for proc in procs:
        proc.start()
    threads = torch.get_num_threads()
    try:
        for _ in procs:
            results.get(timeout=600)
        torch.set_num_threads(FSDP_WORLD)
        single = _train_step_runner(_single())
        single()
        best_single, best_fsdp = float("inf"), float("inf")
        for _ in range(rounds):
            best_single = min(best_single, _best({"single": single}, 2)["single"])
            for queue in commands:
                queue.put(2)
            best_fsdp = min(best_fsdp, results.get(timeout=600)[1])
        for queue in commands:
            queue.put(None)
        for proc in procs:
            proc.join(timeout=60)
    finally:
        torch.set_num_threads(threads)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        del store
    tokens = float(GROUPS * GROUP_SIZE * (PROMPT_LEN + RESPONSE_LEN))
    metrics = {"train_tok_s_single": tokens / best_single, "train_tok_s_fsdp2_w2": tokens / best_fsdp}
    return metrics, {"fsdp2_w2_vs_single": best_single / best_fsdp}


def _smol_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SMOL_SHAPE, tie_word_embeddings=True, max_position_embeddings=2048, rope_theta=100000.0)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).train()  # transformers' random init: the cost does not depend on the values


def _smol_batch():
    """8 groups of 8 responses of 16 tokens after the group's 47-token prompt (GRPO: a group samples one prompt);
    behavior log-probs near a random model's (-log V)."""
    from learner.batch import Batch

    gen = torch.Generator().manual_seed(0)
    n, vocab = SMOL_GROUPS * SMOL_GROUP_SIZE, SMOL_SHAPE["vocab_size"]
    seq_len, resp_len = SMOL_PROMPT_LEN + SMOL_RESPONSE_LEN, SMOL_RESPONSE_LEN
    input_ids = torch.randint(1, vocab, (n, seq_len), generator=gen)
    prompts = torch.randint(1, vocab, (SMOL_GROUPS, SMOL_PROMPT_LEN), generator=gen)
    input_ids[:, :SMOL_PROMPT_LEN] = prompts.repeat_interleave(SMOL_GROUP_SIZE, 0)
    behav = -torch.log(torch.tensor(float(vocab))) + 0.3 * torch.randn((n, resp_len), generator=gen)
    rewards = torch.randint(0, 2, (n,), generator=gen).float()
    return Batch(
        input_ids=input_ids,
        attention_mask=torch.ones((n, seq_len), dtype=torch.long),
        response_pos=(SMOL_PROMPT_LEN + torch.arange(resp_len))[None, :].expand(n, -1).clone(),
        response_ids=input_ids[:, SMOL_PROMPT_LEN:].clone(),
        mask=torch.ones((n, resp_len)),
        behav_logp=behav.clamp_max(0.0),
        versions=torch.zeros((n, resp_len), dtype=torch.long),
        rewards=rewards,
        correct=rewards.clone(),
        group_index=torch.arange(SMOL_GROUPS).repeat_interleave(SMOL_GROUP_SIZE),
        truncated=torch.zeros(n, dtype=torch.bool),
    )


def smol_model_flops(
    model: torch.nn.Module,
    batch,  # noqa: ANN001 - Batch
    proximal_pass: bool,
    share_prefix: bool = False,
) -> float:
    """Model FLOPs of one learner step: 6 x (P_body x T_all + P_head x T_loss), x 4/3 with a proximal forward.

    P_body: parameters besides the embeddings and the LM head; P_head = vocab x hidden (the head's GEMM, tied or
    not); T_all: prompt + response tokens, with `share_prefix` (`learner.share_prefix`) each group's shared prefix
    once (the tokens the decoder must run on: `learner.packing`); T_loss: response tokens (where the loss is). 2
    FLOPs per parameter and token forward, 4 backward; a separate no-grad proximal forward adds 2 more.
    """
    from learner.packing import pays, shared_prefixes

    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    body = sum(p.numel() for p in model.parameters() if p is not embed and p is not head)
    tokens = float(batch.attention_mask.sum())
    if share_prefix:
        lengths = batch.attention_mask.sum(-1).tolist()
        runs, prefixes = shared_prefixes(batch.input_ids, lengths, batch.group_index)
        if pays(runs, prefixes, lengths, batch.attention_mask.numel()):
            tokens -= sum((hi - lo - 1) * prefix for (lo, hi), prefix in zip(runs, prefixes))
    per_pass = body * tokens + head.numel() * float(batch.mask.sum())
    return (6.0 + (2.0 if proximal_pass else 0.0)) * per_pass


def _gemm_peak_flops(repeats: int) -> tuple[float, float]:
    """FLOP/s of a large fp32 GEMM on this process's threads, the best of `repeats` and of both fp32 GEMMs (torch.mm
    and oneDNN's: `learner.fp32_gemm`): per wall second and per busy second (CPU seconds / threads)."""
    from learner.fp32_gemm import fp32_matmuls

    a, b = torch.randn(GEMM_SIZE, GEMM_SIZE), torch.randn(GEMM_SIZE, GEMM_SIZE)
    wall, busy = float("inf"), float("inf")
    for gemm in fp32_matmuls().values():
        gemm(a, b)
        for _ in range(repeats):
            started, cpu = time.perf_counter(), time.process_time()
            gemm(a, b)
            wall = min(wall, time.perf_counter() - started)
            busy = min(busy, (time.process_time() - cpu) / torch.get_num_threads())
    return 2.0 * GEMM_SIZE**3 / wall, 2.0 * GEMM_SIZE**3 / busy


def _smol_step(model, optimizer, batch, sections, scheme: str, publisher, version: int) -> dict[str, float]:  # noqa: ANN001
    """One learner step as `Learner.train_step` runs it; its phases' seconds and `total`."""
    from common.config_rules import W8A8_SCHEMES
    from learner.acrl import AcrlReference
    from learner.losses import mismatch_metrics
    from learner.precision import LossScaler
    from learner.update import timed, train_on_batch
    from quant_sync.export import export_rollout_tensors
    from quant_sync.uaq import quant_error_by_type

    started, cpu = time.perf_counter(), time.process_time()
    scaler, reference = LossScaler(enabled=False), AcrlReference(sections.loss.acrl)
    result = train_on_batch(model, optimizer, scaler, batch, sections, reference, version=version)
    seconds = dict(result.seconds)
    with timed(seconds, "publish"):
        state = model.state_dict()
        tensors = export_rollout_tensors(state, scheme, quantize_head=scheme in W8A8_SCHEMES)  # as quant.lm_head=auto
        publisher.publish(version, tensors, scheme)
    with timed(seconds, "metrics"):
        quant_error_by_type(state, tensors, scheme)
        mismatch_metrics(batch.behav_logp, result.prox_logp, batch.mask, sections.loss.effective_cap)
    seconds["total"] = time.perf_counter() - started
    seconds["busy"] = (time.process_time() - cpu) / torch.get_num_threads()
    seconds["proximal_pass"] = float(result.seconds["proximal"] > 0)
    return seconds


def _smol_child(steps: int, overrides: tuple[str, ...], results) -> None:  # noqa: ANN001 - a multiprocessing queue
    """The fresh process of the SmolLM row: the GEMM peak, the model, `steps` learner steps, its peak RSS after the
    first step (the row's) and after all of them (the steady state: AdamW's state lives through the step)."""
    from learner.fp32_gemm import use_fp32_gemm
    from learner.fused_ops import use_fused_ops
    from learner.group import apply_malloc_settings
    from quant_sync.publisher import WeightPublisher

    apply_malloc_settings()  # as a learner rank does first (learner/group.py)
    settings = [f"rollout.max_new_tokens={SMOL_RESPONSE_LEN}", "rollout.temperature=1.0", "algo.overlong.len=4",
                "loss.weighting=tis", "loss.cap=2.0", "loss.eps_high=0.28", "quant.scheme=int8", "optim.lr=2e-5",
                *overrides]  # fmt: skip
    config = load_config(None, settings)
    sections = UpdateSections.pick(config)
    other = SMOL_COMPARED.get(config.precision.train)
    torch.set_num_threads(sections.learner.threads)
    peaks = [_gemm_peak_flops(5)]
    model, batch = _smol_model(), _smol_batch()
    gemm = use_fp32_gemm(model, sections.learner.fp32_gemm)  # as the learner does, on its threads
    use_fused_ops(model, sections.learner.fused_ops)
    optimizer = adamw(model.parameters(), sections.optim)  # the learner's (fused); weight decay 0 as the default
    publisher = WeightPublisher()
    runs, rss_gb, busy = [], [], {}
    try:
        for version in range(steps):
            runs.append(_smol_step(model, optimizer, batch, sections, config.quant.scheme, publisher, version))
            rss_gb.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9)  # KiB on Linux
        if other is not None:  # bf16_vs_fp32_smol: one more step in the other precision (same model, AdamW, batch)
            compared = UpdateSections.pick(load_config(None, [*settings, f"precision.train={other}"]))
            busy = {config.precision.train: min(run["busy"] for run in runs[1:] or runs)}
            busy[other] = _smol_step(model, optimizer, batch, compared, config.quant.scheme, publisher, steps)["busy"]
    finally:
        publisher.close()
    peaks.append(_gemm_peak_flops(5))
    steady = min(runs[1:] or runs, key=lambda run: run["busy"])  # the first step also allocates AdamW's state
    learner = sections.learner
    results.put(
        {
            "steady": steady,
            "first": runs[0],
            "peak_wall": max(p[0] for p in peaks),
            "peak_busy": max(p[1] for p in peaks),
            "rss_gb": rss_gb,
            "flops": smol_model_flops(model, batch, bool(steady["proximal_pass"]), learner.share_prefix),
            "threads": learner.threads,
            "micro_batch_tokens": learner.micro_batch_tokens,
            "precision_busy": busy,
            "fp32_gemm": gemm.kernel,
        }
    )


def _smol(quick: bool, overrides: tuple[str, ...] = SMOL_OVERRIDES) -> tuple[dict[str, float], dict[str, float]]:
    """The SmolLM row, in a spawned process: one step with --quick, else the best of 2 after a first step.

    MFU is taken over busy seconds (the process's CPU seconds / its threads, for the step and for the peak's GEMM
    alike): on an idle machine they are wall seconds, and on a shared one they leave out the time other processes
    held the cores. The wall-clock figures are metrics (`smol_mfu_wall`).
    """
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_smol_child, args=(1 if quick else 3, overrides, results), daemon=True)
    proc.start()
    try:
        out = results.get(timeout=3600)
    finally:
        proc.join(timeout=60)
    steady, flops = out["steady"], out["flops"]
    metrics = {f"smol_{phase}_s": steady[phase] for phase in PHASES_SMOL}
    metrics["smol_other_s"] = steady["total"] - sum(steady[phase] for phase in PHASES_SMOL)
    metrics.update(
        {
            "smol_step_s": steady["total"],
            "smol_step_busy_s": steady["busy"],
            "smol_first_step_s": out["first"]["total"],
            "smol_model_gflop": flops / 1e9,
            "smol_gemm_peak_gflop_s": out["peak_busy"] / 1e9,
            "smol_model_gflop_s": flops / steady["busy"] / 1e9,
            "smol_mfu_wall": flops / steady["total"] / out["peak_wall"],
            "smol_peak_rss_gb_steady": out["rss_gb"][-1],
            "smol_threads": out["threads"],
            "smol_micro_batch_tokens": out["micro_batch_tokens"],
            "smol_fp32_gemm_onednn": float(out["fp32_gemm"] == "onednn"),
        }
    )
    ratios = {
        "learner_mfu_smol": flops / steady["busy"] / out["peak_busy"],
        "learner_peak_rss_gb_smol": out["rss_gb"][0],
    }
    if busy := out["precision_busy"]:  # a row in fp16 has no such comparison
        metrics.update({f"smol_step_busy_s_{precision}": seconds for precision, seconds in busy.items()})
        ratios["bf16_vs_fp32_smol"] = busy["fp32"] / busy["bf16"]
    return metrics, ratios


BUILTIN_GROUPS, BUILTIN_GROUP_SIZE, BUILTIN_MAX_NEW_TOKENS = 16, 8, 8
BUILTIN_CONFIG = (f"rollout.max_new_tokens={BUILTIN_MAX_NEW_TOKENS}", "rollout.temperature=1.0", "algo.overlong.len=4",
                  "loss.weighting=tis", "loss.cap=2.0", "loss.eps_high=0.28", "quant.scheme=int8", "optim.lr=1e-4",
                  "learner.threads=1")  # fmt: skip
"""configs/dapo_int8.yaml's learner settings (the built-in task of `asyncrl bench e2e`), on one thread."""


def _builtin_batch(tokenizer, seed: int = 0):  # noqa: ANN001 - a Hugging Face tokenizer
    """16 groups of 8 responses to arithmetic prompts as the built-in task draws them (`a+b=` or `a-b=`, operands of
    1-2 digits, BOS + 4-6 characters), each response 1-3 digits and the end token, as the warmed-up model answers
    (2.8 tokens on average in `asyncrl bench e2e`); behavior log-probs near the model's."""
    import random

    from common.wire import Trajectory
    from learner.batch import collate

    rng = random.Random(seed)

    def number() -> int:
        return rng.randint(0, 9) if rng.random() < 0.5 else rng.randint(10, 99)

    groups = []
    for g in range(BUILTIN_GROUPS):
        a, b, op = number(), number(), rng.choice("+-")
        a, b = (b, a) if op == "-" and a < b else (a, b)
        prompt = np.asarray(tokenizer(f"{a}{op}{b}=")["input_ids"], dtype=np.int32)
        group = []
        for i in range(BUILTIN_GROUP_SIZE):
            digits = str(rng.randint(0, 10 ** rng.randint(1, 3) - 1))
            response = np.asarray(tokenizer(digits, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id],
                                  dtype=np.int32)  # fmt: skip
            n = len(response)
            reward = float(rng.random() < 0.5)
            group.append(Trajectory(
                uid=f"{g}/{i}", group=str(g), prompt_index=g, prompt_ids=prompt, response_ids=response,
                behav_logp=np.asarray([-0.5 * rng.random() for _ in range(n)], dtype=np.float32),
                versions=np.zeros(n, dtype=np.int32), reward=reward, correct=reward > 0, finish="stop",
                worker="bench", t_start=0.0, t_end=0.0,
            ))  # fmt: skip
        groups.append(group)
    return collate(groups, tokenizer.pad_token_id or 0)


def _builtin(quick: bool, overrides: tuple[str, ...] = ()) -> tuple[dict[str, float], dict[str, float]]:
    """The built-in row: whole learner steps (as `_smol_step`) of builtin:tiny on a batch of the built-in task's shape
    (configs/dapo_int8.yaml: 16 groups x 8 samples), in this process on `learner.threads`; the best and the median
    step over the measured steps, in busy (CPU) seconds and wall seconds, and the best step's phases."""
    import statistics

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.builtin_model import resolve_model_path
    from learner.batch import micro_batch_budget, micro_batches
    from learner.fp32_gemm import use_fp32_gemm
    from learner.fused_ops import use_fused_ops
    from learner.logprobs import inputs_read
    from learner.packing import pack_groups
    from quant_sync.publisher import WeightPublisher
    from quant_sync.uaq import apply_uaq

    config = load_config(None, [*BUILTIN_CONFIG, *overrides])
    sections = UpdateSections.pick(config)
    model_dir = resolve_model_path("builtin:tiny")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    apply_uaq(model, config.quant.uaq.scale)
    model.train()
    batch = _builtin_batch(AutoTokenizer.from_pretrained(model_dir))
    optimizer = adamw(model.parameters(), sections.optim)  # the learner's (fused); weight decay 0 as the default
    threads = torch.get_num_threads()
    torch.set_num_threads(sections.learner.threads)
    gemm = use_fp32_gemm(model, sections.learner.fp32_gemm)  # as the learner does, on its threads
    use_fused_ops(model, sections.learner.fused_ops)
    publisher = WeightPublisher()
    warmup, measured = (2, 8) if quick else (3, 30)
    runs = []
    try:
        for version in range(warmup + measured):
            runs.append(_smol_step(model, optimizer, batch, sections, config.quant.scheme, publisher, version))
    finally:
        publisher.close()
        torch.set_num_threads(threads)
    runs = runs[warmup:]
    best = min(runs, key=lambda run: run["busy"])
    budget = micro_batch_budget(sections.learner.micro_batch_tokens, model)
    plan = micro_batches(batch, 0, batch.rows, budget, sections.learner.share_prefix)
    read = [inputs_read(batch.input_ids[lo:hi], batch.attention_mask[lo:hi]) for lo, hi in plan]  # as the learner
    packed = [pack_groups(ids, mask, batch.group_index[lo:hi], model.config._attn_implementation)
              if sections.learner.share_prefix else None
              for (lo, hi), (ids, mask) in zip(plan, read)]  # fmt: skip
    model_tokens = sum(
        mask.shape[0] * int(mask.sum(-1).max()) if pk is None else pk.tokens for (_, mask), pk in zip(read, packed)
    )
    metrics = {f"builtin_{phase}_s": best[phase] for phase in PHASES_SMOL}
    metrics.update(
        {
            "builtin_step_busy_s": best["busy"],
            "builtin_step_busy_median_s": statistics.median(run["busy"] for run in runs),
            "builtin_step_s": min(run["total"] for run in runs),
            "builtin_step_median_s": statistics.median(run["total"] for run in runs),
            "builtin_micro_batches": float(len(plan)),
            "builtin_model_tokens": float(model_tokens),  # tokens the decoder ran on, padding included
            "builtin_padded_tokens": float(batch.attention_mask.numel()),  # rows x longest row
            "builtin_real_tokens": float(batch.attention_mask.sum()),
            "builtin_fp32_gemm_onednn": float(gemm.kernel == "onednn"),
        }
    )
    return metrics, {}


ROWS = ("weightings", "fsdp", "smol", "builtin")
"""The bench's parts: weighting overheads and precisions, FSDP2 against one process, the SmolLM row, the built-in
task's learner step."""


def run(quick: bool, rows: tuple[str, ...] = ROWS, smol_overrides: tuple[str, ...] = ()) -> BenchResult:
    """The rows `rows` of the bench (all by default; `python -m asyncrl.bench.learner_bench --rows smol` runs one);
    `smol_overrides`: config overrides of the SmolLM row on top of `SMOL_OVERRIDES` (e.g. `precision.train=bf16`)."""
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        raise ValueError(f"unknown learner bench rows {unknown}; available: {', '.join(ROWS)}")
    torch.manual_seed(0)
    metrics: dict[str, float] = {}
    ratios: dict[str, float] = {}
    if "weightings" in rows:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the weighting comparison: one thread, the least noisy
        try:
            part_metrics, part_ratios = _weightings_and_precision(quick)
        finally:
            torch.set_num_threads(threads)
        metrics.update(part_metrics)
        ratios.update(part_ratios)
    for row, part in (
        ("fsdp", lambda: _fsdp(rounds=2 if quick else 6)),
        ("smol", lambda: _smol(quick, SMOL_OVERRIDES + smol_overrides)),
        ("builtin", lambda: _builtin(quick, smol_overrides)),
    ):
        if row in rows:
            part_metrics, part_ratios = part()
            metrics.update(part_metrics)
            ratios.update(part_ratios)
    return BenchResult(name="learner", metrics=metrics, ratios=ratios)


def main(argv: list[str] | None = None) -> None:
    """`python -m asyncrl.bench.learner_bench [--quick] [--rows smol ...] [--smol-set KEY=VALUE ...] [--json PATH]`."""
    import argparse

    from asyncrl.bench import print_table, write_json

    parser = argparse.ArgumentParser(prog="python -m asyncrl.bench.learner_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (smoke test), same metrics")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS), help="the rows to run (default: all)")
    parser.add_argument("--smol-set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides of the SmolLM and built-in rows")  # fmt: skip
    parser.add_argument("--json", dest="json_path", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    result = run(args.quick, tuple(args.rows), tuple(args.smol_set))
    print_table(result)
    if args.json_path:
        write_json(result, args.json_path)


if __name__ == "__main__":
    main()
