"""A validated dataset's rows, saved once and memory-mapped by every later process of a run.

Every process of a run (driver, buffer, rollout workers, learner, evaluator) builds the same prompt source. Tasks
`jsonl` and `dataset` parse and validate the whole file for it (a 200 MB file: 18 s and 1.2 GB per process). The
first process that builds a source writes the rows it kept to `<cache>/datasets/<key>.rows` (`<cache>`:
$ASYNCRL_CACHE, else ~/.cache/asyncrl, as `common.builtin_model.cache_root`); the others open that file read-only
with `mmap` and decode a row only when it is asked for, so they hold only the rows they touch.

The key is a hash of everything that decides the rows: each dataset file's resolved path, size, mtime_ns and inode
(every file of a directory), the source's settings (keys, max_prompt_tokens, the tokenizer files, ...), the
math-verify version and FORMAT_VERSION. A file changed since the cache was written has another key. A file modified
less than RACY_S ago is not cached: a filesystem's coarse timestamps could give a rewrite of the same size the same
mtime (git's "racily clean" entries).

File layout (little-endian), never pickle:

    b"ARLROWS\0"  u64 FORMAT_VERSION | per column: its UTF-8 bytes, padded to 8, then int64 offsets (rows + 1, from 0)
    | meta (JSON: key, columns [[name, rows, bytes]], sources, extra)  u64 meta_len | 32-byte BLAKE2b digest of all
    that precedes it.

A file whose size, header, key or digest does not match is ignored and rewritten. Writes go to a temporary name
and `os.replace` into place, so concurrent builders never expose a partial file. A cache that cannot be written
(read-only, full disk) costs one warning line; the rows parsed are used as they are. Writing an entry removes the
entries whose dataset files are gone or changed.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import operator
import os
import struct
import sys
import tempfile
import time
from array import array
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 1
"""Bump when the layout or what the sources keep in a row changes: older entries then miss and are rewritten."""
RACY_S = 2.0
"""A dataset file modified less than this many seconds ago is parsed but not cached (see the module docstring)."""
_MAGIC = b"ARLROWS\0"
_HEAD = struct.Struct("<8sQ")  # magic, FORMAT_VERSION
_TAIL = struct.Struct("<Q")  # length of the meta JSON before it
_CHUNK = 1 << 20
_DIGEST_SIZE = 32
_SUFFIX = ".rows"
_warned = False


def cache_dir() -> Path:
    from common.builtin_model import cache_root

    return cache_root() / "datasets"


def path_identity(path: str | Path) -> list | None:
    """[resolved path, size, mtime_ns, inode] of a file, or [resolved path, [[relative path, size, mtime_ns, inode]
    of each file under it]] of a directory; None if it is neither (the parser then reports it)."""
    try:
        target = Path(path).expanduser().resolve()
        if target.is_file():
            st = target.stat()
            return [str(target), st.st_size, st.st_mtime_ns, st.st_ino]
        if target.is_dir():
            files = []
            for file in sorted(p for p in target.rglob("*") if p.is_file()):
                st = file.stat()
                files.append([str(file.relative_to(target)), st.st_size, st.st_mtime_ns, st.st_ino])
            return [str(target), files]
    except OSError:
        return None
    return None


def _newest_mtime_ns(identity: list) -> int:
    return identity[2] if len(identity) == 4 else max((f[2] for f in identity[1]), default=0)


def _math_verify_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("math-verify")
    except PackageNotFoundError:
        return ""


class StringColumn(Sequence[str]):
    """Read-only strings of a mapped cache file, decoded on access."""

    def __init__(self, buffer: mmap.mmap, offsets: np.ndarray, start: int) -> None:
        self._buffer, self._offsets, self._start = buffer, offsets, start

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, index: Any) -> Any:
        i = operator.index(index)
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range (0..{len(self) - 1})")
        lo, hi = int(self._offsets[i]), int(self._offsets[i + 1])
        return self._buffer[self._start + lo : self._start + hi].decode("utf-8", "surrogatepass")


class PairColumn(Sequence[tuple[str, str]]):
    """(prompt, answer) rows over two string columns, as the sources keep them in lists."""

    def __init__(self, prompts: Sequence[str], answers: Sequence[str]) -> None:
        self._prompts, self._answers = prompts, answers

    def __len__(self) -> int:
        return len(self._prompts)

    def __getitem__(self, index: Any) -> Any:
        return self._prompts[index], self._answers[index]


class JsonColumn(Sequence[dict]):
    """Dataset records kept as JSON text, a fresh dict on each access."""

    def __init__(self, texts: Sequence[str]) -> None:
        self._texts = texts

    def __len__(self) -> int:
        return len(self._texts)

    def __getitem__(self, index: Any) -> Any:
        return json.loads(self._texts[index])


def json_exact(value: object) -> bool:
    """Whether `value` comes back equal and of the same types from `json.loads(json.dumps(value))`."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return True
    if type(value) is list:
        return all(json_exact(item) for item in value)
    if type(value) is dict:
        return all(type(k) is str and json_exact(v) for k, v in value.items())
    return False


