"""The buffer's append-only journal: what was leased, admitted and consumed, so a restarted buffer resumes.

File layout (version 2): the 16-byte magic `MAGIC`, then a sequence of records, each
`<u32 length><u64 xxh3_64><msgpack map>` (little-endian header, xxh3-64 of the payload: 13x faster than crc32 here,
about 3 us for a 55 KB group against 40 us). A version 1 file (no magic, `<u32 length><u32 crc32>` headers, written
before this layout) is read as such and rewritten as version 2 when a `Journal` opens it. Record kinds (the `k`
field):

| k | fields | meaning |
|---|---|---|
| `lease` | `i`: problem indices, `x`: skipped ones | new problems handed out, and skipped (restores the cursor) |
| `admit` | `m`: encoded `PushGroup` bytes | a group queued for training |
| `done` | `g`: group ids, `why`: "filtered" or "stale" | groups resolved without training |
| `consume` | `g`: group ids, `s`: train step | groups handed to the learner |
| `requeue` | `g`: group ids | a batch whose reply could not be delivered: back in the queue |
| `max_lag` | `v`: int | staleness.max_lag changed live (SetMaxLag) |
| `streak` | `p`: prompt key (u64), `n`: int | a prompt's zero-variance streak is now `n` (buffer/selective.py) |
| `rewind` | `s`: step, `g`, `d`: group ids, `c`: count | resume at s: `g` (consumed at >= s) requeued, `d` dropped |
| `state` | `cursor`, `step`, `consumed`, `max_lag`, `pending`, `kept_from`, `streaks` | a compacted journal's head |
| `kept` | `m`: encoded `PushGroup` bytes, `s`: train step | a group consumed at s, kept for a resume by a compaction |

A `rewind` record's `c` is the consumed count after it. A `state` record's `pending` lists the indices still leased
or returned; its `kept_from` (absent in journals written before 2026-12-07, which kept none) is the first train step
whose consumed groups follow it as `kept` records; its `max_lag` is null unless set live
(SetMaxLag): a null one leaves the config's value in force after a restart. A `lease` record's `x` (problems that
selective rollout passed over), `streak` records and a `state` record's `streaks` (`[[prompt key, streak], ...]`)
appear only with `algo.skip_zero_variance` on.

A crash can leave a torn last record; `read_records` cuts the file after the last intact record when nothing intact
follows. Damage with intact records after it (a bad disk, an edited file) is skipped instead, keeping the records
after it, and the original is saved beside the journal (`read_records`).

Compaction (`Journal.rewrite`): the service replaces the file with `recovery.snapshot(state)` (one `state` record, a
`kept` record per group consumed at or after its `kept_from` step, and the `admit` records of the groups still
queued) once it outgrows its threshold, so the file stays proportional to what is in flight and to what a resume
from a checkpoint on disk would train again (`recovery.keep_from`). The new file is written beside the old one,
fsynced and renamed over it (then the directory is fsynced): a crash at any point leaves either the old journal or
the new one, both complete, so a consumed group is never replayed and an admitted one never lost.
"""

from __future__ import annotations

import contextlib
import os
import queue
import struct
import sys
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import xxhash

from common.fsutil import fsync_dir

MAGIC = b"asyncrl-journal2"
"""The first 16 bytes of a version-2 journal."""
_HEADER = struct.Struct("<IQ")  # payload length, xxh3_64 of the payload
_V1_HEADER = struct.Struct("<II")  # payload length, crc32 of the payload
FSYNC_POLICIES = ("always", "batch", "never")
WRITE_CHUNK_BYTES = 1024 * 1024
"""Appended records are handed to the writer thread in chunks of about this size (and all of them at `commit`)."""
_IOV_MAX = 1024
_ADMIT_PREFIX = b"\x82\xa1k\xa5admit\xa1m"  # msgpack of {"k": "admit", "m": ...} up to the bytes of "m"


def _bin_header(size: int) -> bytes:
    """The msgpack header of a bin of `size` bytes (the shortest form, as msgpack.packb writes it)."""
    if size < 1 << 8:
        return b"\xc4" + size.to_bytes(1, "big")
    if size < 1 << 16:
        return b"\xc5" + size.to_bytes(2, "big")
    return b"\xc6" + size.to_bytes(4, "big")


