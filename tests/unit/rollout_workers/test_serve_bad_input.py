"""`asyncrl serve` given bad input of every kind, over real HTTP: a one-line error naming what is wrong (no traceback),
exit 2 for a start-up error before the model loads, 400 for a bad request, and a server whose scheduler thread died
fails what was pending and exits non-zero rather than living on broken. Real subprocesses, except where the test
must watch the tokenizer: there the server runs in this process (uvicorn in a thread, a real socket)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from serve_process import serve, serve_in_process

from common.builtin_model import resolve_model_path
from rollout_workers.sglang_api.schemas import (
    MAX_FORWARD_SLEEP_S,
    MAX_MESSAGES_PER_REQUEST,
    MAX_SAMPLES_PER_REQUEST,
    MAX_TEXT_CHARS_PER_REQUEST,
    MAX_TOKENS_PER_REQUEST,
)
from rollout_workers.sglang_api.service import ModelService, SchedulerDied

PROMPT = [3, 4, 10, 5, 12]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
TOO_LONG = "1" * 100_000
"""A text no tokenizer of builtin:micro (64 positions, no token over 5 characters) can fit."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """builtin:micro with a chat template (its tokenizer has none), for the chat route."""
    target = tmp_path_factory.mktemp("micro_chat") / "model"
    shutil.copytree(resolve_model_path("builtin:micro", log=lambda *a: None), target)
    config_path = target / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "chat_template": CHAT_TEMPLATE}))
    return str(target)


@pytest.fixture(scope="module")
def base_url(model_dir):
    with serve(model_dir, "--quant", "none") as url:
        yield url


def post(url: str, body: Any, **kwargs: Any) -> requests.Response:
    return requests.post(url, json=body, timeout=60, **kwargs)


def error_message(path: str, response: requests.Response) -> str:
    """The message of a 400 in SGLang's shape for `path`: native routes `{"error": {"message"}}`, `/v1/...` its
    OpenAI serving's `create_error_response` body; any other shape fails."""
    body = response.json()
    if path.startswith("/v1/"):
        assert set(body) == {"object", "message", "type", "param", "code"}, body
        assert (body["object"], body["type"], body["code"]) == ("error", "BadRequestError", 400), body
        return body["message"]
    assert set(body) == {"error"} and set(body["error"]) == {"message"}, body
    return body["error"]["message"]


