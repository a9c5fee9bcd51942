"""Content hashes, with a cache keyed by ``(device, inode, size, mtime_ns)``.

blake3 hashes gigabytes a second with several threads; the cache means a file that has
not changed since it was last hashed is never read again. The cache is a JSON file (one
per run folder, or per base-model cache) mapping an absolute path to its stat key and hash.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import blake3

from .fsio import write_atomic

__all__ = ["HashCache", "hash_bytes", "hash_file", "stat_key"]

_CHUNK = 16 * 1024 * 1024
ALGORITHM = "blake3"


def hash_bytes(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def hash_file(path: str | os.PathLike) -> str:
    """The blake3 hex digest of a file's content, read in large chunks."""
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    size = os.path.getsize(path)
    if size >= _CHUNK:
        # memory-mapped: blake3 reads it with all cores, without copying it into Python.
        hasher.update_mmap(os.fspath(path))
    else:
        with open(path, "rb") as f:
            hasher.update(f.read())
    return hasher.hexdigest()


def stat_key(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


class HashCache:
    """A persistent path → hash cache, trusted while the file's stat key is unchanged."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._entries: dict[str, dict] | None = None
        self._dirty = False

    def _load(self) -> dict[str, dict]:
        if self._entries is None:
            try:
                self._entries = json.loads(self.path.read_text())
                if not isinstance(self._entries, dict):
                    self._entries = {}
            except (OSError, ValueError):
                # a missing or torn cache costs a rehash, never a wrong answer
                self._entries = {}
        return self._entries

    def hash(self, path: str | os.PathLike, st: os.stat_result | None = None) -> str:
        key = os.path.abspath(path)
        st = st or os.stat(key)
        entries = self._load()
        entry = entries.get(key)
        if entry and entry.get("stat") == stat_key(st):
            return entry["hash"]
        digest = hash_file(key)
        entries[key] = {"stat": stat_key(st), "hash": digest}
        self._dirty = True
        return digest

    def remember(self, path: str | os.PathLike, digest: str, st: os.stat_result | None = None):
        """Record a hash already known (from a stamp whose size and mtime still match)."""
        key = os.path.abspath(path)
        st = st or os.stat(key)
        self._load()[key] = {"stat": stat_key(st), "hash": digest}
        self._dirty = True

    def save(self) -> None:
        if not self._dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, json.dumps(self._entries), durable=False)
        self._dirty = False
