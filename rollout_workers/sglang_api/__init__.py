"""SGLang's HTTP API: `asyncrl serve` (the embedded engine behind it), the HTTP client, and the rollout backend.

- `protocol`: the response shapes, finish reasons and error bodies of SGLang 0.5.x that both sides speak
  (established from SGLang's source, see docs/sglang.md).
- `schemas`: the request bodies, one pydantic model per route with SGLang's field names, and their value checks.
- `server`: `asyncrl serve MODEL`, the command line: the embedded engine behind that API (what the tests run against).
- `server_app`: the FastAPI app (routes, SGLang's error shapes) and its uvicorn listener.
- `service`: the engine adapter: the scheduler thread that owns the embedded engine and batches requests.
- `client`: a thin typed HTTP client of the API (works against real SGLang and `asyncrl serve` alike).
- `backend`: `rollout.backend: sglang`, an Engine that launches, supervises and feeds one server per worker.
- `checkpoint`: the checkpoint directories `/update_weights_from_disk` loads (SGLang's FP8-block / w8a8_int8 layouts).
"""
