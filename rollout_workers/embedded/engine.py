"""The embedded PyTorch rollout engine: continuous batching over a slot KV cache, with version-tagged tokens.

A scheduler runs one `step` at a time:

    swap point -> (retract: recompute in-flight KV) -> admit queued groups (prefill) -> decode -> sample -> retire

- Sequences live in slots 0..n-1 of a preallocated KV cache (`max_batch` slots of `max_seq_len` positions, grown
  in powers of two up to `max_batch` as demand appears). A finished sequence frees its slot between two steps (the
  last active sequence moves into it) and a queued group joins with one prefill.
- `n` samples of one prompt share one prefill: its K/V is written to all n slots and its last logits feed n samples.
- Prefix cache (`prefix_cache`, embedded/prefix_cache.py): a retired sequence's K/V stays, within a token budget,
  keyed by its tokens; a prompt that begins with such tokens (a multi-turn episode's next turn, a shared system
  prompt, a repeated prompt) gets them copied into its slots and prefills only the rest, from that position
  (`Sequence.cached_tokens`). Entries hold the K/V of the running weights only: a swap empties the cache, and a
  sequence whose K/V spans a swap (`in_place`) is not kept. A hit's log-probs are a cold prefill's, to rounding.
- Every token's behavior log-prob is `log_softmax(logits / T)[token]` of the distribution it was drawn from,
  before top-k/top-p filtering (SGLang's convention), and its version is the version of the weights that computed
  those logits.
- New weights are staged from any thread and swapped in atomically between two decode steps, once their fused
  layout is built (between steps, a layer at a time, within half a step). `in_place`: in-flight
  sequences keep the K/V computed with older weights. `retract`: their K/V is recomputed with the new weights
  before the next decode step.
- Prompt log-probs (SGLang's input log-probs) come from the prefill that admits a prompt: `submit(...,
  prompt_logprobs_from=p)` runs the LM head and log-softmax over the final hidden states of positions p.. of just
  that prompt's row, a chunk of positions at a time (scoring.py), and stores them on its sequences. Such a prompt
  uses at most the first p positions of a prefix-cache hit (a cached position has no hidden state to score), so
  its scores are a cold prefill's to rounding. `max_new_tokens=0` sequences are prefilled (and scored) and end in
  the step they join, with no token drawn. A sequence can record the top-k of each distribution it draws from
  (`top_logprobs_num`) and keep its stop tokens out until `min_new_tokens`.
- Sampling is by inverse CDF with one uniform per (sequence, step) from a counter-based hash of the call's seed
  and the sequence's index, so a sequence's samples do not depend on what else is in the batch.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from common.config import SWAP_MODES
from quant_sync import adapter_buffers
from quant_sync.update import WeightUpdate
from rollout_workers.embedded.low_rank import _native_lora, native_dequantizer
from rollout_workers.embedded.model import (
    DTYPES,
    ArchConfig,
    KVCache,
    ModelWeights,
    Prompts,
    forward_step,
    prefill,
)
from rollout_workers.embedded.penalties import apply_penalties
from rollout_workers.embedded.prefix_cache import PrefixCache
from rollout_workers.embedded.sampling import (  # noqa: F401 - re-exported: _uniform
    _uniform,
    filter_logits,
    mask_early_stops,
    record_top,
    sample_key,
    uniforms,
)
from rollout_workers.embedded.scoring import score_positions
from rollout_workers.embedded.sequence import Sequence, _Group
from rollout_workers.embedded.staging import SCALE_SUFFIX, StagedVersions, build_weight_map  # noqa: F401
from rollout_workers.engine import Completion, SamplingParams

PREFIX_CACHE_SHARE = 4
"""The prefix cache keeps up to max_batch * max_seq_len / PREFIX_CACHE_SHARE positions of retired sequences' K/V
(allocated as they retire: a quarter of what the full KV cache would hold)."""
PREFIX_CACHE_MIN_TOKENS = 256
BUILD_SLICE_MIN_S = 0.01
BUILD_SLICE_OF_STEP = 0.3
"""Build work between two steps, as a fraction of a step: the swap gap stays under 1.3 steps plus one build part
(target <= 2; at 0.5 a build part (half a layer) past the budget and a noisy neighbour reached 2 once steps got
faster, hidden-1024 INT8 at batch 16: 45 ms)."""


class EmbeddedEngine:
    """See the module docstring; implements `rollout_workers.engine.Engine`. Thread-safe for `stage_weights`;
    `generate`/`step` run on one thread at a time."""

    def __init__(
        self,
        model_dir: str | Path,
        max_batch: int = 256,
        seed: int = 0,
        swap_mode: str = "in_place",
        max_seq_len: int = 2048,
        precision: str = "fp32",
        device: str = "cpu",
        prefix_cache: bool = True,
    ):
        if swap_mode not in SWAP_MODES:
            raise ValueError(f"rollout.swap_mode {swap_mode!r} is not one of {', '.join(SWAP_MODES)}")
        adapter_buffers.use_native(native_dequantizer)  # int8 adapter versions decode in one native pass
        if precision not in DTYPES:
            raise ValueError(f"precision.rollout {precision!r} is not one of {', '.join(DTYPES)}")
        self.dtype = DTYPES[precision]
        """Compute dtype of everything but quantized linears (those run their scheme's numerics, output cast)."""
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"rollout.device={device}: torch sees no CUDA device on this machine")
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"rollout.device {device!r} is not supported (cpu, cuda, cuda:N)")
        self.arch = ArchConfig.from_model_dir(model_dir)
        self.arch.check_embedded(model_dir)
        self.max_batch = max_batch
        # a sliding window's attention equals full attention up to the window: past it the learner's would differ
        self.max_seq_len = min(max_seq_len, self.arch.max_positions, self.arch.sliding_window or max_seq_len)
        self.swap_mode = swap_mode
        self._weights: ModelWeights | None = None
        self._version = -1
        self._versions = StagedVersions(self.arch, self.dtype, self.device)
        self._step_seconds = 0.0  # moving average of a step's compute time: sizes the build slices
        self._generator = torch.Generator().manual_seed(seed)
        self._cache: KVCache | None = None
        self._active: list[Sequence] = []  # active[i] lives in cache slot i
        self._queue: deque[_Group] = deque()
        self.swaps = 0
        self.build_errors = 0
        """Staged versions dropped because their build failed (the running version kept decoding)."""
        self.fatal = ""  # the Engine protocol's: an embedded engine always can generate
        self.last_build_error = ""
        self.retracted_tokens = 0
        """Tokens whose K/V was recomputed after a swap (retract mode)."""
        self.before_step: Callable[[], object] | None = None
        """Called before each scheduler step: a worker on the learner's machine waits here while the learner trains
        on every core (`common.train_gate`)."""
        budget = max(PREFIX_CACHE_MIN_TOKENS, max_batch * self.max_seq_len // PREFIX_CACHE_SHARE)
        self.prefix_cache = PrefixCache(budget)
        self.prefix_cache_enabled = prefix_cache
        self.prefill_tokens = 0
        """Prompt tokens prefilled (the prefix cache's hits not included)."""
        self.cached_tokens = 0
        """Prompt tokens whose prefill a prefix-cache hit saved (summed over samples sharing a prefill: once)."""
        self.prefix_hits = 0

    @property
    def version(self) -> int:
        return self._version

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The model's EOS ids (`eos_token_id` of its config.json)."""
        return tuple(self.arch.eos_token_ids)

    def stats(self) -> dict[str, Any]:
        """Prefill counters beyond the protocol's (`version`, `swaps`, `build_errors`): tokens prefilled and tokens
        a prefix-cache hit saved, summed per prefill (n samples of one prompt share one)."""
        return {"prefill_tokens": self.prefill_tokens, "prefix_cached_tokens": self.cached_tokens,
                "prefix_hits": self.prefix_hits}  # fmt: skip

    def flush_prefix_cache(self) -> None:
        """Forget every prefix-cache entry (SGLang's `/flush_cache`)."""
        self.prefix_cache.clear()

    def close(self) -> None:
        """Nothing to release: the KV cache and weights are freed with the engine."""

    @property
    def num_active(self) -> int:
        """Sequences in the KV cache: each decodes one token in the next step."""
        return len(self._active)

    @property
    def busy(self) -> bool:
        return bool(self._active or self._queue)

    @property
    def runs_int8_adapters(self) -> bool:
        """Whether int8 LoRA adapters run as they are (csrc/lora_gemm.cpp `lr_apply_q8`: AVX-512F, fp32 on the CPU):
        its subscriber then hands packed int8 versions over undecoded (`keep_int8_adapters`)."""
        return self.device.type == "cpu" and self.dtype == torch.float32 and _native_lora() is not None

    def stage_weights(self, update: WeightUpdate) -> None:
        """Hand over a version (any thread). A bad tensor set fails here, on the caller's thread."""
        self._versions.stage(update)

    @property
    def last_build_s(self) -> float:
        """Decode-thread time the last swapped-in version took to build (summed over its slices)."""
        return self._versions.last_build_s

    def apply_staged(self) -> bool:
        """Advance the build of the staged version and swap it in when complete. Returns whether it swapped.

        Called between decode steps; the build runs here, a slice of a step's duration at a time (staging.py);
        when idle, it completes at once.
        """
        budget = max(BUILD_SLICE_MIN_S, BUILD_SLICE_OF_STEP * self._step_seconds) if self._active else float("inf")
        built = self._versions.advance(self._version, budget)
        if built is None:
            return False
        self._version, self._weights = built
        self.swaps += 1
        self.prefix_cache.clear()  # its K/V was computed by the weights just replaced
        return True

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        keys: list[int],
        top_logprobs_num: int = 0,
        min_new_tokens: int = 0,
        prompt_logprobs_from: int = -1,
        prompt_logprobs_temperature: float = 1.0,
    ) -> list[Sequence]:
        """Queue len(keys) samples of one prompt (one shared prefill); returns their sequences. With
        `top_logprobs_num` k > 0 each sampled token also records the k most likely tokens of its distribution; with
        `min_new_tokens` m no stop token is drawn before the m-th token. With `prompt_logprobs_from` p >= 0 the
        prefill also scores prompt tokens p + 1.. (`Sequence.prompt_logp`, with k > 0 `prompt_top_logprobs`) under
        `log_softmax(logits / prompt_logprobs_temperature)`."""
        self._check(prompt, params)
        if not -1 <= prompt_logprobs_from < len(prompt):
            raise ValueError(f"prompt_logprobs_from ({prompt_logprobs_from}) must lie in [-1, {len(prompt)}) "
                             "(the prompt's length)")  # fmt: skip
        if prompt_logprobs_temperature <= 0:
            raise ValueError(f"prompt_logprobs_temperature must be > 0 (got {prompt_logprobs_temperature})")
        stop_ids = frozenset(params.stop_token_ids or self.arch.eos_token_ids)
        extra = {"top_logprobs_num": top_logprobs_num, "min_new_tokens": min_new_tokens,
                 "prompt_logprobs_from": prompt_logprobs_from,
                 "prompt_logprobs_temperature": prompt_logprobs_temperature}  # fmt: skip
        samples = [Sequence(list(prompt), len(prompt), params, stop_ids, key, **extra) for key in keys]
        for start in range(0, len(samples), self.max_batch):
            self._queue.append(_Group(list(prompt), samples[start : start + self.max_batch]))
        return samples

    @torch.inference_mode()
    def abort(self, sequences: list[Sequence]) -> list[Sequence]:
        """End these sequences between two steps with finish="abort" and what they have; frees their slots.

        Queued samples leave the queue; active ones leave the KV cache. Returns the sequences it ended.
        """
        targets = {id(seq) for seq in sequences if seq.completion is None}
        if not targets:
            return []
        ended: list[Sequence] = []
        for group in list(self._queue):
            kept = [seq for seq in group.samples if id(seq) not in targets]
            ended.extend(seq for seq in group.samples if id(seq) in targets)
            if not kept:
                self._queue.remove(group)
            group.samples = kept
        active = [seq for seq in self._active if id(seq) in targets]
        for seq in ended + active:
            seq.completion = Completion(seq.response, seq.logp, seq.versions, finish="abort")
        self._retire(active)
        return ended + active

    @torch.inference_mode()
    def swap_now(self, recompute_kv: bool = False) -> bool:
        """Finish building the staged version and swap it in now (for a paused scheduler); returns whether it swapped.

        With `recompute_kv` the in-flight sequences' K/V is recomputed with the new weights (SGLang's `retract`).
        """
        swapped = False
        with self._device_scope():
            while self._versions.pending and not swapped:
                swapped = self.apply_staged()
            if swapped and recompute_kv and self._active:
                self._retract()
        return swapped

    def _check(self, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise ValueError("empty prompt: the embedded engine needs at least one prompt token")
        if params.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0 (got {params.max_new_tokens})")
        if len(prompt) + params.max_new_tokens > self.max_seq_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({params.max_new_tokens}) exceeds the engine's "
                             f"max sequence length ({self.max_seq_len}, max_position_embeddings "
                             f"{self.arch.max_positions})")  # fmt: skip
        if params.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (got {params.temperature}); use a small value for greedy")
        if max(prompt) >= self.arch.vocab_size or min(prompt) < 0:
            raise ValueError(f"prompt token ids must lie in [0, {self.arch.vocab_size}) (vocab_size)")

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Queue every prompt (identical prompts share a prefill) and step until all are done."""
        if params.seed is not None:
            self._generator.manual_seed(params.seed)
        base = int(torch.randint(0, 1 << 62, (1,), generator=self._generator, device="cpu"))
        positions: dict[tuple[int, ...], list[int]] = {}
        for index, prompt in enumerate(prompts):
            positions.setdefault(tuple(prompt), []).append(index)
        for prompt in positions:  # all or nothing: a bad prompt must not leave the others queued
            self._check(list(prompt), params)
        out: list[Sequence | None] = [None] * len(prompts)
        for prompt, indices in positions.items():
            keys = [sample_key(base, index) for index in indices]
            for index, seq in zip(indices, self.submit(list(prompt), params, keys)):
                out[index] = seq
        while any(seq.completion is None for seq in out):  # type: ignore[union-attr]
            self.step()
        return [seq.completion for seq in out]  # type: ignore[union-attr,misc]

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """One scheduler step (see the module docstring); returns the sequences that finished in it.

        Tensors made during the step are created on the engine's device (`torch.device` as the default device).
        """
        if self.before_step is not None:
            self.before_step()
        with self._device_scope():
            return self._step()

    def _device_scope(self) -> contextlib.AbstractContextManager:
        """The engine's device as the default one, entered only when it is not already: a `torch.device` context is a
        Python hook on every torch call (measured: 40% of a builtin:tiny decode step on CPU)."""
        if self.device == torch.get_default_device():
            return contextlib.nullcontext()
        return self.device

    def _step(self) -> list[Sequence]:
        try:
            swapped = self.apply_staged()
        except Exception as err:  # the version was dropped (apply_staged); decoding goes on with the running one
            swapped = False
            self.build_errors += 1
            self.last_build_error = f"{type(err).__name__}: {err}"[:300]
            print(f"embedded engine: a weight version failed to build and was dropped: {err}", file=sys.stderr)
        if swapped and self.swap_mode == "retract" and self._active:
            self._retract()
        if self._weights is None:
            raise RuntimeError("the engine has no weights yet: stage a version before generating")
        weights, version = self._weights, self._version
        started = time.perf_counter()
        decoding = list(self._active)
        joining = self._admit()
        if not decoding and not joining:
            return []
        running = None
        if decoding:
            tokens = torch.tensor([seq.tokens[-1] for seq in decoding])
            positions = torch.tensor([len(seq.tokens) - 1 for seq in decoding])
            running = (tokens, positions)
        prompts = self._prompts(joining, len(decoding), self._cache) if joining else None  # type: ignore[arg-type]
        scoring = any(group.samples and group.samples[0].prompt_logprobs_from >= 0 for group in joining)
        hidden: list[torch.Tensor] | None = [] if scoring else None
        # one forward for both: the joining prompts ride along with the decode step (see model.forward_step)
        logits = forward_step(self.arch, weights, self._cache, running, prompts, prompt_hidden=hidden)  # type: ignore
        assert logits is not None
        if prompts is not None:  # one row per prompt -> one per sample (n samples share a prompt's prefill)
            logits = torch.cat((logits[: len(decoding)], logits[len(decoding) :][prompts.slot_rows]))
        if hidden:
            self._score_prompts(weights, joining, prompts, hidden[0])  # type: ignore[arg-type]
        unsampled = [row for row, seq in enumerate(self._active) if seq.params.max_new_tokens == 0]
        if unsampled:  # scoring-only sequences: prefilled, no token drawn
            ended = [self._active[row] for row in unsampled]
            for seq in ended:
                seq.completion = Completion(response_ids=[], behav_logp=[], versions=[], finish="length")
            rows = [row for row, seq in enumerate(self._active) if seq.params.max_new_tokens > 0]
            sampled = [self._active[row] for row in rows]
            finished = ended + (self._sample(logits[torch.tensor(rows)], version, sampled) if rows else [])
        else:
            finished = self._sample(logits, version)
        self._retire(finished)
        self._step_seconds = 0.8 * self._step_seconds + 0.2 * (time.perf_counter() - started)
        return finished

    def _score_prompts(
        self, weights: ModelWeights, groups: list[_Group], prompts: Prompts, hidden: torch.Tensor
    ) -> None:
        """Prompt log-probs of the groups that ask for them, from their prefill's hidden states (M, S, hidden)."""
        for row, group in enumerate(groups):
            first = group.samples[0] if group.samples else None
            if first is None or first.prompt_logprobs_from < 0:
                continue
            begin = first.prompt_logprobs_from
            offset = 0 if prompts.starts is None else int(prompts.starts[row])
            assert offset <= begin, "a scored prompt's prefix-cache hit must end at or before its first scored position"
            states = hidden[row, begin - offset : len(group.prompt) - 1 - offset]
            values, tops = score_positions(weights.head, states, group.prompt[begin + 1 :],
                                           first.prompt_logprobs_temperature, first.top_logprobs_num,
                                           self.arch.vocab_size)  # fmt: skip
            for seq in group.samples:
                seq.prompt_logp, seq.prompt_top_logprobs = values, tops

    def _ensure_cache(self, slots: int) -> KVCache:
        cache = self._cache
        if cache is not None and cache.slots >= slots:
            return cache
        size = min(self.max_batch, 1 << max(slots - 1, 1).bit_length())
        with self.device:
            grown = KVCache(self.arch, size, self.max_seq_len, self.dtype)
        if cache is not None and self._active:
            n = len(self._active)
            grown.keys[:, :n] = cache.keys[:, :n]
            grown.values[:, :n] = cache.values[:, :n]
        self._cache = grown
        return grown

    def _admit(self) -> list[_Group]:
        joining: list[_Group] = []
        free = self.max_batch - len(self._active)
        while self._queue and len(self._queue[0].samples) <= free:
            group = self._queue.popleft()
            free -= len(group.samples)
            joining.append(group)
        if joining:
            self._ensure_cache(self.max_batch - free)
            for group in joining:
                self._active.extend(group.samples)
        return joining

    def _prompts(self, groups: list[_Group], first_slot: int, cache: KVCache) -> Prompts:
        """Each group's prompt, prefilled once into the slots of all its samples from `first_slot` on (its
        `slot_rows` give each sample's prompt row). A prompt's prefix found in the prefix cache is copied into its
        slots and only the rest is prefilled, from that position."""
        starts = [0] * len(groups)
        slot = first_slot
        for row, group in enumerate(groups):
            entry, starts[row] = self.prefix_cache.match(group.prompt) if self.prefix_cache_enabled else (None, 0)
            score_from = group.samples[0].prompt_logprobs_from if group.samples else -1
            if 0 <= score_from < starts[row]:  # a scored position needs its hidden state: prefill from there on
                starts[row] = score_from
                entry = entry if score_from > 0 else None
            for seq in group.samples:
                seq.kv_swaps, seq.cached_tokens = self.swaps, starts[row]
                if entry is not None:
                    cache.write_prefix(slot, entry.keys, entry.values, starts[row])
                slot += 1
            self.prefix_hits += entry is not None
        lengths = torch.tensor([len(group.prompt) - start for group, start in zip(groups, starts)])
        tokens = torch.zeros((len(groups), int(lengths.max())), dtype=torch.long)
        for row, (group, start) in enumerate(zip(groups, starts)):
            tokens[row, : len(group.prompt) - start] = torch.tensor(group.prompt[start:])
        counts = torch.tensor([len(group.samples) for group in groups])
        rows = torch.repeat_interleave(torch.arange(len(groups)), counts)
        slots = torch.arange(first_slot, first_slot + len(rows))
        self.prefill_tokens += int(lengths.sum())
        self.cached_tokens += sum(starts)
        return Prompts(tokens, lengths, rows, slots, torch.tensor(starts) if any(starts) else None)

    def _retract(self) -> None:
        """Recompute the K/V of every in-flight sequence with the new weights (all tokens but the pending one)."""
        history = [seq.tokens[:-1] for seq in self._active]
        lengths = torch.tensor([len(tokens) for tokens in history])
        tokens = torch.zeros((len(history), int(lengths.max())), dtype=torch.long)
        for row, ids in enumerate(history):
            tokens[row, : len(ids)] = torch.tensor(ids)
        slots = torch.arange(len(history))
        prefill(self.arch, self._weights, self._cache, tokens, lengths, slots, slots, need_logits=False)  # type: ignore
        self.retracted_tokens += int(lengths.sum())
        for seq in self._active:
            seq.kv_swaps = self.swaps

    def _sample(self, logits: torch.Tensor, version: int, active: list[Sequence] | None = None) -> list[Sequence]:
        """Draw one token per active sequence (or per one of `active`) from its logits row; append token, log-prob,
        version."""
        active = self._active if active is None else active
        by_params: dict[int, list[int]] = {}
        for row, seq in enumerate(active):
            by_params.setdefault(id(seq.params), []).append(row)
        tokens = torch.empty(len(active), dtype=torch.long)
        token_logp = torch.empty(len(active), dtype=torch.float32)
        for rows in by_params.values():
            params = active[rows[0]].params
            index = torch.tensor(rows) if len(rows) < len(active) else None
            part = logits if index is None else logits[index]
            part = self._mask_early_stops(part, [active[row] for row in rows])
            part = apply_penalties(part, params, [active[row] for row in rows])
            logp = torch.log_softmax(part / params.temperature if params.temperature != 1.0 else part, dim=-1)
            filtered = filter_logits(logp, params.top_k, params.top_p, params.min_p)
            cdf = filtered.exp().cumsum(-1)
            draws = uniforms([active[row].key for row in rows], [len(active[row].logp) for row in rows])
            picked = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None]).clamp_max(cdf.shape[-1] - 1)
            chosen_logp = logp.gather(1, picked).squeeze(1)
            self._record_top(logp, [active[row] for row in rows])
            if index is None:
                tokens, token_logp = picked.squeeze(1), chosen_logp
            else:
                tokens[index], token_logp[index] = picked.squeeze(1), chosen_logp
        finished = []
        for seq, token, token_lp in zip(active, tokens.tolist(), token_logp.tolist()):
            seq.tokens.append(token)
            seq.logp.append(token_lp)
            seq.versions.append(version)
            stopped = token in seq.stop_ids
            if stopped or len(seq.logp) >= seq.params.max_new_tokens:
                seq.completion = Completion(
                    response_ids=seq.response, behav_logp=seq.logp, versions=seq.versions,
                    finish="stop" if stopped else "length",
                )  # fmt: skip
                finished.append(seq)
        return finished

    _mask_early_stops = staticmethod(mask_early_stops)
    _record_top = staticmethod(record_top)

    def _retire(self, finished: list[Sequence]) -> None:
        """Free the slots of finished sequences: the last active sequences move into the holes."""
        if not finished:
            return
        done = set(map(id, finished))
        active = self._active
        if self.prefix_cache_enabled:  # keep their K/V (tokens but the last, never fed) before slots are reused
            cache = self._cache
            for slot, seq in enumerate(active):
                if id(seq) in done and seq.kv_swaps == self.swaps:
                    self.prefix_cache.retain(seq.tokens[:-1], cache.keys[:, slot], cache.values[:, slot])  # type: ignore
        slot = 0
        while slot < len(active):
            if id(active[slot]) not in done:
                slot += 1
                continue
            last = active[-1]
            if slot < len(active) - 1 and id(last) not in done:  # move the last sequence into the hole
                self._cache.copy_slot(len(active) - 1, slot, len(last.tokens) - 1)  # type: ignore[union-attr]
            active.pop()  # only once its K/V is safe: a failed copy leaves the bookkeeping as it was
            if slot < len(active):
                active[slot] = last
        self._active = active