# ---- 1. a text prompt that cannot fit is refused before it is tokenized ----------------------------------------------
class EncoderSpy:
    """Stands in for a fast tokenizer's Rust tokenizer (`tokenizer._tokenizer`), which every way of tokenizing goes
    through (`encode`, `__call__`, `apply_chat_template(tokenize=True)`): records the texts it is given, and the
    token lists it decodes. `rendered`: the message lists the chat template rendered (the `watched` fixture wraps
    the tokenizer's `apply_chat_template`, which renders with `tokenize=False` without coming here)."""

    def __init__(self, inner: Any):
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "texts", [])
        object.__setattr__(self, "decoded", [])
        object.__setattr__(self, "rendered", [])
        object.__setattr__(self, "decode_error", None)

    def fail_decoding(self, error: Exception | None) -> None:
        """From now on `decode` raises `error` (None: decodes again)."""
        object.__setattr__(self, "decode_error", error)

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        if self.decode_error is not None:
            raise self.decode_error
        self.decoded.append(args[0] if args else kwargs.get("ids"))
        return self.inner.decode(*args, **kwargs)

    def encode(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        self.texts.append(text)
        return self.inner.encode(text, *args, **kwargs)

    def encode_batch(self, batch: list[Any], *args: Any, **kwargs: Any) -> Any:
        self.texts.extend(batch)
        return self.inner.encode_batch(batch, *args, **kwargs)

    def encode_batch_fast(self, batch: list[Any], *args: Any, **kwargs: Any) -> Any:
        self.texts.extend(batch)
        return self.inner.encode_batch_fast(batch, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.inner, name, value)


@pytest.fixture(scope="module")
def watched(model_dir):
    """An in-process server whose tokenizer is watched: (base URL, the spy)."""
    service = ModelService(model_dir, "none", max_batch=4, max_seq_len=64)
    spy = EncoderSpy(service.tokenizer._tokenizer)
    service.tokenizer._tokenizer = spy
    render = service.tokenizer.apply_chat_template

    def watched_render(conversation: Any, *args: Any, **kwargs: Any) -> Any:
        spy.rendered.append(conversation)
        return render(conversation, *args, **kwargs)

    service.tokenizer.apply_chat_template = watched_render
    with serve_in_process(service) as url:
        yield url, spy


def tokenized(spy: EncoderSpy, text: str) -> bool:
    return any(isinstance(item, str) and text in item for item in spy.texts)


def test_a_text_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(watched):
    url, spy = watched
    assert post(f"{url}/generate", {"text": "1+2=", "sampling_params": {"max_new_tokens": 2}}).status_code == 200
    assert tokenized(spy, "1+2=")  # the spy sees what is tokenized
    over = "1" * 70  # 71 tokens with BOS: tokenized, then refused by its token count
    refused = post(f"{url}/generate", {"text": over, "sampling_params": {"max_new_tokens": 2}})
    assert refused.status_code == 400 and tokenized(spy, over)
    context = "Requested token count exceeds the model's maximum context length of 64 tokens."
    assert refused.json()["error"]["message"].startswith(context)
    spy.texts.clear()
    for path, body in (
        ("/generate", {"text": TOO_LONG, "sampling_params": {"max_new_tokens": 2}}),
        ("/generate", {"text": ["1+2=", TOO_LONG], "sampling_params": {"max_new_tokens": 2}}),
        ("/v1/completions", {"prompt": TOO_LONG, "max_tokens": 2}),
        ("/v1/completions", {"prompt": ["1+2=", TOO_LONG], "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": TOO_LONG}], "max_tokens": 2}),
        ("/tokenize", {"prompt": TOO_LONG}),
        ("/v1/tokenize", {"prompt": ["1+2=", TOO_LONG]}),
    ):
        response = post(f"{url}{path}", body)
        assert not tokenized(spy, TOO_LONG), path
        assert response.status_code == 400, (path, response.text)
        message = error_message(path, response)
        assert message.startswith(context) and "characters, no token of the tokenizer stands for more than 5" in message
    assert requests.get(f"{url}/health", timeout=10).status_code == 200


def test_a_request_over_the_size_limits_is_refused_before_anything_is_tokenized(watched):
    url, spy = watched
    many = MAX_SAMPLES_PER_REQUEST + 1
    fits = "1" * 300  # not refused untokenized (at least 60 tokens, and 64 positions); its 301 tokens would be
    heavy = -(-MAX_TEXT_CHARS_PER_REQUEST // len(fits)) + 1  # prompts each under the text bound, over it together
    assert heavy < MAX_SAMPLES_PER_REQUEST
    samples = f"A request may ask for at most {MAX_SAMPLES_PER_REQUEST} samples (prompts x n); this one asks for "
    chars = f"The text prompts of a request may hold at most {MAX_TEXT_CHARS_PER_REQUEST} characters together; "
    two = {"max_new_tokens": 2}
    spy.texts.clear()
    for path, body, expected in (
        ("/generate", {"text": ["1+2="] * many, "sampling_params": two}, f"{samples}{many} ({many} prompts x n=1)"),
        ("/generate", {"input_ids": [PROMPT] * many, "sampling_params": two}, f"{samples}{many} ({many} prompts"),
        ("/generate", {"text": ["1+2="] * 20_000, "sampling_params": {**two, "n": 2}}, f"{samples}40000 (20000 "),
        ("/generate", {"input_ids": PROMPT, "rid": "r", "sampling_params": {**two, "n": 2**62}}, f"{samples}{2**62}"),
        ("/v1/completions", {"prompt": ["1+2="] * many, "max_tokens": 2}, f"{samples}{many} ({many} prompts"),
        ("/v1/completions", {"prompt": "1+2=", "max_tokens": 2, "n": 2**40}, f"{samples}{2**40} (1 prompt x n="),
        ("/tokenize", {"prompt": ["1+2="] * many}, f"{samples}{many} ({many} prompts"),
        ("/generate", {"text": [fits] * heavy, "sampling_params": two}, f"{chars}this one's {heavy} prompts hold "),
        ("/v1/completions", {"prompt": [fits] * heavy, "max_tokens": 2}, f"{chars}this one's {heavy} prompts hold "),
        ("/v1/tokenize", {"prompt": [fits] * heavy}, f"{chars}this one's {heavy} prompts hold {heavy * len(fits)}."),
    ):
        response = post(f"{url}{path}", body)
        assert response.status_code == 400, (path, response.text[:500])
        assert expected in error_message(path, response), (path, response.json())
        assert spy.texts == [], path  # refused before the first prompt was tokenized
    batch = post(f"{url}/generate", {"text": ["1+2=", "3+4=", "5+6="], "sampling_params": {**two, "n": 2}})
    assert batch.status_code == 200 and len(batch.json()) == 6, batch.text[:500]
    choices = post(f"{url}/v1/completions", {"prompt": ["1+2="] * 4, "max_tokens": 2}).json()["choices"]
    assert [choice["index"] for choice in choices] == [0, 1, 2, 3]
    legal = MAX_TEXT_CHARS_PER_REQUEST // len(fits)  # a legal batch at the character limit is tokenized whole
    counts: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: counts.update(post(f"{url}/tokenize", {"prompt": [fits] * legal}).json()))
    spy.texts.clear()
    worker.start()
    while not spy.texts and worker.is_alive():  # until the server has begun tokenizing the batch
        time.sleep(0.005)
    assert requests.get(f"{url}/health", timeout=60).status_code == 200
    assert worker.is_alive()  # /health answered while the batch was being tokenized: that runs off the event loop
    worker.join(timeout=120)
    assert counts["count"] == [len(counts["tokens"][0])] * legal


