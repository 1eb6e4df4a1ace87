"""`asyncrl serve`'s `/v1` routes as SGLang's serving_chat / serving_completions take a tool-using conversation and
the fields they do not run, in a real subprocess over HTTP: a tool call's history reaches the chat template whole
(its `arguments` as an object), `tool_choice` picks the template's tools or is refused where SGLang would constrain
decoding, a template's own refusal is a 400, and every SGLang field the server does not run is refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import requests
from serve_process import serve

from common.builtin_model import resolve_model_path

TEMPLATE = (
    "{% if tools %}tools={{ tools | length }}\n{% endif %}"
    "{% for message in messages %}"
    "{% if loop.index0 > 0 and message['role'] == 'user' and loop.previtem['role'] == 'user' %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}"
    "{{ message['role'] }}: {{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %} call {{ call.function.name }}"
    "({{ call.function.arguments.city }}){% endfor %}"
    "{% if message.get('tool_call_id') %} [{{ message['tool_call_id'] }}]{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}
HISTORY = [
    {"role": "user", "content": "P?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "P"}'}}],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "s"},
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """builtin:micro (its tokenizer maps every character to one token) with the template above; (URL, tokenizer)."""
    from transformers import AutoTokenizer

    target = tmp_path_factory.mktemp("micro_tools") / "model"
    shutil.copytree(resolve_model_path("builtin:micro", log=lambda *a: None), target)
    config_path = target / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "chat_template": TEMPLATE}))
    with serve(target, "--quant", "none") as url:
        yield url, AutoTokenizer.from_pretrained(target)


def chat(url: str, **body) -> requests.Response:
    return requests.post(f"{url}/v1/chat/completions", json={"max_tokens": 1, **body}, timeout=60)


def prompt_tokens(url: str, **body) -> int:
    reply = chat(url, **body)
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["prompt_tokens"]


def test_a_tool_calls_history_reaches_the_template_whole(served):
    url, tokenizer = served
    # the tool call and its id were dropped before the template ran; its arguments must reach it as an object
    rendered = "user: P?\nassistant:  call w(P)\ntool: s [c1]\nassistant: "
    assert prompt_tokens(url, messages=HISTORY) == len(tokenizer.encode(rendered, add_special_tokens=False))
    bad = json.loads(json.dumps(HISTORY))
    bad[1]["tool_calls"][0]["function"]["arguments"] = "{city"
    reply = chat(url, messages=bad)
    assert reply.status_code == 400 and "tool_calls[0].function.arguments is not JSON" in reply.text


def test_tool_choice_picks_the_templates_tools_or_is_refused(served):
    url, _ = served
    messages = HISTORY[:1]
    plain = prompt_tokens(url, messages=messages)
    assert prompt_tokens(url, messages=messages, tools=[WEATHER]) == plain + len("tools=1\n")
    assert prompt_tokens(url, messages=messages, tools=[WEATHER], tool_choice="auto") == plain + len("tools=1\n")
    assert prompt_tokens(url, messages=messages, tools=[WEATHER], tool_choice="none") == plain  # rendered anyway
    named = {"type": "function", "function": {"name": "w"}}
    for body, words in (
        ({"tool_choice": "required"}, "Tools cannot be empty if tool choice is set to required."),
        ({"tool_choice": named}, "Tools cannot be empty if tool choice is set to a specific tool."),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "Tool 'x' not found"),
        ({"tools": [WEATHER], "tool_choice": "required"}, "constrained decoding is not implemented"),  # it was 200
        ({"tools": [WEATHER], "tool_choice": named}, "constrained decoding is not implemented"),
    ):
        reply = chat(url, messages=messages, **body)
        assert reply.status_code == 400 and words in reply.text, (body, reply.text)


def test_a_template_that_refuses_the_conversation_is_a_400(served):
    url, _ = served
    reply = chat(url, messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert reply.status_code == 400 and "roles must alternate" in reply.text  # a 500 and a traceback in the log


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_fields_sglang_runs_and_serve_does_not_are_refused_by_name(served, route):
    url, _ = served
    head = {"prompt": "1+2="} if route == "completions" else {"messages": HISTORY[:1]}
    for extra, words in (
        ({"stop_regex": "a"}, "stop_regex is not supported"),
        ({"response_format": {"type": "json_object"}}, "response_format 'json_object' is not supported"),
        ({"return_hidden_states": True}, "--enable-return-hidden-states"),
        ({"custom_logit_processor": "{}"}, "--enable-custom-logit-processor"),
        ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "continuous_usage_stats"),
    ):  # each answered 200 as if it had run
        reply = requests.post(f"{url}/v1/{route}", json={**head, "max_tokens": 2, **extra}, timeout=60)
        assert reply.status_code == 400 and words in reply.text, (route, extra, reply.text)
    fine = requests.post(f"{url}/v1/{route}", json={**head, "max_tokens": 2, "response_format": {"type": "text"}})
    assert fine.status_code == 200, fine.text
