"""SGLang 0.5.x's native HTTP API as both our sides speak it: paths, request fields, response shapes, errors.

Established from SGLang's source (paths are in sgl-project/sglang; details and caveats in docs/sglang.md):

- `entrypoints/http_server.py`: `POST|PUT /generate` takes `GenerateReqInput`; a `ValueError` while handling it is
  answered 400 `{"error": {"message": ...}}`; a body that does not validate is answered 400 with
  `{"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}` (FastAPI's 422 overridden).
  `/pause_generation` takes `{"mode": "abort" | "retract" | "in_place"}` (default `abort`) and answers
  `{"message": "Generation paused successfully.", "status": "ok"}`; `/continue_generation` likewise.
  `/update_weights_from_disk` answers `{"success", "message", "num_paused_requests"}`, 200 or 400.
  `/get_model_info` gives `model_path`, `tokenizer_path`, `is_generation`, `preferred_sampling_params`,
  `weight_version`. `/flush_cache` answers text, 200, or 400 while requests run. Unknown paths: 404
  `{"detail": "Not Found"}` (FastAPI).
- `managers/io_struct.py`: `GenerateReqInput` (`text` | `input_ids`, `sampling_params`, `return_logprob`,
  `logprob_start_len`, `top_logprobs_num`, `return_text_in_logprobs`, `stream`, `rid`), `PauseGenerationReqInput`,
  `UpdateWeightFromDiskReqInput` (`model_path`, `load_format`, `abort_all_requests`, `weight_version`, ...),
  `UpdateWeightsFromDistributedReqInput` (`names`, `dtypes`, `shapes`, `group_name`, `flush_cache`,
  `abort_all_requests`, `weight_version`), `InitWeightsUpdateGroupReqInput`.
- `sampling/sampling_params.py`: `max_new_tokens` (128), `temperature` (1.0; below 1e-6 means greedy),
  `top_p`, `top_k` (-1: all), `stop_token_ids`, `n`, `ignore_eos`, `sampling_seed`, ...; `verify` raises ValueError.
- `managers/schedule_batch.py`: finish reasons `{"type": "stop", "matched": id | str}`,
  `{"type": "length", "length": n}`, `{"type": "abort", "message", "status_code", "err_type"}`.
- `managers/tokenizer_manager.py`: `meta_info` has `id`, `finish_reason`, `prompt_tokens`, `weight_version` (a
  string, the server's version when the response is built), `completion_tokens`, `cached_tokens`, `e2e_latency`,
  and with `return_logprob` `output_token_logprobs` as `[logprob, token_id, text or null]` triples.

One extension of ours: `meta_info["weight_versions"]`, run-length spans `[[version, n_tokens], ...]` giving the
weight version of every output token. SGLang does not send it; the client falls back to `weight_version`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

PAUSE_MODES = ("abort", "retract", "in_place")
WEIGHT_VERSIONS_KEY = "weight_versions"
TOP_K_ALL = -1
SAMPLING_KEYS = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "n",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "sampling_seed",
    "min_new_tokens",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "stream_interval",
    "stop_regex",
    "logit_bias",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "custom_params",
}
"""Every key SGLang's SamplingParams accepts; `asyncrl serve` runs the ones `parse_sampling` lets through."""


class BadRequest(ValueError):
    """A request SGLang would answer 400; `validation` picks the error shape (pydantic vs. ValueError)."""

    def __init__(self, message: str, validation: bool = False):
        super().__init__(message)
        self.validation = validation


