"""CurveZMQ for the buffer and weight sockets: encryption and client authentication, on loopback as beyond it.

One setting, `buffer.curve_keys_dir`, names a directory with this layout (`asyncrl keys DIR` writes it):

| file | holds | read by |
|---|---|---|
| `server.key_secret` | the buffer's keypair | the buffer service only |
| `server.key` | the buffer's public key | every client (rollout workers, learner, driver) |
| `client.key_secret` | the keypair clients present | every client |
| `clients/*.key` | public keys of the clients the buffer accepts (the allow-list) | the buffer service only |

With keys, the service is a CURVE server whose ZAP handler (pyzmq's `ThreadAuthenticator`) admits only the client
public keys found in `clients/`; a client that does not know the server's public key, or whose key is not in the
allow-list, fails the handshake and never reaches the service (its requests time out; the service counts
`rejected_handshakes`). Without keys the socket is plain ZMQ, which `BufferConfig` allows only on a loopback host.
A local run with no such directory gets one of its own (`buffer.run_keys`, on by default): `make_run_keys` writes
fresh keys into a private temporary directory that the driver removes when the run ends, since loopback ports are
open to every user of the machine. On a cluster, copy the directory to every node; nodes that run only clients need
neither `server.key_secret` nor `clients/`. Add a node's own client key by generating it with
`zmq.auth.create_certificates` and copying its public `.key` file into `clients/`.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

SERVER_SECRET = "server.key_secret"
SERVER_PUBLIC = "server.key"
CLIENT_SECRET = "client.key_secret"
ALLOWED_CLIENTS = "clients"
KEY = "buffer.curve_keys_dir"


class CurveKeyError(ValueError):
    """A missing or unreadable CurveZMQ key; the message names `buffer.curve_keys_dir` and the file."""


@dataclass(frozen=True, slots=True)
class ServerKeys:
    """What the buffer service needs: its keypair (Z85) and the directory of allowed client public keys."""

    public: bytes
    secret: bytes
    allowed_dir: Path


@dataclass(frozen=True, slots=True)
class ClientKeys:
    """What a client needs: its own keypair and the buffer's public key (all Z85, 40 bytes each)."""

    public: bytes
    secret: bytes
    server_public: bytes


def _load(keys_dir: str, name: str, need_secret: bool) -> tuple[bytes, bytes | None]:
    import zmq.auth

    path = Path(keys_dir).expanduser() / name
    if not path.is_file():
        raise CurveKeyError(f"`{KEY}={keys_dir}`: {path} does not exist (create the keys with `asyncrl keys DIR`)")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as err:
        raise CurveKeyError(f"`{KEY}={keys_dir}`: cannot read {path}: {err}") from None
    if need_secret and not secret:
        raise CurveKeyError(f"`{KEY}={keys_dir}`: {path} has no secret-key")
    if not _is_key(public) or (secret is not None and not _is_key(secret)):
        raise CurveKeyError(f"`{KEY}={keys_dir}`: {path} does not hold 40-character Z85 CurveZMQ keys")
    return public, secret


def _is_key(key: bytes) -> bool:
    """A 40-character Z85 text that decodes to a 32-byte key (a stray character would fail only at socket setup)."""
    from zmq.utils import z85

    try:
        return len(key) == 40 and len(z85.decode(key)) == 32
    except (ValueError, KeyError, TypeError):
        return False


def server_keys(keys_dir: str) -> ServerKeys | None:
    """The service's keys from `keys_dir` (None if empty); CurveKeyError if a file or the allow-list is missing."""
    if not keys_dir:
        return None
    public, secret = _load(keys_dir, SERVER_SECRET, need_secret=True)
    assert secret is not None
    allowed = Path(keys_dir).expanduser() / ALLOWED_CLIENTS
    if not allowed.is_dir() or not any(allowed.glob("*.key")):
        raise CurveKeyError(f"`{KEY}={keys_dir}`: no allowed client keys (`*.key` files) in {allowed}")
    for client in sorted(allowed.glob("*.key")):  # one bad file makes ZMQ's authenticator admit no one at all
        _load(keys_dir, f"{ALLOWED_CLIENTS}/{client.name}", need_secret=False)
    return ServerKeys(public, secret, allowed)


def client_keys(keys_dir: str) -> ClientKeys | None:
    """A client's keys from `keys_dir` (None if empty); raises CurveKeyError if a file is missing."""
    if not keys_dir:
        return None
    public, secret = _load(keys_dir, CLIENT_SECRET, need_secret=True)
    server_public, _ = _load(keys_dir, SERVER_PUBLIC, need_secret=False)
    assert secret is not None
    return ClientKeys(public, secret, server_public)


def create_keys(keys_dir: str | os.PathLike[str]) -> list[Path]:
    """Write a server keypair, a client keypair and the allow-list holding that client (layout: module docstring).

    Refuses to overwrite existing keys. Secret files are made readable by their owner only. Returns the files.
    """
    import zmq.auth

    if not str(keys_dir).strip():
        raise ValueError("the keys directory is empty: name a new directory")
    root = Path(keys_dir).expanduser()
    names = (SERVER_SECRET, SERVER_PUBLIC, CLIENT_SECRET, "client.key", f"{ALLOWED_CLIENTS}/client.key")
    existing = [root / name for name in names if (root / name).exists()]
    if existing:
        raise FileExistsError(f"{existing[0]} exists; not overwriting CurveZMQ keys (choose an empty directory)")
    written: list[Path] = []
    umask = os.umask(0o077)  # secret files are never readable by others, not even for a moment
    try:
        (root / ALLOWED_CLIENTS).mkdir(parents=True, exist_ok=True)
        for name in ("server", "client"):
            public_file, secret_file = zmq.auth.create_certificates(root, name)
            written += [Path(public_file), Path(secret_file)]
        written.append(root / ALLOWED_CLIENTS / "client.key")
        written[-1].write_bytes((root / "client.key").read_bytes())
    finally:
        os.umask(umask)
    for path in written:
        if not path.name.endswith("_secret"):
            os.chmod(path, 0o644)  # public keys: meant to be copied around
    return written


RUN_KEYS_PREFIX = "asyncrl-keys-"
"""Name prefix of a run's own keys directory (`make_run_keys`): `asyncrl-keys-<driver pid>-<random>`, in the system's
temporary directory."""


def make_run_keys() -> Path:
    """A fresh directory (mode 0700, in the system's temporary directory) holding new keys for one run; the caller
    removes it when the run ends. Its secret files are readable by their owner only, as `create_keys` writes them.
    First removes the directories that drivers killed before they could remove theirs left behind
    (`sweep_run_keys`)."""
    sweep_run_keys(Path(tempfile.gettempdir()))
    root = Path(tempfile.mkdtemp(prefix=f"{RUN_KEYS_PREFIX}{os.getpid()}-"))
    create_keys(root)
    return root


def sweep_run_keys(temp_dir: Path) -> list[Path]:
    """Remove this user's run-keys directories in `temp_dir` whose driver is gone (a driver killed by SIGKILL cannot
    remove its own); returns them."""
    from common.processes import sweep_dead_owner_dirs

    return sweep_dead_owner_dirs(temp_dir, RUN_KEYS_PREFIX)