def _xxh3(parts: tuple[bytes | memoryview, ...]) -> int:
    digest = xxhash.xxh3_64()
    for part in parts:
        digest.update(part)
    return digest.intdigest()


def _is_v1(head: bytes) -> bool:
    """Whether a journal starting with `head` is version 1 (a torn magic, a prefix of it, is version 2)."""
    prefix = head[: len(MAGIC)]
    return bool(prefix) and not MAGIC.startswith(prefix)


def _head(path: Path) -> bytes:
    with open(path, "rb") as handle:
        return handle.read(len(MAGIC))


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every intact record of the journal at `path` (version 2, or 1), in order.

    A torn tail (a record cut short by a crash, or bytes after which no record is intact) is cut off, as a crash
    leaves it. Damage anywhere else (bytes that fail their checksum with intact records after them, or a damaged
    magic) is not what a crash leaves: the damaged bytes are skipped, every intact record after them is kept, the
    original file is kept beside the journal (`<name>.damaged`, `<name>.damaged-2`, ...) and the journal is rewritten
    from the intact records, each step said on stderr. What the skipped bytes held is lost."""
    if not path.exists():
        return []
    data = path.read_bytes()
    v1, offset, magic_damaged = _layout(data)
    header = _V1_HEADER if v1 else _HEADER
    records: list[dict[str, Any]] = []
    skipped: list[tuple[int, int]] = []  # (offset, bytes) of damage with intact records after it
    while offset < len(data):
        record, end = _record_at(data, offset, v1)
        if record is not None:
            records.append(record)
            offset = end
            continue
        zeros = data.count(0, offset) == len(data) - offset  # blocks a crash allocated and never wrote
        candidates = range(offset + 1, len(data) - header.size + 1) if not zeros else range(0)
        intact = next((at for at in candidates if _record_at(data, at, v1)[0] is not None), None)
        if intact is None:
            break  # nothing intact after it: a torn tail
        skipped.append((offset, intact - offset))
        offset = intact
    if offset < len(data):
        print(f"buffer journal: truncating {len(data) - offset} torn bytes at offset {offset}", file=sys.stderr)
    if skipped or magic_damaged:
        kept = _keep_damaged(path)
        damage = ["the magic"] * magic_damaged + [f"{size} bytes at offset {at}" for at, size in skipped[:5]]
        print(f"buffer journal: {path} is damaged ({', '.join(damage)}{', ...' if skipped[5:] else ''}); "
              f"{len(records)} intact records kept, the original saved as {kept}; what the damaged bytes held "
              "(leases, admitted groups, consumption marks) is lost", file=sys.stderr)  # fmt: skip
        _write_atomically(path, records)
    elif offset < len(data):
        with open(path, "r+b") as handle:
            handle.truncate(offset)
    return records


def intact_records(path: Path) -> Iterator[dict[str, Any]]:
    """The records of the journal at `path` up to the first that is not intact, read without changing the file (a
    compaction reads the live journal with it; `read_records` is the start-up reader that repairs)."""
    data = path.read_bytes()
    v1, offset, _ = _layout(data)
    while offset < len(data):
        record, end = _record_at(data, offset, v1)
        if record is None:
            return
        yield record
        offset = end


def _layout(data: bytes) -> tuple[bool, int, bool]:
    """(version 1?, offset of the first record, whether the magic is damaged) of a journal's bytes. A file without the
    magic is version 1 if a version-1 record starts it; else version 2 with a damaged magic if a version-2 record
    follows the magic's 16 bytes; else as `_is_v1` says (a torn magic, a prefix of it, is version 2, cut whole)."""
    if data[: len(MAGIC)] == MAGIC:
        return False, len(MAGIC), False
    v1 = _is_v1(data)
    if v1 and _record_at(data, 0, True)[0] is None and _record_at(data, len(MAGIC), False)[0] is not None:
        return False, len(MAGIC), True
    return v1, 0 if v1 or len(data) < len(MAGIC) else len(MAGIC), False


