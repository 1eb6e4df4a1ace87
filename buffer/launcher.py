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

EXIT_JOURNAL_UNWRITABLE = 3
"""The buffer service's exit status when its journal cannot be written (disk full, I/O error): a restart on the same
disk would fail the same way, so a supervisor stops the run instead."""


def start_service(
    config_values: dict[str, Any],
    run_dir: Path,
    timeout_s: float = 60.0,
    resume_step: int | None = None,
    redeliver: bool = False,
    vocab_size: int = 0,
) -> tuple[subprocess.Popen, str]:
    """Write the config as JSON into run_dir, launch the service, wait for READY; returns (process, endpoint).

    `resume_step`: the next train step of the learner checkpoint being resumed; the service rewinds its journal to it.
    `redeliver`: a restart under a running learner (a dead buffer replaced, asyncrl/supervise.py): the batch of the
    last consumed step is given again to a FetchBatch for that step (buffer/service.py). `vocab_size`: the model's;
    a pushed group with a token id at or past it is refused (0: unchecked).
    """
    config_file = run_dir / "buffer_config.json"
    config_file.write_text(json.dumps(config_values))
    cmd = [sys.executable, "-m", "buffer", "--config-json", str(config_file), "--run-dir", str(run_dir)]
    if resume_step is not None:
        cmd += ["--resume-step", str(resume_step)]
    if redeliver:
        cmd.append("--redeliver")
    if vocab_size:
        cmd += ["--vocab-size", str(vocab_size)]
    # Its own session: a Ctrl-C at the terminal reaches the driver alone, which stops the run (checkpoint included,
    # which asks the buffer) and then the buffer. If the caller dies instead, the buffer gets SIGTERM (Linux).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, start_new_session=True, preexec_fn=_die_with_parent)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline().decode().strip() if ready else ""
    if not line.startswith("READY "):
        try:  # its stdout closed without READY: it is exiting
            code = proc.wait(timeout=5) if ready and not line else proc.poll()
        except subprocess.TimeoutExpired:
            code = None
        proc.kill()
        proc.wait()
        if code is not None:
            raise RuntimeError(f"buffer service exited with code {code} at start-up (its error is printed above)")
        raise RuntimeError(f"buffer service failed to start within {timeout_s:.0f} s (said {line!r}); see its stderr")
    return proc, line.split(" ", 1)[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the thread that started it exits (call start_service from the main
    thread), so that a killed driver never leaves its buffer running. Linux only; elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


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
