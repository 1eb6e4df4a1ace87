"""`asyncrl serve` in a real subprocess over real HTTP: SGLang's request/response contract, log-prob parity with the
embedded engine, version spans across weight updates in every pause mode, aborts."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from common.builtin_model import resolve_model_path
from quant_sync.export import export_rollout_tensors
from quant_sync.update import WeightUpdate
from rollout_workers.engine import SamplingParams
from rollout_workers.sglang_api.checkpoint import read_tensors, rollout_tensors, sglang_tensors, write_version_dir
from rollout_workers.sglang_api.client import ServerError, ServerUnavailable, SGLangClient

PROMPT = [3, 4, 10, 5, 12]  # "1+2=" in the built-in character tokenizer, give or take: any in-vocab ids do


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(resolve_model_path("builtin:micro", log=lambda *a: None))


def start_server(model_dir: str, *args: str) -> tuple[subprocess.Popen, SGLangClient]:
    command = [sys.executable, "-m", "asyncrl.cli", "serve", model_dir, "--port", "0", *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # blocks until the ready line (or EOF if it died)
    assert "ready on http://" in line, proc.stderr.read()[-3000:]
    url = line.split("ready on ", 1)[1].split()[0]
    return proc, SGLangClient(url, timeout_s=60)


@pytest.fixture(scope="module")
def server(model_dir):
    proc, client = start_server(model_dir, "--quant", "int8")
    yield client
    proc.terminate()
    proc.wait(timeout=10)


def test_generate_response_matches_sglang_shapes(server):
    out = server.generate(
        {
            "input_ids": PROMPT,
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 6, "ignore_eos": True},
        }
    )
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert isinstance(out["text"], str) and all(isinstance(t, int) for t in out["output_ids"])
    meta = out["meta_info"]
    for key, kind in (
        ("id", str),
        ("finish_reason", dict),
        ("prompt_tokens", int),
        ("weight_version", str),
        ("completion_tokens", int),
        ("cached_tokens", int),
        ("e2e_latency", float),
    ):
        assert isinstance(meta[key], kind), key
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 6
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == out["output_ids"]
    assert all(isinstance(lp, float) and lp <= 0 and isinstance(text, str) for lp, _, text in triples)
    assert meta["weight_versions"] == [[meta["weight_version"], 6]]
    # without return_text_in_logprobs the third element is null, as in SGLang
    plain = server.generate({"input_ids": PROMPT, "return_logprob": True, "sampling_params": {"max_new_tokens": 2}})
    assert all(entry[2] is None for entry in plain["meta_info"]["output_token_logprobs"])
    # a stop: finish_reason names the matched token, which ends output_ids
    stop = server.generate(
        {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 40, "temperature": 0, "stop_token_ids": list(range(64))},
        }
    )
    assert stop["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop["output_ids"][-1]}
    # batches and n: lists in SGLang 0.5.9's order (tokenizer_manager: each prompt's n samples, prompt by prompt)
    batch = server.generate(
        {"input_ids": [PROMPT, PROMPT[:2]], "sampling_params": {"max_new_tokens": 1, "n": 2}, "rid": "r"}
    )
    assert [b["meta_info"]["prompt_tokens"] for b in batch] == [5, 5, 2, 2]
    assert [b["meta_info"]["id"] for b in batch] == ["r_0", "r_1", "r_2", "r_3"]
    text = server.generate({"text": ["1+2=", "3-1="], "sampling_params": {"max_new_tokens": 1}})
    assert isinstance(text, list) and len(text) == 2
    info = server.model_info()
    assert {"model_path", "tokenizer_path", "is_generation", "preferred_sampling_params", "weight_version"} <= set(info)
    assert server.weight_version() == info["weight_version"]


def test_bad_requests_get_sglang_status_codes_and_error_shapes(server):
    def error(method: str, path: str, body=None) -> ServerError:
        with pytest.raises(ServerError) as caught:
            server.request(method, path, body)
        return caught.value

    bad_top_p = error("POST", "/generate", {"input_ids": PROMPT, "sampling_params": {"top_p": 2}})
    assert bad_top_p.status == 400 and bad_top_p.body == {"error": {"message": "top_p must be in (0, 1], got 2.0."}}
    empty = error("POST", "/generate", {"input_ids": []})
    assert empty.status == 400 and empty.body["error"]["message"] == "input_ids cannot be empty."
    neither = error("POST", "/generate", {"sampling_params": {}})
    assert "Either text, input_ids" in neither.body["error"]["message"]
    too_long = error("POST", "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 10_000}})
    assert too_long.status == 400 and "maximum context length" in too_long.body["error"]["message"]
    wrong_type = error("POST", "/generate", {"input_ids": ["a"]})
    assert wrong_type.status == 400
    assert set(wrong_type.body) == {"object", "message", "type", "param", "code"} and wrong_type.body["code"] == 400
    assert error("POST", "/pause_generation", {"mode": "later"}).body["type"] == "Bad Request"
    missing = error("POST", "/update_weights_from_disk", {"model_path": "/nonexistent"})
    assert missing.status == 400 and missing.body["success"] is False and missing.body["num_paused_requests"] == 0
    assert error("GET", "/nope").status == 404 and error("GET", "/nope").body == {"detail": "Not Found"}
    assert error("GET", "/generate").status == 405
    assert error("POST", "/update_weights_from_distributed", {}).body["success"] is False


def test_logprobs_match_the_embedded_engine(server, model_dir):
    from rollout_workers.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine(model_dir, max_batch=4)
    engine.stage_weights(WeightUpdate(0, rollout_tensors(read_tensors(model_dir), "int8"), "int8"))
    for seed in (1, 2, 3):
        out = server.generate(
            {
                "input_ids": PROMPT,
                "return_logprob": True,
                "sampling_params": {"max_new_tokens": 8, "sampling_seed": seed, "ignore_eos": True},
            }
        )
        (ref,) = engine.generate([PROMPT], SamplingParams(max_new_tokens=8, seed=seed, stop_token_ids=(-1,)))
        assert out["output_ids"] == ref.response_ids
        served = [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]
        assert served == pytest.approx(ref.behav_logp, abs=1e-5)


def nudged_checkpoint(model_dir: str, root: Path, version: int, scale: float) -> Path:
    floats = {name: tensor.to(torch.float32) for name, tensor in read_tensors(model_dir).items()}
    torch.manual_seed(version)
    nudged = {name: t + scale * torch.randn_like(t) * t.std() if t.dim() == 2 else t for name, t in floats.items()}
    update = WeightUpdate(version, export_rollout_tensors(nudged, "int8"), "int8")
    return write_version_dir(root, f"v{version}", sglang_tensors(update), model_dir, "int8")


@pytest.mark.parametrize("mode", ["retract", "in_place", "abort"])
def test_weight_update_mid_generation_in_each_pause_mode(server, model_dir, tmp_path, mode):
    before = int(server.weight_version())
    version = before + 1
    path = nudged_checkpoint(model_dir, tmp_path, version, 0.5)
    results: list = []
    server.request("POST", "/slow_down", {"forward_sleep_time": 0.02})
    try:
        body = {
            "input_ids": PROMPT,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 50, "ignore_eos": True, "n": 2},
        }
        thread = threading.Thread(target=lambda: results.append(server.generate(body)))
        thread.start()
        time.sleep(0.3)  # about 15 tokens in
        server.pause(mode)
        flush = mode != "in_place"  # in_place keeps the requests in the batch: SGLang's flush fails and ends it
        done = server.update_weights_from_disk(str(path), weight_version=str(version), flush_cache=flush)
        assert done["success"] and f"Weight version updated to {version}" in done["message"]
        assert server.weight_version() == str(version)
        server.resume()
        thread.join(timeout=30)
    finally:
        server.request("POST", "/slow_down", {"forward_sleep_time": None})
    for out in results[0]:
        meta = out["meta_info"]
        spans = meta["weight_versions"]
        n = len(out["output_ids"])
        assert sum(count for _, count in spans) == n == len(meta["output_token_logprobs"])
        if mode == "abort":  # ended by the pause with the tokens it had, all of the old version
            assert meta["finish_reason"]["type"] == "abort" and 0 < n < 50
            assert spans == [[str(before), n]]
        else:  # kept in flight: old tokens then new ones, in one response
            assert meta["finish_reason"] == {"type": "length", "length": 50}
            assert [v for v, _ in spans] == [str(before), str(version)] and all(c > 0 for _, c in spans)
            assert meta["total_retractions"] == (1 if mode == "retract" else 0)
    after = server.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert after["meta_info"]["weight_versions"] == [[str(version), len(after["output_ids"])]]


def test_abort_request_and_requests_waiting_while_paused(server):
    server.request("POST", "/slow_down", {"forward_sleep_time": 0.02})
    results: list = []
    try:
        body = {"input_ids": PROMPT, "rid": "victim", "sampling_params": {"max_new_tokens": 50, "ignore_eos": True}}
        thread = threading.Thread(target=lambda: results.append(server.generate(body)))
        thread.start()
        time.sleep(0.2)
        server.abort(rid="vic")  # SGLang 0.5.9 aborts a rid it has, not a prefix of one
        time.sleep(0.2)
        assert thread.is_alive() and not results
        server.abort(rid="victim")
        thread.join(timeout=10)
        assert results[0]["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(results[0]["output_ids"]) < 50
        # while paused (in_place), a new request waits; it runs after continue_generation
        server.pause("in_place")
        late = threading.Thread(
            target=lambda: results.append(
                server.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
            )
        )
        late.start()
        time.sleep(0.3)
        assert len(results) == 1 and server.flush_cache() is False  # a request is waiting: SGLang refuses to flush
        server.resume()
        late.join(timeout=10)
        assert len(results) == 2 and results[1]["meta_info"]["finish_reason"]["type"] == "length"
        assert server.flush_cache() is True
    finally:
        server.request("POST", "/slow_down", {"forward_sleep_time": None})


def test_a_client_gone_before_its_answer_has_its_request_aborted(server):
    """SGLang 0.5.9 aborts a non-streaming request whose client disconnected (checked every 4 s as it waits); the
    stand-in ran it to its end, holding a slot. Native /generate and OpenAI's routes both."""
    import requests as requests_module

    server.request("POST", "/slow_down", {"forward_sleep_time": 0.1})  # 50 tokens: 5 s a request
    try:
        for path, body in (
            ("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 50, "ignore_eos": True}}),
            ("/v1/completions", {"model": "default", "prompt": PROMPT, "max_tokens": 50, "ignore_eos": True}),
        ):
            with pytest.raises(requests_module.ReadTimeout):
                requests_module.post(server.base_url + path, json=body, timeout=0.5)
            deadline = time.monotonic() + 3.0  # 1 s checks; the request would run 4.5 s more
            while server.request("GET", "/get_load")[0]["num_reqs"]:
                assert time.monotonic() < deadline, f"{path}: the request of a client gone still runs"
                time.sleep(0.05)
    finally:
        server.request("POST", "/slow_down", {"forward_sleep_time": None})


def test_malformed_http_gets_a_4xx_and_the_connection_stays_usable(server):
    """Raw requests a client library would never send: bad Content-Length, undecodable or absurd bodies, an
    unknown route whose body must not be read as the next request of the connection."""
    import http.client
    import json as json_module
    from urllib.parse import urlparse

    url = urlparse(server.base_url)

    def raw(head: bytes, body: bytes = b"") -> tuple[int, bytes]:
        import socket

        with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
            sock.sendall(head + body)
            reply = sock.makefile("rb").read()
        return int(reply.split(b" ", 2)[1]), reply

    for length in (b"-1", b"abc"):
        status, reply = raw(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: " + length + b"\r\n\r\n")
        assert status == 400 and b"Content-Length must be a number of bytes" in reply
    bodies = [
        b"\xff\xfe not utf-8",
        b'{"input_ids": [1], "sampling_params": {"temperature": 1' + b"0" * 5000 + b"}}",
        json_module.dumps({"input_ids": PROMPT, "sampling_params": {"temperature": 10**400}}).encode(),
        json_module.dumps({"input_ids": PROMPT, "sampling_params": {"sampling_seed": 2**64}}).encode(),
        json_module.dumps({"input_ids": PROMPT, "sampling_params": {"sampling_seed": -1}}).encode(),
    ]
    for body in bodies:
        head = f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        status, reply = raw(head.encode(), body)
        assert status == 400, reply[:300]
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=10)  # one keep-alive connection
    for method, path, expected in (("POST", "/nope", 404), ("GET", "/generate", 405)):
        connection.request(method, path, body=json_module.dumps({"model_path": "x"}))
        response = connection.getresponse()
        assert response.status == expected and response.read()
        connection.request("GET", "/get_model_info")  # reconnects if the server closed: never a garbled request
        response = connection.getresponse()
        assert response.status == 200 and json_module.loads(response.read())
    connection.close()


def test_an_answer_cut_off_mid_body_is_server_unavailable():
    """A server killed while it answers leaves its chunked body unfinished: requests raises ChunkedEncodingError,
    which the client now reports as ServerUnavailable (what the backend's supervisor and samplers handle). Before, it
    escaped every handler in the backend (its sync thread could end on it)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer_half() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.recv(65536)
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            connection.sendall(head + b'10\r\n{"text": "ab')  # 16 bytes announced, 12 sent, then closed

    thread = threading.Thread(target=answer_half, daemon=True)
    thread.start()
    try:
        with pytest.raises(ServerUnavailable, match="ChunkedEncodingError"):
            SGLangClient(f"http://127.0.0.1:{port}", timeout_s=10).request("POST", "/generate", {"text": "x"})
    finally:
        thread.join(5)
        listener.close()
