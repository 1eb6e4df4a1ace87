"""Versioned weight publication: the learner publishes each version once, every rollout worker fetches the latest.

Two paths, one protocol (msgpack control messages, raw tensor bytes as zero-copy ZMQ frames, no pickle):

    worker -> publisher  {"v": 2, "type": "get", "have": <version the worker runs>, "wait_ms": W (optional)}
    publisher -> worker  the header of the latest version if it is newer than `have`, else {"v": 2, "version": V}
                         (with `wait_ms`, a long poll: the answer waits until a newer version is published or
                         W ms, at most MAX_WAIT_MS, have passed)
    header = {"v": 2, "version", "scheme", "boot_id", "shm": path | None, "shm_offset": N (optional: a ring),
              "tensors": [{"name", "dtype", "shape", "nbytes", "file_offset"}],
              "chunks": [[tensor index, byte offset in the tensor, length, xxh3-64 digest], ...],
              "pinned": true (optional), "base": B (optional)}
    worker -> publisher  {"v": 2, "type": "get", "have": -1, "version": B}    (one held version: a pinned base)
    publisher -> worker  its header, or {"v": 2, "version": <latest>, "gone": true}
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
  Adapter-only versions (LoRA, small and frequent) have no file of their own: the publisher copies each into the
  next stretch of one ring file it allocated once (`shm_offset` in the header; `quant_sync.shm_ring`), and a reader
  copies the version out and verifies the copy, since the ring overwrites a version RING_SLOTS versions later.
- The publisher keeps the last `keep_versions` versions, so a worker still fetching version k when k+1 is
  published completes it; a chunk of a dropped version answers `gone` and the worker starts over on the latest.
- A late or restarted worker asks with have=-1 and receives the latest version.
- LoRA (learner/lora.py): the quantized base is published once as a `pinned` complete version, which the publisher
  holds (outside `keep_versions`) until another is pinned; each later version holds only the adapters and names the
  pinned one as its `base`. A subscriber keeps the pinned version it has and hands the engine the base's tensors
  with the adapters' on top, a complete version; one that lacks the base (late, restarted) fetches it first.

Sockets: ROUTER (publisher, binds 127.0.0.1 unless configured) and DEALER (subscriber), linger 0. The publisher
serves from a background thread, so `publish` returns once the version is hashed (and written to /dev/shm).
With the buffer's CurveZMQ keys (`buffer.curve_keys_dir`, common/curve.py; required when binding beyond loopback)
the publisher is a CURVE server admitting only allow-listed client keys, and subscribers connect with theirs. A
wildcard bind (0.0.0.0) is advertised as this node's routable address.

Layout: `quant_sync.manifest` (the format: constants and bounds, the header, chunk digests), `quant_sync.publisher`
(`WeightPublisher`), `quant_sync.subscriber` (`WeightSubscriber`, `read_shm`). Their public names are re-exported
here.
"""

from __future__ import annotations

from quant_sync.manifest import (
    CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    MAX_CHUNKS,
    MAX_TENSORS,
    MAX_VERSION_BYTES,
    MAX_WAIT_MS,
    PROTOCOL_VERSION,
    SHM_DIR,
    Manifest,
    PayloadError,
    ShmUnavailable,
    assemble,
    boot_id,
    parse_header,
)
from quant_sync.publisher import WeightPublisher
from quant_sync.subscriber import LONG_POLL_MS, WINDOW_CHUNKS, WeightSubscriber, read_shm

__all__ = [
    "CHUNK_BYTES",
    "LONG_POLL_MS",
    "MAX_CHUNKS",
    "MAX_CHUNK_BYTES",
    "MAX_TENSORS",
    "MAX_VERSION_BYTES",
    "MAX_WAIT_MS",
    "PROTOCOL_VERSION",
    "SHM_DIR",
    "WINDOW_CHUNKS",
    "Manifest",
    "PayloadError",
    "ShmUnavailable",
    "WeightPublisher",
    "WeightSubscriber",
    "assemble",
    "boot_id",
    "parse_header",
    "read_shm",
]
