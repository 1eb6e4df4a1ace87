"""Versioned weight publication over ZMQ: the learner side publishes, every rollout worker subscribes.

Protocol (no pickle; msgpack headers, raw tensor bytes as separate zero-copy frames):

    worker  -> publisher   [msgpack {"v": 1, "type": "get", "have": <version the worker runs>}]
    publisher -> worker    [msgpack header] + one frame per tensor, only if latest > have; else the header alone
    header = {"v": 1, "version": int, "scheme": str, "tensors": [{"name", "dtype", "shape", "nbytes", "crc32"}]}

A late or restarted worker asks with have=-1 and receives the latest version. The subscriber checks every frame's
length and CRC32 against the header; a corrupt or partial payload is dropped (counted) and fetched again, never
applied. The publisher serves from a background thread, so `publish` returns as soon as the version is set.
Sockets: ROUTER (publisher, binds 127.0.0.1 unless configured) and DEALER (subscriber), linger 0.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import numpy as np
import torch
import zmq

from rollout_workers.engine import WeightUpdate

PROTOCOL_VERSION = 1
_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().view(-1)
    return memoryview(flat.view(torch.uint8).numpy())


@dataclass(slots=True)
class _Version:
    header: bytes
    frames: list[memoryview]
    version: int


class WeightPublisher:
    """Serves the latest published version to any subscriber that asks for something newer."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        if port:
            self._socket.bind(f"tcp://{host}:{port}")
            self.endpoint = f"tcp://{host}:{port}"
        else:
            self.endpoint = f"tcp://{host}:{self._socket.bind_to_random_port(f'tcp://{host}')}"
        self._latest: _Version | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.served = 0
        self.bad_requests = 0
        self._thread = threading.Thread(target=self._serve, name="weight-publisher", daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        return -1 if self._latest is None else self._latest.version

    def publish(self, version: int, tensors: dict[str, torch.Tensor], scheme: str) -> None:
        """Make `tensors` the latest version (they must not be modified afterwards)."""
        frames, entries = [], []
        for name, tensor in tensors.items():
            data = _tensor_bytes(tensor)
            frames.append(data)
            entries.append(
                {
                    "name": name,
                    "dtype": _DTYPE_NAMES[tensor.dtype],
                    "shape": list(tensor.shape),
                    "nbytes": data.nbytes,
                    "crc32": zlib.crc32(data),
                }
            )
        header = msgpack.packb({"v": PROTOCOL_VERSION, "version": version, "scheme": scheme, "tensors": entries})
        with self._lock:
            self._latest = _Version(header=header, frames=frames, version=version)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                identity, payload = self._socket.recv_multipart()[:2]
                request = msgpack.unpackb(payload, max_bin_len=0, max_str_len=64, max_map_len=8)
                have = int(request["have"])
                if request.get("v") != PROTOCOL_VERSION or request.get("type") != "get":
                    raise ValueError("bad request")
            except Exception:  # a malformed request must not kill the publisher: count it and go on
                self.bad_requests += 1
                continue
            with self._lock:
                latest = self._latest
            if latest is None:
                self._socket.send_multipart([identity, msgpack.packb({"v": PROTOCOL_VERSION, "version": -1})])
            elif latest.version > have:
                self._socket.send_multipart([identity, latest.header, *latest.frames], copy=False)
                self.served += 1
            else:
                self._socket.send_multipart(
                    [identity, msgpack.packb({"v": PROTOCOL_VERSION, "version": latest.version})]
                )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._socket.close(0)


class PayloadError(ValueError):
    """A weight payload that does not match its header (partial, corrupt, wrong shape); never applied."""


def decode_payload(frames: list[bytes]) -> WeightUpdate | None:
    """Header + tensor frames -> WeightUpdate; None when the publisher has nothing newer. Raises PayloadError."""
    try:
        header = msgpack.unpackb(frames[0])
        version = int(header["version"])
    except Exception as err:
        raise PayloadError(f"unreadable weight header: {err}") from err
    entries = header.get("tensors")
    if entries is None:
        return None
    if len(entries) != len(frames) - 1:
        raise PayloadError(f"version {version}: header lists {len(entries)} tensors, got {len(frames) - 1} frames")
    tensors: dict[str, torch.Tensor] = {}
    for entry, frame in zip(entries, frames[1:]):
        name = entry["name"]
        if len(frame) != entry["nbytes"] or zlib.crc32(frame) != entry["crc32"]:
            raise PayloadError(f"version {version}: tensor {name} is corrupt or partial (length or CRC32 mismatch)")
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise PayloadError(f"version {version}: tensor {name} has unknown dtype {entry['dtype']!r}")
        raw = torch.from_numpy(np.frombuffer(bytearray(frame), dtype=np.uint8))
        tensor = raw.view(dtype)
        numel = int(np.prod(entry["shape"])) if entry["shape"] else 1
        if tensor.numel() != numel:
            raise PayloadError(f"version {version}: tensor {name} has {tensor.numel()} elements, shape says {numel}")
        tensors[name] = tensor.view(entry["shape"])
    return WeightUpdate(version=version, tensors=tensors, scheme=str(header["scheme"]))


class WeightSubscriber:
    """Polls a publisher from a background thread and hands each newer version to `on_update`."""

    def __init__(self, endpoint: str, on_update: Callable[[WeightUpdate], None], poll_s: float = 0.05):
        self.endpoint = endpoint
        self._on_update = on_update
        self._poll_s = poll_s
        self.have = -1
        self.rejected = 0
        self.received = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weight-subscriber", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        context = zmq.Context.instance()
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.endpoint)
        try:
            while not self._stop.is_set():
                socket.send(msgpack.packb({"v": PROTOCOL_VERSION, "type": "get", "have": self.have}))
                if not socket.poll(5000):  # publisher gone or busy: reconnect with a fresh socket
                    socket.close(0)
                    socket = context.socket(zmq.DEALER)
                    socket.setsockopt(zmq.LINGER, 0)
                    socket.connect(self.endpoint)
                    continue
                frames = socket.recv_multipart()
                try:
                    update = decode_payload(frames)
                except PayloadError:
                    self.rejected += 1
                    continue
                if update is not None and update.version > self.have:
                    self._on_update(update)
                    self.have = update.version
                    self.received += 1
                else:
                    self._stop.wait(self._poll_s)
        finally:
            socket.close(0)

    def wait_for(self, version: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.have < version and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.have >= version

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=6)
