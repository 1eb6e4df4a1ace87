"""What `asyncrl serve` says about itself, in SGLang 0.5.9's shapes: `/model_info`, `/server_info`
(`/get_server_info`), `/get_load` and `/get_weights_by_name` (`entrypoints/http_server.py`; the routes are in
server_app.py).

- `/server_info` is SGLang's `{**dataclasses.asdict(server_args), **scheduler_info, "internal_states": [...],
  "version"}`. SGLang's ServerArgs has some 300 fields; we give the ones that mean something for the embedded engine,
  under SGLang's names and with SGLang's value for what we do not have (tp 1, no CUDA graphs, ...), so that a
  client reading `max_total_num_tokens`, `context_length`, `max_running_requests`, `quantization` or
  `internal_states[0]["memory_usage"]` finds them. `version` is the SGLang API version served ("0.5.9");
  `served_by` says what actually answers.
- The KV cache is `max_batch` slots of `max_seq_len` positions: `max_total_num_tokens` = their product (SGLang's
  token pool size), `max_req_input_len` = `context_length - 1` as SGLang computes it.
- `/get_weights_by_name` gives the first `truncate_size` rows of a weight as the engine serves it, as float32 lists:
  SGLang's Llama `get_weights_by_name` (`models/llama.py`), by Hugging Face name (`...q_proj.weight`, an `lm_head`
  tied to the embedding gives the embedding). Quantized linears give their int8 / e4m3 values in the checkpoint's
  (out, in) layout and their per-row `..._scale` (SGLang's w8a8_int8 holds the weight transposed after loading).
  It is read from the served checkpoint directory on each call: a testing route, as in SGLang.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout_workers.sglang_api.protocol import BadRequest

if TYPE_CHECKING:
    from rollout_workers.sglang_api.service import ModelService

SGLANG_API_VERSION = "0.5.9"
"""The SGLang release whose HTTP API `asyncrl serve` follows (docs/sglang.md lists every route)."""
QUANTIZATION = {"int8": "w8a8_int8", "fp8": "fp8", "none": None}
"""`--quant` -> SGLang's `--quantization`."""
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
"""SGLang's `GPU_MEMORY_ALL_TYPES`: what `/release_memory_occupation` may name."""
DECODE_LOG_INTERVAL = 40
"""Steps per `last_gen_throughput` measurement (SGLang's `--decode-log-interval` default)."""


class Throughput:
    """`last_gen_throughput`: tokens per second of engine steps, measured over DECODE_LOG_INTERVAL steps (idle time
    between steps does not count)."""

    def __init__(self) -> None:
        self.last = 0.0
        self._steps, self._tokens, self._seconds = 0, 0, 0.0

    def add(self, tokens: int, seconds: float) -> None:
        """One step that sampled `tokens` tokens (one per sequence in it) in `seconds`."""
        self._steps, self._tokens, self._seconds = self._steps + 1, self._tokens + tokens, self._seconds + seconds
        if self._steps >= DECODE_LOG_INTERVAL:
            self.last = self._tokens / max(self._seconds, 1e-9)
            self._steps, self._tokens, self._seconds = 0, 0, 0.0


class MemoryOccupation:
    """`/release_memory_occupation` and `/resume_memory_occupation` (SGLang frees GPU memory with its memory saver,
    for a colocated trainer). Here they are bookkeeping only: nothing is freed, since the engine's weights and KV
    cache are ordinary tensors with no memory saver to hand them back (releasing `kv_cache` empties the prefix
    cache, as SGLang flushes its radix cache), and requests keep being served. What SGLang
    refuses (a release while requests run, whose scheduler assertion fails; a resume of a tag not released) is
    answered 400, and the released tags show in `/server_info`'s `internal_states`."""

    def __init__(self) -> None:
        self.released: set[str] = set()

    def release(self, tags: list[str] | None, busy: bool) -> set[str]:
        """Record the tags released (returned); refused while requests run or wait (`busy`)."""
        named = self._named(tags)
        if busy:
            raise BadRequest("release_memory_occupation should be called only when no ongoing request.")
        self.released |= named
        return named

    def resume(self, tags: list[str] | None) -> None:
        named = self._named(tags)
        if named - self.released:
            raise BadRequest(f"resume_memory_occupation: {sorted(named - self.released)} were not released")
        self.released -= named

    @staticmethod
    def _named(tags: list[str] | None) -> set[str]:
        """The tags a request names (none or empty: all of them, as in SGLang)."""
        unknown = set(tags or ()) - set(MEMORY_TAGS)
        if unknown:
            raise BadRequest(f"memory tags must be among {', '.join(MEMORY_TAGS)}, got {sorted(unknown)}")
        return set(tags or MEMORY_TAGS)


