"""The learner: one train step = fetch a batch of groups, proximal forward, decoupled PPO update, publish k+1.

    buffer --FetchBatch(step k)--> groups --advantages, prox log-probs (no grad)--> PPO minibatches (grad)
           --> AdamW --> quantize (quant_sync) --> publish version k+1 to every rollout worker

One `Learner` per rank, each in its own process (a Ray actor; `learner.group` starts them). With
`learner.world_size > 1` the model is sharded with FSDP2 (`learner.distributed`); rank 0 alone talks to the buffer
and to quant_sync, and broadcasts each batch to the other ranks. The update itself is `learner.update`.
Precision (`precision.train`) and rollout-aligned forwards (`learner.rollout_aligned`) are set up here.
A step whose loss or gradient is not finite is skipped and counted: the weights stay as they were and are
published again as version k+1, so the staleness bound (step k publishes k+1) holds and a synchronous run
(`staleness.max_lag=0`), which waits for version k+1 before step k+1, does not wait forever.
A rank reads only its config sections (`learner.sections.LearnerSections`), never the root config.

Resumable checkpoints (`save_checkpoint`, `resume_dir`): `model/` is a Hugging Face model directory of the (UAQ-
reparametrized) fp32 master weights, `training_state.pt` holds the optimizer, LR schedule, loss scaler, ACRL
reference, skipped-step count and RNG states (plain tensors and numbers: loaded with `weights_only=True`).
"""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from common.config import set_key
from common.config_rules import head_quantized
from common.train_gate import TrainGate
from common.wire import Trajectory
from learner import aligned, distributed, reference
from learner.acrl import AcrlReference
from learner.batch import Batch, collate, overlong_shaping, token_logp  # noqa: F401 - re-exported
from learner.devices import cpu_state, model_device, rank_device
from learner.fp32_gemm import use_fp32_gemm
from learner.fused_ops import use_fused_ops
from learner.losses import mismatch_metrics
from learner.optimizer import adamw
from learner.precision import LossScaler
from learner.pretrained import load_causal_lm
from learner.recompute import enable_gradient_checkpointing
from learner.schedules import LrSchedule
from learner.sections import LearnerSections
from learner.threads import BOUND_WAIT_SHARE, ThreadsPolicy, available_cores
from learner.update import timed, train_on_batch
from quant_sync.export import export_rollout_tensors
from quant_sync.uaq import apply_uaq, quant_error_by_type


