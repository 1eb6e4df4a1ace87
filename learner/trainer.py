"""The learner: one train step = fetch a batch of groups, proximal forward, decoupled PPO update, publish k+1.

    buffer --FetchBatch(step k)--> groups --advantages, prox log-probs (no grad)--> PPO minibatches (grad)
           --> AdamW --> quantize (quant_sync) --> publish version k+1 to every rollout worker

Single rank in this version (FSDP2 arrives with the learner issue); runs in its own process (a Ray actor).
A step whose loss or gradient is not finite is skipped and counted, and its weights are never published.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncrl.config import Config, from_dict
from asyncrl.wire import Trajectory
from buffer.client import BufferClient
from learner.acrl import AcrlReference
from learner.losses import LossInputs, advantages, group_discrepancy, mismatch_metrics, policy_loss
from learner.schedules import LrSchedule
from quant_sync.export import export_rollout_tensors
from quant_sync.transport import WeightPublisher
from quant_sync.uaq import apply_uaq, quant_error_by_type


@dataclass(slots=True)
class Batch:
    input_ids: torch.Tensor  # (B, S) prompt + response, right-padded
    attention_mask: torch.Tensor  # (B, S)
    response_pos: torch.Tensor  # (B, T) position of each response token in input_ids (0 where padded)
    response_ids: torch.Tensor  # (B, T)
    mask: torch.Tensor  # (B, T) float, 1 on response tokens
    behav_logp: torch.Tensor  # (B, T)
    versions: torch.Tensor  # (B, T) int
    rewards: torch.Tensor  # (B,)
    correct: torch.Tensor  # (B,)
    group_index: torch.Tensor  # (B,) 0..n_groups-1
    truncated: torch.Tensor  # (B,) bool


def collate(groups: list[list[Trajectory]], pad_id: int) -> Batch:
    trajs = [t for group in groups for t in group]
    group_index = torch.tensor([g for g, group in enumerate(groups) for _ in group])
    seq_len = max(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    resp_len = max(len(t.response_ids) for t in trajs)
    n = len(trajs)
    input_ids = torch.full((n, seq_len), pad_id, dtype=torch.long)
    attention = torch.zeros((n, seq_len), dtype=torch.long)
    response_pos = torch.zeros((n, resp_len), dtype=torch.long)
    response_ids = torch.zeros((n, resp_len), dtype=torch.long)
    mask = torch.zeros((n, resp_len))
    behav = torch.zeros((n, resp_len))
    versions = torch.zeros((n, resp_len), dtype=torch.long)
    for i, t in enumerate(trajs):
        p, r = len(t.prompt_ids), len(t.response_ids)
        input_ids[i, :p] = torch.from_numpy(t.prompt_ids.astype("int64"))
        input_ids[i, p : p + r] = torch.from_numpy(t.response_ids.astype("int64"))
        attention[i, : p + r] = 1
        response_pos[i, :r] = torch.arange(p, p + r)
        response_ids[i, :r] = input_ids[i, p : p + r]
        mask[i, :r] = 1.0
        behav[i, :r] = torch.from_numpy(t.behav_logp.copy())
        versions[i, :r] = torch.from_numpy(t.versions.astype("int64"))
    return Batch(
        input_ids=input_ids,
        attention_mask=attention,
        response_pos=response_pos,
        response_ids=response_ids,
        mask=mask,
        behav_logp=behav,
        versions=versions,
        rewards=torch.tensor([t.reward for t in trajs], dtype=torch.float32),
        correct=torch.tensor([float(t.correct) for t in trajs]),
        group_index=group_index,
        truncated=torch.tensor([t.finish == "length" for t in trajs]),
    )


def overlong_shaping(lengths: torch.Tensor, truncated: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO overlong reward shaping (ALGORITHMS.md): a penalty per response, 0 when disabled (cache_len = 0)."""
    if cache_len <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    soft = -(lengths.float() - (max_len - cache_len)) / cache_len
    penalty = torch.where(lengths.float() > max_len - cache_len, soft, torch.zeros_like(soft))
    return torch.where(truncated, torch.full_like(penalty, -1.0), penalty)