def model_info(service: ModelService) -> dict[str, Any]:
    """`/model_info` (and the deprecated `/get_model_info`)."""
    arch = service.engine.arch
    return {
        "model_path": service.model_dir,
        "tokenizer_path": service.tokenizer_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": service.weight_version,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": arch.model_type,
        "architectures": service.architectures,
    }


def server_args(service: ModelService) -> dict[str, Any]:
    """SGLang's ServerArgs fields that describe this server (see the module docstring)."""
    engine = service.engine
    return {
        "model_path": service.model_dir,
        "tokenizer_path": service.tokenizer_path,
        "tokenizer_mode": "auto",
        "skip_tokenizer_init": False,
        "load_format": "auto",
        "trust_remote_code": False,
        "dtype": DTYPES.get(service.precision, service.precision),
        "kv_cache_dtype": "auto",
        "quantization": QUANTIZATION.get(service.quant),
        "context_length": engine.max_seq_len,
        "device": str(engine.device),
        "served_model_name": service.served_model_name,
        "is_embedding": False,
        "host": service.launch.get("host"),
        "port": service.launch.get("port"),
        "mem_fraction_static": None,
        "max_running_requests": engine.max_batch,
        "max_queued_requests": service.max_queued_requests,
        "max_total_tokens": engine.max_batch * engine.max_seq_len,
        "schedule_policy": "fcfs",
        "random_seed": service.seed,
        "tp_size": 1,
        "pp_size": 1,
        "dp_size": 1,
        "ep_size": 1,
        "stream_interval": 1,
        "weight_version": service.weight_version,
        "preferred_sampling_params": None,
        "enable_lora": False,
        "disable_radix_cache": not engine.prefix_cache_enabled,
        "disable_cuda_graph": True,
        "enable_memory_saver": False,
        "enable_deterministic_inference": False,
        "sampling_backend": "pytorch",
        "attention_backend": "torch_native",
        "page_size": 1,
        "log_level": "warning",
        "api_key": None,
    }


def server_info(service: ModelService) -> dict[str, Any]:
    """`/server_info` (and the deprecated `/get_server_info`), as SGLang 0.5.9 composes it."""
    engine, arch = service.engine, service.engine.arch
    args = server_args(service)
    tokens = engine.max_batch * engine.max_seq_len
    kv_bytes = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * tokens * engine.dtype.itemsize
    internal = {
        **args,
        "last_gen_throughput": service.throughput.last,
        "memory_usage": {
            "weight": round(service.weight_bytes / (1 << 30), 2),
            "kvcache": round(kv_bytes / (1 << 30), 2),
            "token_capacity": tokens,
            "graph": 0.0,
        },
        "effective_max_running_requests_per_dp": engine.max_batch,
        "released_memory_tags": sorted(service.memory.released),
    }
    return {
        **args,
        "status": "ready",
        "max_total_num_tokens": tokens,
        "max_req_input_len": min(engine.max_seq_len - 1, tokens - 1),
        "internal_states": [internal],
        "version": SGLANG_API_VERSION,
        "served_by": "asyncrl serve",
    }


def load_report(running: list[Any], waiting: list[list[Any]]) -> dict[str, Any]:
    """SGLang's `GetLoadReqOutput` of one scheduler, as its `/get_load` serializes it: requests running and
    waiting, tokens in the KV cache, `ts_tic` (`time.perf_counter()`); `dp_rank` is null without data parallelism,
    as in SGLang 0.5.9."""
    queued = sum(len(group) for group in waiting)
    return {
        "rid": None,
        "http_worker_ipc": None,
        "dp_rank": None,
        "num_reqs": len(running) + queued,
        "num_waiting_reqs": queued,
        "num_tokens": sum(len(req.seq.tokens) for req in running if req.seq is not None),
        "ts_tic": time.perf_counter(),
    }


def weights_by_name(model_dir: str, served: str, name: str, truncate_size: int, tied_head: bool) -> list | None:
    """The first `truncate_size` rows of weight `name` as served (float32 lists); None when there is no such
    weight (SGLang then answers 400 "Get parameter by name failed")."""
    from safetensors import safe_open

    from rollout_workers.sglang_api.checkpoint import checkpoint_scheme, rollout_tensors

    if name == "lm_head.weight" and tied_head:
        name = "model.embed_tokens.weight"  # SGLang's Llama: a tied head answers with the embedding
    base = name[: -len("_scale")] if name.endswith("weight_scale") else name
    stem = base[: -len("weight")] if base.endswith("weight") else base
    wanted = {base, base + "_scale", stem + "weight_scale_inv"}
    tensors = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as reader:
            for key in set(reader.keys()) & wanted:
                tensors[key] = reader.get_tensor(key)
    if base not in tensors:
        return None
    _, block = checkpoint_scheme(model_dir)
    value = rollout_tensors(tensors, served, block).get(name)
    if value is None:
        return None
    import torch

    return value.to(torch.float32).tolist()[:truncate_size]
