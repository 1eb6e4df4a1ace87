"""The embedded PyTorch rollout engine: batched decode with a preallocated KV cache and version-tagged tokens.

This first version decodes one static batch per `generate` call (prompts left-padded, finished rows masked
until the whole batch ends); continuous batching arrives with the engine issue. What is already exact:

- every token's behavior log-prob is `log_softmax(logits / T)[token]` of the distribution it was drawn from,
  before top-k/top-p filtering (SGLang's convention);
- new weights are staged from any thread and swapped in between two decode steps; every token records the version
  of the weights that computed its logits (`in_place` mode: earlier KV entries keep their older weights).
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from quant_sync.quantizers import QuantizedWeight
from rollout_workers.embedded.model import ArchConfig, KVCache, forward
from rollout_workers.engine import Completion, SamplingParams, WeightUpdate

SCALE_SUFFIX = "_scale"


def build_weight_map(update: WeightUpdate) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Published tensors -> the forward's weight map: `X.weight` + `X.weight_scale` pairs become QuantizedWeight."""
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    for name, tensor in update.tensors.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = update.tensors.get(name + SCALE_SUFFIX)
        if scale is not None:
            weights[name] = QuantizedWeight(q=tensor, scale=scale, scheme=update.scheme)
        else:
            weights[name] = tensor.to(torch.float32)
    return weights


def filter_logits(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside top-k and the top-p nucleus of each row of log-probs (B, V)."""
    if top_k > 0 and top_k < logp.shape[-1]:
        kth = torch.topk(logp, top_k, dim=-1).values[:, -1:]
        logp = logp.masked_fill(logp < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
        cumulative = sorted_logp.softmax(-1).cumsum(-1)
        drop_sorted = cumulative - sorted_logp.softmax(-1) >= top_p  # keep the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logp = logp.masked_fill(drop, float("-inf"))
    return logp


class EmbeddedEngine:
    """See the module docstring. Thread-safe for `stage_weights`; `generate` runs on one thread at a time."""

    def __init__(self, model_dir: str | Path, max_batch: int = 256, seed: int = 0):
        self.arch = ArchConfig.from_model_dir(model_dir)
        self.max_batch = max_batch
        self._weights: dict[str, torch.Tensor | QuantizedWeight] | None = None
        self._version = -1
        self._staged: WeightUpdate | None = None
        self._lock = threading.Lock()
        self._generator = torch.Generator().manual_seed(seed)
        self.swaps = 0

    @property
    def version(self) -> int:
        return self._version

    def stage_weights(self, update: WeightUpdate) -> None:
        with self._lock:
            if self._staged is None or update.version > self._staged.version:
                self._staged = update

    def apply_staged(self) -> bool:
        """Swap in the staged version, if any (called between decode steps). Returns whether it swapped."""
        with self._lock:
            update, self._staged = self._staged, None
        if update is None or update.version <= self._version:
            return False
        self._weights = build_weight_map(update)
        self._version = update.version
        self.swaps += 1
        return True

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        self.apply_staged()
        if self._weights is None:
            raise RuntimeError("the engine has no weights yet: stage a version before generating")
        if params.seed is not None:
            self._generator.manual_seed(params.seed)
        batch = len(prompts)
        lengths = torch.tensor([len(p) for p in prompts])
        width = int(lengths.max())
        total = width + params.max_new_tokens
        if total > self.arch.max_positions:
            raise ValueError(f"prompt ({width}) + max_new_tokens ({params.max_new_tokens}) exceeds the model's "
                             f"max_position_embeddings ({self.arch.max_positions})")  # fmt: skip
        pad = width - lengths  # (B,) left padding
        tokens = torch.zeros((batch, width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            tokens[row, int(pad[row]) :] = torch.tensor(prompt, dtype=torch.long)
        slots = torch.arange(total)
        key_valid = slots[None, :] >= pad[:, None]  # (B, total)
        causal = slots[:width, None] >= slots[None, :width]
        prefill_mask = (causal[None] & key_valid[:, None, :width]) | torch.eye(width, dtype=torch.bool)[None]
        positions = (slots[None, :width] - pad[:, None]).clamp_min(0)
        cache = KVCache(self.arch, batch, total)
        logits = forward(self.arch, self._weights, tokens, positions, cache, 0, prefill_mask[:, None])
        stop_ids = torch.tensor(params.stop_token_ids or self.arch.eos_token_ids or (-1,))
        out_tokens = torch.zeros((batch, params.max_new_tokens), dtype=torch.long)
        out_logp = torch.zeros((batch, params.max_new_tokens), dtype=torch.float32)
        out_version = torch.zeros((batch, params.max_new_tokens), dtype=torch.int32)
        done = torch.zeros(batch, dtype=torch.bool)
        ended_at = torch.full((batch,), params.max_new_tokens, dtype=torch.long)
        for step in range(params.max_new_tokens):
            version = self._version  # the weights that computed `logits`
            logp = torch.log_softmax(logits / params.temperature, dim=-1)
            sample_logp = filter_logits(logp, params.top_k, params.top_p)
            token = torch.multinomial(sample_logp.exp(), 1, generator=self._generator).squeeze(1)
            out_tokens[:, step] = token
            out_logp[:, step] = logp.gather(1, token[:, None]).squeeze(1)
            out_version[:, step] = version
            newly_done = ~done & torch.isin(token, stop_ids)
            ended_at[newly_done] = step + 1
            done |= newly_done
            if bool(done.all()) or step + 1 == params.max_new_tokens:
                break
            self.apply_staged()  # the zero-pause swap point: between two decode steps
            slot = width + step
            mask = key_valid[:, None, None, : slot + 1]
            logits = forward(self.arch, self._weights, token[:, None], (lengths + step)[:, None], cache, slot, mask)
        completions = []
        for row in range(batch):
            n = int(ended_at[row])
            finish = (
                "stop" if n < params.max_new_tokens or bool(torch.isin(out_tokens[row, n - 1], stop_ids)) else "length"
            )
            completions.append(
                Completion(
                    response_ids=out_tokens[row, :n].tolist(),
                    behav_logp=out_logp[row, :n].tolist(),
                    versions=out_version[row, :n].tolist(),
                    finish=finish,
                )
            )
        return completions