def test_a_detokenize_over_the_size_limits_is_refused_before_anything_is_decoded(watched):
    url, spy = watched
    assert post(f"{url}/detokenize", {"tokens": [4, 13, 5]}).json() == {"text": "1+2"}
    assert spy.decoded  # the spy sees what is decoded
    lists = f"A detokenize request may hold at most {MAX_SAMPLES_PER_REQUEST} token lists; this one holds "
    tokens = f"The token lists of a detokenize request may hold at most {MAX_TOKENS_PER_REQUEST} tokens together; "
    quarter = [4] * (MAX_TOKENS_PER_REQUEST // 4 + 1)  # four lists each under the token bound, over it together
    for path, body, expected in (
        ("/detokenize", {"tokens": [[4]] * (MAX_SAMPLES_PER_REQUEST + 1)}, f"{lists}{MAX_SAMPLES_PER_REQUEST + 1}."),
        ("/v1/detokenize", {"tokens": [[]] * (MAX_SAMPLES_PER_REQUEST + 1)}, f"{lists}{MAX_SAMPLES_PER_REQUEST + 1}."),
        ("/detokenize", {"tokens": [quarter] * 4}, f"{tokens}this one's 4 lists hold {4 * len(quarter)}."),
        ("/v1/detokenize", {"tokens": [4] * (MAX_TOKENS_PER_REQUEST + 1)}, f"{tokens}this one's 1 list holds "),
    ):
        spy.decoded.clear()
        response = post(f"{url}{path}", body)
        assert response.status_code == 400, (path, response.text[:500])
        assert expected in error_message(path, response), (path, response.json())  # in SGLang's shape
        assert spy.decoded == [], path  # refused before the first list was decoded
    spy.decoded.clear()
    at_limit = post(f"{url}/detokenize", {"tokens": [[4]] * MAX_SAMPLES_PER_REQUEST})
    assert at_limit.status_code == 200 and at_limit.json()["text"] == ["1"] * MAX_SAMPLES_PER_REQUEST
    assert len(spy.decoded) == MAX_SAMPLES_PER_REQUEST


def test_a_chat_over_the_size_limits_is_refused_before_its_messages_are_rendered(watched):
    url, spy = watched
    chat = {"messages": [{"role": "user", "content": "1+2="}], "max_tokens": 2}
    spy.rendered.clear()
    assert post(f"{url}/v1/chat/completions", chat).status_code == 200
    assert spy.rendered == [[{"role": "user", "content": "1+2="}]]  # the spy sees what is rendered
    many = MAX_MESSAGES_PER_REQUEST + 1
    half = "1" * (MAX_TEXT_CHARS_PER_REQUEST // 2)  # two messages each under the character bound, over it together
    heavy = [{"role": "user", "content": half}, {"role": "assistant", "content": [{"type": "text", "text": half}]}]
    count = f"A chat request may hold at most {MAX_MESSAGES_PER_REQUEST} messages; this one holds {many}."
    chars = f"The messages of a chat request may hold at most {MAX_TEXT_CHARS_PER_REQUEST} characters together "
    one = {"role": "user", "content": "1" * (MAX_TEXT_CHARS_PER_REQUEST + 1)}
    for messages, expected in (
        ([{"role": "user", "content": "1"}] * many, count),
        (heavy, f"{chars}(roles and contents); this one's 2 messages hold {2 * len(half) + len('userassistant')}."),
        ([one], f"{chars}(roles and contents); this one's 1 message holds {MAX_TEXT_CHARS_PER_REQUEST + 5}."),
    ):
        spy.rendered.clear()
        spy.texts.clear()
        response = post(f"{url}/v1/chat/completions", {**chat, "messages": messages})
        assert response.status_code == 400, response.text[:500]
        assert expected in error_message("/v1/chat/completions", response), response.json()  # in SGLang's shape
        assert spy.rendered == [] and spy.texts == []  # refused before the template rendered anything
    assert post(f"{url}/v1/chat/completions", chat).status_code == 200


def test_max_token_chars_is_the_longest_token_special_ones_included_times_4_under_unicode_composition():
    from tokenizers import Tokenizer, models, normalizers
    from transformers import PreTrainedTokenizerFast

    from rollout_workers.token_chars import max_token_chars

    for normalizer, factor in ((None, 1), (normalizers.NFC(), 4), (normalizers.Sequence([normalizers.NFKC()]), 4)):
        inner = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "▁hello": 2}, unk_token="<unk>"))
        if normalizer is not None:
            inner.normalizer = normalizer
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=inner)
        assert max_token_chars(tokenizer) == len("▁hello") * factor
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|a_long_special|>"]})  # one token in any text
        assert max_token_chars(tokenizer) == len("<|a_long_special|>") * factor


