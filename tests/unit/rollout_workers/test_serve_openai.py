"""`asyncrl serve` as SGLang's clients and the `openai` client see it (issue 25), in a real subprocess over HTTP:
prompt log-probs on `/generate` in SGLang's shapes and equal to the learner's forward (fp32), scoring a prompt with
`max_new_tokens=0`, and the OpenAI-compatible `/v1/models`, `/v1/completions`, `/v1/chat/completions` through the
real `openai` client."""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest
import requests
import torch
from serve_process import serve

from common.builtin_model import resolve_model_path

PROMPT = [3, 4, 10, 5, 12, 7, 9, 11]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """builtin:micro with a chat template (its tokenizer has none), for the chat route."""
    source = resolve_model_path("builtin:micro", log=lambda *a: None)
    target = tmp_path_factory.mktemp("micro_chat") / "model"
    shutil.copytree(source, target)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return str(target)


@pytest.fixture(scope="module")
def base_url(model_dir):
    with serve(model_dir, "--quant", "none", "--weight-version", "v7") as url:
        yield url


def generate(base_url: str, body: dict) -> requests.Response:
    """POST /generate; at most 4 new tokens unless the body says (builtin:micro has 64 positions)."""
    body = {**body, "sampling_params": {"max_new_tokens": 4, **body.get("sampling_params", {})}}
    return requests.post(f"{base_url}/generate", json=body, timeout=60)


def learner_logp(model_dir: str, tokens: list[int]) -> torch.Tensor:
    """The learner's log-probs (fp32) of tokens[1:] given their prefixes, as the trainer computes them."""
    from transformers import AutoModelForCausalLM

    from learner.logprobs import response_logp

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([tokens])
    positions = torch.arange(1, len(tokens))[None]
    mask = torch.ones((1, len(tokens) - 1), dtype=torch.bool)
    with torch.no_grad():
        logp, _ = response_logp(model, ids, torch.ones_like(ids), positions, ids[:, 1:], mask, 1.0)
    return logp[0]


def test_prompt_logprobs_equal_the_learners_forward(base_url, model_dir):
    out = generate(
        base_url,
        {
            "input_ids": PROMPT,
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 3,
            "sampling_params": {"max_new_tokens": 0},
        },
    )
    assert out.status_code == 200, out.text
    meta = out.json()["meta_info"]
    assert out.json()["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
    entries = meta["input_token_logprobs"]
    assert [entry[1] for entry in entries] == PROMPT and entries[0][0] is None  # SGLang: the first is always None
    served = torch.tensor([entry[0] for entry in entries[1:]])
    assert torch.allclose(served, learner_logp(model_dir, PROMPT), atol=1e-5, rtol=0)
    tops = meta["input_top_logprobs"]
    assert tops[0] is None and all(len(top) == 3 for top in tops[1:])
    for top, entry in zip(tops[1:], entries[1:]):
        values = [alt[0] for alt in top]
        assert values == sorted(values, reverse=True) and values[0] >= entry[0] - 1e-6
    assert meta["output_top_logprobs"] == [] and meta["output_token_logprobs"] == []


def test_logprob_start_len_and_output_top_logprobs_in_sglangs_shapes(base_url):
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "logprob_start_len": 3,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
        "sampling_params": {"max_new_tokens": 5, "ignore_eos": True, "sampling_seed": 4},
    }
    meta = generate(base_url, body).json()["meta_info"]
    assert [entry[1] for entry in meta["input_token_logprobs"]] == PROMPT[3:]
    assert meta["input_token_logprobs"][0][0] is None and isinstance(meta["input_token_logprobs"][1][2], str)
    output, output_top = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert len(output) == len(output_top) == 5
    for (logp, token, _), top in zip(output, output_top):
        assert len(top) == 2 and top[0][0] >= top[1][0] and top[0][0] >= logp - 1e-6
        assert token in {alt[1] for alt in top} or logp <= top[1][0] + 1e-6
    default = generate(
        base_url,
        {
            "input_ids": PROMPT,
            "return_logprob": True,
            "logprob_start_len": -1,
            "sampling_params": {"max_new_tokens": 2},
        },
    ).json()
    assert default["meta_info"]["input_token_logprobs"] == [[None, PROMPT[-1], None]]
    assert "output_top_logprobs" not in default["meta_info"]
    batch = generate(
        base_url,
        {
            "input_ids": [PROMPT, PROMPT[:4]],
            "return_logprob": True,
            "logprob_start_len": [0, 1],
            "sampling_params": {"max_new_tokens": 2},
        },
    ).json()
    assert [len(out["meta_info"]["input_token_logprobs"]) for out in batch] == [len(PROMPT), 3]
    mixed = generate(  # a list return_logprob applies prompt by prompt, as SGLang's (it was any() for all)
        base_url,
        {"input_ids": [PROMPT, PROMPT[:4]], "return_logprob": [True, False], "sampling_params": {"max_new_tokens": 2}},
    ).json()
    assert "output_token_logprobs" in mixed[0]["meta_info"] and "output_token_logprobs" not in mixed[1]["meta_info"]


