"""`asyncrl serve --api-key` / `--api-key-file`: SGLang's check (utils/auth.py of 0.5.9): every route but OPTIONS,
/health* and /metrics* wants `Authorization: Bearer KEY`, else 401 {"error": "Unauthorized"}; SGLang's and the
OpenAI client send it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import requests
from serve_process import serve

from common.builtin_model import resolve_model_path


def test_every_route_but_health_wants_the_key(tmp_path: Path) -> None:
    model_dir = resolve_model_path("builtin:micro", log=lambda *a: None)
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    with serve(model_dir, "--quant", "none", "--api-key-file", str(key_file)) as url:
        body = {"input_ids": [3, 4, 10], "sampling_params": {"max_new_tokens": 2}}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            refused = requests.post(f"{url}/generate", json=body, headers=headers, timeout=30)
            assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"}), headers
            assert requests.get(f"{url}/model_info", headers=headers, timeout=30).status_code == 401
        assert requests.get(f"{url}/health", timeout=30).status_code == 200
        answer = requests.post(f"{url}/generate", json=body, headers={"Authorization": "Bearer s3cret"}, timeout=60)
        assert answer.status_code == 200 and len(answer.json()["output_ids"]) == 2
        from openai import AuthenticationError, OpenAI

        models = OpenAI(base_url=f"{url}/v1", api_key="s3cret").models.list()  # the client sends it as a bearer
        assert len(models.data) == 1
        try:
            OpenAI(base_url=f"{url}/v1", api_key="other").models.list()
        except AuthenticationError as err:
            assert err.status_code == 401
        else:
            raise AssertionError("a wrong key was let through")


def test_a_bad_key_option_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("\n")
    for args, words in ((["--api-key", "a", "--api-key-file", str(tmp_path / "empty")], "not both"),
                        (["--api-key-file", str(tmp_path / "empty")], "is empty"),
                        (["--api-key-file", str(tmp_path / "missing")], "cannot read it")):  # fmt: skip
        done = subprocess.run([sys.executable, "-m", "asyncrl.cli", "serve", "builtin:micro", "--port", "0", *args],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode != 0 and words in done.stderr, (args, done.stderr[-2000:])
