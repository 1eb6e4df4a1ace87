"""The Ray cluster of a run: token authentication always on, and a local cluster that listens on loopback only.

- `ray.address` empty (the default): a local cluster whose every server (GCS, raylet, object manager, core
  workers, runtime-env agent) listens on 127.0.0.1, guarded by a fresh per-run token in a private file (0600). It
  declares `ray.num_cpus * ray.local_oversubscribe` logical CPUs (`RayConfig.local_cpus`): Ray's CPUs only decide
  where an actor may start, and on one machine of asyncrl's own, actors past the cores share them as processes do,
  so `asyncrl scale` can add rollout workers past the core count.
  The head runs without Ray's autoscaler monitor (a local cluster never scales) and without the dashboard's API
  server (`include_dashboard=False` still starts it, minimal, and `ray.init` waits for it to publish its address):
  two Python processes that import Ray, about 1.4 CPU-seconds of a 2-core start-up (`LEAN_HEAD_SKIPS`).
- `ray.address` = `host:port` or `auto`: a cluster started elsewhere, joined with the user's token
  (`RAY_AUTH_TOKEN`, `RAY_AUTH_TOKEN_PATH`, or Ray's `~/.ray/auth_token`). A cluster that admits clients without
  a token is refused unless `ray.allow_unauthenticated` is set, which warns on every run.

Two facts of Ray 2.60 this rests on (docs/security.md):
- A loopback `node_ip_address` is replaced by the machine's address unless `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`
  (`ray._private.services.get_node_ip_address`); with it, the compiled servers bind the node address, 127.0.0.1.
  Ray reads it when it is imported, so it is set before the first `import ray` of the process.
- A client sends its token only with `RAY_AUTH_MODE=token`; a cluster's own mode is not visible to a client that
  sends one, so `probe_open` asks from a fresh process that sends none.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from common.config import RayConfig

TOKEN_FILE = "auth_token"
LOCAL_HOST = "127.0.0.1"
_PROBE = """
import sys
from ray._raylet import GcsClient
try:
    GcsClient(address=sys.argv[1]).internal_kv_get(b"asyncrl-auth-probe", None, timeout=10)
except Exception as err:
    print("refused" if "auth" in f"{type(err).__name__} {err}".lower() else f"error {type(err).__name__}: {err}")
else:
    print("open")
"""


class RayAuthError(RuntimeError):
    """The cluster named by `ray.address` cannot be joined with token authentication: the message says why."""


def local_token_file(temp_dir: Path) -> Path:
    """A fresh random token in `temp_dir`/auth_token, readable by this user only (written 0600 from the start)."""
    path = temp_dir / TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_hex(32))
    return path


def _has_token(environ: dict[str, str]) -> bool:
    path = environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / TOKEN_FILE)
    return bool(environ.get("RAY_AUTH_TOKEN")) or Path(path).is_file()


def probe_open(address: str, timeout_s: float = 60.0) -> bool:
    """True if the cluster at `address` (host:port of its GCS) answers a client that sends no token."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}  # no mode: no token is sent
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, address], env=environ, capture_output=True, text=True, timeout=timeout_s
    )
    verdict = (result.stdout.strip().splitlines() or [""])[-1]
    if verdict not in ("open", "refused"):
        raise RayAuthError(
            f"ray.address={address}: could not reach the cluster's GCS ({verdict or result.stderr[-300:]})"
        )
    return verdict == "open"


def _gcs_address(address: str) -> str:
    if address != "auto":
        return address
    from ray._private.services import canonicalize_bootstrap_address_or_die

    return canonicalize_bootstrap_address_or_die("auto")


