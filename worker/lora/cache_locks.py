"""Cross-process locks on the adapter cache's folders, so that several worker processes (the workers
of a node sharing a hostPath) can share one cache folder.

One lock file per cache key, `CACHE/.locks/KEY.lock`, locked with `fcntl.flock`:

- shared while a process reads or serves from the key's folder (a lease, or an adapter loaded
  from it that may be re-read);
- exclusive while a process downloads the key's content (others wait, then find the finished
  folder: one download per node) or evicts the folder (never while anyone holds it shared).

The kernel drops a dead process's locks, so a process killed mid-download blocks no one; what it
left (a `.partial-KEY-*` folder, invisible to lookups) is removed by the next holder of the
exclusive lock. Lock files are never deleted: unlinking a lock file another process has open
would let two processes hold "exclusive" locks on different inodes. They are empty files, one per
content ever fetched.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

LOCKS = ".locks"
PARTIAL = ".partial-"
EVICTING = ".evicting-"


class KeyLock:
    """The flock of one cache key (an open file description: threads of one process sharing it
    share the lock; another `KeyLock` of the same key, even in this process, contends with it)."""

    def __init__(self, cache_dir: Path, key: str) -> None:
        folder = cache_dir / LOCKS
        folder.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(folder / f"{key}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o664)

    def shared(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_SH)

    def exclusive(self) -> None:
        # Released first, explicitly: two shared holders converting at once must not wait on each other.
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def try_exclusive(self) -> bool:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def close(self) -> None:
        os.close(self.fd)  # releases the lock


def remove_leftovers(cache_dir: Path, key: str) -> None:
    """The partial downloads and half-removed folders of `key` that dead processes left (call with
    the key's exclusive lock held: no live process is writing them)."""
    for prefix in (PARTIAL, EVICTING):
        for entry in cache_dir.glob(f"{prefix}{key}-*"):
            shutil.rmtree(entry, ignore_errors=True)


def remove_folder(cache_dir: Path, key: str) -> bool:
    """Delete the key's folder if no process holds it (True when it is gone). Renamed out of sight
    first, so a crash midway leaves no half-deleted folder under the key's name."""
    lock = KeyLock(cache_dir, key)
    try:
        if not lock.try_exclusive():
            return False
        remove_leftovers(cache_dir, key)
        folder = cache_dir / key
        if not folder.is_dir():
            return True
        doomed = cache_dir / f"{EVICTING}{key}-{os.getpid()}"
        os.rename(folder, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        return True
    finally:
        lock.close()