def test_a_chat_ending_with_the_assistant_s_message_renders_it_as_the_user_s(watched):
    """SGLang's serving_chat turns a last assistant message into a user one unless continue_final_message (the
    template would otherwise close the answer and open another)."""
    url, spy = watched
    model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    messages = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    spy.rendered.clear()
    assert (
        post(f"{url}/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 1}).status_code == 200
    )
    assert spy.rendered == [[messages[0], {"role": "user", "content": "3"}]]
    spy.rendered.clear()
    kept = {"model": model, "messages": messages, "max_tokens": 1, "continue_final_message": True}
    assert post(f"{url}/v1/chat/completions", kept).status_code == 200
    assert spy.rendered == [messages]


def test_a_chat_within_the_bound_is_tokenized_as_the_chat_template_does(watched, model_dir):
    from transformers import AutoTokenizer

    url, _ = watched
    messages = [{"role": "user", "content": "1+2="}]
    body = {"messages": messages, "max_tokens": 3, "temperature": 0}
    answer = post(f"{url}/v1/chat/completions", body)
    assert answer.status_code == 200, answer.text
    expected = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(messages, add_generation_prompt=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert answer.json()["usage"]["prompt_tokens"] == len(expected)


# ---- 2. /slow_down is bounded; a scheduler thread that dies takes the server down -----------------------------------
def test_slow_down_refuses_a_sleep_over_the_maximum_and_the_server_keeps_serving(base_url):
    for raw in (b'{"forward_sleep_time": 1e308}', b'{"forward_sleep_time": Infinity}', b'{"forward_sleep_time": NaN}'):
        response = requests.post(
            f"{base_url}/slow_down", data=raw, headers={"Content-Type": "application/json"}, timeout=10
        )
        assert response.status_code == 400, (raw, response.text)
        message = response.json()["error"]["message"]
        assert f"forward_sleep_time must be at most {MAX_FORWARD_SLEEP_S:g} seconds per forward" in message
    for ok in (0.0, -1.0, None):  # SGLang: 0 or less (or null) is no sleep
        assert post(f"{base_url}/slow_down", {"forward_sleep_time": ok}).status_code == 200
    answer = post(f"{base_url}/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert answer.status_code == 200 and len(answer.json()["output_ids"]) <= 2
    assert requests.get(f"{base_url}/health", timeout=10).status_code == 200


def test_the_longest_slow_down_is_taken_and_a_new_setting_ends_a_sleep_under_way(base_url):
    assert post(f"{base_url}/slow_down", {"forward_sleep_time": MAX_FORWARD_SLEEP_S}).status_code == 200
    body = {"input_ids": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    try:
        with post(f"{base_url}/generate", body, stream=True) as stream:  # times out (60 s) if the sleep went on
            events = (line for line in stream.iter_lines() if line)
            first = json.loads(next(events).removeprefix(b"data: "))
            assert len(first["output_ids"]) == 1  # the first step ran: the scheduler sleeps an hour now
            assert post(f"{base_url}/slow_down", {"forward_sleep_time": None}).status_code == 200
            rest = list(events)
    finally:
        post(f"{base_url}/slow_down", {"forward_sleep_time": None})
    assert rest[-1] == b"data: [DONE]" and len(json.loads(rest[-2].removeprefix(b"data: "))["output_ids"]) == 3


def test_a_stream_that_fails_after_its_headers_went_out_ends_with_an_error_event_and_done(watched):
    url, spy = watched
    openai = {"max_tokens": 4, "ignore_eos": True}
    bodies = {
        "/generate": {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}},
        "/v1/completions": {"prompt": "1+2=", **openai},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "1+2="}], **openai},
    }
    assert post(f"{url}/slow_down", {"forward_sleep_time": 0.5}).status_code == 200  # the stream outlives one chunk
    try:
        for path, body in bodies.items():
            with post(f"{url}{path}", {**body, "stream": True}, stream=True) as stream:
                events = (line for line in stream.iter_lines() if line)
                first = json.loads(next(events).removeprefix(b"data: "))
                assert "error" not in first, first
                spy.fail_decoding(RuntimeError("injected: the tokenizer broke"))  # the next chunk cannot be built
                try:
                    rest = list(events)
                finally:
                    spy.fail_decoding(None)
            assert rest[-1] == b"data: [DONE]", (path, rest)
            error = json.loads(rest[-2].removeprefix(b"data: "))["error"]
            assert error["message"] == "RuntimeError: injected: the tokenizer broke", (path, error)
            if path != "/generate":
                assert (error["type"], error["code"]) == ("InternalServerError", 500)
            assert all(b'"error"' not in line for line in rest[:-2]), path
    finally:
        post(f"{url}/slow_down", {"forward_sleep_time": None})
    assert requests.get(f"{url}/health", timeout=10).status_code == 200  # the server keeps serving
    answer = post(f"{url}/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert answer.status_code == 200 and requests.get(f"{url}/get_load", timeout=10).json()[0]["num_reqs"] == 0


CRASHING_SERVER = """
import sys

from rollout_workers.sglang_api.server import main
from rollout_workers.sglang_api.service import ModelService


def crash(self):  # runs on the scheduler thread after every engine step
    raise OverflowError("injected: a bug on the scheduler thread")


ModelService._stop_on_strings = crash
raise SystemExit(main(sys.argv[1:]))
"""


def test_a_dead_scheduler_fails_pending_requests_and_the_process_exits_non_zero(model_dir):
    command = [sys.executable, "-c", CRASHING_SERVER, model_dir, "--port", "0", "--quant", "none"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "ready on http://" in line, proc.stderr.read()[-3000:]
        url = line.split("ready on ", 1)[1].split()[0]
        assert post(f"{url}/pause_generation", {"mode": "in_place"}).status_code == 200
        answers: dict[str, Any] = {}
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}}

        def plain() -> None:
            answers["plain"] = post(f"{url}/generate", body)

        def stream(path: str, stream_body: dict[str, Any]) -> None:
            answers[path] = post(f"{url}{path}", {**stream_body, "stream": True}).text

        openai = {"max_tokens": 4, "ignore_eos": True}  # running when the first step kills the scheduler
        streams = {
            "/generate": body,
            "/v1/completions": {"prompt": "1+2=", **openai},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "1+2="}], **openai},
        }
        threads = [threading.Thread(target=plain)]
        threads += [threading.Thread(target=stream, args=item) for item in streams.items()]
        for thread in threads:
            thread.start()
        while requests.get(f"{url}/get_load", timeout=10).json()[0]["num_waiting_reqs"] < len(threads):
            pass  # every request waits while paused (the streams' headers went out)
        assert post(f"{url}/continue_generation", {}).status_code == 200  # the first step kills the scheduler
        for thread in threads:
            thread.join(timeout=60)
        rc = proc.wait(timeout=60)  # exits by itself
        stderr = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    died = "the scheduler thread died (OverflowError: injected: a bug on the scheduler thread)"
    assert answers["plain"].status_code == 500 and died in answers["plain"].json()["error"]["message"]
    for path in streams:  # the samples' abort chunks, then SGLang's error event naming the cause, then [DONE]
        events = [chunk for chunk in answers[path].split("\n\n") if chunk]
        assert events[-1] == "data: [DONE]", (path, events)
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert died in error["message"], (path, error)
        last = json.loads(events[-3].removeprefix("data: "))
        if path == "/generate":
            assert error == {"message": error["message"]}  # http_server.py's shape
            finish = last["meta_info"]["finish_reason"]
            assert finish["type"] == "abort" and finish["status_code"] == 500 and died in finish["message"]
        else:  # serving_chat.py / serving_completions.py: create_streaming_error_response
            assert error == {"object": "error", "message": error["message"], "type": "InternalServerError",
                             "param": None, "code": 500}  # fmt: skip
            assert last["choices"][0]["finish_reason"] == "abort", (path, last)
    assert rc == 1, stderr[-3000:]
    assert stderr.count("Traceback") == 1 and "OverflowError: injected" in stderr, stderr[-3000:]
    assert stderr.rstrip().splitlines()[-1] == f"asyncrl serve: exiting: {died}"


