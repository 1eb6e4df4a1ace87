"""`asyncrl serve --quant int8` against SGLang 0.5.9's behaviour, in a real subprocess over HTTP (issue 25): its
prompt and sampled log-probs equal the rollout-aligned (QaRL) learner's, 32 concurrent streams give the tokens of
plain requests with the same seeds, penalties and `logit_bias` through the native and OpenAI routes, and the
introspection routes in SGLang's shapes (`/server_info`, `/model_info`, `/get_load`, `/get_weights_by_name`, the
memory-occupation routes)."""

from __future__ import annotations

import json
import threading

import pytest
import requests
import torch
from serve_process import serve

from common.builtin_model import resolve_model_path

PROMPT = [3, 4, 10, 5, 12, 7, 9, 11]
MAX_BATCH, MAX_SEQ_LEN = 48, 64


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(resolve_model_path("builtin:micro", log=lambda *a: None))


@pytest.fixture(scope="module")
def base_url(model_dir):
    args = ["--quant", "int8", "--max-batch", str(MAX_BATCH), "--max-seq-len", str(MAX_SEQ_LEN), "--seed", "1"]
    with serve(model_dir, *args) as url:
        yield url


def generate(base_url: str, body: dict) -> requests.Response:
    return requests.post(f"{base_url}/generate", json=body, timeout=120)


def learner_logp(model_dir: str, tokens: list[int], aligned: bool = True) -> torch.Tensor:
    """The learner's log-probs of tokens[1:] as the trainer computes them: the QaRL learner's
    (`learner.rollout_aligned`, int8), or with `aligned=False` the plain fp32 one."""
    from transformers import AutoModelForCausalLM

    from learner.aligned import make_rollout_aligned
    from learner.logprobs import response_logp

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if aligned:
        make_rollout_aligned(model, "int8")
    ids = torch.tensor([tokens])
    positions = torch.arange(1, len(tokens))[None]
    mask = torch.ones((1, len(tokens) - 1), dtype=torch.bool)
    with torch.no_grad():
        logp, _ = response_logp(model, ids, torch.ones_like(ids), positions, ids[:, 1:], mask, 1.0)
    return logp[0]


def test_int8_server_logprobs_equal_the_rollout_aligned_learners(base_url, model_dir):
    """Prompt log-probs (input_token_logprobs) and behaviour log-probs of sampled tokens, to 1e-5."""
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 12, "sampling_seed": 7, "ignore_eos": True},
    }
    out = generate(base_url, body).json()
    meta = out["meta_info"]
    tokens = PROMPT + out["output_ids"]
    served = [entry[0] for entry in meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]]
    assert len(served) == len(tokens) - 1 == len(PROMPT) + 11
    learner = learner_logp(model_dir, tokens)
    assert torch.allclose(torch.tensor(served), learner, atol=1e-5, rtol=0), (
        (torch.tensor(served) - learner).abs().max()
    )
    # and it is int8 that is served: the fp32 learner's log-probs differ by far more than the tolerance
    assert float((learner_logp(model_dir, tokens, aligned=False) - learner).abs().max()) > 1e-4


