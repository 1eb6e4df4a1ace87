"""The rollout worker's side of weight publication (protocol in `quant_sync.transport`): `WeightSubscriber` long-polls
the publisher for each newer version, maps it from /dev/shm when it shares the machine (`read_shm`) or fetches its
chunks over ZMQ, verifies every chunk, and hands the complete version to the engine. An adapter-only version (LoRA)
is completed with the pinned base it names, fetched first if this subscriber does not hold it. For an engine that
runs int8 adapters as published (`keep_int8_adapters`), a packed version arrives as one `PooledAdapters`
(`WeightUpdate.pooled`): copied once into a pooled buffer (from the publisher's ring, verified there), its views made
once per buffer.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgpack
import numpy as np
import torch
import zmq

from quant_sync.export import LORA_PACKED, LORA_PACKED_INDEX, decode_adapters, decode_pooled_adapters, packed_plan
from quant_sync.manifest import (
    PROTOCOL_VERSION,
    SHM_DIR,
    Manifest,
    PayloadError,
    ShmUnavailable,
    assemble,
    boot_id,
    chunk_digest,
    parse_header,
)
from quant_sync.shm_ring import RingOverwritten, read_ring, ring_bytes, verify_copy
from quant_sync.update import WeightUpdate

if TYPE_CHECKING:
    from common.curve import ClientKeys
    from quant_sync.adapter_buffers import PooledAdapters

WINDOW_CHUNKS = 8
"""Chunk requests a subscriber keeps in flight (ZMQ path)."""
LONG_POLL_MS = 1000
"""How long a subscriber's `get` waits at the publisher for a newer version (well under its reply timeout)."""