def test_once_the_scheduler_died_calls_into_the_service_fail_rather_than_hang(model_dir, monkeypatch):
    from rollout_workers.sglang_api.schemas import GenerateReqInput

    def crash(self: ModelService) -> None:
        raise OverflowError("injected")

    monkeypatch.setattr(ModelService, "_stop_on_strings", crash)
    service = ModelService(model_dir, "none", max_batch=2, max_seq_len=64)
    try:
        order = service.submit(GenerateReqInput(input_ids=PROMPT, sampling_params={"max_new_tokens": 2}).normalize())
        assert service.died.wait(timeout=60)
        assert order[0].done.done() and order[0].finish["status_code"] == 500
        assert service.failure == "OverflowError: injected"
        with pytest.raises(SchedulerDied, match=r"the scheduler thread died \(OverflowError: injected\)"):
            service.load()  # a command: it would wait for a thread that is gone
        with pytest.raises(SchedulerDied):
            service.submit(GenerateReqInput(input_ids=PROMPT, sampling_params={"max_new_tokens": 2}).normalize())
        assert not service.health_generate()
    finally:
        service.close()


def test_a_sample_the_engine_finished_but_the_scheduler_has_not_settled_is_still_running(model_dir):
    """The engine sets a sequence's completion a moment before the scheduler settles its request (and may set its
    finish, a matched stop string, in between): an answer built then must not be a final one, or a stream sends the
    sample's final chunk twice (3 streams in 30 did). The same request, settled, gives its final answer."""
    from concurrent.futures import Future
    from dataclasses import replace

    from rollout_workers.sglang_api.schemas import GenerateReqInput

    service = ModelService(model_dir, "none", max_batch=2, max_seq_len=64)
    try:
        request = GenerateReqInput(input_ids=PROMPT, sampling_params={"max_new_tokens": 3}).normalize()
        (req,) = service.submit(request)
        assert req.done.result(timeout=60) is None and req.seq.completion is not None
        final = service.response(request, req)
        assert final["meta_info"]["finish_reason"] is not None and len(final["output_ids"]) == 3
        unsettled = replace(req, done=Future())  # the window between the engine's completion and the settle
        partial = service.response(request, unsettled)
        assert partial["meta_info"]["finish_reason"] is None and partial["output_ids"] == final["output_ids"]
    finally:
        service.close()


