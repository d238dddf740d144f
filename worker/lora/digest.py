"""Adapter digests: sha256 in a thread over the bytes that were read, and a cache by file identity.

A load does not wait for its digest (`Digest`): the adapter serves as soon as its weights are read
and checked, and whoever needs the value (a second load under the same name, the admin
inventory the operator checks against `spec.sha256`, a re-read after a CPU-cache eviction) waits
for the thread then.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)


class Sha256Thread:
    """sha256 of `parts` in a thread (hashlib releases the GIL on large buffers); `hexdigest` joins it.

    `on_done(hexdigest)` runs in the thread once the hash is complete (errors in it are logged).
    Not a daemon thread: a process that exits meanwhile waits for it (at most the time to hash one
    adapter) rather than finalizing the interpreter under it. A daemon thread still running then is
    ended at its next GIL acquisition, and where that is inside a C++ frame, as when the thread
    drops the last reference to the torch tensors it hashed, the process aborts ("terminate called
    without an active exception", pytorch/pytorch#38228)."""

    def __init__(self, parts: Sequence, on_done: Callable[[str], None] | None = None) -> None:
        self._hash = hashlib.sha256()
        self._error: BaseException | None = None
        self._on_done = on_done
        self._thread = threading.Thread(target=self._run, args=(parts,), name="adapter-sha256")
        self._thread.start()

    def _run(self, parts: Sequence) -> None:
        try:
            for part in parts:
                self._hash.update(part)
        except BaseException as exc:  # noqa: BLE001 - re-raised by hexdigest on the caller's thread
            self._error = exc
            return
        if self._on_done is not None:
            try:
                self._on_done(self._hash.hexdigest())
            except Exception:  # noqa: BLE001 - a cache update must not lose the digest
                log.exception("after hashing an adapter")

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def hexdigest(self) -> str:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._hash.hexdigest()


class Digest:
    """An adapter's content digest, "sha256:<hex>": known, or still being computed by a thread."""

    __slots__ = ("_value", "_thread", "_lock")

    def __init__(self, source: str | Sha256Thread) -> None:
        self._value = source if isinstance(source, str) else None
        self._thread = None if isinstance(source, str) else source
        self._lock = threading.Lock()

    @property
    def ready(self) -> bool:
        thread = self._thread  # None once the value is set
        return thread is None or thread.done

    @property
    def value(self) -> str:
        """The digest, waiting for the hash if it is still running (raises what the hash raised)."""
        if self._value is None:
            with self._lock:
                if self._value is None:
                    assert self._thread is not None
                    self._value = "sha256:" + self._thread.hexdigest()
                    self._thread = None
        return self._value

    def __repr__(self) -> str:
        return f"Digest({self._value!r})" if self._value is not None else "Digest(<hashing>)"


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