def token_logp(model: torch.nn.Module, batch: Batch, temperature: float, rows: slice | None = None):
    """Log-probs (B, T) of the response tokens under `model` (at the rollout temperature), and entropies (B, T)."""
    sel = rows or slice(None)
    logits = model(input_ids=batch.input_ids[sel], attention_mask=batch.attention_mask[sel]).logits.float()
    pos = (batch.response_pos[sel] - 1).clamp_min(0)  # logits at position p predict token p + 1
    picked = logits.gather(1, pos[..., None].expand(-1, -1, logits.shape[-1])) / temperature  # (B, T, V)
    logp_all = torch.log_softmax(picked, dim=-1)
    logp = logp_all.gather(-1, batch.response_ids[sel][..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy.detach()


class Learner:
    def __init__(self, config: dict[str, Any], model_dir: str, buffer_endpoint: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg: Config = from_dict(config)
        torch.set_num_threads(self.cfg.learner.threads)
        torch.manual_seed(self.cfg.train.seed)
        self.model_dir = model_dir
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        apply_uaq(self.model, self.cfg.quant.uaq.scale)  # before the optimizer sees the parameters
        self.model.train()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if self.tokenizer.pad_token is None:  # many base models ship without one; only used for padding
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        optim = self.cfg.optim
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay
        )
        self.schedule = LrSchedule(optim, total_steps=self.cfg.train.steps)
        self.acrl_reference = AcrlReference(self.cfg.loss.acrl)
        self.client = BufferClient(buffer_endpoint, identity="learner", timeout_s=60)
        self.publisher = WeightPublisher(host=self.cfg.buffer.host)
        self.skipped_steps = 0
        self._publish(0)

    def weights_endpoint(self) -> str:
        return self.publisher.endpoint

    def _publish(self, version: int) -> dict[str, float]:
        """Quantize the current weights once and publish them as `version`; returns the quantization errors."""
        state = self.model.state_dict()
        tensors = export_rollout_tensors(state, self.cfg.quant.scheme)
        self.publisher.publish(version, tensors, self.cfg.quant.scheme)
        return quant_error_by_type(state, tensors, self.cfg.quant.scheme)

    def fetch(self, step: int) -> tuple[list[list[Trajectory]], int, float]:
        started = time.monotonic()
        dropped = 0
        while True:
            reply = self.client.fetch_batch(step, self.cfg.train.groups_per_step, wait_s=5.0)
            dropped += reply.dropped_stale
            if reply.ready:
                return reply.groups, dropped, time.monotonic() - started

    def train_step(self, step: int) -> dict[str, float]:
        """Run train step `step` (consumes one batch, publishes version step + 1); returns its metrics."""
        groups, dropped_stale, wait_s = self.fetch(step)
        started = time.monotonic()
        cfg = self.cfg
        batch = collate(groups, self.pad_id)
        lengths = batch.mask.sum(-1)
        shaped = batch.rewards + overlong_shaping(
            lengths, batch.truncated, cfg.rollout.max_new_tokens, cfg.algo.overlong.len
        )
        adv = advantages(shaped, batch.group_index, cfg.algo.adv)
        lr = self.schedule.lr(step, float(lengths.mean()))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        temperature = cfg.rollout.temperature
        if cfg.learner.prox == "recompute":
            with torch.no_grad():
                prox_logp, entropy = token_logp(self.model, batch, temperature)
        else:
            prox_logp, entropy = batch.behav_logp.clone(), torch.zeros_like(batch.behav_logp)
        acrl_x, acrl_y = None, None
        if cfg.loss.weighting == "acrl":  # Y_g over whole groups, before minibatches split them (ACRL eq. 9)
            acrl_y = group_discrepancy(batch.behav_logp, prox_logp, batch.mask, batch.group_index)
            acrl_x = self.acrl_reference.update_and_get(acrl_y)
        before = [p.detach().clone() for p in self.model.parameters()]
        metrics: dict[str, float] = {}
        n = batch.input_ids.shape[0]
        bounds = torch.linspace(0, n, cfg.learner.minibatches + 1).long().tolist()
        skipped = False
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            rows = slice(lo, hi)
            cur_logp, _ = token_logp(self.model, batch, temperature, rows)
            out = policy_loss(
                LossInputs(
                    behav_logp=batch.behav_logp[rows],
                    prox_logp=prox_logp[rows],
                    cur_logp=cur_logp,
                    advantages=adv[rows],
                    mask=batch.mask[rows],
                    max_len=cfg.rollout.max_new_tokens,
                    group_index=batch.group_index[rows],
                    acrl_x=acrl_x,
                    acrl_y=acrl_y,
                ),
                cfg.loss,
            )
            self.optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
            loss_value = float(out.loss.detach())
            if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
                skipped = True
                break
            self.optimizer.step()
            metrics.update({k: v for k, v in out.metrics.items()})
            metrics["loss"] = loss_value
            metrics["grad_norm"] = grad_norm
        if skipped:
            self.skipped_steps += 1
            with torch.no_grad():
                for param, old in zip(self.model.parameters(), before):
                    param.copy_(old)
        quant_err = self._publish(step + 1) if not skipped else {"norm_quant_err": float("nan")}
        with torch.no_grad():
            delta = sum(float((p.detach() - o).pow(2).sum()) for p, o in zip(self.model.parameters(), before))
            base = sum(float(o.pow(2).sum()) for o in before)
        oldest = (batch.versions + (1 - batch.mask.long()) * 10**9).min(-1).values  # (B,) oldest token version
        staleness = (step - oldest).float()
        metrics.update(mismatch_metrics(batch.behav_logp, prox_logp, batch.mask, cfg.loss.cap))
        metrics.update(
            {
                "step": step,
                "version": step + 1 if not skipped else step,
                "reward/batch": float(batch.rewards.mean()),
                "acc/batch": float(batch.correct.mean()),
                "response_len/mean": float(lengths.mean()),
                "response_len/max": float(lengths.max()),
                "staleness/mean": float(staleness.mean()),
                "staleness/max": float(staleness.max()),
                "staleness/dropped": float(dropped_stale),
                "entropy": float((entropy * batch.mask).sum() / batch.mask.sum()),
                "lr": lr,
                **self.schedule.metrics(),
                "norm_update": delta / max(base, 1e-30),
                **quant_err,
                "skipped_steps": float(self.skipped_steps),
                "perf/train_s": time.monotonic() - started,
                "perf/fetch_wait_s": wait_s,
                "perf/batch_tokens": float(batch.mask.sum()),
            }
        )
        return metrics

    def save(self, out_dir: str) -> str:
        """Write a Hugging Face model directory (weights, config, tokenizer) atomically."""
        target = Path(out_dir)
        staging = target.with_name(target.name + ".tmp")
        self.model.save_pretrained(staging, safe_serialization=True)
        self.tokenizer.save_pretrained(staging)
        if target.exists():
            import shutil

            shutil.rmtree(target)
        staging.rename(target)
        return str(target)

    @torch.no_grad()
    def evaluate(self, prompts: list[str], answers: list[str], max_new_tokens: int) -> float:
        """Greedy accuracy of the current (full-precision) policy on held-out problems."""
        from asyncrl.tasks import make_source

        source = make_source(self.cfg.data)
        self.model.eval()
        correct = 0
        for lo in range(0, len(prompts), 64):
            chunk = prompts[lo : lo + 64]
            enc = self.tokenizer(chunk, return_tensors="pt", padding=True, padding_side="left")
            out = self.model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=self.pad_id)
            texts = self.tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            correct += sum(source.reward(t, a) for t, a in zip(texts, answers[lo : lo + 64]))
        self.model.train()
        return correct / max(len(prompts), 1)

    def close(self) -> None:
        self.publisher.close()
        self.client.close()
