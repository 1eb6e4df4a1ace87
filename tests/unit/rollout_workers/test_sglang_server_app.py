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
