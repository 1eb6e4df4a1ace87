"""`asyncrl serve --enable-lora` in a real subprocess: SGLang's dynamic LoRA API (`/load_lora_adapter`,
`/unload_lora_adapter`, `lora_path` per request) over the embedded engine, with peft's own adapter directories. Under
an adapter the server's log-probs are peft's (fp32 base, <= 1e-5); requests of different adapters in one batch each
get their own; bad loads, unknown adapters and unloads are answered in SGLang's words."""

from __future__ import annotations

import json

import pytest
import requests
import torch
from serve_process import serve

from common.builtin_model import resolve_model_path
from rollout_workers.sglang_api.lora_serve import resolve_adapters
from rollout_workers.sglang_api.protocol import BadRequest

PROMPT = [3, 4, 10, 5, 12, 7]
TOL = 1e-5


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(resolve_model_path("builtin:micro", log=lambda *a: None))


def peft_adapter(model_dir: str, out_dir, rank: int, seed: int, targets=("q_proj", "v_proj", "down_proj")):
    """A peft LoRA directory on the micro model with random non-zero B (peft starts B at 0) and its peft model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets)))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    model.save_pretrained(str(out_dir))
    return model.eval()


@pytest.fixture(scope="module")
def server(model_dir):
    with serve(
        model_dir, "--quant", "none", "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all"
    ) as url:
        yield url


def post(url: str, path: str, body: dict) -> requests.Response:
    return requests.post(url + path, json=body, timeout=120)


def reference_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log p(output[t] | prompt + output[:t]) of an HF (or peft) model in fp32."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return logp[positions, torch.tensor(output)]


def sample(url: str, lora_path, seed: int = 1, n_tokens: int = 8) -> dict:
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": n_tokens, "sampling_seed": seed, "ignore_eos": True}}  # fmt: skip
    if lora_path is not None:
        body["lora_path"] = lora_path
    reply = post(url, "/generate", body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_adapters_load_run_with_peft_log_probs_and_unload(server, model_dir, tmp_path):
    model_a = peft_adapter(model_dir, tmp_path / "a", rank=4, seed=0)
    model_b = peft_adapter(model_dir, tmp_path / "b", rank=8, seed=1, targets=("o_proj", "gate_proj", "up_proj"))
    loaded = post(server, "/load_lora_adapter", {"lora_name": "a", "lora_path": str(tmp_path / "a")})
    assert loaded.status_code == 200 and loaded.json()["success"] is True, loaded.text
    assert loaded.json()["loaded_adapters"] == {"a": str(tmp_path / "a")}
    assert post(server, "/load_lora_adapter", {"lora_name": "b", "lora_path": str(tmp_path / "b")}).status_code == 200

    for name, model in (("a", model_a), ("b", model_b)):  # each adapter's samples have peft's log-probs
        out = sample(server, name)
        tokens = out["output_ids"]
        served = torch.tensor([entry[0] for entry in out["meta_info"]["output_token_logprobs"]])
        assert len(tokens) == 8 and (served - reference_logprobs(model, PROMPT, tokens)).abs().max() <= TOL

    # one batch, three adapters (a, the base, b): the engine runs them in separate steps, each on its own weights
    body = {"input_ids": [PROMPT] * 3, "return_logprob": True, "lora_path": ["a", None, "b"],
            "sampling_params": {"max_new_tokens": 6, "sampling_seed": 5, "ignore_eos": True}}  # fmt: skip
    outs = post(server, "/generate", body).json()
    with model_a.disable_adapter():  # the base alone
        base_ref = reference_logprobs(model_a, PROMPT, outs[1]["output_ids"])
    for out, ref in zip(outs, (None, base_ref, None)):
        model = model_a if out is outs[0] else model_b
        ref = ref if ref is not None else reference_logprobs(model, PROMPT, out["output_ids"])
        served = torch.tensor([entry[0] for entry in out["meta_info"]["output_token_logprobs"]])
        assert len(out["output_ids"]) == 6 and (served - ref).abs().max() <= TOL
    assert outs[0]["output_ids"] != outs[1]["output_ids"] or outs[1]["output_ids"] != outs[2]["output_ids"]

    # unload: the adapter is gone from the list; a request naming it reloads it from its path (SGLang 0.5.9)
    unloaded = post(server, "/unload_lora_adapter", {"lora_name": "a"})
    assert unloaded.status_code == 200 and unloaded.json()["loaded_adapters"] == {"b": str(tmp_path / "b")}
    again = sample(server, "a")
    served = torch.tensor([entry[0] for entry in again["meta_info"]["output_token_logprobs"]])
    assert (served - reference_logprobs(model_a, PROMPT, again["output_ids"])).abs().max() <= TOL


def test_bad_loads_unknown_adapters_and_unknown_unloads_are_refused_in_sglang_words(server, model_dir, tmp_path):
    peft_adapter(model_dir, tmp_path / "wide", rank=16, seed=2)
    peft_adapter(model_dir, tmp_path / "c", rank=2, seed=3)
    peft_adapter(model_dir, tmp_path / "patterned", rank=4, seed=4)  # per-module alpha: was served with alpha / r
    config_path = tmp_path / "patterned" / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "alpha_pattern": {"v_proj": 32}}))
    cases = [
        ({"lora_name": "x", "lora_path": str(tmp_path / "none-such")}, "not a LoRA adapter directory"),
        ({"lora_name": "p", "lora_path": str(tmp_path / "patterned")}, "alpha_pattern (per-module ranks or scales)"),
        ({"lora_name": "wide", "lora_path": str(tmp_path / "wide")}, "with rank 16 is incompatible"),
        ({"lora_name": "c", "lora_path": str(tmp_path / "c")}, None),
        ({"lora_name": "c", "lora_path": str(tmp_path / "c")}, "Failed to load LoRA adapter c because it is already"),
    ]
    for body, error in cases:
        reply = post(server, "/load_lora_adapter", body)
        if error is None:
            assert reply.status_code == 200, reply.text
        else:
            assert reply.status_code == 400 and reply.json()["success"] is False, reply.text
            assert error in reply.json()["error_message"]
    missing = post(server, "/load_lora_adapter", {"lora_name": "y"})  # lora_path is required: validation shape
    assert missing.status_code == 400 and missing.json()["object"] == "error"
    unknown = post(
        server, "/generate", {"input_ids": PROMPT, "lora_path": "never", "sampling_params": {"max_new_tokens": 2}}
    )
    assert unknown.status_code == 400
    assert "Got LoRA adapter that has never been loaded: never" in unknown.json()["error"]["message"]
    gone = post(server, "/unload_lora_adapter", {"lora_name": "never"})
    assert gone.status_code == 400 and "LoRA with name never does not exist" in gone.json()["error_message"]
    assert post(server, "/unload_lora_adapter", {"lora_name": "c"}).status_code == 200


def test_a_request_naming_an_adapter_without_enable_lora_is_refused():
    with pytest.raises(BadRequest, match="LoRA adapter 'a' was requested, but LoRA is not enabled"):
        resolve_adapters(None, ["a", None], 2)
    assert resolve_adapters(None, None, 3) == [None, None, None]
    with pytest.raises(BadRequest, match="lora_path has 1 entries for a batch of 2"):
        resolve_adapters(None, ["a"], 2)


def test_openai_routes_take_base_colon_adapter_and_list_adapters(server, model_dir, tmp_path):
    model = peft_adapter(model_dir, tmp_path / "d", rank=4, seed=6)
    assert post(server, "/load_lora_adapter", {"lora_name": "d", "lora_path": str(tmp_path / "d")}).status_code == 200
    cards = requests.get(f"{server}/v1/models", timeout=10).json()["data"]
    assert {"id": "d", "root": str(tmp_path / "d"), "parent": model_dir} in [
        {key: card[key] for key in ("id", "root", "parent")} for card in cards
    ]
    native = sample(server, "d", seed=2, n_tokens=5)  # the adapter's sample on the native route
    expected = torch.tensor([entry[0] for entry in native["meta_info"]["output_token_logprobs"]])
    assert (expected - reference_logprobs(model, PROMPT, native["output_ids"])).abs().max() <= TOL
    for extra in ({"model": f"{model_dir}:d"}, {"model": model_dir, "lora_path": "d"}):  # SGLang's two spellings
        body = {"prompt": PROMPT, "max_tokens": 5, "logprobs": 0, "seed": 2, "ignore_eos": True, **extra}
        reply = post(server, "/v1/completions", body)
        assert reply.status_code == 200, reply.text
        served = torch.tensor(reply.json()["choices"][0]["logprobs"]["token_logprobs"])
        assert torch.equal(served, expected)  # the same draw under the same adapter
    base = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "logprobs": 0, "seed": 2,
                                            "ignore_eos": True, "model": model_dir}).json()  # fmt: skip
    assert not torch.equal(torch.tensor(base["choices"][0]["logprobs"]["token_logprobs"]), expected)
    assert post(server, "/unload_lora_adapter", {"lora_name": "d"}).status_code == 200


def test_lora_paths_at_start_and_start_up_checks(model_dir, tmp_path):
    from argparse import Namespace

    from rollout_workers.sglang_api.lora_serve import attach
    from rollout_workers.sglang_api.service import ModelService

    peft_adapter(model_dir, tmp_path / "e", rank=2, seed=7)
    service = ModelService(model_dir, "none", max_batch=4, max_seq_len=64)
    try:
        flags = {"enable_lora": False, "max_lora_rank": None, "lora_target_modules": None, "lora_paths": None}
        attach(service, Namespace(**flags))
        assert service.lora is None  # no --enable-lora: LoRA stays off
        with pytest.raises(ValueError, match="you need to specify both --max-lora-rank and --lora-target-modules"):
            attach(service, Namespace(**{**flags, "enable_lora": True}))
        with pytest.raises(ValueError, match="--lora-paths bad=/none: .*not a LoRA adapter directory"):
            attach(service, Namespace(**{**flags, "lora_paths": ["bad=/none"]}))
        attach(service, Namespace(**{**flags, "lora_paths": [f"e={tmp_path / 'e'}", str(tmp_path / "e")]}))
        assert service.lora is not None
        assert service.lora.loaded() == {"e": str(tmp_path / "e"), str(tmp_path / "e"): str(tmp_path / "e")}
    finally:
        service.close()
