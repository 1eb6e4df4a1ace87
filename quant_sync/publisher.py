"""The learner's side of weight publication (protocol in `quant_sync.transport`): `WeightPublisher` hashes each
version into chunks, writes it once to /dev/shm when it can, and serves headers, chunks and long polls to every
subscriber from a background thread. A pinned version (LoRA's quantized base) stays held while later versions (its
adapters) name it as their base.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgpack
import torch
import zmq

from common.actor_host import at_orphaned
from common.netaddr import bind
from quant_sync.manifest import (
    ALIGN_BYTES,
    CHUNK_BYTES,
    DTYPE_NAMES,
    MAX_CHUNK_BYTES,
    MAX_WAIT_MS,
    PROTOCOL_VERSION,
    SHM_DIR,
    boot_id,
    chunk_digest,
)
from quant_sync.shm_owner import FILE_PREFIX, ShmOwner, sweep_stale
from quant_sync.shm_ring import RING_MAX_VERSION_BYTES, ShmRing

if TYPE_CHECKING:
    from common.curve import ServerKeys


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().view(-1)
    return memoryview(flat.view(torch.uint8).numpy())


@dataclass(slots=True)
class _Version:
    version: int
    header: bytes
    chunks: list[memoryview]
    shm_path: str | None


MAX_REQUEST_BYTES = 1 << 16
"""Largest frame a subscriber may send (a request is a small msgpack map): a larger one, which would be copied into
the learner's memory whole (a 400 MB frame grew it by 1.6 GB), disconnects its sender."""


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
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)  # a peer sending more is disconnected unread
        if curve is not None:
            self._socket.curve_secretkey = curve.secret
            self._socket.curve_publickey = curve.public
            self._socket.curve_server = True
        self.endpoint = bind(self._socket, host, port)
        if shm_dir == "auto":
            shm_dir = SHM_DIR if os.access(SHM_DIR, os.W_OK) else None
        self._prefix = f"{FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._owner: ShmOwner | None = None
        if shm_dir:
            try:  # the files of publishers that died without closing go first (quant_sync.shm_owner)
                self._owner = ShmOwner(shm_dir, self._prefix)
                sweep_stale(shm_dir, keep_prefix=self._prefix)
                at_orphaned(self._owner.remove_files)  # a local actor whose driver was killed: its files go too
            except OSError:  # /dev/shm not writable after all: ZMQ alone
                shm_dir = None
        self.shm_dir = shm_dir
        self.chunk_bytes = chunk_bytes
        self.keep_versions = max(1, keep_versions)
        self._boot_id = boot_id()
        self._versions: OrderedDict[int, _Version] = OrderedDict()
        self._latest: _Version | None = None
        self._pinned: int | None = None  # the version adapter-only versions build on: never evicted while pinned
        self._lock = threading.Lock()
        self._spare_path = os.path.join(shm_dir, f"{self._prefix}-spare") if shm_dir else ""
        self._spare_bytes = 0  # size of the preallocated spare file (0: none ready)
        self._spare_lock = threading.Lock()  # held while the spare is being allocated
        self._ring: ShmRing | None = None  # adapter-only versions' /dev/shm ring (quant_sync.shm_ring)
        self._rings = 0  # rings made so far (each has its own name: a reader's mapping of an old one never aliases)
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

    def publish(
        self, version: int, tensors: dict[str, torch.Tensor], scheme: str, pin: bool = False, base: int | None = None
    ) -> None:
        """Make `tensors` the latest version (they must not be modified afterwards): hash, write /dev/shm, serve.

        `pin`: a complete version that later ones build on (LoRA's base): held until another is pinned. `base`: this
        version holds only the tensors that change (LoRA's adapters) and completes the pinned version `base`.
        """
        if base is not None and pin:
            raise ValueError(f"version {version}: a pinned version is complete, it has no base (got base {base})")
        if base is not None and (base != self._pinned or base >= version):
            raise ValueError(f"version {version}: base {base} is not the pinned version ({self._pinned}) before it")
        if self._latest is not None and version <= self._latest.version:  # a new subscriber would get it, the
            raise ValueError(  # others stay on the later one: versions must only grow
                f"version {version}: not after the latest published version {self._latest.version}"
            )
        started = time.perf_counter()
        entries, chunks, table, views = [], [], [], []
        file_offset = 0
        for index, (name, tensor) in enumerate(tensors.items()):
            if tensor.dtype not in DTYPE_NAMES:
                raise ValueError(f"version {version}: tensor {name} has dtype {tensor.dtype}, not publishable")
            data = _tensor_bytes(tensor)
            views.append(data)
            entries.append({"name": name, "dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                            "nbytes": data.nbytes, "file_offset": file_offset})  # fmt: skip
            for offset in range(0, data.nbytes, self.chunk_bytes):
                chunk = data[offset : offset + self.chunk_bytes]
                chunks.append(chunk)
                table.append([index, offset, chunk.nbytes, chunk_digest(chunk)])
            file_offset += -(-data.nbytes // ALIGN_BYTES) * ALIGN_BYTES
        ring = self._ring_for(file_offset) if base is not None else None
        if ring is not None:  # an adapter-only version: copied into the ring, no file of its own
            offsets = [entry["file_offset"] for entry in entries]
            shm_path, shm = None, {"shm": ring.path, "shm_offset": ring.write(views, offsets, file_offset)}
        else:
            shm_path = self._write_shm(version, views, entries) if self.shm_dir else None
            shm = {"shm": shm_path}
        fields = {"v": PROTOCOL_VERSION, "version": version, "scheme": scheme, "tensors": entries, "chunks": table,
                  **shm, "boot_id": self._boot_id}  # fmt: skip
        if pin:
            fields["pinned"] = True
        if base is not None:
            fields["base"] = base
        published = _Version(version=version, header=msgpack.packb(fields), chunks=chunks, shm_path=shm_path)
        with self._lock:
            self._versions[version] = published
            self._latest = published
            if pin:
                self._pinned = version
            evicted = []
            unpinned = [held for held in self._versions if held != self._pinned]
            while len(unpinned) > self.keep_versions:
                evicted.append(self._versions.pop(unpinned.pop(0)))
        self.last_publish_s = time.perf_counter() - started
        with self._lock, contextlib.suppress(zmq.Again):  # a wake already queued will do
            self._wake_out.send(b"", zmq.NOBLOCK)
        dropped = [old.shm_path for old in evicted if old.shm_path]
        if dropped or shm_path is not None:  # freeing and allocating tmpfs pages: off the caller's clock
            self._housekeeper = threading.Thread(target=self._housekeep, args=(dropped, file_offset), daemon=True)
            self._housekeeper.start()

    def _ring_for(self, nbytes: int) -> ShmRing | None:
        """The ring an adapter-only version of `nbytes` goes into (made, or remade larger, here), or None: no
        /dev/shm, or a version too large for one (RING_MAX_VERSION_BYTES), which gets a file of its own."""
        if not self.shm_dir or nbytes > RING_MAX_VERSION_BYTES:
            return None
        if self._ring is None or not self._ring.fits(nbytes):
            if self._ring is not None:
                self._ring.close()
            self._rings += 1
            self._ring = ShmRing.create(os.path.join(self.shm_dir, f"{self._prefix}-ring{self._rings}"), nbytes)
        return self._ring

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
            fd = os.open(self._spare_path, os.O_RDWR | os.O_CREAT, 0o600)  # weights: this user only
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
            spare = self._take_spare(nbytes, tmp)
            with (
                open(tmp, "r+b")
                if spare
                else open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as file
            ):
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
            frames = self._socket.recv_multipart(copy=True)
            try:
                if len(frames) < 2:
                    raise ValueError("an empty request")
                request = msgpack.unpackb(frames[1], max_bin_len=0, max_str_len=64, max_map_len=8)
                if not isinstance(request, dict):
                    raise ValueError(f"a request is a map, got {type(request).__name__}")
                if request.get("v") != PROTOCOL_VERSION:
                    raise ValueError(f"protocol {request.get('v')!r}: this publisher speaks {PROTOCOL_VERSION} "
                                     "(another asyncrl version?)")  # fmt: skip
                if request.get("type") not in ("get", "chunk"):
                    raise ValueError(f"unknown request type {request.get('type')!r}")
                identity = frames[0]
                if request["type"] == "get" and "version" in request:  # one held version (a pinned base)
                    self._answer_held(identity, int(request["version"]))
                elif request["type"] == "get":
                    wait_ms = min(max(int(request.get("wait_ms", 0)), 0), MAX_WAIT_MS)
                    self._answer_get(identity, int(request["have"]), wait_ms)
                else:
                    self._answer_chunk(identity, int(request["version"]), int(request["index"]))
            except Exception as err:  # a malformed request must not kill the publisher: answered, counted, and on
                self.bad_requests += 1
                reply = {"v": PROTOCOL_VERSION, "version": -1, "error": f"{type(err).__name__}: {err}"[:300]}
                with contextlib.suppress(zmq.ZMQError):  # the asker said why it gets nothing (it timed out, unsaid)
                    self._socket.send_multipart([frames[0], msgpack.packb(reply)])

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

    def _answer_held(self, identity: bytes, version: int) -> None:
        """The header of held version `version`, or {"v", "version": latest, "gone": true} if it is not held."""
        with self._lock:
            held, latest = self._versions.get(version), self._latest
        if held is not None:
            self._socket.send_multipart([identity, held.header])
            self.served += 1
            return
        latest_version = -1 if latest is None else latest.version
        reply = {"v": PROTOCOL_VERSION, "version": latest_version, "gone": True}
        self._socket.send_multipart([identity, msgpack.packb(reply)])

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
            self._pinned = None
        for held in versions:
            _unlink(held.shm_path)
        with self._spare_lock:  # waits for an allocation in progress
            _unlink(self._spare_path or None)
            self._spare_bytes = 0
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        if self._owner is not None:
            self._owner.release()
            self._owner = None


def _unlink(path: str | None) -> None:
    if path:
        with contextlib.suppress(OSError):
            os.unlink(path)
