"""SGLang's own client against `asyncrl serve` (issue 25's acceptance): `sglang.utils.wait_for_server` returns (it
polls `/v1/models`), and the frontend's `RuntimeEndpoint` runs a `gen` with and without log-probs.

SGLang itself is not a dependency: a session fixture installs `sglang==0.5.9` and `pybase64` with `--no-deps` once
into a cache directory and puts it on `sys.path`; the client's remaining imports (`aiohttp`, `IPython`) come from the
`dev` extra. Nothing of SGLang is in the repository."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from serve_process import serve

from common.builtin_model import cache_root, resolve_model_path

SGLANG_CLIENT = ("sglang==0.5.9", "pybase64==1.5.1")


@pytest.fixture(scope="session")
def sglang_client() -> object:
    target = cache_root() / "test-deps" / "-".join(SGLANG_CLIENT).replace("==", "-")
    if not (target / "sglang" / "__init__.py").is_file():
        staging = target.with_name(target.name + f".tmp{os.getpid()}")
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(staging), *SGLANG_CLIENT],
            check=True, timeout=600,
        )  # fmt: skip
        if not target.exists():  # else another process installed it meanwhile
            staging.rename(target)
    sys.path.insert(0, str(target))
    import sglang

    return sglang


@pytest.fixture(scope="module")
def server():
    model_dir = resolve_model_path("builtin:micro", log=lambda *a: None)
    with serve(model_dir, "--quant", "int8") as url:
        yield url, Path(model_dir)


def test_sglangs_wait_for_server_and_runtime_endpoint_work_against_asyncrl_serve(sglang_client, server):
    sgl = sglang_client
    from sglang.utils import wait_for_server

    base_url, _ = server
    wait_for_server(base_url, timeout=60)  # returns once /v1/models answers; raises on a timeout
    backend = sgl.RuntimeEndpoint(base_url)
    assert backend.get_model_name()

    @sgl.function
    def add(s, question):
        s += question
        s += sgl.gen("answer", max_tokens=4, temperature=0.0, return_logprob=True, logprob_start_len=0)

    state = add.run(question="12+34=", backend=backend)
    answer = state["answer"]
    assert isinstance(answer, str) and all(ch in "0123456789+-=" for ch in answer)
    meta = state.get_meta_info("answer")
    assert len(meta["output_token_logprobs"]) >= 1
    assert all(entry[0] <= 0.0 for entry in meta["output_token_logprobs"])  # (log-prob, token id, ...) per token
    again = add.run(question="12+34=", backend=backend)
    assert again["answer"] == answer  # greedy: the same text twice
