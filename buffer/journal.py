"""The buffer's append-only journal: what was leased, admitted and consumed, so a restarted buffer resumes.

File layout: a sequence of records, each `<u32 length><u32 crc32><msgpack map>` (little-endian header, crc32 of the
payload). Record kinds (the `k` field):

| k | fields | meaning |
|---|---|---|
| `lease` | `i`: list of problem indices | new problems handed out (restores the dataset cursor) |
| `admit` | `m`: encoded `PushGroup` bytes | a group queued for training |
| `done` | `g`: group ids, `why`: "filtered" or "stale" | groups resolved without training |
| `consume` | `g`: group ids, `s`: train step | groups handed to the learner |
| `requeue` | `g`: group ids | a batch whose reply could not be delivered: back in the queue |
| `max_lag` | `v`: int | staleness.max_lag changed live (SetMaxLag) |
| `state` | `cursor`, `step`, `consumed`, `max_lag`, `pending`: indices | the head of a compacted journal |

A crash can leave a torn last record; `read_records` stops at the first record that is short or fails its crc and
truncates the file there.

Compaction (`Journal.rewrite`): the service replaces the file with `BufferState.snapshot()` (one `state` record and
the `admit` records of the groups still queued) once it outgrows its threshold, so the file stays proportional to
what is in flight. The new file is written beside the old one, fsynced and renamed over it (then the directory is
fsynced): a crash at any point leaves either the old journal or the new one, both complete, so a consumed group is
never replayed and an admitted one never lost.
"""

from __future__ import annotations

import os
import struct
import sys
import zlib
from pathlib import Path
from typing import Any

import msgpack

_HEADER = struct.Struct("<II")
FSYNC_POLICIES = ("always", "batch", "never")


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every intact record of the journal at `path`, in order; a torn or corrupt tail is cut off the file."""
    if not path.exists():
        return []
    data = path.read_bytes()
    records: list[dict[str, Any]] = []
    offset = 0
    while offset < len(data):
        if len(data) - offset < _HEADER.size:
            break
        length, crc = _HEADER.unpack_from(data, offset)
        start, end = offset + _HEADER.size, offset + _HEADER.size + length
        if end > len(data) or zlib.crc32(data[start:end]) != crc:
            break
        try:
            record = msgpack.unpackb(data[start:end], raw=False)
        except Exception:  # crc matched but not msgpack: treat as torn, like a bad crc
            break
        if not isinstance(record, dict):
            break
        records.append(record)
        offset = end
    if offset < len(data):
        print(f"buffer journal: truncating {len(data) - offset} torn bytes at offset {offset}", file=sys.stderr)
        with open(path, "r+b") as handle:
            handle.truncate(offset)
    return records


class Journal:
    """Appends records; `commit` makes them durable per the fsync policy before the service replies.

    `always`: fsync after every record; `batch`: one fsync per request (in `commit`); `never`: written to the OS at
    `commit` (survives a killed process, not a power loss).
    """

    def __init__(self, path: Path, fsync: str = "batch") -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"buffer.fsync must be one of {FSYNC_POLICIES}, got {fsync!r}")
        self.path = path
        self.fsync = fsync
        self._file = open(path, "ab")  # noqa: SIM115 - held open for the life of the service
        self._dirty = False

    def append(self, record: dict[str, Any]) -> None:
        payload = msgpack.packb(record, use_bin_type=True)
        self._file.write(_HEADER.pack(len(payload), zlib.crc32(payload)))
        self._file.write(payload)
        self._dirty = True
        if self.fsync == "always":
            self.commit()

    def commit(self) -> None:
        """Push appended records to the OS (and to disk unless fsync=never); call before replying."""
        if not self._dirty:
            return
        self._file.flush()
        if self.fsync != "never":
            os.fsync(self._file.fileno())
        self._dirty = False

    def rewrite(self, records: list[dict[str, Any]]) -> None:
        """Atomically replace the journal with `records` (compaction); appends continue on the new file."""
        self.commit()
        tmp = self.path.with_name(self.path.name + ".compact")
        with open(tmp, "wb") as handle:
            for record in records:
                payload = msgpack.packb(record, use_bin_type=True)
                handle.write(_HEADER.pack(len(payload), zlib.crc32(payload)))
                handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.path)
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        self._file.close()
        self._file = open(self.path, "ab")  # noqa: SIM115 - held open for the life of the service

    def size_bytes(self) -> int:
        return self._file.tell()

    def close(self) -> None:
        if not self._file.closed:
            self.commit()
            self._file.close()