def test_32_concurrent_streams_give_the_tokens_of_plain_requests(base_url):
    def body(seed: int, stream: bool) -> dict:
        params = {"max_new_tokens": 10, "sampling_seed": seed, "ignore_eos": True, "temperature": 0.9}
        return {"input_ids": PROMPT, "return_logprob": True, "stream": stream, "sampling_params": params}

    streamed: dict[int, dict] = {}

    def one(seed: int) -> None:
        with requests.post(f"{base_url}/generate", json=body(seed, True), stream=True, timeout=120) as reply:
            events = [
                line[len("data: ") :] for line in reply.iter_lines(decode_unicode=True) if line.startswith("data: ")
            ]
        assert events[-1] == "[DONE]"
        streamed[seed] = json.loads(events[-2])

    threads = [threading.Thread(target=one, args=(seed,)) for seed in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(streamed) == list(range(32))  # every stream ended with its answer and [DONE]
    batch = {**body(0, False), "input_ids": [PROMPT] * 32}
    batch["sampling_params"] = [body(seed, False)["sampling_params"] for seed in range(32)]
    plain = generate(base_url, batch).json()
    assert len({tuple(out["output_ids"]) for out in plain}) > 8  # the seeds do draw different samples
    for seed, out in enumerate(plain):
        final = streamed[seed]
        assert final["output_ids"] == out["output_ids"] and final["meta_info"]["finish_reason"] == {
            "type": "length",
            "length": 10,
        }
        got = [entry[0] for entry in final["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx([entry[0] for entry in out["meta_info"]["output_token_logprobs"]], abs=1e-5)


def test_penalties_and_logit_bias_through_the_native_and_openai_routes(base_url):
    from openai import OpenAI

    greedy = generate(base_url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    token = greedy.json()["output_ids"][0]
    banned = {"max_new_tokens": 1, "temperature": 0, "logit_bias": {str(token): -100}}
    other = generate(base_url, {"input_ids": PROMPT, "sampling_params": banned}).json()["output_ids"][0]
    assert other != token
    penalised = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "repetition_penalty": 1.2, "logit_bias": {"5": 2.0}}
    base = {"max_new_tokens": 8, "sampling_seed": 3, "ignore_eos": True}
    native = generate(base_url, {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {**base, **penalised}})
    free = generate(base_url, {"input_ids": PROMPT, "sampling_params": base}).json()
    assert native.json()["output_ids"] != free["output_ids"]
    client = OpenAI(base_url=f"{base_url}/v1", api_key="none")
    via_openai = client.completions.create(
        model="m", prompt=PROMPT, max_tokens=8, seed=3, frequency_penalty=1.5, presence_penalty=0.5,
        logit_bias={"5": 2.0}, logprobs=0, extra_body={"ignore_eos": True, "repetition_penalty": 1.2},
    )  # fmt: skip
    expected = [entry[0] for entry in native.json()["meta_info"]["output_token_logprobs"]]
    assert via_openai.choices[0].text == native.json()["text"]
    assert via_openai.choices[0].logprobs.token_logprobs == pytest.approx(expected, abs=1e-6)
    for bad, field in (
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"16": 1.0}}, "logit_bias"),
        ({"logit_bias": {"a": 1.0}}, "logit_bias"),
    ):
        reply = generate(base_url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1, **bad}})
        assert reply.status_code == 400 and field in reply.json()["error"]["message"], reply.text


def test_server_info_and_model_info_in_sglangs_shapes(base_url, model_dir):
    info = requests.get(f"{base_url}/server_info", timeout=10).json()
    assert info["max_total_num_tokens"] == MAX_BATCH * MAX_SEQ_LEN and info["max_req_input_len"] == MAX_SEQ_LEN - 1
    assert info["context_length"] == MAX_SEQ_LEN and info["max_running_requests"] == MAX_BATCH
    assert info["quantization"] == "w8a8_int8" and info["model_path"] == model_dir and info["version"] == "0.5.9"
    assert info["status"] == "ready" and info["tp_size"] == 1 and info["random_seed"] == 1
    assert info["host"] == "127.0.0.1" and isinstance(info["port"], int) and info["port"] > 0
    (state,) = info["internal_states"]
    assert set(state["memory_usage"]) == {"weight", "kvcache", "token_capacity", "graph"}
    assert state["memory_usage"]["token_capacity"] == MAX_BATCH * MAX_SEQ_LEN
    assert state["effective_max_running_requests_per_dp"] == MAX_BATCH and state["last_gen_throughput"] >= 0
    deprecated = requests.get(f"{base_url}/get_server_info", timeout=10).json()
    assert set(deprecated) == set(info) and deprecated["max_total_num_tokens"] == info["max_total_num_tokens"]
    model = requests.get(f"{base_url}/model_info", timeout=10).json()
    assert model["model_type"] == "llama" and model["architectures"] == ["LlamaForCausalLM"]
    assert model["is_generation"] is True and model["has_image_understanding"] is False
    assert requests.get(f"{base_url}/get_model_info", timeout=10).json() == model
    (load,) = requests.get(f"{base_url}/get_load", timeout=10).json()
    assert {key: load[key] for key in ("dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens")} == {
        "dp_rank": None,
        "num_reqs": 0,
        "num_waiting_reqs": 0,
        "num_tokens": 0,
    }
    assert isinstance(load["ts_tic"], float)