class RowCache:
    """The columns and extra values of one cache entry."""

    def __init__(self, columns: dict[str, StringColumn], extra: dict[str, Any]) -> None:
        self.columns, self.extra = columns, extra

    def pairs(self, prompts: str, answers: str) -> PairColumn:
        return PairColumn(self.columns[prompts], self.columns[answers])


def entry_key(sources: list[list], settings: dict[str, Any]) -> str | None:
    """The cache key of rows read from `sources` (path identities) with `settings`; None when they must not be
    cached (a source is missing, or was modified less than RACY_S ago)."""
    if any(identity is None for identity in sources):
        return None
    if any(time.time_ns() - _newest_mtime_ns(identity) < RACY_S * 1e9 for identity in sources):
        return None
    payload = {"format": FORMAT_VERSION, "math_verify": _math_verify_version(), "sources": sources, **settings}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def load(key: str | None) -> RowCache | None:
    """The entry saved under `key`, mapped read-only; None if there is none or it is damaged, foreign or stale."""
    if key is None:
        return None
    try:
        with open(cache_dir() / f"{key}{_SUFFIX}", "rb") as file:
            meta, size = _read_meta(file)
            if meta.get("key") != key or not _digest_matches(file, size):
                return None
            buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        columns, position = {}, _HEAD.size
        for name, rows, nbytes in meta["columns"]:
            offsets = np.frombuffer(buffer, dtype="<i8", count=rows + 1, offset=position + _padded(nbytes))
            if offsets[0] != 0 or offsets[-1] != nbytes:
                return None
            columns[name] = StringColumn(buffer, offsets, position)
            position += _padded(nbytes) + (rows + 1) * 8
    except (OSError, ValueError, KeyError, TypeError, struct.error):  # no entry, or not one of ours: parse instead
        return None
    return RowCache(columns, meta.get("extra", {}))


def _read_meta(file: Any) -> tuple[dict, int]:
    """(meta, file size) of a cache file; ValueError if it is not a whole one of ours."""
    magic, version = _HEAD.unpack(file.read(_HEAD.size))
    if magic != _MAGIC or version != FORMAT_VERSION:
        raise ValueError("not a row cache of this version")
    size = os.fstat(file.fileno()).st_size
    file.seek(size - _DIGEST_SIZE - _TAIL.size)
    (meta_len,) = _TAIL.unpack(file.read(_TAIL.size))
    if meta_len > size:
        raise ValueError("truncated")
    file.seek(size - _DIGEST_SIZE - _TAIL.size - meta_len)
    meta = json.loads(file.read(meta_len).decode("utf-8"))
    body = sum(_padded(nbytes) + (rows + 1) * 8 for _, rows, nbytes in meta["columns"])
    if size != _HEAD.size + body + meta_len + _TAIL.size + _DIGEST_SIZE:
        raise ValueError("wrong size")
    return meta, size