# ---- 3. start-up options: one line naming the option, exit 2, before the model loads ------------------------------
def dead_pid() -> int:
    """The id of a process that has ended."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture(scope="module")
def busy_port():
    """A port something already listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


MISSING = "/nonexistent/model"
"""A model that cannot load: an option refused with its own name was checked before the model."""


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["builtin:nope"], "unknown built-in model 'builtin:nope'; valid: builtin:"),
        ([MISSING], f"MODEL {MISSING} is not a directory"),
        ([MISSING, "--threads", "0"], "--threads must be at least 1, got 0"),
        ([MISSING, "--threads", "-3"], "--threads must be at least 1, got -3"),
        ([MISSING, "--port", "-1"], "--port must be in [0, 65535] (0 picks a free one), got -1"),
        ([MISSING, "--port", "70000"], "--port must be in [0, 65535] (0 picks a free one), got 70000"),
        ([MISSING, "--host", "999.1.1.1"], "--host 999.1.1.1: cannot resolve it"),
        ([MISSING, "--host", "nonexistent.invalid"], "--host nonexistent.invalid: cannot resolve it"),
        ([MISSING, "--device", "bogus"], "--device must be cpu, cuda or cuda:N, got 'bogus'"),
        ([MISSING, "--device", "cuda:99"], "--device cuda:99: torch sees "),
        ([MISSING, "--max-batch", "0"], "--max-batch must be at least 1 (sequences decoded together), got 0"),
        ([MISSING, "--max-batch", "-5"], "--max-batch must be at least 1 (sequences decoded together), got -5"),
        ([MISSING, "--max-seq-len", "0"], "--max-seq-len must be at least 2 (a prompt and a generated token), got 0"),
        ([MISSING, "--seed", str(2**64)], f"--seed must fit in 64 bits, got {2**64}"),
        ([MISSING, "--enable-lora", "--max-lora-rank", "-3"], "--max-lora-rank must be at least 1, got -3"),
        ([MISSING, "--parent-pid", "-3"], "--parent-pid must be a process id (0: none), got -3"),
        ([MISSING, "--parent-pid", "DEAD"], "--parent-pid DEAD: no such process"),
        ([MISSING, "--port", "BUSY"], "--host 127.0.0.1 --port BUSY: cannot listen there (Address already in use)"),
        (["builtin:micro", "--cache-dir", "FILE"], "--cache-dir FILE: cannot hold builtin:micro (Not a directory"),
    ],
)
def test_a_bad_start_up_option_is_one_line_naming_it_and_exit_2(args, expected, busy_port, tmp_path):
    file = tmp_path / "a_file"
    file.write_text("not a directory")
    values = {"DEAD": str(dead_pid()), "BUSY": str(busy_port), "FILE": str(file)}
    args = [values.get(arg, arg) for arg in args]
    for name, value in values.items():
        expected = expected.replace(name, value)
    command = [sys.executable, "-m", "asyncrl.cli", "serve", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stdout == ""  # no ready line
    assert done.stderr.startswith("asyncrl serve: ") and done.stderr.count("\n") == 1, done.stderr[-3000:]
    assert expected in done.stderr, done.stderr


def test_model_service_refuses_max_batch_and_max_seq_len_out_of_range(model_dir):
    with pytest.raises(ValueError, match="max_batch must be at least 1 .*got 0"):
        ModelService(model_dir, "none", max_batch=0)
    with pytest.raises(ValueError, match="max_batch must be at least 1 .*got -5"):
        ModelService(model_dir, "none", max_batch=-5)
    with pytest.raises(ValueError, match="max_seq_len must be at least 2 .*got 1"):
        ModelService(model_dir, "none", max_seq_len=1)


# ---- 4-6. detokenize ids, unknown model ids, bodies that are not JSON ----------------------------------------------
def test_detokenize_refuses_token_ids_outside_the_vocabulary_by_name(base_url):
    vocab_size = json.loads((Path(requests.get(f"{base_url}/model_info", timeout=10).json()["model_path"])
                             / "config.json").read_text())["vocab_size"]  # fmt: skip
    for path in ("/detokenize", "/v1/detokenize"):
        for tokens, bad in (([-1], [-1]), ([[3, 4], [5, vocab_size]], [vocab_size]), ([2**70, 3], [2**70])):
            response = post(f"{base_url}{path}", {"tokens": tokens})
            assert response.status_code == 400, (path, tokens, response.text)
            message = response.json()["message"]
            assert message == f"tokens must lie in [0, {vocab_size}) (the model's vocab_size), got {bad}"
        assert post(f"{base_url}{path}", {"tokens": [4, 13, 5]}).json() == {"text": "1+2"}
    assert requests.get(f"{base_url}/health", timeout=10).status_code == 200


def test_retrieving_an_unknown_model_id_is_sglangs_404(base_url, model_dir):
    response = requests.get(f"{base_url}/v1/models/nope", timeout=10)
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "The model 'nope' does not exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    card = requests.get(f"{base_url}/v1/models/{model_dir}", timeout=10)
    assert card.status_code == 200 and card.json()["id"] == model_dir


def test_a_body_that_is_not_sent_as_json_is_told_to_send_json(base_url):
    body = json.dumps({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}})
    for path in ("/generate", "/v1/completions", "/tokenize"):
        for content_type in ("application/x-www-form-urlencoded", "text/plain"):  # curl -d sends a form
            response = requests.post(f"{base_url}{path}", data=body, headers={"Content-Type": content_type}, timeout=30)
            assert response.status_code == 400, (path, content_type, response.text)
            error = response.json()
            assert error["type"] == "Bad Request" and error["code"] == 400
            assert f"Only 'application/json' is allowed, got '{content_type}'" in error["message"]
            assert "send the body as JSON with Content-Type: application/json" in error["message"]
    answer = requests.post(f"{base_url}/generate", data=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert answer.status_code == 200, answer.text


def test_a_max_new_tokens_not_given_is_cut_to_the_context_and_a_given_one_is_checked(base_url):
    """SGLang checks prompt + max_new_tokens against the context only for a number the request gave; the default
    (128) or null (no limit) is cut to what the context leaves (scheduler `init_req_max_new_tokens`), and a chat
    without max_tokens sends null. builtin:micro's context is 64: these were refused for 128 + the prompt."""
    prompt = [3, 4, 10, 5, 12] * 12  # 60 tokens: 4 left
    for sampling in ({"ignore_eos": True}, {"ignore_eos": True, "max_new_tokens": None}):
        answer = post(f"{base_url}/generate", {"input_ids": prompt, "sampling_params": sampling})
        assert answer.status_code == 200, answer.text
        assert answer.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    given = post(f"{base_url}/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 10}})
    assert given.status_code == 400 and "maximum context length of 64" in given.json()["error"]["message"]
    full = post(f"{base_url}/generate", {"input_ids": prompt + prompt[:4], "sampling_params": {}})
    assert full.status_code == 400, full.text
    assert "The input (64 tokens) is longer than the model's context length (64 tokens)" in full.text
    model = requests.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]
    chat = {"model": model, "messages": [{"role": "user", "content": "1+2=" * 10}], "ignore_eos": True}
    reply = post(f"{base_url}/v1/chat/completions", chat)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["finish_reason"] == "length"
    assert reply.json()["usage"]["prompt_tokens"] + reply.json()["usage"]["completion_tokens"] == 64


TOOLS_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}{% endfor %}{% if tools %}{{ tools | length }}{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}9{% endif %}"
)


