"""The learner: one train step = fetch a batch of groups, proximal forward, decoupled PPO update, publish k+1.

    buffer --FetchBatch(step k)--> groups --advantages, prox log-probs (no grad)--> PPO minibatches (grad)
           --> AdamW --> quantize (quant_sync) --> publish version k+1 to every rollout worker

One `Learner` per rank, each in its own process (a Ray actor; `learner.group` starts them). With
`learner.world_size > 1` the model is sharded with FSDP2 (`learner.distributed`); rank 0 alone talks to the buffer
and to quant_sync, and broadcasts each batch to the other ranks. The update itself is `learner.update`.
Precision (`precision.train`) and rollout-aligned forwards (`learner.rollout_aligned`) are set up here.
A step whose loss or gradient is not finite is skipped and counted, and its weights are never published.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from asyncrl.config import Config, from_dict
from asyncrl.wire import Trajectory
from learner import aligned, distributed
from learner.acrl import AcrlReference
from learner.batch import Batch, collate, overlong_shaping, token_logp  # noqa: F401 - re-exported
from learner.losses import mismatch_metrics
from learner.precision import LossScaler
from learner.schedules import LrSchedule
from learner.update import train_on_batch
from quant_sync.export import export_rollout_tensors
from quant_sync.uaq import apply_uaq, quant_error_by_type


class Learner:
    """One learner rank. Rank 0 fetches batches, publishes weights and reports metrics; others only compute."""

    def __init__(
        self, config: dict[str, Any], model_dir: str, buffer_endpoint: str, rank: int = 0, rendezvous: str = ""
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg: Config = from_dict(config)
        cfg = self.cfg
        torch.set_num_threads(cfg.learner.threads)
        torch.manual_seed(cfg.train.seed)
        self.ranks = distributed.init_distributed(rank, cfg.learner.world_size, rendezvous)
        self.model_dir = model_dir
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # fp32 master weights
        apply_uaq(self.model, cfg.quant.uaq.scale)  # before the optimizer sees the parameters
        if cfg.learner.rollout_aligned:
            aligned.make_rollout_aligned(self.model, cfg.quant.scheme, cache=self.ranks.world == 1)
        if self.ranks.world > 1:
            distributed.shard_model(self.model)
        self.model.train()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if self.tokenizer.pad_token is None:  # many base models ship without one; only used for padding
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        optim = cfg.optim
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay
        )
        self.scaler = LossScaler(
            scale=cfg.precision.loss_scale_init,
            growth_interval=cfg.precision.loss_scale_growth_interval,
            enabled=cfg.precision.train == "fp16",
        )
        self.schedule = LrSchedule(optim, total_steps=cfg.train.steps)
        self.acrl_reference = AcrlReference(cfg.loss.acrl)
        self.skipped_steps = 0
        self.client = self.publisher = None
        if self.ranks.is_main:
            from buffer.client import BufferClient
            from buffer.curve import client_keys
            from quant_sync.transport import WeightPublisher

            curve = client_keys(cfg.buffer.curve_keys_dir)
            self.client = BufferClient(buffer_endpoint, identity="learner", timeout_s=60, curve=curve)
            self.publisher = WeightPublisher(host=cfg.buffer.host)
        self._publish(0)

    def weights_endpoint(self) -> str:
        assert self.publisher is not None, "only rank 0 publishes weights"
        return self.publisher.endpoint

    def _publish(self, version: int) -> dict[str, float]:
        """Quantize the current weights once and publish them as `version`; returns the quantization errors.

        A collective with FSDP2 (the full state dict is gathered on rank 0): every rank calls it.
        """
        state = distributed.full_state_dict(self.model, self.ranks)
        if not self.ranks.is_main:
            return {}
        tensors = export_rollout_tensors(state, self.cfg.quant.scheme)
        if self.cfg.learner.rollout_aligned:  # the next forwards run on exactly these tensors (QaRL)
            aligned.install_operands(self.model, tensors, self.cfg.quant.scheme)
        assert self.publisher is not None
        self.publisher.publish(version, tensors, self.cfg.quant.scheme)
        return quant_error_by_type(state, tensors, self.cfg.quant.scheme)

    def fetch(self, step: int) -> tuple[list[list[Trajectory]], int, float]:
        assert self.client is not None
        started = time.monotonic()
        dropped = 0
        while True:
            reply = self.client.fetch_batch(step, self.cfg.train.groups_per_step, wait_s=5.0)
            dropped += reply.dropped_stale
            if reply.ready:
                return reply.groups, dropped, time.monotonic() - started

    def train_step(self, step: int) -> dict[str, float]:
        """Run train step `step` (consumes one batch, publishes version step + 1); metrics on rank 0, {} elsewhere."""
        batch: Batch | None = None
        dropped_stale, wait_s = 0, 0.0
        if self.ranks.is_main:
            groups, dropped_stale, wait_s = self.fetch(step)
            batch = collate(groups, self.pad_id)
        batch = distributed.broadcast_batch(batch, self.ranks)
        started = time.monotonic()
        cfg = self.cfg
        lengths = batch.mask.sum(-1)
        lr = self.schedule.lr(step, float(lengths.mean()))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        result = train_on_batch(self.model, self.optimizer, self.scaler, batch, cfg, self.acrl_reference, self.ranks)
        if result.skipped:
            self.skipped_steps += 1
        quant_err = self._publish(step + 1) if not result.skipped else {"norm_quant_err": float("nan")}
        if not self.ranks.is_main:
            return {}
        oldest = (batch.versions + (1 - batch.mask.long()) * 10**9).min(-1).values  # (B,) oldest token version
        staleness = (step - oldest).float()
        metrics = dict(result.metrics)
        metrics.update(mismatch_metrics(batch.behav_logp, result.prox_logp, batch.mask, cfg.loss.cap))
        metrics.update(
            {
                "step": step,
                "version": step + 1 if not result.skipped else step,
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
                "perf/train_s": time.monotonic() - started,
                "perf/fetch_wait_s": wait_s,
                "perf/batch_tokens": float(batch.mask.sum()),
            }
        )
        return metrics

    def _full_precision_copy(self) -> torch.nn.Module | None:
        """Rank 0: an unsharded fp32 model with the current weights (a collective with FSDP2); None elsewhere."""
        if self.ranks.world == 1:
            return self.model
        from transformers import AutoModelForCausalLM

        state = distributed.full_state_dict(self.model, self.ranks)
        if not self.ranks.is_main:
            return None
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        model.load_state_dict(state)  # the UAQ-reparametrized weights define the same function
        return model

    def save(self, out_dir: str) -> str:
        """Write a Hugging Face model directory (weights, config, tokenizer) atomically; every rank calls it."""
        model = self._full_precision_copy()
        if model is None:
            return ""
        target = Path(out_dir)
        staging = target.with_name(target.name + ".tmp")
        model.save_pretrained(staging, safe_serialization=True)
        self.tokenizer.save_pretrained(staging)
        if target.exists():
            import shutil

            shutil.rmtree(target)
        staging.rename(target)
        return str(target)

    @torch.no_grad()
    def evaluate(self, prompts: list[str], answers: list[str], max_new_tokens: int) -> float:
        """Greedy accuracy of the current full-precision policy on held-out problems; every rank calls it."""
        from asyncrl.tasks import make_source

        model = self._full_precision_copy()
        if model is None:
            return float("nan")
        source = make_source(self.cfg.data)
        model.eval()
        correct = 0
        with aligned.full_precision(model):
            for lo in range(0, len(prompts), 64):
                chunk = prompts[lo : lo + 64]
                enc = self.tokenizer(chunk, return_tensors="pt", padding=True, padding_side="left")
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
