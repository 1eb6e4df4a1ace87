"""`asyncrl serve` as a subprocess for the server tests: start it, wait for its ready line, give its URL, stop it."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path


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