def test_chat_passes_tools_and_template_variables_and_refuses_constrained_formats(tmp_path):
    """SGLang's serving_chat renders `tools` and `chat_template_kwargs` with the template; they were dropped
    silently, and response_format json_object was answered with free text."""
    target = tmp_path / "model"
    shutil.copytree(resolve_model_path("builtin:micro", log=lambda *a: None), target)
    config_path = target / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "chat_template": TOOLS_TEMPLATE}))
    generation = target / "generation_config.json"  # SGLang's chat falls back on the model's sampling values
    generation.write_text(json.dumps({**json.loads(generation.read_text()), "temperature": 1e-7, "top_k": 1}))
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    with serve(str(target), "--quant", "none") as url:
        model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        chat = {"model": model, "messages": [{"role": "user", "content": "1+1="}], "max_tokens": 1}

        def prompt_tokens(**extra: Any) -> int:
            reply = post(f"{url}/v1/chat/completions", {**chat, **extra})
            assert reply.status_code == 200, reply.text
            return reply.json()["usage"]["prompt_tokens"]

        assert prompt_tokens() == 4
        assert prompt_tokens(tools=[tool, tool]) == 5  # "1+1=2"
        assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == 5  # "1+1=9"
        assert prompt_tokens(response_format={"type": "text"}) == 4
        refused = post(f"{url}/v1/chat/completions", {**chat, "response_format": {"type": "json_object"}})
        assert refused.status_code == 400 and "response_format 'json_object' is not supported" in refused.text
        refused = post(f"{url}/v1/chat/completions", {**chat, "chat_template_kwargs": {"tokenize": True}})
        assert refused.status_code == 400 and "chat_template_kwargs may not set tokenize" in refused.text
        long = {**chat, "max_tokens": 6, "ignore_eos": True}
        answers = {
            post(f"{url}/v1/chat/completions", long).json()["choices"][0]["message"]["content"] for _ in range(5)
        }
        assert len(answers) == 1  # greedy by the model's generation_config, not sampled at the default 1.0