def error_body(message: str, validation: bool) -> dict[str, Any]:
    """SGLang's 400 bodies: validation errors (FastAPI's, overridden to 400) or a ValueError from handling."""
    if validation:
        return {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
    return {"error": {"message": message}}


def finish_stop(matched: int | str) -> dict[str, Any]:
    return {"type": "stop", "matched": matched}


def finish_length(length: int) -> dict[str, Any]:
    return {"type": "length", "length": length}


def finish_abort(message: str = "Aborted", status_code: int | None = None) -> dict[str, Any]:
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": None}


@dataclass(slots=True)
class Sampling:
    """The sampling parameters of one request, after SGLang's defaults and checks."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None


@dataclass(slots=True)
class GenerateRequest:
    """A parsed `/generate` body: one entry per prompt (before `n` expands it)."""

    prompts: list[list[int] | str]
    sampling: list[Sampling]
    rids: list[str] | None
    single: bool
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def _number(values: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    value = values.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise BadRequest(f"sampling_params.{key}: expected {kind.__name__}, got {value!r}"[:300], validation=True)
    if isinstance(value, int) and not -(2**63) <= value < 2**63:  # a float would overflow, torch would refuse it
        raise BadRequest(f"sampling_params.{key}: {str(value)[:40]}... is out of range", validation=True)
    return kind(value)


def parse_sampling(values: dict[str, Any]) -> Sampling:
    """SGLang's SamplingParams defaults and `verify` for the keys `asyncrl serve` runs; others are refused."""
    if not isinstance(values, dict):
        raise BadRequest(f"sampling_params must be an object, got {type(values).__name__}", validation=True)
    unknown = sorted(set(values) - SAMPLING_KEYS)
    if unknown:
        raise BadRequest(f"unknown sampling_params: {', '.join(unknown)}")
    defaults = {
        "min_p": 0.0,
        "min_new_tokens": 0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "repetition_penalty": 1.0,
    }
    for key, neutral in defaults.items():
        if values.get(key) not in (None, neutral):
            raise BadRequest(f"sampling_params.{key}={values[key]!r} is not supported by asyncrl serve")
    for key in ("stop", "stop_regex", "logit_bias", "json_schema", "regex", "ebnf", "structural_tag"):
        if values.get(key):
            raise BadRequest(f"sampling_params.{key} is not supported by asyncrl serve (use stop_token_ids)")
    sampling = Sampling(
        max_new_tokens=_number(values, "max_new_tokens", int, 128),
        temperature=_number(values, "temperature", float, 1.0),
        top_p=_number(values, "top_p", float, 1.0),
        top_k=_number(values, "top_k", int, TOP_K_ALL),
        n=_number(values, "n", int, 1),
        ignore_eos=bool(values.get("ignore_eos") or False),
        skip_special_tokens=values.get("skip_special_tokens") is not False,
        sampling_seed=_number(values, "sampling_seed", int, None),
    )
    stop_ids = values.get("stop_token_ids") or ()
    if not isinstance(stop_ids, (list, tuple)) or not all(isinstance(t, int) for t in stop_ids):
        raise BadRequest(f"sampling_params.stop_token_ids must be a list of ints, got {stop_ids!r}", validation=True)
    sampling.stop_token_ids = tuple(stop_ids)
    if sampling.sampling_seed is not None and sampling.sampling_seed < 0:
        raise BadRequest(f"sampling_seed must be at least 0, got {sampling.sampling_seed}.")
    if not math.isfinite(sampling.temperature) or sampling.temperature < 0.0:
        raise BadRequest(f"temperature must be a non-negative finite number, got {sampling.temperature}.")
    if not 0.0 < sampling.top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {sampling.top_p}.")
    if sampling.top_k < 1 and sampling.top_k != TOP_K_ALL:
        raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {sampling.top_k}.")
    if sampling.max_new_tokens < 0:
        raise BadRequest(f"max_new_tokens must be at least 0, got {sampling.max_new_tokens}.")
    if sampling.n < 1:
        raise BadRequest(f"n must be at least 1, got {sampling.n}.")
    return sampling


def parse_generate(body: Any) -> GenerateRequest:
    """Validate a `/generate` body as SGLang's GenerateReqInput does (single or batch, `text` or `input_ids`)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", validation=True)
    for key in ("stream",):
        if body.get(key):
            raise BadRequest(f"{key}=true is not supported by asyncrl serve")
    if body.get("logprob_start_len") not in (None, -1) or body.get("top_logprobs_num") not in (None, 0):
        raise BadRequest("asyncrl serve returns output-token logprobs only (logprob_start_len=-1, top_logprobs_num=0)")
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")
    if text is not None:
        if isinstance(text, str):
            prompts, single = [text], True
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            prompts, single = list(text), False
        else:
            raise BadRequest("text must be a string or a non-empty list of strings", validation=True)
    else:
        if not isinstance(input_ids, list):
            raise BadRequest("input_ids must be a list of ints or a list of lists of ints", validation=True)
        if len(input_ids) == 0:
            raise BadRequest("input_ids cannot be empty.")
        single = isinstance(input_ids[0], int)
        prompts = [input_ids] if single else input_ids
        for ids in prompts:
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise BadRequest("input_ids must be a list of ints or a list of lists of ints", validation=True)
    raw = body.get("sampling_params")
    raw_list = raw if isinstance(raw, list) else [raw or {}] * len(prompts)
    if len(raw_list) != len(prompts):
        raise BadRequest("The length of sampling_params should be equal to the batch size.")
    sampling = [parse_sampling(values or {}) for values in raw_list]
    if len({s.n for s in sampling}) > 1:
        raise BadRequest("The parallel_sample_num should be the same for all samples in sample params.")
    rid = body.get("rid")
    rids: list[str] | None = None
    if isinstance(rid, str):
        rids = [rid] if single and sampling[0].n == 1 else [f"{rid}_{i}" for i in range(len(prompts) * sampling[0].n)]
    elif isinstance(rid, list):
        if len(rid) != len(prompts):
            raise BadRequest("The specified rids length mismatch with the batch_size for batch processing.")
        rids = [str(r) for r in rid] if sampling[0].n == 1 else None
    elif rid is not None:
        raise BadRequest("The rid should be a string or a list of strings.")
    return GenerateRequest(
        prompts=prompts,
        sampling=sampling,
        rids=rids,
        single=single and sampling[0].n == 1,
        return_logprob=bool(body.get("return_logprob")),
        return_text_in_logprobs=bool(body.get("return_text_in_logprobs")),
    )


def version_spans(versions: list[Any]) -> list[list[Any]]:
    """Per-token version labels -> run-length spans `[[label, n_tokens], ...]` (our `weight_versions` extension)."""
    spans: list[list[Any]] = []
    for version in versions:
        if spans and spans[-1][0] == str(version):
            spans[-1][1] += 1
        else:
            spans.append([str(version), 1])
    return spans


def expand_spans(spans: list[list[Any]], n_tokens: int) -> list[int]:
    """`weight_versions` spans -> one integer version per token; raises ValueError if they do not cover n_tokens."""
    versions = [int(version) for version, count in spans for _ in range(int(count))]
    if len(versions) != n_tokens:
        raise ValueError(f"weight_versions cover {len(versions)} tokens, the response has {n_tokens}")
    return versions