def _record_at(data: bytes, offset: int, v1: bool) -> tuple[dict[str, Any] | None, int]:
    """(the record at `offset`, the offset after it), or (None, offset) where none intact starts there."""
    header = _V1_HEADER if v1 else _HEADER
    if len(data) - offset < header.size:
        return None, offset
    length, check = header.unpack_from(data, offset)
    start, end = offset + header.size, offset + header.size + length
    if end > len(data):
        return None, offset
    payload = memoryview(data)[start:end]
    if (zlib.crc32(payload) if v1 else xxhash.xxh3_64_intdigest(payload)) != check:
        return None, offset
    try:
        record = msgpack.unpackb(payload, raw=False)
    except Exception:  # checksum matched but not msgpack: treat as torn, like a bad checksum
        return None, offset
    return (record, end) if isinstance(record, dict) else (None, offset)


def _keep_damaged(path: Path) -> Path:
    """Copy the damaged journal beside itself under a name no earlier copy has; returns the copy's path."""
    import shutil

    copy, n = path.with_name(f"{path.name}.damaged"), 1
    while copy.exists():
        n += 1
        copy = path.with_name(f"{path.name}.damaged-{n}")
    shutil.copyfile(path, copy)
    return copy


class _Writer:
    """A thread that writes chunks of appended records to the journal file, so that the kernel's copy into the page
    cache overlaps the service's next requests. `wait` returns once every submitted chunk is written (raising the
    first write error, if any); the service calls it (via `Journal.commit`) before it replies.

    A durability mark (`mark`) asks the thread to fsync, after the chunks before it, and then to record the mark's
    sequence number as `durable` and write a byte to `ready_fd` (a pipe the service polls): the pipelined commit,
    where the service goes on admitting while the disk syncs and sends the replies once their mark is durable."""

    def __init__(self) -> None:
        self._chunks: queue.Queue[tuple[int, list[bytes | memoryview]] | tuple[int, int, bool] | None] = queue.Queue()
        self._error: BaseException | None = None
        self.durable = 0  # the highest mark synced (written only by the thread; read by the service)
        self.ready_fd, self._notify_fd = os.pipe()
        os.set_blocking(self.ready_fd, False)
        os.set_blocking(self._notify_fd, False)  # a full pipe is readable already: never block the writer on it
        self._thread = threading.Thread(target=self._run, name="journal-writer", daemon=True)
        self._thread.start()

    def submit(self, fd: int, parts: list[bytes | memoryview]) -> None:
        self._chunks.put((fd, parts))

    def mark(self, fd: int, seq: int, sync: bool) -> None:
        self._chunks.put((fd, seq, sync))

    def check(self) -> None:
        if self._error is not None:
            raise OSError(f"buffer journal write failed: {self._error}") from self._error

    def wait(self) -> None:
        self._chunks.join()
        self.check()

    def stop(self) -> None:
        self._chunks.put(None)
        self._thread.join()
        os.close(self.ready_fd)
        os.close(self._notify_fd)

    def _run(self) -> None:
        while True:
            item = self._chunks.get()
            try:
                if item is None:
                    return
                if self._error is None:
                    if len(item) == 2:
                        _write_all(*item)
                    else:
                        fd, seq, sync = item
                        if sync:
                            os.fsync(fd)
                        self.durable = seq
                        self._notify()
            except BaseException as err:  # reported to the service thread by `wait` / `check`
                self._error = err
                self._notify()  # wake the service so that it sees the error
            finally:
                self._chunks.task_done()

    def _notify(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._notify_fd, b"\x00")


def _write_all(fd: int, parts: list[bytes | memoryview]) -> None:
    """os.writev until every byte of `parts` is written (a write may be partial; at most IOV_MAX buffers a call)."""
    views = [memoryview(part).cast("B") for part in parts]
    while views:
        written = os.writev(fd, views[:_IOV_MAX])
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