def connect(ray_cfg: RayConfig, warn: Callable[[str], object] = print) -> None:
    """`ray.init` for a run (see the module docstring) on this thread; call it before anything else of this process
    imports ray. A local cluster's private directory is removed when the process exits (after Ray's own exit hook,
    registered later, has shut the cluster down)."""
    import atexit
    import shutil

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if ray_cfg.address:
        _join(ray_cfg, warn)
    else:
        temp_dir, private = _prepare_local()
        atexit.register(shutil.rmtree, private, True)
        _init_local(ray_cfg.local_cpus(), temp_dir)


class RayStart:
    """A `connect` under way: a local cluster starts on a thread while the caller goes on (`wait` joins the start).

    The thread lives until `close`: Ray ties its GCS and raylet to the thread that started them (PR_SET_PDEATHSIG,
    the kernel signals them when that thread exits), so it must outlive the run; call `close` after `ray.shutdown`.
    """

    def __init__(self, private_dir: Path | None = None) -> None:
        self.private_dir = private_dir
        """A local cluster's private directory: its token file and Ray's temp directory (sockets, logs)."""
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._release = threading.Event()
        self._error: BaseException | None = None

    def _start(self, start: Callable[[], None]) -> None:
        self._thread = threading.Thread(target=self._run, args=(start,), name="ray-init", daemon=True)
        self._thread.start()

    def _run(self, start: Callable[[], None]) -> None:
        try:
            start()
        except BaseException as err:  # handed to `wait`, in the caller's thread
            self._error = err
        finally:
            self._started.set()
        self._release.wait()  # the cluster's processes live while this thread does

    def wait(self) -> None:
        """Until Ray is up; raises what the start raised."""
        if self._thread is not None:
            self._started.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def settle(self) -> None:
        """Until the start is over, whatever its outcome (an error stays for `wait` to raise)."""
        if self._thread is not None:
            self._started.wait()

    def close(self) -> None:
        """Once the start is over (whatever its outcome), let the thread end: after `ray.shutdown`, or the cluster's
        processes are signalled by the kernel."""
        if self._thread is not None:
            self._started.wait()
            self._release.set()
            self._thread.join()
            self._thread = None

    def remove_files(self, keep_logs: bool) -> None:
        """After `close`: remove a local cluster's private directory, or with `keep_logs` (a failed run: Ray's logs
        are in it) its token only. They stayed in /tmp after every run (139 of them on one machine)."""
        import shutil

        if self.private_dir is None:
            return
        if keep_logs:
            (self.private_dir / TOKEN_FILE).unlink(missing_ok=True)
        else:
            shutil.rmtree(self.private_dir, ignore_errors=True)


def connect_in_background(ray_cfg: RayConfig, warn: Callable[[str], object] = print) -> RayStart:
    """`connect`, with a local cluster's `import ray` and `ray.init` (2-3 s on 2 cores) on a thread, so that the caller
    starts its other services meanwhile; joining a cluster is done here, before returning. The environment (loopback
    address, token mode, token file) is set here, in the calling thread, before the thread starts: processes the
    caller starts meanwhile inherit it, the same as those it starts after."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if ray_cfg.address:
        _join(ray_cfg, warn)
        return RayStart()
    temp_dir, private_dir = _prepare_local()
    start = RayStart(private_dir)
    start._start(lambda: _init_local(ray_cfg.local_cpus(), temp_dir))
    return start


def _prepare_local() -> tuple[Path, Path]:
    """The environment of a private local cluster, set before the first `import ray` (module docstring); returns
    Ray's temp directory and the private (0700) directory that holds it and the token file."""
    if "ray" in sys.modules:
        from ray._private import ray_constants

        if ray_constants.ENABLE_RAY_CLUSTER:  # read by Ray at import: ray was imported before this function set it
            raise RuntimeError(
                "ray was imported before asyncrl.raycluster.connect: the local cluster would not be private"
            )
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep the loopback node address (module docstring)
    # Ray runs its workers at nice 15 by default: on a machine shared with other work at nice 0 the learner and the
    # rollout workers would get a fraction of the CPU that a single-process trainer gets; the user's value wins.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Ray makes its temp directory 0777 (for other users' sessions), and again as its processes start: it goes inside
    # a private (0700) one, which also holds the token (in Ray's, another local user could have replaced the token
    # file, or its sockets)
    private = Path(tempfile.mkdtemp(prefix="asyncrl-ray-", dir="/tmp"))
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(local_token_file(private))
    os.environ.pop("RAY_AUTH_TOKEN", None)  # the file is the one token of this cluster
    return private / "ray", private