def test_bad_logprob_and_unsupported_sampling_requests_get_400_naming_the_field(base_url):
    too_far = generate(base_url, {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": len(PROMPT)})
    assert too_far.status_code == 400 and "logprob_start_len" in too_far.json()["error"]["message"]
    below = generate(base_url, {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": -2})
    assert below.status_code == 400 and "logprob_start_len" in below.json()["error"]["message"]
    for key, value in (("regex", "a+"), ("json_schema", "{}"), ("ebnf", "root ::= 'a'")):
        reply = generate(base_url, {"input_ids": PROMPT, "sampling_params": {key: value}})
        assert reply.status_code == 400 and key in reply.json()["error"]["message"]
    reply = generate(base_url, {"input_ids": PROMPT, "sampling_params": {"min_p": 1.5}})
    assert reply.status_code == 400 and "min_p must be in [0, 1], got 1.5." in reply.json()["error"]["message"]
    for route, body in (("generate", {"input_ids": PROMPT, "sampling_params": {"min_p": 0.5, "max_new_tokens": 4}}),
                        ("v1/completions", {"prompt": [PROMPT], "max_tokens": 4, "min_p": 0.5})):  # fmt: skip
        reply = requests.post(f"{base_url}/{route}", json=body, timeout=60)  # min-p sampling runs (it was refused)
        assert reply.status_code == 200, (route, reply.text)
    for key, value, words in (("return_hidden_states", True, "--enable-return-hidden-states"),
                              ("custom_logit_processor", "{}", "--enable-custom-logit-processor"),
                              ("token_ids_logprob", [1, 2], "token_ids_logprob is not supported")):  # fmt: skip
        reply = generate(base_url, {"input_ids": PROMPT, key: value})  # they were dropped silently
        assert reply.status_code == 400 and words in reply.json()["error"]["message"], key
    for bad, message in (({"max_tokens": 0}, "max_tokens must be positive"), ({"prompt": ""}, "Prompt cannot be empty"),
                         ({"prompt": ["", ""]}, "Prompt cannot be empty")):  # fmt: skip
        reply = requests.post(f"{base_url}/v1/completions", json={"prompt": "1+", "max_tokens": 2, **bad}, timeout=30)
        assert reply.status_code == 400 and message in reply.json()["message"], (bad, reply.text)
    # on /v1, SGLang's OpenAI serving answers create_error_response's flat body, whose code and type the client reads
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="none")
    model = client.models.list().data[0].id
    with pytest.raises(BadRequestError) as caught:
        client.completions.create(model=model, prompt=[PROMPT], max_tokens=2, extra_body={"regex": "a+"})
    assert (
        str(caught.value.code) == "400" and caught.value.type == "BadRequestError" and "regex" in caught.value.message
    )


def test_openai_client_models_and_completions(base_url, model_dir):
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="none")
    (card,) = client.models.list().data
    assert card.id == model_dir and card.model_extra["max_model_len"] > 0
    text = client.completions.create(model=card.id, prompt="1+2=", max_tokens=4, temperature=0)
    assert text.object == "text_completion" and len(text.choices) == 1
    assert text.usage.completion_tokens <= 4 and text.model_extra["metadata"] == {"weight_version": "v7"}
    assert text.choices[0].finish_reason in ("stop", "length")
    echoed = client.completions.create(
        model=card.id, prompt=PROMPT, max_tokens=3, echo=True, logprobs=2, n=2, seed=5, extra_body={"ignore_eos": True}
    )
    assert [choice.index for choice in echoed.choices] == [0, 1]
    for choice in echoed.choices:
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(PROMPT) + 3 and logprobs.token_logprobs[0] is None
        assert logprobs.top_logprobs[0] is None and all(len(top) <= 2 for top in logprobs.top_logprobs[1:])
        assert logprobs.text_offset == sorted(logprobs.text_offset)
    native = generate(
        base_url,
        {
            "input_ids": PROMPT,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 3, "sampling_seed": 5, "n": 2, "ignore_eos": True},
        },
    ).json()
    for choice, out in zip(echoed.choices, native):  # the same seed draws the same tokens through either route
        assert choice.logprobs.token_logprobs[len(PROMPT) :] == [
            entry[0] for entry in out["meta_info"]["output_token_logprobs"]
        ]
    bare_echo = client.completions.create(model=card.id, prompt="1+2=", max_tokens=2, echo=True, temperature=0)
    assert bare_echo.choices[0].text.startswith("1+2=") and bare_echo.choices[0].logprobs is None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = [tokenizer.bos_token_id, *PROMPT[:2]]  # echoed as SGLang's _get_echo_text: without special tokens
    special_echo = client.completions.create(model=card.id, prompt=ids, max_tokens=1, echo=True, temperature=0)
    assert special_echo.choices[0].text.startswith(tokenizer.decode(PROMPT[:2]))
    batch = client.completions.create(model=card.id, prompt=[PROMPT, PROMPT[:3]], max_tokens=2, n=2)
    assert len(batch.choices) == 4 and batch.usage.prompt_tokens == len(PROMPT) + 3


def test_openai_client_chat_completions(base_url):
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="none")
    messages = [{"role": "user", "content": "1+2="}]
    chat = client.chat.completions.create(
        model="m", messages=messages, max_tokens=4, logprobs=True, top_logprobs=2, n=2, seed=3
    )
    assert chat.object == "chat.completion" and len(chat.choices) == 2
    assert chat.metadata == {"weight_version": "v7"}  # a declared field of the client's ChatCompletion
    for choice in chat.choices:
        assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
        content = choice.logprobs.content
        assert 1 <= len(content) <= 4
        assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in content)
    assert sum(len(choice.logprobs.content) for choice in chat.choices) == chat.usage.completion_tokens
    assert chat.usage.prompt_tokens == len("user: 1+2=\nassistant: ")  # the template's text, one token a character
    plain = client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None and plain.usage.prompt_tokens > 0
    with pytest.raises(BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=messages, extra_body={"regex": "a+"})
    assert "regex" in str(caught.value)


