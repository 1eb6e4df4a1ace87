"""Start and stop the buffer service as a child process (`python -m buffer`); used by the driver and benchmarks.

The service prints one line `READY tcp://HOST:PORT` once its socket is bound; `start_service` waits for it (with a
deadline, so a service that dies or hangs at start-up fails clearly) and returns the process and endpoint.
"""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any


def start_service(
    config_values: dict[str, Any], run_dir: Path, timeout_s: float = 60.0, resume_step: int | None = None
) -> tuple[subprocess.Popen, str]:
    """Write the config as JSON into run_dir, launch the service, wait for READY; returns (process, endpoint).

    `resume_step`: the next train step of the learner checkpoint being resumed; the service rewinds its journal to it.
    """
    config_file = run_dir / "buffer_config.json"
    config_file.write_text(json.dumps(config_values))
    cmd = [sys.executable, "-m", "buffer", "--config-json", str(config_file), "--run-dir", str(run_dir)]
    if resume_step is not None:
        cmd += ["--resume-step", str(resume_step)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline().decode().strip() if ready else ""
    if not line.startswith("READY "):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"buffer service failed to start within {timeout_s:.0f} s (said {line!r}); see its stderr")
    return proc, line.split(" ", 1)[1]


def stop_service(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """SIGTERM (the service flushes its journal and exits 0), then SIGKILL after timeout_s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