def _digest_matches(file: Any, size: int) -> bool:
    """Whether the digest at the end of the file is that of the rest (read in chunks: nothing stays mapped)."""
    digest, left, chunk = hashlib.blake2b(digest_size=_DIGEST_SIZE), size - _DIGEST_SIZE, bytearray(_CHUNK)
    file.seek(0)
    while left > 0:
        got = file.readinto(memoryview(chunk)[: min(left, len(chunk))])
        if not got:
            return False
        digest.update(memoryview(chunk)[:got])
        left -= got
    return file.read(_DIGEST_SIZE) == digest.digest()


def _padded(n: int) -> int:
    return (n + 7) // 8 * 8


class _DigestWriter:
    """Writes to a file through a buffer, hashing what it writes."""

    def __init__(self, file: Any) -> None:
        self.file, self.digest, self.pending = file, hashlib.blake2b(digest_size=_DIGEST_SIZE), bytearray()

    def write(self, data: bytes) -> None:
        self.pending += data
        if len(self.pending) >= _CHUNK:
            self.flush()

    def flush(self) -> None:
        self.digest.update(self.pending)
        self.file.write(self.pending)
        self.pending.clear()


def store(key: str | None, columns: dict[str, Iterable[str]], sources: list[list], extra: dict[str, Any]) -> bool:
    """Save `columns` (each text is encoded and written as it comes: nothing is built whole in memory) under `key`,
    through a temporary file and `os.replace`; False, with one warning line per process, if the cache cannot be
    written. Removes the entries whose dataset files are gone or changed."""
    global _warned
    if key is None:
        return False
    folder, temp_name = cache_dir(), None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{key}.", suffix=".tmp", delete=False) as file:
            temp_name = file.name
            out = _DigestWriter(file)
            out.write(_HEAD.pack(_MAGIC, FORMAT_VERSION))
            specs = []
            for name, texts in columns.items():
                lengths = array("q", [0])
                for text in texts:
                    piece = text.encode("utf-8", "surrogatepass")
                    lengths.append(len(piece))
                    out.write(piece)
                offsets = np.cumsum(np.frombuffer(lengths, dtype=np.int64), dtype="<i8")
                del lengths
                nbytes = int(offsets[-1])
                out.write(b"\0" * (_padded(nbytes) - nbytes))
                out.flush()
                out.write(offsets.tobytes())
                specs.append([name, len(offsets) - 1, nbytes])
            meta = json.dumps({"key": key, "columns": specs, "sources": sources, "extra": extra}).encode("utf-8")
            out.write(meta + _TAIL.pack(len(meta)))
            out.flush()
            file.write(out.digest.digest())
        os.replace(temp_name, folder / f"{key}{_SUFFIX}")
    except OSError as err:
        if temp_name is not None:
            Path(temp_name).unlink(missing_ok=True)
        if not _warned:
            _warned = True
            print(f"asyncrl: warning: dataset rows not cached in {folder} ({err}); each process parses the dataset",
                  file=sys.stderr)  # fmt: skip
        return False
    _prune(folder, keep=key)
    return True


def _prune(folder: Path, keep: str) -> None:
    """Remove the entries whose dataset files are gone or changed, unreadable entries, and temporary files an hour
    old (a builder that died)."""
    for entry in folder.iterdir():
        try:
            if entry.name.endswith(".tmp") and entry.name.startswith("."):
                if time.time() - entry.stat().st_mtime > 3600:
                    entry.unlink(missing_ok=True)
                continue
            if not entry.name.endswith(_SUFFIX) or entry.name == f"{keep}{_SUFFIX}":
                continue
            try:
                with entry.open("rb") as file:
                    sources = _read_meta(file)[0]["sources"]
                stale = any(path_identity(identity[0]) != identity for identity in sources)
            except (ValueError, KeyError, TypeError, IndexError, struct.error):
                stale = True
            if stale:
                entry.unlink(missing_ok=True)
        except OSError:  # another process removed it first, or the folder is shared read-only: leave it
            continue