def sse_events(reply: requests.Response) -> list:
    """The `data:` payloads of a server-sent-event stream, `[DONE]` as the string."""
    events = []
    for line in reply.iter_lines(decode_unicode=True):
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_generate_stream_ends_with_done_and_matches_the_plain_answer(base_url):
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 6, "sampling_seed": 9, "ignore_eos": True},
    }
    plain = generate(base_url, body).json()
    with requests.post(f"{base_url}/generate", json={**body, "stream": True}, stream=True, timeout=60) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        events = sse_events(reply)
    assert events[-1] == "[DONE]" and len(events) >= 2
    chunks = events[:-1]
    assert all(chunk["meta_info"]["finish_reason"] is None for chunk in chunks[:-1])
    final = chunks[-1]
    assert final["output_ids"] == plain["output_ids"] and final["text"] == plain["text"]
    assert final["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
    lengths = [len(chunk["output_ids"]) for chunk in chunks]
    assert lengths == sorted(lengths)  # cumulative, as SGLang streams /generate
    n_body = {"input_ids": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 3, "n": 2}}
    with requests.post(f"{base_url}/generate", json=n_body, stream=True, timeout=60) as reply:
        events = sse_events(reply)
    assert {chunk["index"] for chunk in events[:-1]} == {0, 1} and events[-1] == "[DONE]"