LEAN_HEAD_SKIPS = ("start_monitor", "start_api_server")
"""The methods of Ray's `Node` whose processes a local cluster's head does without (module docstring); a Ray
without one of them starts its head as it is."""


def _skipped(self: object, *args: object, **kwargs: object) -> None:
    return None


@contextlib.contextmanager
def _lean_head() -> Iterator[None]:
    """While `ray.init` starts a local cluster: its head node starts no process of `LEAN_HEAD_SKIPS`."""
    from ray._private.node import Node

    saved = {name: Node.__dict__.get(name) for name in LEAN_HEAD_SKIPS}
    if not all(saved.values()):
        yield
        return
    for name in LEAN_HEAD_SKIPS:
        setattr(Node, name, _skipped)
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(Node, name, method)


class _NotMainThreadNote(logging.Filter):
    """Drops Ray's note that `ray.init` off the main thread sets no SIGTERM handler: the driver sets its own."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


def _init_local(logical_cpus: int, temp_dir: Path) -> None:
    import ray
    from ray._private import ray_constants

    if ray_constants.ENABLE_RAY_CLUSTER:  # read by Ray at import: ray was imported before this function set it
        raise RuntimeError("ray was imported before asyncrl.raycluster.connect: the local cluster would not be private")
    note = _NotMainThreadNote()
    ray_logger = logging.getLogger("ray._private.worker")
    ray_logger.addFilter(note)
    try:
        with _lean_head():
            ray.init(num_cpus=logical_cpus, include_dashboard=False, log_to_driver=True, _node_ip_address=LOCAL_HOST,
                     _temp_dir=str(temp_dir))  # fmt: skip
    finally:
        ray_logger.removeFilter(note)


def _join(ray_cfg: RayConfig, warn: Callable[[str], object]) -> None:
    import ray

    gcs = _gcs_address(ray_cfg.address)
    if probe_open(gcs):
        if not ray_cfg.allow_unauthenticated:
            raise RayAuthError(
                f"ray.address={ray_cfg.address}: the cluster admits clients without a token, so anyone who reaches "
                "its ports can run code on it. Restart it with token authentication (RAY_AUTH_MODE=token, see "
                "docs/security.md), or set ray.allow_unauthenticated=true to accept the risk"
            )
        warn(f"WARNING: ray.address={ray_cfg.address} runs WITHOUT token authentication (ray.allow_unauthenticated)")
        os.environ.pop("RAY_AUTH_MODE", None)  # the cluster checks no token; Ray's local default must not apply
    else:
        if not _has_token(dict(os.environ)):
            raise RayAuthError(
                f"ray.address={ray_cfg.address}: the cluster needs its token; set RAY_AUTH_TOKEN_PATH to the token "
                "file (or RAY_AUTH_TOKEN); `ray get-auth-token` prints it on the head node"
            )
        os.environ["RAY_AUTH_MODE"] = "token"  # a client sends its token only in this mode
    quiet = ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS", "TOKENIZERS_PARALLELISM", "PYTHONWARNINGS")
    env_vars = {name: os.environ[name] for name in quiet if name in os.environ}
    try:
        ray.init(address=ray_cfg.address, log_to_driver=True, runtime_env={"env_vars": env_vars})
    except ConnectionError as err:
        raise RayAuthError(f"ray.address={ray_cfg.address}: could not join the cluster ({err}); a wrong token "
                           "looks the same as no token to Ray") from err  # fmt: skip
