"""`asyncrl serve MODEL`: the embedded engine behind SGLang's native HTTP API, on SGLang's own stack (FastAPI,
pydantic, uvicorn).

    uvicorn (h11, one event loop)  ->  server_app.py (FastAPI routes, schemas.py bodies)  ->  service.py
    parses HTTP, frames bodies          validates, answers SGLang's error shapes              the scheduler thread
                                        blocking calls in the thread pool                     that owns the engine

This module is the command line (parsed before anything heavy is imported): it checks the options, binds the socket
(port 0 picks a free one, printed in the ready line the launchers wait for), loads the model, serves it
(server_app.serve) and exits when `--parent-pid` is gone. Binds 127.0.0.1 unless `--host` says otherwise. SIGTERM
or Ctrl-C stop it after server_app.SHUTDOWN_GRACE_S.

Exit status: 0 when stopped (or its parent is gone); START_UP_ERROR (2, as argparse exits on a bad flag) for a bad
option, a port it cannot listen on or a model it cannot load, with one line naming what is wrong, printed before
the model loads wherever the option allows; SCHEDULER_DIED (1) when the scheduler thread died while serving (its
traceback printed once, service.py), so that a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from common.config import PRECISIONS
from common.config_rules import is_device_name
from common.processes import pid_alive
from rollout_workers.sglang_api.protocol import SERVED_SCHEMES

if TYPE_CHECKING:
    from rollout_workers.sglang_api.service import ModelService

START_UP_ERROR = 2
SCHEDULER_DIED = 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncrl serve", description="The embedded engine behind SGLang's HTTP API.")
    parser.add_argument("model", help="a Hugging Face model directory (float, w8a8_int8 or FP8-block), or builtin:NAME")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=30000, help="TCP port (0 picks a free one; SGLang's default 30000)")
    parser.add_argument(
        "--quant",
        choices=SERVED_SCHEMES,
        default=None,
        help="served weight scheme (default: the checkpoint's quantization_config, else none)",
    )
    parser.add_argument("--weight-version", default="0", help="label of the weights loaded at start")
    parser.add_argument("--seed", type=int, default=0, help="seed of requests without sampling_seed")
    parser.add_argument("--max-batch", type=int, default=256, help="sequences decoded together (KV-cache slots)")
    parser.add_argument("--max-seq-len", type=int, default=2048, help="prompt + response positions per slot")
    parser.add_argument("--max-queued-requests", type=int, default=None,
                        help="requests that may wait to join the engine; one more is refused with 503 (default: no "
                             "limit, as SGLang)")  # fmt: skip
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--cache-dir", default="", help="cache of built-in models (builtin:NAME)")
    parser.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone (0: never)")
    parser.add_argument("--api-key", default="", help="SGLang's: requests but /health and /metrics need "
                        "`Authorization: Bearer KEY` (visible in `ps`: prefer --api-key-file)")  # fmt: skip
    parser.add_argument("--api-key-file", default="", help="the --api-key read from this file (keep it 0600)")
    lora = parser.add_argument_group("LoRA (SGLang's flags; rollout_workers/sglang_api/lora_serve.py)")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (/load_lora_adapter)")
    lora.add_argument("--max-lora-rank", type=int, default=None, help="the largest adapter rank accepted")
    lora.add_argument("--lora-target-modules", nargs="*", default=None, metavar="MODULE",
                      help="linears adapters go on (q_proj ... down_proj, qkv_proj, gate_up_proj, all)")  # fmt: skip
    lora.add_argument("--lora-paths", nargs="*", default=None, help="adapters loaded at start: PATH or NAME=PATH")
    return parser


def _exit_with(pid: int) -> None:
    """No orphaned servers: the launching worker gone (even killed), this process ends too."""
    while True:
        time.sleep(1.0)
        if not pid_alive(pid):
            print(f"asyncrl serve: --parent-pid {pid} is gone; exiting", file=sys.stderr, flush=True)
            os._exit(0)


def check_options(args: argparse.Namespace) -> None:
    """The options' ranges, before anything is bound or loaded: ValueError naming the option."""
    if args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535] (0 picks a free one), got {args.port}")
    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be at least 1 (sequences decoded together), got {args.max_batch}")
    if args.max_seq_len < 2:
        raise ValueError(f"--max-seq-len must be at least 2 (a prompt and a generated token), got {args.max_seq_len}")
    if not -(2**63) <= args.seed < 2**64:
        raise ValueError(f"--seed must fit in 64 bits, got {args.seed}")
    if args.max_lora_rank is not None and args.max_lora_rank < 1:
        raise ValueError(f"--max-lora-rank must be at least 1, got {args.max_lora_rank}")
    if not is_device_name(args.device):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if args.parent_pid < 0:
        raise ValueError(f"--parent-pid must be a process id (0: none), got {args.parent_pid}")
    if args.parent_pid and not pid_alive(args.parent_pid):
        raise ValueError(f"--parent-pid {args.parent_pid}: no such process")
    if args.api_key and args.api_key_file:
        raise ValueError("give --api-key or --api-key-file, not both")
    if args.api_key_file:
        try:
            args.api_key = Path(args.api_key_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"--api-key-file {args.api_key_file}: cannot read it ({err})") from None
        if not args.api_key:
            raise ValueError(f"--api-key-file {args.api_key_file} is empty")


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (server_app.listen), before the model loads: ValueError naming --host / --port."""
    from rollout_workers.sglang_api.server_app import listen

    try:
        return listen(host, port)
    except socket.gaierror as err:
        raise ValueError(f"--host {host}: cannot resolve it ({err.strerror})") from None
    except OSError as err:
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({err.strerror})") from None


def load(args: argparse.Namespace) -> ModelService:
    """The model (built first for builtin:NAME) on `--device`, with its LoRA adapters: ValueError or OSError."""
    import torch

    from common.builtin_model import ModelCacheError, resolve_model_path
    from rollout_workers.sglang_api.lora_serve import attach
    from rollout_workers.sglang_api.service import ModelService

    if args.device.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count <= int(args.device.partition(":")[2] or 0):
            seen = f"only {count} CUDA device(s)" if count else "no CUDA device"
            raise ValueError(f"--device {args.device}: torch sees {seen} on this machine")
    torch.set_num_threads(args.threads)
    try:
        model_dir = resolve_model_path(args.model, args.cache_dir, log=lambda *a: print(*a, file=sys.stderr))
    except ModelCacheError as cache_err:  # the cache of built-in models cannot be written
        err = cache_err.os_error
        where = f"--cache-dir {args.cache_dir}" if args.cache_dir else "the cache of built-in models (--cache-dir)"
        raise ValueError(f"{where}: cannot hold {args.model} ({err.strerror}: {err.filename})") from None
    if not model_dir.is_dir():
        raise ValueError(f"MODEL {args.model} is not a directory (a Hugging Face model directory, or builtin:NAME)")
    service = ModelService(
        str(model_dir),
        args.quant,
        args.weight_version,
        args.seed,
        args.max_batch,
        args.max_seq_len,
        args.precision,
        args.device,
        args.max_queued_requests,
    )
    try:
        attach(service, args)  # --enable-lora
    except BaseException:
        service.close()
        raise
    return service


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        check_options(args)
        sock = bind(args.host, args.port)
    except ValueError as err:
        print(f"asyncrl serve: {err}", file=sys.stderr)
        return START_UP_ERROR
    try:
        service = load(args)
    except (ValueError, OSError) as err:
        print(f"asyncrl serve: {err}", file=sys.stderr)
        sock.close()
        return START_UP_ERROR
    from rollout_workers.sglang_api.server_app import serve

    host, port = sock.getsockname()[:2]
    service.launch.update(host=host, port=port)
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    print(f"asyncrl serve: ready on {url} model={service.model_dir} quant={service.quant}", flush=True)
    if args.parent_pid:
        threading.Thread(target=_exit_with, args=(args.parent_pid,), name="parent-watch", daemon=True).start()
    try:
        serve(service, sock, args.api_key)
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        service.close()
    if service.failure is not None:
        print(f"asyncrl serve: exiting: the scheduler thread died ({service.failure})", file=sys.stderr, flush=True)
        return SCHEDULER_DIED
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
