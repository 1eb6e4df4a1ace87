"""`asyncrl serve MODEL`: the embedded engine behind SGLang's native HTTP API, on SGLang's own stack (FastAPI,
pydantic, uvicorn).

    uvicorn (h11, one event loop)  ->  server_app.py (FastAPI routes, schemas.py bodies)  ->  service.py
    parses HTTP, frames bodies          validates, answers SGLang's error shapes              the scheduler thread
                                        blocking calls in the thread pool                     that owns the engine

This module is the command line (parsed before anything heavy is imported): it loads the model, binds the socket
(port 0 picks a free one, printed in the ready line the launchers wait for), serves it (server_app.serve) and exits
when `--parent-pid` is gone. Binds 127.0.0.1 unless `--host` says otherwise. SIGTERM or Ctrl-C stop it after
server_app.SHUTDOWN_GRACE_S.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

from common.config import PRECISIONS
from rollout_workers.sglang_api.protocol import SERVED_SCHEMES


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
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--cache-dir", default="", help="cache of built-in models (builtin:NAME)")
    parser.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone (0: never)")
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
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(0)
        except PermissionError:
            pass


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    from common.builtin_model import resolve_model_path
    from rollout_workers.sglang_api.server_app import listen, serve
    from rollout_workers.sglang_api.service import ModelService

    torch.set_num_threads(args.threads)
    model_dir = str(resolve_model_path(args.model, args.cache_dir, log=lambda *a: print(*a, file=sys.stderr)))
    try:
        service = ModelService(
            model_dir,
            args.quant,
            args.weight_version,
            args.seed,
            args.max_batch,
            args.max_seq_len,
            args.precision,
            args.device,
        )
        from rollout_workers.sglang_api.lora_serve import attach

        attach(service, args)  # --enable-lora
    except (ValueError, OSError) as err:
        print(f"asyncrl serve: {err}", file=sys.stderr)
        return 2
    sock = listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    service.launch.update(host=host, port=port)
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    print(f"asyncrl serve: ready on {url} model={model_dir} quant={service.quant}", flush=True)
    if args.parent_pid:
        threading.Thread(target=_exit_with, args=(args.parent_pid,), name="parent-watch", daemon=True).start()
    try:
        serve(service, sock)
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        service.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
