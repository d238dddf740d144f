"""Adapter digests: sha256 in a thread over the bytes being parsed, and a cache by file identity."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from pathlib import Path


class Sha256Thread:
    """sha256 of `parts` in a thread (hashlib releases the GIL on large buffers); `hexdigest` joins it."""

    def __init__(self, parts: Sequence) -> None:
        self._hash = hashlib.sha256()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(parts,), name="adapter-sha256", daemon=True)
        self._thread.start()

    def _run(self, parts: Sequence) -> None:
        try:
            for part in parts:
                self._hash.update(part)
        except BaseException as exc:  # noqa: BLE001 - re-raised by hexdigest on the caller's thread
            self._error = exc

    def hexdigest(self) -> str:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._hash.hexdigest()


class DigestCache:
    """Digests of adapter folders by file identity: a re-read of unchanged files skips the hash.

    The key is each file's (device, inode, size, mtime, ctime), taken before the read and checked
    again after it (as git's index does); writing a file changes its ctime, which user space
    cannot set back, so changed content always misses. Bounded LRU, shared by the process.
    """

    def __init__(self, capacity: int = 4096) -> None:
        self._items: dict[tuple, str] = {}
        self._lock = threading.Lock()
        self.capacity = capacity
        self.hits = 0

    @staticmethod
    def key(*paths: Path) -> tuple:
        out = []
        for path in paths:
            st = path.stat()
            out.append((str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        return tuple(out)

    def get(self, key: tuple) -> str | None:
        with self._lock:
            digest = self._items.pop(key, None)
            if digest is not None:
                self._items[key] = digest  # most recent last
                self.hits += 1
            return digest

    def put(self, key: tuple, digest: str) -> None:
        with self._lock:
            self._items.pop(key, None)
            self._items[key] = digest
            while len(self._items) > self.capacity:
                self._items.pop(next(iter(self._items)))


DIGEST_CACHE = DigestCache()