class Learner:
    """One learner rank. Rank 0 fetches batches, publishes weights and reports metrics; others only compute."""

    def __init__(
        self,
        section_values: dict[str, Any],
        model_dir: str,
        buffer_endpoint: str,
        rank: int = 0,
        rendezvous: str = "",
        resume_dir: str = "",
        start_version: int = 0,
    ):
        """`section_values`: `common.config.to_dict` of a `LearnerSections`. `resume_dir`: a checkpoint of
        `save_checkpoint` to continue from; it was saved at `start_version`."""
        from transformers import AutoTokenizer

        sections = self.sections = LearnerSections.load(section_values)
        torch.set_num_threads(sections.learner.threads)
        torch.manual_seed(sections.train.seed)
        self.device = rank_device(sections.learner.device, rank)  # before anything loads: a missing GPU fails fast
        self.ranks = distributed.init_distributed(rank, sections.learner.world_size, rendezvous, device=self.device)
        self.model_dir = model_dir
        self.quantized_head = head_quantized(sections.quant, sections.rollout)  # quant.lm_head, `auto` resolved
        self.trust_remote_code = sections.model.trust_remote_code
        resume_model = "" if sections.model.lora.rank else resume_dir  # a LoRA checkpoint holds only the adapters
        source = str(Path(resume_model) / "model") if resume_model else model_dir
        self.model = load_causal_lm(source, self.trust_remote_code).to(self.device)  # fp32 master weights
        if not resume_model:  # a checkpoint holds the reparametrized weights already
            apply_uaq(self.model, sections.quant.uaq.scale)  # before the optimizer sees the parameters
        self.reference = reference.initial_reference(  # KL's frozen initial model (None: loss.kl.coef = 0); a resumed
            sections.loss.kl, model_dir, sections.quant.uaq.scale, self.ranks,  # run rebuilds it from model_dir
            policy=None if resume_model else self.model, trust_remote_code=self.trust_remote_code, device=self.device,
        )  # fmt: skip
        if sections.learner.rollout_aligned:
            aligned.make_rollout_aligned(
                self.model, sections.quant.scheme, cache=self.ranks.world == 1, head=self.quantized_head
            )
        self.lora = None  # model.lora.rank > 0: a frozen base, only the adapters train and travel (learner/lora.py)
        if sections.model.lora.rank:
            from learner import lora

            self.model, self.lora = lora.add_adapters(self.model, sections, self.quantized_head, resume_dir)
        on_cpu = self.device.type == "cpu"  # the CPU kernels: a GPU keeps torch's own
        self.fp32_gemm = use_fp32_gemm(self.model, sections.learner.fp32_gemm if on_cpu else "blas")  # learner.threads
        self.fused_ops = use_fused_ops(self.model, sections.learner.fused_ops and on_cpu)
        if self.reference is not None:
            use_fp32_gemm(self.reference, self.fp32_gemm.kernel)
            use_fused_ops(self.reference, sections.learner.fused_ops and on_cpu)
        if sections.learner.gradient_checkpointing:
            enable_gradient_checkpointing(self.model)  # before sharding: FSDP2's hooks stay outside the recomputation
        if self.ranks.world > 1:
            distributed.shard_model(self.model)
        self.model.train()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=self.trust_remote_code)
        if self.tokenizer.pad_token is None:  # many base models ship without one; only used for padding
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        optim = sections.optim
        self.optimizer = adamw(self.model.parameters(), optim)  # fused where torch's kernel applies
        self.scaler = LossScaler(
            scale=sections.precision.loss_scale_init,
            growth_interval=sections.precision.loss_scale_growth_interval,
            enabled=sections.precision.train == "fp16",
        )
        self.schedule = LrSchedule(optim, total_steps=sections.train.steps)
        self.acrl_reference = AcrlReference(sections.loss.acrl)
        self.skipped_steps = 0
        self.lease_throttled = 0  # the buffer's count of refused leases at the previous step (policy `throttled`)
        learner = sections.learner
        cores = available_cores()
        self.threads_policy = ThreadsPolicy(  # one rank only: with FSDP2 every rank keeps learner.threads
            learner.threads_policy if learner.world_size == 1 else "fixed", learner.threads,
            min(learner.threads_max, cores) if learner.threads_max else cores,
            parameters=sum(param.numel() for param in self.model.parameters()),
            synchronous=sections.staleness.max_lag == 0,
        )  # fmt: skip
        self.cores = cores
        # common.train_gate: the workers on this machine pause while a CPU learner trains on every core
        self.train_gate = TrainGate.from_env() if self.ranks.is_main and on_cpu else None
        if self.train_gate is not None:
            self.train_gate.open()  # a learner restarted after one that died mid-step: the workers go on at once
        self.loop_mark: tuple[float, int] | None = None  # the end of the last step's fetch and its trained samples
        self.last_train_s = 0.0  # the last step's training seconds (perf/train_s)
        self.client = self.publisher = None
        if self.ranks.is_main:
            from buffer.client import BufferClient
            from common.curve import client_keys, server_keys
            from quant_sync.transport import WeightPublisher

            curve = client_keys(sections.buffer.curve_keys_dir)
            self.client = BufferClient(buffer_endpoint, identity="learner", timeout_s=60, curve=curve)
            # the weight publisher binds where the buffer does, with the same keys (workers are its clients)
            self.publisher = WeightPublisher(
                host=sections.buffer.host, curve=server_keys(sections.buffer.curve_keys_dir)
            )
        if resume_dir:
            self._load_training_state(Path(resume_dir) / "training_state.pt")
        self.version = start_version
        self._publish(start_version)

    def weights_endpoint(self) -> str:
        assert self.publisher is not None, "only rank 0 publishes weights"
        return self.publisher.endpoint

    def _publish(self, version: int) -> dict[str, float]:
        """Quantize the current weights once and publish them as `version`; returns the quantization errors.

        A collective with FSDP2 (the full state dict is gathered on rank 0): every rank calls it.
        """
        if self.lora is not None:  # the quantized base once, then the adapters alone (gathered on rank 0 with FSDP2)
            self.version = version
            return self.lora.publish(self.model, self.publisher, version, self.ranks)
        state = cpu_state(distributed.full_state_dict(self.model, self.ranks))  # quant_sync publishes CPU tensors
        if not self.ranks.is_main:
            return {}
        scheme = self.sections.quant.scheme
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        tensors = export_rollout_tensors(state, scheme, quantize_head=self.quantized_head, tied_head=tied)
        if self.sections.learner.rollout_aligned:  # the next forwards run on exactly these tensors (QaRL)
            aligned.install_operands(self.model, tensors, scheme)
        assert self.publisher is not None
        self.publisher.publish(version, tensors, scheme)
        self.version = version
        return quant_error_by_type(state, tensors, scheme)

    def fetch(self, step: int) -> tuple[list[list[Trajectory]], int, float]:
        assert self.client is not None
        started = time.monotonic()
        dropped = 0
        while True:
            reply = self.client.fetch_batch(step, self.sections.train.groups_per_step, wait_s=5.0)
            dropped += reply.dropped_stale
            if reply.ready:
                return reply.groups, dropped, time.monotonic() - started

    def train_step(self, step: int) -> dict[str, float]:
        """Run train step `step` (consumes one batch, publishes version step + 1); metrics on rank 0, {} elsewhere."""
        batch: Batch | None = None
        dropped_stale, wait_s = 0, 0.0
        if self.ranks.is_main:
            groups, dropped_stale, wait_s = self.fetch(step)
            loop_s = self.record_loop(time.monotonic(), sum(len(group) for group in groups))
            batch = collate(groups, self.pad_id)
            torch.set_num_threads(self.step_threads(step, wait_s))
        batch = distributed.broadcast_batch(batch, self.ranks)
        started, cpu_started = time.monotonic(), time.process_time()
        sections = self.sections
        lengths = batch.mask.sum(-1)
        lr = self.schedule.lr(step, float(lengths.mean()))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # on every core, the workers on this machine would only fill its gaps at a loss (common.train_gate)
        gate = self.train_gate if self.train_gate is not None and torch.get_num_threads() >= self.cores else None
        if gate is not None:
            gate.close()
        try:
            result = train_on_batch(
                self.model, self.optimizer, self.scaler, batch, sections, self.acrl_reference, self.ranks, self.version,
                reference=self.reference,  # the frozen initial model of the KL penalty (None: loss.kl.coef = 0)
            )  # fmt: skip  # self.version: the weights this step starts from (the latest published)
        finally:
            if gate is not None:
                gate.open()
        if result.skipped:
            self.skipped_steps += 1
        seconds = dict(result.seconds)
        with timed(seconds, "publish"):
            quant_err = self._publish(step + 1)  # a skipped step republishes its unchanged weights (docstring)
        if not self.ranks.is_main:
            return {}
        oldest = (batch.versions + (1 - batch.mask.long()) * 10**9).min(-1).values  # (B,) oldest token version
        staleness = (step - oldest).float()
        metrics = dict(result.metrics)
        with timed(seconds, "metrics"):
            metrics.update(
                mismatch_metrics(batch.behav_logp, result.prox_logp, batch.mask, sections.loss.effective_cap)
            )
        metrics.update(
            {
                "step": step,
                "version": self.version,  # the latest published: step + 1, skipped or not
                "reward/batch": float(batch.rewards.mean()),
                "acc/batch": float(batch.correct.mean()),
                "response_len/mean": float(lengths.mean()),
                "response_len/max": float(lengths.max()),
                "staleness/mean": float(staleness.mean()),
                "staleness/max": float(staleness.max()),
                "staleness/dropped": float(dropped_stale),
                "entropy": float((result.entropy * batch.mask).sum() / batch.mask.sum()),
                "lr": lr,
                **self.schedule.metrics(),
                **quant_err,
                "skipped_steps": float(self.skipped_steps),
                **{f"perf/{phase}_s": value for phase, value in seconds.items()},
                "learner/threads": float(torch.get_num_threads()),
                "learner/fp32_gemm_onednn": float(self.fp32_gemm.kernel == "onednn"),
                "learner/fused_ops": float(self.fused_ops["swapped"]),
                "learner/fused_attention": float(self.fused_ops["attention"]),
                "perf/train_s": time.monotonic() - started,
                "perf/gate_closed": float(gate is not None),  # the workers here paused through this step's training
                "perf/fetch_wait_s": wait_s,
                "perf/batch_tokens": float(batch.mask.sum()),
            }
        )
        self.last_train_s = metrics["perf/train_s"]
        if loop_s is not None:  # the previous step's loop: the end of its fetch to the end of this step's
            metrics["perf/prev_loop_s"] = loop_s
        # CPU seconds of every thread of this process over the step's wall seconds: 1.0 = one core busy throughout
        metrics["perf/learner_cpu_util"] = (time.process_time() - cpu_started) / max(time.monotonic() - started, 1e-9)
        self.threads_policy.record_util(metrics["perf/learner_cpu_util"])
        return metrics

    def record_loop(self, fetched_at: float, samples: int) -> float | None:
        """At the end of a step's fetch: the previous step's loop seconds (the end of its fetch to now), given to the
        threads policy per trained sample; None at the first step."""
        mark, self.loop_mark = self.loop_mark, (fetched_at, samples)
        if mark is None:
            return None
        loop_s = fetched_at - mark[0]
        self.threads_policy.record(loop_s / max(mark[1], 1))
        return loop_s

    def step_threads(self, step: int, wait_s: float) -> int:
        """The torch threads of step `step` (`learner.threads_policy`, learner/threads.py). `wait_s`: how long this
        step waited for its batch (at most a quarter of the previous step's training: the learner is the bound)."""
        throttled = False
        if self.threads_policy.needs_throttle_signal() and self.client is not None:
            refused = int(self.client.stats().get("lease_throttled", 0))  # the buffer refused a lease since last step
            throttled, self.lease_throttled = refused > self.lease_throttled, refused
        learner_bound = wait_s <= BOUND_WAIT_SHARE * self.last_train_s
        return self.threads_policy.threads(step, throttled=throttled, learner_bound=learner_bound)

    def _full_precision_copy(self) -> torch.nn.Module | None:
        """Rank 0: an unsharded fp32 model with the current weights (a collective with FSDP2); None elsewhere."""
        if self.ranks.world == 1:
            return self.model
        state = distributed.full_state_dict(self.model, self.ranks)
        if not self.ranks.is_main:
            return None
        model = load_causal_lm(self.model_dir, self.trust_remote_code, checked=False)  # its weights are replaced
        if self.lora is not None:  # the same peft structure (frozen base, adapters), to load the peft names into
            from learner import lora

            model, _ = lora.add_adapters(model, self.sections, self.quantized_head)
        model.load_state_dict(state)  # the UAQ-reparametrized weights define the same function
        return model

    def save(self, out_dir: str) -> str:
        """Write a Hugging Face model directory (weights, config, tokenizer) atomically; every rank calls it."""
        if self.lora is not None:  # the adapters alone: gathered on rank 0 with FSDP2 (a collective)
            from learner.lora import gather_adapters

            model, gathered = self.model, gather_adapters(self.model)
        else:
            model, gathered = self._full_precision_copy(), None
        if model is None or not self.ranks.is_main:
            return ""
        target = Path(out_dir)
        staging = target.with_name(target.name + ".tmp")
        if staging.exists():
            shutil.rmtree(staging)
        if self.lora is not None:  # a peft adapter directory for the original base model
            self.lora.save(model, staging, gathered)
        else:
            model.save_pretrained(staging, safe_serialization=True)
        self.tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
        return str(target)

    def save_checkpoint(self, out_dir: str) -> str:
        """Write `out_dir/model` (Hugging Face directory) and `out_dir/training_state.pt`; every rank calls it.

        With FSDP2 the model and the optimizer state are gathered unsharded on rank 0 (collectives), which writes
        them; any world size can resume from them. The caller makes the directory appear atomically
        (asyncrl/checkpoint.py writes to a temporary name first).
        """
        self.save(str(Path(out_dir) / "model"))
        optimizer_state = distributed.full_optimizer_state(self.model, self.optimizer, self.ranks)
        if not self.ranks.is_main:
            return ""
        state = {
            "optimizer": optimizer_state,
            "schedule": self.schedule.state_dict(),
            "scaler": self.scaler.state_dict(),
            "acrl": self.acrl_reference.state_dict(),
            "skipped_steps": self.skipped_steps,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }
        torch.save(state, Path(out_dir) / "training_state.pt")
        return out_dir

    def _load_training_state(self, path: Path) -> None:
        state = torch.load(path, weights_only=True, map_location="cpu")  # loading moves AdamW's state to the params
        fused = self.optimizer.param_groups[0].get("fused")  # a loaded group brings its run's kernel choice
        distributed.load_optimizer_state(self.model, self.optimizer, state["optimizer"], self.ranks)
        for group in self.optimizer.param_groups:  # the resumed run's optim.* (lr is set every step) and kernel
            group["weight_decay"] = self.sections.optim.weight_decay
            group["betas"] = tuple(self.sections.optim.betas)
            group["fused"] = fused
        self.schedule.load_state_dict(state["schedule"])
        self.scaler.load_state_dict(state["scaler"])
        self.acrl_reference.load_state_dict(state["acrl"])
        self.skipped_steps = int(state["skipped_steps"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])

    def set_live(self, changes: dict[str, Any]) -> None:
        """Apply validated live config changes (common.config.live_update) before the next train step."""
        optim = self.sections.optim
        for key, value in changes.items():
            if key == "optim.lr":  # length_decay keeps its halvings relative to the new peak
                ratio = value / optim.lr if optim.lr > 0 else 1.0
                self.schedule.decayed_lr = self.schedule.decayed_lr * ratio if optim.lr > 0 else value
                self.schedule.lr_min = optim.lr_min_ratio * value
            set_key(self.sections, key, value)

    @torch.no_grad()
    def evaluate(self, prompts: list[str], answers: list[str], max_new_tokens: int) -> float:
        """Greedy accuracy of the current full-precision policy on held-out problems; every rank calls it."""
        from common.tasks import make_source
        from common.tasks.chat import PromptEncoder

        model = self._full_precision_copy()
        if model is None:
            return float("nan")
        source = make_source(self.sections.data)
        encode = PromptEncoder.for_source(self.tokenizer, self.sections.data, source)  # the worker's ids
        model.eval()
        correct = 0
        with aligned.full_precision(model):
            for lo in range(0, len(prompts), 64):
                chunk = prompts[lo : lo + 64]
                ids = {"input_ids": [encode(prompt) for prompt in chunk]}
                enc = self.tokenizer.pad(ids, return_tensors="pt", padding=True, padding_side="left")
                enc = {key: value.to(model_device(model)) for key, value in enc.items()}
                out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=self.pad_id)
                texts = self.tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
                correct += sum(source.reward(t, a) for t, a in zip(texts, answers[lo : lo + 64]))
        model.train()
        return correct / max(len(prompts), 1)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        if self.client is not None:
            self.client.close()
        distributed.close(self.ranks)