def test_a_stream_the_client_drops_is_aborted_and_frees_its_slot(base_url):
    requests.post(f"{base_url}/slow_down", json={"forward_sleep_time": 0.5}, timeout=10).raise_for_status()
    try:
        body = {"input_ids": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 50, "ignore_eos": True}}
        with requests.post(f"{base_url}/generate", json=body, stream=True, timeout=60) as reply:
            first = next(line for line in reply.iter_lines() if line.startswith(b"data: "))
            assert json.loads(first[len(b"data: ") :])["meta_info"]["finish_reason"] is None
        # dropped after one chunk: 50 tokens at 0.5 s a step would run 25 s; aborted, the server is idle long before
        deadline = time.monotonic() + 12.0
        while requests.post(f"{base_url}/flush_cache", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "the dropped stream's request still runs after 12 s"
            time.sleep(0.1)
    finally:
        requests.post(f"{base_url}/slow_down", json={"forward_sleep_time": None}, timeout=10).raise_for_status()


def test_openai_streams_match_the_plain_answers(base_url):
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="none")
    args = {"model": "m", "max_tokens": 5, "seed": 11, "extra_body": {"ignore_eos": True}}
    plain = client.completions.create(prompt=PROMPT, **args)
    streamed = list(client.completions.create(prompt=PROMPT, stream=True, **args))
    assert "".join(chunk.choices[0].text for chunk in streamed) == plain.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"
    messages = [{"role": "user", "content": "2+2="}]
    chat = client.chat.completions.create(messages=messages, **args)
    chunks = list(client.chat.completions.create(messages=messages, stream=True, logprobs=True, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == chat.choices[0].message.content
    assert sum(len(chunk.choices[0].logprobs.content) for chunk in chunks) == chat.usage.completion_tokens


def test_stop_strings_min_new_tokens_and_ignore_eos(base_url):
    free = {"max_new_tokens": 12, "sampling_seed": 21, "ignore_eos": True}
    plain = generate(base_url, {"input_ids": PROMPT, "sampling_params": free}).json()
    text = plain["text"]
    assert len(text) >= 4, text
    stop = text[2:4]  # a stop string the free run produces: the same seed stops there
    first = text.find(stop)
    stopped = generate(base_url, {"input_ids": PROMPT, "sampling_params": {**free, "stop": [stop]}}).json()
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stopped["text"] == text[:first]  # trimmed: the stop string and what follows it are not returned
    assert stopped["output_ids"] == plain["output_ids"][: len(stopped["output_ids"])]
    kept = generate(
        base_url, {"input_ids": PROMPT, "sampling_params": {**free, "stop": stop, "no_stop_trim": True}}
    ).json()
    assert kept["text"].endswith(stop) and kept["text"] == text[: first + len(stop)]
    kept_token = 5  # every other token of builtin:micro's 16 stops: only min_new_tokens keeps a request going
    stops = [token for token in range(16) if token != kept_token]
    early = {"max_new_tokens": 8, "stop_token_ids": stops, "sampling_seed": 3}
    short = generate(base_url, {"input_ids": PROMPT, "sampling_params": early}).json()
    assert short["meta_info"]["finish_reason"]["type"] == "stop" and short["output_ids"][-1] in stops
    longer = generate(base_url, {"input_ids": PROMPT, "sampling_params": {**early, "min_new_tokens": 4}}).json()
    assert longer["output_ids"][:4] == [kept_token] * 4  # the stop tokens could not be drawn before the 4th
    assert len(longer["output_ids"]) > len(short["output_ids"]) or short["output_ids"][:4] == [kept_token] * 4
    bad = generate(base_url, {"input_ids": PROMPT, "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 2}})
    assert bad.status_code == 400 and "min_new_tokens" in bad.json()["error"]["message"]


def test_tokenize_detokenize_load_and_lora_routes(base_url):
    tokens = requests.post(f"{base_url}/tokenize", json={"prompt": "1+2="}, timeout=10).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] > 0
    text = requests.post(f"{base_url}/detokenize", json={"tokens": tokens["tokens"]}, timeout=10).json()
    assert text == {"text": "1+2="}
    assert requests.post(f"{base_url}/v1/tokenize", json={"prompt": "1+2="}, timeout=10).json() == tokens
    assert requests.post(f"{base_url}/v1/detokenize", json={"tokens": tokens["tokens"]}, timeout=10).json() == text
    batch = requests.post(f"{base_url}/tokenize", json={"prompt": ["1", "22"]}, timeout=10).json()
    assert batch["count"] == [len(ids) for ids in batch["tokens"]]
    (load,) = requests.get(f"{base_url}/get_load", timeout=10).json()
    assert {key: load[key] for key in ("dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens")} == {
        "dp_rank": None,  # SGLang 0.5.9 without data parallelism
        "num_reqs": 0,
        "num_waiting_reqs": 0,
        "num_tokens": 0,
    }
    for path in ("/load_lora_adapter", "/unload_lora_adapter"):
        reply = requests.post(f"{base_url}{path}", json={"lora_name": "a", "lora_path": "/x"}, timeout=10)
        assert reply.status_code == 400 and reply.json()["success"] is False and reply.json()["error_message"]


def test_model_path_and_weight_version_after_a_disk_update(base_url, model_dir, tmp_path):
    copy = tmp_path / "next"
    shutil.copytree(model_dir, copy)
    info = requests.get(f"{base_url}/get_model_info", timeout=10).json()
    assert info["model_path"] == model_dir and info["weight_version"] == "v7"
    update = requests.post(f"{base_url}/update_weights_from_disk", json={"model_path": str(copy)}, timeout=60)
    assert update.status_code == 200 and update.json()["success"] is True
    info = requests.get(f"{base_url}/get_model_info", timeout=10).json()
    assert info["model_path"] == str(copy) and info["tokenizer_path"] == model_dir
    assert info["weight_version"] == "v7"  # kept: the update gave none
    labelled = {"model_path": model_dir, "weight_version": "disk_update_v2.0.0"}
    assert requests.post(f"{base_url}/update_weights_from_disk", json=labelled, timeout=60).json()["success"]
    info = requests.get(f"{base_url}/get_model_info", timeout=10).json()
    assert info["model_path"] == model_dir and info["weight_version"] == "disk_update_v2.0.0"
    requests.post(f"{base_url}/update_weight_version", json={"new_version": "v7"}, timeout=10).raise_for_status()


@pytest.mark.parametrize("scheme", ["none", "int8"])
def test_prompt_scoring_agrees_with_the_prefill_that_samples(model_dir, scheme):
    """Scoring prompt + sampled token from the prompt's last position gives the sampled token's behavior log-prob."""
    from quant_sync.update import WeightUpdate
    from rollout_workers.embedded.engine import EmbeddedEngine
    from rollout_workers.engine import SamplingParams
    from rollout_workers.sglang_api.checkpoint import read_tensors, rollout_tensors

    engine = EmbeddedEngine(model_dir, max_batch=4)
    engine.stage_weights(WeightUpdate(0, rollout_tensors(read_tensors(model_dir), scheme), scheme))
    for seed in (1, 2, 3):
        (out,) = engine.generate([PROMPT], SamplingParams(max_new_tokens=1, seed=seed, temperature=0.7))
        params = SamplingParams(max_new_tokens=0, temperature=0.7)
        start = len(PROMPT) - 1
        (seq,) = engine.submit(PROMPT + out.response_ids, params, [0], prompt_logprobs_from=start,
                               prompt_logprobs_temperature=0.7)  # fmt: skip
        while seq.completion is None:
            engine.step()
        assert seq.completion.response_ids == [] and len(seq.prompt_logp) == 1
        assert seq.prompt_logp[0] == pytest.approx(out.behav_logp[0], abs=1e-5)


def test_streams_carry_matched_stop_the_echo_and_a_usage_chunk(base_url):
    """As SGLang's serving_completions / serving_chat stream them: `matched_stop` on a choice's last chunk, the
    prompt at the head of each completion choice under `echo`, and a last `choices: []` chunk with the usage under
    `stream_options.include_usage` (matched_stop was null, the echo and the usage chunk missing)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="none")
    model = client.models.list().data[0].id
    stops = list(range(16))  # every token of builtin:micro stops: the first one does
    chunks = list(client.completions.create(
        model=model, prompt="1+2=", max_tokens=3, echo=True, n=2, stream=True, stream_options={"include_usage": True},
        extra_body={"stop_token_ids": stops},
    ))  # fmt: skip
    *choice_chunks, usage_chunk = chunks
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 2  # one token each, its stop
    assert usage_chunk.usage.prompt_tokens > 0
    for index in (0, 1):
        mine = [c.choices[0] for c in choice_chunks if c.choices[0].index == index]
        assert mine[0].text.startswith("1+2=")
        assert mine[-1].finish_reason == "stop" and mine[-1].model_extra["matched_stop"] in stops
    chat = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "1+2="}], max_tokens=2, stream=True,
        stream_options={"include_usage": True}, extra_body={"stop_token_ids": stops},
    ))  # fmt: skip
    assert chat[-1].choices == [] and chat[-1].usage.completion_tokens == 1
    assert chat[-2].choices[0].model_extra["matched_stop"] in stops


def test_streams_with_stop_strings_never_send_text_the_final_answer_takes_back(base_url):
    """A stream shows a running sample's text only as far as it was checked against the stop strings, and without a
    trailing start of one: its deltas join to the plain answer (the first character of a two-character stop string
    went out before the second arrived, then the trimmed final text was sent again whole: "xa" + "x")."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="none")
    free = {"max_new_tokens": 24, "ignore_eos": True}
    cases = []
    for seed in range(8):
        text = generate(base_url, {"input_ids": PROMPT, "sampling_params": {**free, "sampling_seed": seed}}).json()
        args = {"model": "m", "prompt": PROMPT, "max_tokens": 24, "seed": seed, "stop": [text["text"][6:8]]}
        plain = client.completions.create(extra_body={"ignore_eos": True}, **args).choices[0].text
        cases.append((args, plain))  # a two-character stop string this seed produces, and the answer it gives

    def streamed(args: dict) -> str:
        chunks = list(client.completions.create(stream=True, extra_body={"ignore_eos": True}, **args))
        assert all(args["stop"][0] not in chunk.choices[0].text for chunk in chunks)
        return "".join(chunk.choices[0].text for chunk in chunks)

    results: dict[int, str] = {}
    threads = [
        threading.Thread(target=lambda i=i, args=args: results.update({i: streamed(args)}))
        for i, (args, _) in enumerate(cases)
    ]
    assert requests.post(f"{base_url}/slow_down", json={"forward_sleep_time": 0.03}, timeout=10).status_code == 200
    try:  # a step every 30 ms: the streams (polling every 10 ms) see each token as it comes
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        requests.post(f"{base_url}/slow_down", json={"forward_sleep_time": None}, timeout=10)
    assert [results.get(i) for i in range(len(cases))] == [plain for _, plain in cases]


def test_what_a_running_stream_shows_is_extended_by_every_later_text():
    """Byte-level tokens that end mid-character decode to U+FFFD: a stream must not show that (SGLang's
    detokenizer holds it back), or the next text, where the character is whole, no longer extends what was sent."""
    from transformers import AutoTokenizer

    from asyncrl.bench.e2e_smol import smol_model_dir
    from rollout_workers.sglang_api.serve_requests import shown_while_running

    tokenizer = AutoTokenizer.from_pretrained(smol_model_dir(log=lambda *_: None))
    ids = tokenizer.encode("1. 🌟 The first 日本語 line")
    texts = [tokenizer.decode(ids[:n]) for n in range(1, len(ids) + 1)]
    assert any(not later.startswith(text) for text, later in zip(texts, texts[1:]))  # the raw decodes do not
    shown = [shown_while_running(text, []) for text in texts[:-1]] + [texts[-1]]
    assert all(later.startswith(text) for text, later in zip(shown, shown[1:])), shown
    assert shown_while_running("12 a", ["ab", "zz"]) == "12 " and shown_while_running("xab", ["abc"]) == "x"
    assert shown_while_running("xa", ["b"]) == "xa" and shown_while_running("", ["ab"]) == ""
