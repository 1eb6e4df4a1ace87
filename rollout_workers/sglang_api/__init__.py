"""SGLang's HTTP API: `asyncrl serve` (the embedded engine behind it), the HTTP client, and the rollout backend.

- `protocol`: the request and response shapes of SGLang 0.5.x that both sides speak (established from SGLang's
  source, see docs/sglang.md), and the validation of requests.
- `server`: `asyncrl serve MODEL`, the embedded engine behind that API (CPU; what the tests run against).
- `client`: a thin typed HTTP client of the API (works against real SGLang and `asyncrl serve` alike).
- `backend`: `rollout.backend: sglang`, an Engine that launches, supervises and feeds one server per worker.
- `checkpoint`: the checkpoint directories `/update_weights_from_disk` loads (SGLang's FP8-block / w8a8_int8 layouts).
"""