def _write_atomically(path: Path, records: list[dict[str, Any]]) -> None:
    """Replace the journal at `path` with a version-2 file of `records`: written beside it, fsynced, renamed over
    it, directory fsynced. A crash leaves the old file or the new one, each complete."""
    tmp = path.with_name(path.name + ".compact")
    with open(tmp, "wb") as handle:
        handle.write(MAGIC)
        for record in records:
            payload = msgpack.packb(record, use_bin_type=True)
            handle.write(_HEADER.pack(len(payload), xxhash.xxh3_64_intdigest(payload)))
            handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class Journal:
    """Appends records; `commit` makes them durable per the fsync policy before the service replies.

    `always`: fsync after every record; `batch`: one fsync per request (in `commit`); `never`: written to the OS at
    `commit` (survives a killed process, not a power loss). Appended records are checksummed at once and gathered in
    memory (the large `admit` payloads are referenced, not copied); every `WRITE_CHUNK_BYTES` they go to a writer
    thread, and `commit` waits until all of them are written before it fsyncs. Nothing is acknowledged before
    `commit` returns, so what a killed service loses was never acknowledged.
    """

    def __init__(self, path: Path, fsync: str = "batch") -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"buffer.fsync must be one of {FSYNC_POLICIES}, got {fsync!r}")
        self.path = path
        self.fsync = fsync
        if path.exists() and _is_v1(_head(path)):
            records = read_records(path)
            print(f"buffer journal: converting {path} ({len(records)} records) to version 2", file=sys.stderr)
            _write_atomically(path, records)
        self._fd = self._open()
        self._size = os.fstat(self._fd).st_size
        self._pending: list[bytes | memoryview] = []
        self._pending_bytes = 0
        self._dirty = False
        self._seq = 0
        self._writer = _Writer()

    def _open(self) -> int:
        created = not self.path.exists()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if os.fstat(fd).st_size == 0:  # new (or emptied by read_records): starts with the magic
            os.write(fd, MAGIC)
            os.fsync(fd)
        if created:  # the file's directory entry must survive a power loss as much as its records
            fsync_dir(self.path.parent)
        return fd

    def append(self, record: dict[str, Any]) -> None:
        self._append((msgpack.packb(record, use_bin_type=True),))

    def append_admit(self, push: bytes | memoryview) -> None:
        """`append({"k": "admit", "m": push})`, byte for byte, without copying the (large) encoded PushGroup."""
        self._append((_ADMIT_PREFIX + _bin_header(memoryview(push).nbytes), push))

    def _append(self, parts: tuple[bytes | memoryview, ...]) -> None:
        """One record whose msgpack payload is the concatenation of `parts`."""
        length = sum(memoryview(part).nbytes for part in parts)
        self._pending += (_HEADER.pack(length, _xxh3(parts)), *parts)
        self._pending_bytes += _HEADER.size + length
        self._size += _HEADER.size + length
        self._dirty = True
        if self._pending_bytes >= WRITE_CHUNK_BYTES:
            self._submit()
        if self.fsync == "always":
            self.commit()

    def _submit(self) -> None:
        if self._pending:
            self._writer.submit(self._fd, self._pending)
            self._pending, self._pending_bytes = [], 0

    def commit(self) -> None:
        """Write appended records to the OS (and to disk unless fsync=never); call before replying."""
        if not self._dirty:
            self._writer.wait()  # a commit_async still in flight completes (it syncs itself)
            return
        self._submit()
        self._writer.wait()
        if self.fsync != "never":
            os.fsync(self._fd)
        self._dirty = False

    def commit_async(self) -> int:
        """Start committing the appended records (as `commit` would) in the writer thread and return at once.

        Returns a sequence number: the records appended so far are durable once `durable() >= seq`, which the
        writer thread signals by making `ready_fd` readable. The service sends the replies waiting for them then.
        """
        if self._dirty:
            self._submit()
            self._seq += 1
            self._writer.mark(self._fd, self._seq, self.fsync != "never")
            self._dirty = False
        return self._seq

    def durable(self) -> int:
        """The highest `commit_async` sequence number that is durable; raises OSError if the writer failed. Drains
        `ready_fd`."""
        try:
            while os.read(self._writer.ready_fd, 4096):
                pass
        except BlockingIOError:
            pass
        self._writer.check()
        return self._writer.durable

    @property
    def ready_fd(self) -> int:
        """Readable when a `commit_async` completes (or the writer failed): register it in the service's poller."""
        return self._writer.ready_fd

    def rewrite(self, records: list[dict[str, Any]]) -> None:
        """Atomically replace the journal with `records` (compaction); appends continue on the new file."""
        self.commit()
        _write_atomically(self.path, records)
        os.close(self._fd)
        self._fd = self._open()
        self._size = os.fstat(self._fd).st_size

    def size_bytes(self) -> int:
        """Bytes of the journal, records not yet written included."""
        return self._size

    def close(self) -> None:
        if self._fd >= 0:
            try:
                self.commit()
            finally:
                self._writer.stop()
                os.close(self._fd)
                self._fd = -1
