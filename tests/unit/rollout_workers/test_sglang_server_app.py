"""`asyncrl serve` on FastAPI/uvicorn in a real subprocess: what the stack itself must get right. Requests waiting
while paused hold no thread (so `/continue_generation` gets through however many there are), bodies are read as JSON
only when they say JSON or say nothing, and the body limit holds for declared and chunked bodies alike."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import requests
from serve_process import serve

from common.builtin_model import resolve_model_path
from rollout_workers.sglang_api.server_app import MAX_BODY_BYTES

PROMPT = [3, 4, 10, 5, 12]


@pytest.fixture(scope="module")
def base_url():
    model_dir = str(resolve_model_path("builtin:micro", log=lambda *a: None))
    with serve(model_dir, "--quant", "int8") as url:
        yield url


def test_many_requests_waiting_while_paused_do_not_block_continue(base_url):
    """More waiting /generate requests than the thread pool has threads (40): continue and abort still answer."""
    requests.post(f"{base_url}/pause_generation", json={"mode": "in_place"}, timeout=10).raise_for_status()
    statuses: list[int] = []

    def one(seed: int) -> None:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "sampling_seed": seed}}
        statuses.append(requests.post(f"{base_url}/generate", json=body, timeout=60).status_code)

    threads = [threading.Thread(target=one, args=(seed,)) for seed in range(64)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    assert statuses == []  # all waiting
    assert requests.post(f"{base_url}/abort_request", json={"rid": "none-such"}, timeout=5).status_code == 200
    assert requests.post(f"{base_url}/continue_generation", json={}, timeout=5).status_code == 200
    for thread in threads:
        thread.join(timeout=60)
    assert statuses == [200] * 64


def test_bodies_are_json_when_they_say_so_or_say_nothing(base_url):
    body = json.dumps({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}})
    for content_type, expected in (("application/json", 200), (None, 200), ("text/plain", 400)):
        headers = {"Content-Type": content_type} if content_type else {}
        request = requests.Request("POST", f"{base_url}/generate", data=body, headers=headers).prepare()
        if content_type is None:
            request.headers.pop("Content-Type", None)
        response = requests.Session().send(request, timeout=30)
        assert response.status_code == expected, (content_type, response.text)
    digits = b'{"input_ids": [1], "sampling_params": {"temperature": 1' + b"0" * 5000 + b"}}"
    response = requests.post(
        f"{base_url}/generate", data=digits, headers={"Content-Type": "application/json"}, timeout=30
    )
    assert response.status_code == 400 and response.json()["type"] == "Bad Request"


def test_body_limit_for_declared_and_chunked_bodies(base_url):
    host, port = base_url.split("//", 1)[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:  # declared too large: refused unread
        sock.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: {MAX_BODY_BYTES + 1}\r\n\r\n".encode())
        reply = sock.makefile("rb").read()  # returns: the server closes the connection
    assert reply.startswith(b"HTTP/1.1 400") and b"Content-Length must be a number of bytes" in reply
    chunk = b" " * (1 << 20)
    chunks = (chunk for _ in range(MAX_BODY_BYTES // len(chunk) + 2))  # no Content-Length: sent chunked
    response = requests.post(
        f"{base_url}/generate", data=chunks, headers={"Content-Type": "application/json"}, timeout=60
    )
    assert response.status_code == 400 and "over" in response.json()["error"]["message"]
    assert requests.get(f"{base_url}/health", timeout=5).status_code == 200


def test_requests_past_max_queued_requests_are_refused_as_sglang_refuses_them():
    """`--max-queued-requests 3`: with three requests waiting (paused), one more is refused with SGLang's 503 on
    /generate and on /v1/completions, a stream's samples (native and OpenAI) end on the abort, and a batch that would
    pass the limit is refused whole; the waiting ones then finish, and the queue takes requests again once it has
    room."""
    from rollout_workers.sglang_api.protocol import QUEUE_FULL

    # SGLang's http_server.py turns its tokenizer manager's HTTPException into an ErrorResponse on every route
    QUEUE_FULL_BODY = {"object": "error", "message": QUEUE_FULL, "type": "503", "param": None, "code": 503}  # noqa: N806

    model_dir = str(resolve_model_path("builtin:micro", log=lambda *a: None))
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
    with serve(model_dir, "--quant", "int8", "--max-queued-requests", "3") as url:
        assert requests.get(f"{url}/server_info", timeout=10).json()["max_queued_requests"] == 3
        requests.post(f"{url}/pause_generation", json={"mode": "in_place"}, timeout=10).raise_for_status()
        statuses: list[int] = []
        waiting = [
            threading.Thread(
                target=lambda: statuses.append(requests.post(f"{url}/generate", json=body, timeout=60).status_code)
            )
            for _ in range(3)
        ]
        for thread in waiting:
            thread.start()
        deadline = time.monotonic() + 60
        while requests.get(f"{url}/get_load", timeout=10).json()[0]["num_waiting_reqs"] < 3:
            assert time.monotonic() < deadline and not statuses, statuses  # queued, not answered
            time.sleep(0.05)
        refused = requests.post(f"{url}/generate", json=body, timeout=10)
        assert refused.status_code == 503 and refused.json() == QUEUE_FULL_BODY
        model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        completion = {"model": model, "prompt": "1+1=", "max_tokens": 2}
        refused = requests.post(f"{url}/v1/completions", json=completion, timeout=10)
        assert refused.status_code == 503
        assert refused.json() == QUEUE_FULL_BODY
        stream = requests.post(f"{url}/generate", json={**body, "stream": True}, timeout=10)
        events = [line[len("data: ") :] for line in stream.text.splitlines() if line.startswith("data: ")]
        assert stream.status_code == 200 and events[-1] == "[DONE]"
        finish = json.loads(events[-2])["meta_info"]["finish_reason"]
        assert finish["type"] == "abort" and finish["status_code"] == 503 and finish["message"] == QUEUE_FULL
        stream = requests.post(f"{url}/v1/completions", json={**completion, "stream": True}, timeout=10)
        events = [line[len("data: ") :] for line in stream.text.splitlines() if line.startswith("data: ")]
        assert stream.status_code == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
        assert requests.get(f"{url}/get_load", timeout=10).json()[0]["num_waiting_reqs"] == 3  # none joined
        requests.post(f"{url}/continue_generation", json={}, timeout=10).raise_for_status()
        for thread in waiting:
            thread.join(timeout=60)
        assert statuses == [200] * 3
        batch = {"input_ids": [PROMPT, PROMPT], "sampling_params": {"max_new_tokens": 2, "n": 1}}
        answer = requests.post(f"{url}/generate", json=batch, timeout=60)
        assert answer.status_code == 200 and len(answer.json()) == 2
        requests.post(f"{url}/pause_generation", json={"mode": "in_place"}, timeout=10).raise_for_status()
        four = {"input_ids": [PROMPT] * 4, "sampling_params": {"max_new_tokens": 2}}
        refused = requests.post(f"{url}/generate", json=four, timeout=10)  # 4 > 3 even into an empty queue
        assert refused.status_code == 503 and refused.json() == QUEUE_FULL_BODY
        assert requests.get(f"{url}/get_load", timeout=10).json()[0]["num_reqs"] == 0