def read_shm(manifest: Manifest) -> WeightUpdate:
    """Map the version's /dev/shm file copy-on-write and verify every chunk on the mapping (a version in the
    publisher's ring: copy it out and verify the copy, `shm_ring.read_ring`); raises PayloadError."""
    if not manifest.shm or manifest.boot_id != boot_id() or os.path.dirname(os.path.normpath(manifest.shm)) != SHM_DIR:
        raise ShmUnavailable(f"version {manifest.version}: no shared-memory copy on this machine")
    if manifest.shm_offset is not None:
        return assemble(manifest, read_ring(manifest, manifest.shm, manifest.shm_offset))
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
        if chunk_digest(view[start : start + length]) != digest:
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
        keep_int8_adapters: bool = False,
    ):
        self.endpoint = endpoint
        self._keep_int8_adapters = keep_int8_adapters
        """Hand packed int8 LoRA versions over int8 with their scales (`decode_adapters(keep_int8=True)`): for an
        engine that runs them so (`EmbeddedEngine.runs_int8_adapters`)."""
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
        self.ring_overwritten = 0
        """Adapter versions the publisher's ring had overwritten before this subscriber copied them (fetched over
        ZMQ instead): not corruption, a reader more than RING_SLOTS versions behind."""
        self.last_fetch_s = 0.0
        """Seconds from a new version's header to its verified tensors (the last one fetched)."""
        self.last_fetch_cpu_s = 0.0
        """This thread's CPU seconds over the same span (`time.thread_time`: what the fetch costs the machine, which
        wall time under load does not say)."""
        self.last_update_cpu_s = 0.0
        """This thread's CPU seconds in `on_update` for the last version taken (the engine's `stage_weights`)."""
        self.last_update_t = 0.0
        """`time.monotonic()` when `on_update` returned for the last version taken (the engine has it staged)."""
        self.base: WeightUpdate | None = None
        """The last pinned version fetched (LoRA's quantized base), which adapter-only versions complete."""
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
                    cpu = time.thread_time()
                    try:
                        self._on_update(update)
                    except Exception as err:  # a version the engine cannot take (missing or misshapen weights)
                        self._refuse(update.version, err)
                        continue
                    self.have = update.version
                    self.received += 1
                    self.last_update_t = time.monotonic()
                    self.last_update_cpu_s = time.thread_time() - cpu
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
            started, cpu = time.perf_counter(), time.thread_time()  # the fetch proper, without the long poll's wait
            manifest = parse_header(frame.bytes)
        except PayloadError as err:
            self._reject(err)
            return None
        if isinstance(manifest, int) or manifest.version <= have:
            return None
        lacks_base = manifest.base is not None and (self.base is None or self.base.version != manifest.base)
        if lacks_base and not self._fetch_base(socket, manifest.base):  # type: ignore[arg-type]
            return None
        update = self._fetch_payload(socket, manifest)
        if update is None:
            return None
        if manifest.pinned:
            self.base = update
        elif manifest.base is not None:  # adapters only: the base's tensors with these on top
            assert self.base is not None
            if self.base.scheme != manifest.scheme:
                self._reject(PayloadError(f"version {manifest.version}: scheme {manifest.scheme!r}, its base's is "
                                          f"{self.base.scheme!r}"))  # fmt: skip
                return None
            base = self.base if update.pooled is not None else None  # pooled adapters name the base they complete
            tensors = {**self.base.tensors, **update.tensors}
            update = WeightUpdate(manifest.version, tensors, manifest.scheme, pooled=update.pooled, base=base)
        self.last_fetch_s = time.perf_counter() - started
        self.last_fetch_cpu_s = time.thread_time() - cpu
        return update

    def _fetch_base(self, socket: zmq.Socket, version: int) -> bool:
        """Fetch the pinned version `version` into `self.base`; False if the publisher no longer holds it."""
        socket.send(msgpack.packb({"v": PROTOCOL_VERSION, "type": "get", "have": -1, "version": version}))
        try:
            manifest = parse_header(self._recv(socket)[0].bytes)
            if not isinstance(manifest, int) and (manifest.version != version or not manifest.pinned):
                raise PayloadError(f"asked for pinned version {version}, got version {manifest.version}")
        except PayloadError as err:
            self._reject(err)
            return False
        if isinstance(manifest, int):  # gone: a newer base was pinned; the next get brings versions built on it
            return False
        update = self._fetch_payload(socket, manifest)
        if update is None:
            return False
        self.base = update
        return True

    def _fetch_payload(self, socket: zmq.Socket, manifest: Manifest) -> WeightUpdate | None:
        """The version's tensors: mapped from /dev/shm when it can, else fetched over ZMQ; None if they failed."""
        update = None
        if self._use_shm and manifest.shm:
            try:
                pooled = self._read_pooled(manifest) if self._keep_int8_adapters else None
                if pooled is not None:  # copied from the publisher's ring straight into a pooled buffer
                    self.via_shm += 1
                    return WeightUpdate(manifest.version, pooled.tensors, manifest.scheme, pooled=pooled)
                update = read_shm(manifest)
                self.via_shm += 1
            except RingOverwritten:
                self.ring_overwritten += 1
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
        if update is None:
            return None
        try:  # LoRA adapters sent in bf16 or int8 (model.lora.sync_dtype): the float32 values the learner ran
            pooled = decode_pooled_adapters(update.tensors) if self._keep_int8_adapters else None
            if pooled is not None:  # int8 as published, in a pooled buffer whose views are made once
                return WeightUpdate(update.version, pooled.tensors, update.scheme, pooled=pooled)
            decoded = decode_adapters(update.tensors, keep_int8=self._keep_int8_adapters)
            return WeightUpdate(update.version, decoded, update.scheme)
        except ValueError as err:
            self._reject(PayloadError(f"version {manifest.version}: {err}"))
            return None

    @staticmethod
    def _read_pooled(manifest: Manifest) -> PooledAdapters | None:
        """A packed int8 adapter version in the publisher's ring, copied once, straight into a pooled buffer of a
        verbatim plan and verified there (`PackedPlan.decode_pooled`); None for any other version (`read_shm`
        then copies it out). RingOverwritten when the copy does not check out; PayloadError for a bad index."""
        names = [entry["name"] for entry in manifest.tensors]
        if manifest.shm_offset is None or sorted(names) != sorted((LORA_PACKED, LORA_PACKED_INDEX)):
            return None
        if any(entry["dtype"] != "int8" for entry in manifest.tensors):
            return None
        packed_at, index_at = names.index(LORA_PACKED), names.index(LORA_PACKED_INDEX)
        with ring_bytes(manifest, manifest.shm, manifest.shm_offset) as parts:
            index = torch.from_numpy(parts[index_at].copy()).view(torch.int8)
            verify_copy(manifest, index_at, index)
            try:
                plan = packed_plan(index, parts[packed_at].size)
            except ValueError as err:
                raise PayloadError(f"version {manifest.version}: {err}") from None
            if plan is None or not plan.verbatim:
                return None
            return plan.decode_pooled(parts[packed_at], check=lambda copy: verify_copy(manifest, packed_at, copy))

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
            if len(data) != length or chunk_digest(data) != digest:
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
