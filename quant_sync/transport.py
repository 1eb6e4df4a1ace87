"""Versioned weight publication: the learner publishes each version once, every rollout worker fetches the latest.

Two paths, one protocol (msgpack control messages, raw tensor bytes as zero-copy ZMQ frames, no pickle):

    worker -> publisher  {"v": 2, "type": "get", "have": <version the worker runs>, "wait_ms": W (optional)}
    publisher -> worker  the header of the latest version if it is newer than `have`, else {"v": 2, "version": V}
                         (with `wait_ms`, a long poll: the answer waits until a newer version is published or
                         W ms, at most MAX_WAIT_MS, have passed)
    header = {"v": 2, "version", "scheme", "boot_id", "shm": path | None,
              "tensors": [{"name", "dtype", "shape", "nbytes", "file_offset"}],
              "chunks": [[tensor index, byte offset in the tensor, length, xxh3-64 digest], ...]}
    worker -> publisher  {"v": 2, "type": "chunk", "version": V, "index": i}      (a window of these in flight)
    publisher -> worker  [{"v": 2, "version": V, "index": i}, <chunk bytes>]  or {..., "gone": true}

- Chunked: tensors travel in chunks of at most `chunk_bytes` (4 MiB), each with its own xxh3-64 digest, so a
  multi-GB version never sits in one ZMQ message, and a corrupt or truncated chunk is rejected (counted) and
  fetched again alone. A payload is applied only when every chunk checks out; a header that does not describe
  its tensors exactly (sizes, dtypes, chunk coverage) is rejected whole.
- Local fast path: when the publisher can write to `/dev/shm`, each version is also written there once (to a
  temporary name, then renamed: readers never see a partial file). The file of the next version is allocated in
  the background after each publish (a spare), so that publishing only copies bytes into pages that exist. A
  worker on the same machine (same kernel boot id) maps that file copy-on-write instead of fetching chunks,
  verifies every chunk digest on the mapping, and hands the engine tensors that are views of it: no socket copy
  at all. Any failure (file gone, digest mismatch) falls back to the ZMQ path for that version.
- The publisher keeps the last `keep_versions` versions, so a worker still fetching version k when k+1 is
  published completes it; a chunk of a dropped version answers `gone` and the worker starts over on the latest.
- A late or restarted worker asks with have=-1 and receives the latest version.

Sockets: ROUTER (publisher, binds 127.0.0.1 unless configured) and DEALER (subscriber), linger 0. The publisher
serves from a background thread, so `publish` returns once the version is hashed (and written to /dev/shm).
With the buffer's CurveZMQ keys (`buffer.curve_keys_dir`, common/curve.py; required when binding beyond loopback)
the publisher is a CURVE server admitting only allow-listed client keys, and subscribers connect with theirs. A
wildcard bind (0.0.0.0) is advertised as this node's routable address.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgpack
import numpy as np
import torch
import xxhash
import zmq

from common.netaddr import bind
from quant_sync.update import WeightUpdate

if TYPE_CHECKING:
    from common.curve import ClientKeys, ServerKeys

PROTOCOL_VERSION = 2
CHUNK_BYTES = 4 << 20
WINDOW_CHUNKS = 8
"""Chunk requests a subscriber keeps in flight (ZMQ path)."""
MAX_WAIT_MS = 2000
"""Longest long poll the publisher holds a `get` for."""
LONG_POLL_MS = 1000
"""How long a subscriber's `get` waits at the publisher for a newer version (well under its reply timeout)."""
MAX_TENSORS = 1 << 16
MAX_CHUNKS = 1 << 22
MAX_CHUNK_BYTES = 1 << 30
"""Largest chunk a header may announce (publishers use `chunk_bytes`, 4 MiB by default)."""
MAX_VERSION_BYTES = 1 << 40
"""Largest version a header may announce (1 TiB): a bound on what a hostile header can make a worker allocate."""
SHM_DIR = "/dev/shm"
_ALIGN = 64
_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def boot_id() -> str:
    """This kernel's boot id: equal on both ends only when they share a machine (and its /dev/shm)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().view(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def _digest(data: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


@dataclass(slots=True)
class _Version:
    version: int
    header: bytes
    chunks: list[memoryview]
    shm_path: str | None


class WeightPublisher:
    """Serves the latest published version (header, chunks, /dev/shm file) to every subscriber that asks."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        shm_dir: str | None = "auto",
        chunk_bytes: int = CHUNK_BYTES,
        keep_versions: int = 2,
        curve: ServerKeys | None = None,
    ):
        if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in (0, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
        # A CURVE server gets its own context: its ZAP handler then answers for this socket alone.
        self._context = zmq.Context() if curve is not None else zmq.Context.instance()
        self._auth = None
        if curve is not None:
            from zmq.auth.thread import ThreadAuthenticator

            self._auth = ThreadAuthenticator(self._context)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(curve.allowed_dir))
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            self._socket.curve_secretkey = curve.secret
            self._socket.curve_publickey = curve.public
            self._socket.curve_server = True
        self.endpoint = bind(self._socket, host, port)
        if shm_dir == "auto":
            shm_dir = SHM_DIR if os.access(SHM_DIR, os.W_OK) else None
        self.shm_dir = shm_dir
        self.chunk_bytes = chunk_bytes
        self.keep_versions = max(1, keep_versions)
        self._prefix = f"asyncrl-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._boot_id = boot_id()
        self._versions: OrderedDict[int, _Version] = OrderedDict()
        self._latest: _Version | None = None
        self._lock = threading.Lock()
        self._spare_path = os.path.join(shm_dir, f"{self._prefix}-spare") if shm_dir else ""
        self._spare_bytes = 0  # size of the preallocated spare file (0: none ready)
        self._spare_lock = threading.Lock()  # held while the spare is being allocated
        self._housekeeper: threading.Thread | None = None  # unlinks evicted files, allocates the spare
        self._parked: list[tuple[bytes, int, float]] = []  # long polls: (identity, have, deadline), serve thread only
        self._wake_endpoint = f"inproc://weights-wake-{uuid.uuid4().hex}"  # unique even if an unclosed one lingers
        self._wake_in = self._context.socket(zmq.PULL)
        self._wake_in.bind(self._wake_endpoint)
        self._wake_out = self._context.socket(zmq.PUSH)  # publish() -> serve thread: a version was published
        self._wake_out.setsockopt(zmq.LINGER, 0)
        self._wake_out.connect(self._wake_endpoint)
        self._stop = threading.Event()
        self.served = 0
        self.chunks_served = 0
        self.bad_requests = 0
        self.last_publish_s = 0.0
        self._thread = threading.Thread(target=self._serve, name="weight-publisher", daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        return -1 if self._latest is None else self._latest.version

    def publish(self, version: int, tensors: dict[str, torch.Tensor], scheme: str) -> None:
        """Make `tensors` the latest version (they must not be modified afterwards): hash, write /dev/shm, serve."""
        started = time.perf_counter()
        entries, chunks, table, views = [], [], [], []
        file_offset = 0
        for index, (name, tensor) in enumerate(tensors.items()):
            if tensor.dtype not in _DTYPE_NAMES:
                raise ValueError(f"version {version}: tensor {name} has dtype {tensor.dtype}, not publishable")
            data = _tensor_bytes(tensor)
            views.append(data)
            entries.append({"name": name, "dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                            "nbytes": data.nbytes, "file_offset": file_offset})  # fmt: skip
            for offset in range(0, data.nbytes, self.chunk_bytes):
                chunk = data[offset : offset + self.chunk_bytes]
                chunks.append(chunk)
                table.append([index, offset, chunk.nbytes, _digest(chunk)])
            file_offset += -(-data.nbytes // _ALIGN) * _ALIGN
        shm_path = self._write_shm(version, views, entries) if self.shm_dir else None
        header = msgpack.packb({"v": PROTOCOL_VERSION, "version": version, "scheme": scheme, "tensors": entries,
                                "chunks": table, "shm": shm_path, "boot_id": self._boot_id})  # fmt: skip
        published = _Version(version=version, header=header, chunks=chunks, shm_path=shm_path)
        with self._lock:
            self._versions[version] = published
            self._latest = published
            evicted = []
            while len(self._versions) > self.keep_versions:
                evicted.append(self._versions.popitem(last=False)[1])
        self.last_publish_s = time.perf_counter() - started
        with self._lock, contextlib.suppress(zmq.Again):  # a wake already queued will do
            self._wake_out.send(b"", zmq.NOBLOCK)
        dropped = [old.shm_path for old in evicted if old.shm_path]
        if dropped or shm_path is not None:  # freeing and allocating tmpfs pages: off the caller's clock
            self._housekeeper = threading.Thread(target=self._housekeep, args=(dropped, file_offset), daemon=True)
            self._housekeeper.start()

    def _housekeep(self, dropped: list[str], spare_bytes: int) -> None:
        for path in dropped:  # mapped readers keep their pages: unlinking only drops the name
            _unlink(path)
        if self.shm_dir:
            self._allocate_spare(spare_bytes)

    def _allocate_spare(self, nbytes: int) -> None:
        """Allocate the next version's /dev/shm file ahead of time (tmpfs pages are allocated and zeroed here), so
        that `publish` only copies into it: 158 MB took 108 ms to write into a fresh file, 40 ms into a spare."""
        if not self._spare_lock.acquire(blocking=False):
            return
        try:
            if self._spare_bytes >= nbytes or self._stop.is_set():
                return
            fd = os.open(self._spare_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                os.posix_fallocate(fd, 0, nbytes)
                self._spare_bytes = nbytes
            except OSError:  # /dev/shm full: publish writes a fresh file, or falls back to ZMQ
                _unlink(self._spare_path)
            finally:
                os.close(fd)
        finally:
            self._spare_lock.release()

    def _take_spare(self, nbytes: int, tmp: str) -> bool:
        """Rename the spare file to `tmp` if one of at least `nbytes` is ready (never waits for one)."""
        if not self._spare_lock.acquire(blocking=False):
            return False
        try:
            if self._spare_bytes < nbytes:
                return False
            os.replace(self._spare_path, tmp)
            self._spare_bytes = 0
            return True
        except OSError:
            self._spare_bytes = 0
            return False
        finally:
            self._spare_lock.release()

    def _write_shm(self, version: int, views: list[memoryview], entries: list[dict]) -> str | None:
        path = os.path.join(self.shm_dir, f"{self._prefix}-v{version}")  # type: ignore[arg-type]
        tmp = path + ".tmp"
        nbytes = max((e["file_offset"] + e["nbytes"] for e in entries), default=0)
        try:
            with open(tmp, "r+b") if self._take_spare(nbytes, tmp) else open(tmp, "wb") as file:
                for data, entry in zip(views, entries):
                    file.seek(entry["file_offset"])
                    file.write(data)
                file.truncate(nbytes)
            os.replace(tmp, path)
            return path
        except OSError:  # /dev/shm full or gone: the ZMQ path still serves this version
            _unlink(tmp)
            return None

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        while not self._stop.is_set():
            now = time.monotonic()
            timeout = min([100.0] + [(deadline - now) * 1000 for _, _, deadline in self._parked])
            events = dict(poller.poll(max(0, int(timeout))))
            if self._wake_in in events:
                while self._wake_in.poll(0):
                    self._wake_in.recv()
            self._answer_parked()
            if self._socket not in events:
                continue
            try:
                identity, payload = self._socket.recv_multipart(copy=True)[:2]
                request = msgpack.unpackb(payload, max_bin_len=0, max_str_len=64, max_map_len=8)
                if request.get("v") != PROTOCOL_VERSION or request.get("type") not in ("get", "chunk"):
                    raise ValueError("bad request")
                if request["type"] == "get":
                    wait_ms = min(max(int(request.get("wait_ms", 0)), 0), MAX_WAIT_MS)
                    self._answer_get(identity, int(request["have"]), wait_ms)
                else:
                    self._answer_chunk(identity, int(request["version"]), int(request["index"]))
            except Exception:  # a malformed request must not kill the publisher: count it and go on
                self.bad_requests += 1

    def _answer_get(self, identity: bytes, have: int, wait_ms: int = 0) -> None:
        with self._lock:
            latest = self._latest
        if latest is not None and latest.version > have:
            self._socket.send_multipart([identity, latest.header])
            self.served += 1
        elif wait_ms > 0:  # a long poll: answered by _answer_parked
            self._parked = [p for p in self._parked if p[0] != identity]  # a subscriber asks one thing at a time
            self._parked.append((identity, have, time.monotonic() + wait_ms / 1000))
        else:
            version = -1 if latest is None else latest.version
            self._socket.send_multipart([identity, msgpack.packb({"v": PROTOCOL_VERSION, "version": version})])

    def _answer_parked(self) -> None:
        """Answer the long polls that a newer version satisfies, and those whose wait is over."""
        if not self._parked:
            return
        with self._lock:
            latest = self._latest
        now, waiting = time.monotonic(), []
        for identity, have, deadline in self._parked:
            if (latest is not None and latest.version > have) or now >= deadline:
                self._answer_get(identity, have)
            else:
                waiting.append((identity, have, deadline))
        self._parked = waiting

    def _answer_chunk(self, identity: bytes, version: int, index: int) -> None:
        with self._lock:
            held = self._versions.get(version)
        reply = {"v": PROTOCOL_VERSION, "version": version, "index": index}
        if held is None or not 0 <= index < len(held.chunks):
            self._socket.send_multipart([identity, msgpack.packb({**reply, "gone": True})])
            return
        self._socket.send_multipart([identity, msgpack.packb(reply), held.chunks[index]], copy=False)
        self.chunks_served += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        if self._housekeeper is not None:
            self._housekeeper.join()
        self._socket.close(0)
        self._wake_out.close(0)
        self._wake_in.close(0)
        if self._auth is not None:
            self._auth.stop()
            self._context.term()
        with self._lock:
            versions, self._versions, self._latest = list(self._versions.values()), OrderedDict(), None
        for held in versions:
            _unlink(held.shm_path)
        with self._spare_lock:  # waits for an allocation in progress
            _unlink(self._spare_path or None)
            self._spare_bytes = 0


def _unlink(path: str | None) -> None:
    if path:
        with contextlib.suppress(OSError):
            os.unlink(path)


class PayloadError(ValueError):
    """A weight header or chunk that does not check out (partial, corrupt, inconsistent); never applied."""


class ShmUnavailable(PayloadError):
    """No usable shared-memory copy here (another machine, or the file is gone): not corruption, use ZMQ."""


@dataclass(frozen=True, slots=True)
class Manifest:
    """A validated version header."""

    version: int
    scheme: str
    tensors: list[dict]
    chunks: list[tuple[int, int, int, int]]
    shm: str | None
    boot_id: str

    @property
    def nbytes(self) -> int:
        return sum(int(entry["nbytes"]) for entry in self.tensors)


def _int(value: object) -> int:
    if type(value) is not int:
        raise TypeError(f"{value!r} is not an int")
    return value


def parse_header(frame: bytes) -> Manifest | int:
    """A header frame -> its Manifest, or the publisher's version (int) when it has nothing newer.

    Raises PayloadError unless the header describes its tensors exactly: unique str names, known dtypes, shapes of
    non-negative ints, nbytes = numel x itemsize (at most MAX_VERSION_BYTES in all), file offsets that are
    non-negative multiples of 64 and do not overlap, and chunks of at most MAX_CHUNK_BYTES that cover each tensor's
    bytes in order without gaps or overlaps.
    """
    try:
        header = msgpack.unpackb(frame, max_bin_len=0, max_array_len=MAX_CHUNKS)
        version = _int(header["version"])
        if header.get("v") != PROTOCOL_VERSION:
            raise ValueError(f"protocol {header.get('v')!r}, expected {PROTOCOL_VERSION}")
        if "tensors" not in header:
            return version
        tensors, chunks = header["tensors"], [tuple(map(_int, c)) for c in header["chunks"]]
        if any(len(chunk) != 4 for chunk in chunks):
            raise ValueError("a chunk entry is not [tensor, offset, length, digest]")
        scheme, shm, boot = str(header["scheme"]), header.get("shm"), str(header.get("boot_id", ""))
    except Exception as err:
        raise PayloadError(f"unreadable weight header: {err}") from err
    if not isinstance(tensors, list) or len(tensors) > MAX_TENSORS:
        raise PayloadError(f"version {version}: bad tensor list")
    covered = [0] * len(tensors)
    for index, offset, length, _ in chunks:
        if not 0 <= index < len(tensors) or offset != covered[index] or not 0 < length <= MAX_CHUNK_BYTES:
            raise PayloadError(f"version {version}: chunk table does not tile tensor {index} in order")
        covered[index] += length
    names, total, file_end = set(), 0, 0
    for index, entry in enumerate(tensors):
        try:
            name, dtype = entry["name"], _DTYPES[entry["dtype"]]
            shape = [_int(dim) for dim in entry["shape"]]
            nbytes, file_offset = _int(entry["nbytes"]), _int(entry["file_offset"])
            if type(name) is not str or name in names:
                raise ValueError(f"name {name!r} is not a unique str")
        except (KeyError, TypeError, ValueError) as err:
            raise PayloadError(f"version {version}: tensor entry {index} is malformed ({err})") from err
        names.add(name)
        if min(shape, default=0) < 0 or nbytes != math.prod(shape) * dtype.itemsize or covered[index] != nbytes:
            raise PayloadError(f"version {version}: tensor {name!r} sizes disagree (shape, dtype, chunks)")
        if file_offset % _ALIGN or file_offset < file_end:
            raise PayloadError(f"version {version}: tensor {name!r} has a misplaced file offset {file_offset}")
        total, file_end = total + nbytes, file_offset + nbytes
        if total > MAX_VERSION_BYTES:
            raise PayloadError(f"version {version}: more than {MAX_VERSION_BYTES} bytes of weights")
    return Manifest(version, scheme, tensors, chunks, shm if isinstance(shm, str) else None, boot)


def assemble(manifest: Manifest, buffers: list[torch.Tensor]) -> WeightUpdate:
    """Per-tensor byte buffers (uint8, already verified) -> the WeightUpdate the engine stages."""
    tensors = {}
    for entry, raw in zip(manifest.tensors, buffers):
        tensors[entry["name"]] = raw.view(_DTYPES[entry["dtype"]]).view(entry["shape"])
    return WeightUpdate(version=manifest.version, tensors=tensors, scheme=manifest.scheme)


def read_shm(manifest: Manifest) -> WeightUpdate:
    """Map the version's /dev/shm file copy-on-write and verify every chunk on the mapping; raises PayloadError."""
    if not manifest.shm or manifest.boot_id != boot_id() or os.path.dirname(os.path.normpath(manifest.shm)) != SHM_DIR:
        raise ShmUnavailable(f"version {manifest.version}: no shared-memory copy on this machine")
    try:
        with open(manifest.shm, "rb") as file:
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as err:
        raise ShmUnavailable(f"version {manifest.version}: cannot map {manifest.shm}: {err}") from err
    whole = torch.frombuffer(mapped, dtype=torch.uint8) if len(mapped) else torch.empty(0, dtype=torch.uint8)
    buffers = []
    for entry in manifest.tensors:
        start, nbytes = int(entry["file_offset"]), int(entry["nbytes"])
        if start < 0 or start + nbytes > whole.numel():
            raise PayloadError(f"version {manifest.version}: {manifest.shm} is shorter than its header says")
        buffers.append(whole[start : start + nbytes])
    view = memoryview(mapped)
    for index, offset, length, digest in manifest.chunks:
        start = int(manifest.tensors[index]["file_offset"]) + offset
        if _digest(view[start : start + length]) != digest:
            raise PayloadError(f"version {manifest.version}: chunk of tensor {index} at {offset} is corrupt in shm")
    view.release()
    return assemble(manifest, buffers)


class WeightSubscriber:
    """Fetches each newer version from a background thread and hands it to `on_update` (never a partial one).

    It asks with a long poll (`LONG_POLL_MS`): the publisher answers as soon as a newer version is published, so a
    version reaches the worker without polling delay. `poll_s` only paces a publisher that answers at once.
    """

    def __init__(
        self,
        endpoint: str,
        on_update: Callable[[WeightUpdate], None],
        poll_s: float = 0.05,
        use_shm: bool = True,
        timeout_s: float = 5.0,
        curve: ClientKeys | None = None,
    ):
        self.endpoint = endpoint
        self._curve = curve
        self._on_update = on_update
        self._poll_s = poll_s
        self._use_shm = use_shm
        self._timeout_ms = int(timeout_s * 1000)
        self.have = -1
        self.rejected = 0
        """Headers and chunks that did not check out (each was fetched again, never applied), and versions that
        `on_update` refused."""
        self.refused: int | None = None
        """The last version `on_update` raised on: not asked for again, the next get waits for a newer one."""
        self.last_error = ""
        self.received = 0
        self.via_shm = 0
        self.last_fetch_s = 0.0
        """Seconds from a new version's header to its verified tensors (the last one fetched)."""
        self._stop = threading.Event()
        self._socket: zmq.Socket | None = None
        self._thread = threading.Thread(target=self._run, name="weight-subscriber", daemon=True)
        self._thread.start()

    def _connect(self) -> zmq.Socket:
        if self._socket is not None:
            self._socket.close(0)
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            self._socket.curve_secretkey = self._curve.secret
            self._socket.curve_publickey = self._curve.public
            self._socket.curve_serverkey = self._curve.server_public
        self._socket.connect(self.endpoint)
        return self._socket

    def _run(self) -> None:
        socket = self._connect()
        try:
            while not self._stop.is_set():
                asked = time.monotonic()
                try:
                    update = self._fetch_latest(socket)
                except TimeoutError:  # publisher gone or busy (or we are stopping): reconnect with a fresh socket
                    if self._stop.is_set():
                        break
                    socket = self._connect()
                    continue
                if update is not None and update.version > self.have:
                    try:
                        self._on_update(update)
                    except Exception as err:  # a version the engine cannot take (missing or misshapen weights)
                        self._refuse(update.version, err)
                        continue
                    self.have = update.version
                    self.received += 1
                elif time.monotonic() - asked < LONG_POLL_MS / 2000:  # answered without waiting: do not spin
                    self._stop.wait(self._poll_s)
        finally:
            if self._socket is not None:
                self._socket.close(0)

    def _refuse(self, version: int, err: Exception) -> None:
        self.rejected += 1
        self.refused = version
        self.last_error = f"version {version}: {type(err).__name__}: {err}"[:300]

    @property
    def alive(self) -> bool:
        """Whether the fetching thread runs (it stops only on close)."""
        return self._thread.is_alive()

    def _recv(self, socket: zmq.Socket) -> list[zmq.Frame]:
        deadline = time.monotonic() + self._timeout_ms / 1000
        while not socket.poll(100):  # in slices, so that close() does not wait out a long poll
            if self._stop.is_set() or time.monotonic() > deadline:
                raise TimeoutError
        return socket.recv_multipart(copy=False)

    def _fetch_latest(self, socket: zmq.Socket) -> WeightUpdate | None:
        have = max(self.have, -1 if self.refused is None else self.refused)  # never the refused version again
        socket.send(msgpack.packb({"v": PROTOCOL_VERSION, "type": "get", "have": have, "wait_ms": LONG_POLL_MS}))
        try:
            frame = self._recv(socket)[0]
            started = time.perf_counter()  # the fetch proper, without the long poll's wait
            manifest = parse_header(frame.bytes)
        except PayloadError as err:
            self._reject(err)
            return None
        if isinstance(manifest, int) or manifest.version <= have:
            return None
        update = None
        if self._use_shm and manifest.shm:
            try:
                update = read_shm(manifest)
                self.via_shm += 1
            except ShmUnavailable:
                pass
            except PayloadError as err:
                self._reject(err)
        if update is None:
            try:
                update = self._fetch_chunks(socket, manifest)
            except PayloadError as err:  # e.g. a version too large to hold: the ZMQ socket was drained
                self._reject(err)
                return None
        if update is not None:
            self.last_fetch_s = time.perf_counter() - started
        return update

    def _reject(self, err: Exception) -> None:
        self.rejected += 1
        self.last_error = str(err)[:300]

    def _fetch_chunks(self, socket: zmq.Socket, manifest: Manifest) -> WeightUpdate | None:
        """Fetch every chunk over ZMQ with WINDOW_CHUNKS in flight; refetch bad ones; None if the version is gone."""
        try:
            buffers = [torch.empty(int(entry["nbytes"]), dtype=torch.uint8) for entry in manifest.tensors]
        except RuntimeError as err:  # the allocator refused: this machine cannot hold the version
            raise PayloadError(
                f"version {manifest.version}: cannot allocate its {manifest.nbytes} bytes: {err}"
            ) from err
        pending = list(range(len(manifest.chunks)))[::-1]  # a stack: pop() yields chunk 0 first
        in_flight = 0
        while pending or in_flight:
            while pending and in_flight < WINDOW_CHUNKS:
                index = pending.pop()
                socket.send(msgpack.packb({"v": PROTOCOL_VERSION, "type": "chunk", "version": manifest.version,
                                           "index": index}))  # fmt: skip
                in_flight += 1
            frames = self._recv(socket)
            in_flight -= 1
            try:
                reply = msgpack.unpackb(frames[0].bytes, max_bin_len=0, max_str_len=64, max_map_len=8)
                index = int(reply["index"])
                if int(reply["version"]) != manifest.version or not 0 <= index < len(manifest.chunks):
                    raise ValueError("reply for another request")
            except Exception:
                self.rejected += 1
                self._drain(socket, in_flight)
                return None
            if reply.get("gone"):  # superseded while we fetched: start over on the latest
                self._drain(socket, in_flight)
                return None
            tensor, offset, length, digest = manifest.chunks[index]
            data = frames[1].buffer if len(frames) == 2 else b""
            if len(data) != length or _digest(data) != digest:
                self.rejected += 1
                pending.append(index)  # fetch this chunk again
                continue
            buffers[tensor].numpy()[offset : offset + length] = np.frombuffer(data, dtype=np.uint8)
        return assemble(manifest, buffers)

    def _drain(self, socket: zmq.Socket, in_flight: int) -> None:
        for _ in range(in_flight):
            self._recv(socket)

    def wait_for(self, version: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.have < version and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.have >= version

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._timeout_ms / 1000 + 1)
