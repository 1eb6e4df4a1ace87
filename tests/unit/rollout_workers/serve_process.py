"""`asyncrl serve` for the server tests: as a subprocess (start it, wait for its ready line, give its URL, stop it), or
in this process around a `ModelService` the test can reach into."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests


@contextlib.contextmanager
def serve(model_dir: str | Path, *args: str) -> Iterator[str]:
    """`asyncrl serve MODEL_DIR --port 0 ARGS...` until the block ends; yields its base URL (http://127.0.0.1:PORT)."""
    command = [sys.executable, "-m", "asyncrl.cli", "serve", str(model_dir), "--port", "0", *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # blocks until the ready line (or EOF if it died)
        assert "ready on http://" in line, proc.stderr.read()[-3000:]
        yield line.split("ready on ", 1)[1].split()[0]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@contextlib.contextmanager
def serve_in_process(service: Any) -> Iterator[str]:
    """`service` (a `ModelService`) behind the server's app on 127.0.0.1 in a thread of this process, until the block
    ends (the service is closed then); yields its base URL once `/health` answers."""
    import uvicorn

    from rollout_workers.sglang_api.server_app import SGLangH11Protocol, listen, make_app

    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(make_app(service), http=SGLangH11Protocol, lifespan="off", log_config=None))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        assert requests.get(f"{url}/health", timeout=30).status_code == 200
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
        service.close()
