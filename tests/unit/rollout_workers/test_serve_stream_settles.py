"""A `/generate` stream whose request settles while the server builds a partial answer: that answer is already the
final one, and the stream sends it once (SGLang's streams carry a finish reason on their last chunk only). In-process
server over real HTTP; the answer is held until the request settles, which a loaded machine does by chance."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
import requests
from serve_process import serve_in_process

from common.builtin_model import resolve_model_path
from rollout_workers.sglang_api.service import ModelService

PROMPT = [3, 4, 10, 5, 12]


@pytest.fixture
def held_service() -> Iterator[tuple[str, list[bool]]]:
    """(base URL, whether each answer was asked for while its request ran): the first one asked for while the
    request ran waits until the request has settled."""
    service = ModelService(str(resolve_model_path("builtin:micro", log=lambda *a: None)), "none", max_batch=4,
                           max_seq_len=64)  # fmt: skip
    build, seen = service.response, []

    def held(request, req):  # noqa: ANN001, ANN202 - the service's own signature
        seen.append(not req.done.done())
        if seen.count(True) == 1 and seen[-1]:
            deadline = time.monotonic() + 30.0
            while not req.done.done() and time.monotonic() < deadline:
                time.sleep(0.005)
        return build(request, req)

    service.response = held
    with serve_in_process(service) as url:
        yield url, seen


def test_a_request_that_settles_while_its_chunk_is_built_ends_the_stream_with_one_final_chunk(held_service):
    url, seen = held_service
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "sampling_seed": 3, "ignore_eos": True}}
    plain = requests.post(f"{url}/generate", json=body, timeout=60).json()
    seen.clear()
    # engine steps of 50 ms: the stream sees the first tokens while the request runs, and its answer waits
    requests.post(f"{url}/slow_down", json={"forward_sleep_time": 0.05}, timeout=10).raise_for_status()
    with requests.post(f"{url}/generate", json={**body, "stream": True}, stream=True, timeout=60) as reply:
        events = [line[len("data: ") :] for line in reply.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert seen[0] is True  # asked for while the request ran (then built once it settled)
    assert [chunk["meta_info"]["finish_reason"] is not None for chunk in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1]["output_ids"] == plain["output_ids"] and len(chunks) == len(seen)