def test_get_weights_by_name_gives_the_served_rows(base_url, model_dir):
    from transformers import AutoModelForCausalLM

    from quant_sync.quantizers import quantize_weight

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    state = model.state_dict()
    name = "model.layers.1.mlp.down_proj.weight"
    rows = requests.post(f"{base_url}/get_weights_by_name", json={"name": name, "truncate_size": 3}, timeout=30).json()
    served = quantize_weight(state[name], "int8")
    assert torch.equal(torch.tensor(rows), served.q[:3].to(torch.float32))  # the int8 values the engine computes with
    scale = requests.post(f"{base_url}/get_weights_by_name", json={"name": name + "_scale"}, timeout=30).json()
    assert torch.allclose(torch.tensor(scale), served.scale.reshape(-1).to(torch.float32))
    norm = requests.get(f"{base_url}/get_weights_by_name", json={"name": "model.norm.weight"}, timeout=30).json()
    assert torch.equal(torch.tensor(norm), state["model.norm.weight"])
    head = requests.post(
        f"{base_url}/get_weights_by_name", json={"name": "lm_head.weight", "truncate_size": 2}, timeout=30
    )
    assert torch.equal(torch.tensor(head.json()), state["model.embed_tokens.weight"][:2])  # tied: the embedding
    missing = requests.post(f"{base_url}/get_weights_by_name", json={"name": "model.nothing.weight"}, timeout=30)
    assert missing.status_code == 400 and missing.json() == {"error": {"message": "Get parameter by name failed"}}


def test_memory_occupation_routes_answer_as_sglang(base_url):
    def post(path: str, body: dict | None = None) -> requests.Response:
        return requests.post(f"{base_url}{path}", json=body or {}, timeout=30)

    released = post("/release_memory_occupation")
    assert released.status_code == 200 and released.json() is None
    state = requests.get(f"{base_url}/server_info", timeout=10).json()["internal_states"][0]
    assert state["released_memory_tags"] == ["cuda_graph", "kv_cache", "weights"]
    ok = generate(base_url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200  # nothing was freed: the engine keeps serving
    assert post("/resume_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
    again = post("/resume_memory_occupation", {"tags": ["kv_cache"]})
    assert again.status_code == 400 and "kv_cache" in again.json()["error"]["message"]
    unknown = post("/release_memory_occupation", {"tags": ["gpu"]})
    assert unknown.status_code == 400 and "gpu" in unknown.json()["error"]["message"]
    assert post("/resume_memory_occupation", {"tags": ["weights", "cuda_graph"]}).status_code == 200
    requests.post(f"{base_url}/slow_down", json={"forward_sleep_time": 0.2}, timeout=10).raise_for_status()
    try:
        running = threading.Thread(
            target=generate,
            args=(base_url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 20, "ignore_eos": True}}),
        )
        running.start()
        while requests.get(f"{base_url}/get_load", timeout=10).json()[0]["num_reqs"] == 0:
            pass
        busy = post("/release_memory_occupation", {"tags": ["kv_cache"]})
        assert busy.status_code == 400 and "no ongoing request" in busy.json()["error"]["message"]
    finally:
        requests.post(f"{base_url}/slow_down", json={"forward_sleep_time": None}, timeout=10).raise_for_status()
        running.join(timeout=60)
