"""SGLang 0.5.x's native HTTP API as both our sides speak it: paths, response shapes, errors (the request bodies are
pydantic models in schemas.py).

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
  and with `return_logprob` `output_token_logprobs` and `input_token_logprobs` (from `logprob_start_len`, the first
  always null) as `[logprob, token_id, text or null]` triples, with `top_logprobs_num > 0` also
  `input_top_logprobs` / `output_top_logprobs` (a list of triples per position).

One extension of ours: `meta_info["weight_versions"]`, run-length spans `[[version, n_tokens], ...]` giving the
weight version of every output token. SGLang does not send it; the client falls back to `weight_version`.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

SERVED_SCHEMES = ("none", "int8", "fp8")
"""The weight schemes `asyncrl serve` and the SGLang backend serve (SGLang's w8a8_int8 and FP8 block formats)."""

PauseMode = Literal["abort", "retract", "in_place"]
"""`/pause_generation`'s modes: `abort` ends the running requests, `retract` and `in_place` keep them."""
PAUSE_MODES: tuple[str, ...] = get_args(PauseMode)
WEIGHT_VERSIONS_KEY = "weight_versions"
TOP_K_ALL = -1


class BadRequest(ValueError):
    """A request SGLang would answer 400; `validation` picks the error shape (pydantic vs. ValueError)."""

    def __init__(self, message: str, validation: bool = False):
        super().__init__(message)
        self.validation = validation


QUEUE_FULL = "The request queue is full."
"""SGLang's words for a request its scheduler refuses at admission (`--max-queued-requests`)."""


class QueueFull(Exception):
    """A non-streaming request refused at admission: `--max-queued-requests` requests already wait. SGLang answers
    503: FastAPI's `{"detail"}` on `/generate`, its OpenAI error body (`type` "503", `code` 503) on `/v1/...`."""

    def __init__(self) -> None:
        super().__init__(QUEUE_FULL)


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
