"""Adapters from remote sources (`s3://`, `hf://`): resolved, size-checked, downloaded once into a
local cache, then read like any local folder (the same validation, the same digest).

A backend per scheme (`s3_fetch.S3Backend`, `hub_fetch.HubBackend`) resolves a source into the two
files, their sizes and a content identity (S3: the objects' ETags; the Hub: the commit and the
files' blob ids), and downloads one file. Everything else is here and shared:

- the cache (`LORAFLEET_ADAPTER_CACHE_DIR`, bounded by `LORAFLEET_ADAPTER_CACHE_BYTES`, least
  recently used folders evicted first) holds one folder per content identity: content that changes
  gets a new folder, never a silent swap under a loaded adapter;
- size caps before any download (`pick_files`);
- atomicity: a download lands in a `.partial-*` folder beside the cache and is renamed into place
  whole, so a partial download is never visible;
- single flight: concurrent fetches of one source share one download, in this process (a future
  per source) and across the processes sharing the cache folder (a node-wide cache: a lock file per
  content, cache_locks.py): one downloads, the others wait and count a cache hit;
- eviction never removes a folder another process of the node holds (its shared lock);
- bounded retries with exponential back-off on transient errors (5xx, 429, connection resets,
  timeouts; `LORAFLEET_ADAPTER_FETCH_ATTEMPTS`);
- counters for the worker's `/metrics` (`FetchStats`).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from lorafleet.worker import envs
from lorafleet.worker.lora.adapter import WEIGHTS_FILE
from lorafleet.worker.lora.cache_locks import PARTIAL, KeyLock, remove_folder, remove_leftovers
from lorafleet.worker.lora.errors import AdapterError
from lorafleet.worker.lora.hub_fetch import HubBackend
from lorafleet.worker.lora.remote_files import Backend, RemoteSource, Resolved, TransientError
from lorafleet.worker.lora.s3_fetch import S3Backend
from lorafleet.worker.lora.sources import S3Source

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 20 << 30
DEFAULT_ATTEMPTS = 5
MAX_BACKOFF_S = 10.0
_SECONDS_KEPT = 1024  # download durations no scrape has taken yet (oldest dropped beyond)

T = TypeVar("T")


@dataclass
class FetchStats:
    """What the fetcher did, for tests and the worker's `/metrics` (mirrored there at each scrape)."""

    downloads: int = 0  # sources downloaded (each once)
    hits: int = 0  # fetches answered from the cache
    bytes_downloaded: int = 0
    evictions: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # by reason
    # (counter, scheme, reason or "") -> total; counters: hits, misses, bytes, retries, errors
    totals: dict[tuple[str, str, str], int] = field(default_factory=dict)
    # (scheme, download seconds) not yet taken by a scrape; the oldest dropped beyond the bound
    seconds: deque[tuple[str, float]] = field(default_factory=lambda: deque(maxlen=_SECONDS_KEPT))

    def take_seconds(self) -> list[tuple[str, float]]:
        """The durations recorded since the last call (safe beside the fetcher's threads)."""
        out = []
        while self.seconds:
            out.append(self.seconds.popleft())
        return out

    def count(self, counter: str, scheme: str, n: int = 1, reason: str = "") -> None:
        key = (counter, scheme, reason)
        self.totals[key] = self.totals.get(key, 0) + n


class AdapterFetcher:
    """Fetches `s3://` and `hf://` adapter folders into a bounded local cache (thread-safe)."""

    def __init__(self, cache_dir: str | os.PathLike | None = None, max_cache_bytes: int = DEFAULT_CACHE_BYTES, *,
                 attempts: int = DEFAULT_ATTEMPTS, backoff_s: float = 0.5, hub_endpoint: str | None = None,
                 hub_token: str | None = None) -> None:
        self.cache_dir = Path(cache_dir) if cache_dir else Path(tempfile.gettempdir()) / "lorafleet-adapters"
        self.max_cache_bytes = max_cache_bytes
        self.attempts = max(1, attempts)
        self.backoff_s = backoff_s
        self.s3 = S3Backend(self.attempts)
        self.hub = HubBackend(hub_endpoint, hub_token)
        self.stats = FetchStats()
        self._lock = threading.Lock()
        self._flights: dict[RemoteSource, Future] = {}
        self._used: dict[str, float] = {}  # cache folder name -> last use (monotonic), for LRU
        self._leases: dict[str, int] = {}  # folders handed out and not yet `release`d: never evicted
        # cache key -> its lock, held shared while the folder is leased or protected (cache_locks.py)
        self._held: dict[str, KeyLock] = {}
        self._key_locks: dict[str, threading.Lock] = {}  # one fetch of a key at a time in this process

    @classmethod
    def from_env(cls) -> AdapterFetcher:
        """From `LORAFLEET_ADAPTER_CACHE_DIR` (default: TMPDIR/lorafleet-adapters),
        `LORAFLEET_ADAPTER_CACHE_BYTES` (default 20 GiB) and `LORAFLEET_ADAPTER_FETCH_ATTEMPTS`
        (default 5), read at start-up (`worker/envs.py`); the Hub's `HF_ENDPOINT` and `HF_TOKEN` are
        huggingface_hub's own. Touches nothing until the first fetch."""
        return cls(envs.ADAPTER_CACHE_DIR, envs.ADAPTER_CACHE_BYTES, attempts=envs.ADAPTER_FETCH_ATTEMPTS)

    def client(self):
        """The boto3 S3 client (created on first use, from the standard AWS environment)."""
        return self.s3.client()

    def backend(self, source: RemoteSource) -> Backend:
        return self.s3 if isinstance(source, S3Source) else self.hub

    def fetch(self, source: RemoteSource, max_bytes: int, protected: Callable[[], set[str]] = set) -> str:
        """The local folder holding `source`'s adapter_config.json and adapter_model.safetensors
        (AdapterError with a reason if they cannot be had). `max_bytes` caps the weights file, as
        for local folders; `protected()` names folders eviction must keep (adapters loaded from them
        are re-read from there). The folder is leased to the caller, safe from eviction until
        `release(path)`."""
        with self._lock:
            flight = self._flights.get(source)
            leader = flight is None
            if leader:
                flight = self._flights[source] = Future()
        if not leader:
            return self._lease(flight.result())
        scheme = self.backend(source).scheme
        try:
            path = self._fetch(source, max_bytes)
        except BaseException as exc:
            reason = getattr(exc, "reason", type(exc).__name__)
            with self._lock:
                self.stats.errors[reason] = self.stats.errors.get(reason, 0) + 1
                self.stats.count("errors", scheme, reason=reason)
                del self._flights[source]
            flight.set_exception(exc)
            raise
        with self._lock:
            del self._flights[source]
        flight.set_result(path)  # leased by `_fetch` already
        try:
            self._evict(keep={path} | set(protected()))
        except OSError as exc:  # a cache that cannot be trimmed must not fail the load
            log.warning("adapter cache eviction failed: %s", exc)
        return path

    def _lease(self, path: str) -> str:
        with self._lock:
            self._leases[path] = self._leases.get(path, 0) + 1
        return path

    def release(self, path: str) -> None:
        """The caller of `fetch` is done reading `path` (the folder may be evicted from now on)."""
        with self._lock:
            left = self._leases.pop(path, 0) - 1
            if left > 0:
                self._leases[path] = left

    # -- one fetch -------------------------------------------------------------------------------
    def _fetch(self, source: RemoteSource, max_bytes: int) -> str:
        backend = self.backend(source)
        resolved = self.retrying(backend.scheme, lambda: backend.resolve(source, max_bytes))
        key = f"{backend.scheme}-{resolved.identity}"
        final = self.cache_dir / key
        with self._key_lock(key):
            lock = self._held.get(key)
            fresh = lock is None
            if lock is None:
                try:
                    self.cache_dir.mkdir(parents=True, exist_ok=True)
                    lock = KeyLock(self.cache_dir, key)
                except PermissionError:
                    raise AdapterError("cache_unwritable", "the adapter cache folder (LORAFLEET_ADAPTER_CACHE_DIR) "
                                       f"is not writable by this worker's user (uid {os.getuid()})") from None
            try:
                seconds = self._fill(lock, key, final, source, resolved, backend)
            except BaseException:
                if fresh:
                    lock.close()
                else:  # still leased here: back to shared, never left exclusive
                    lock.shared()
                raise
            with self._lock:
                self._held[key] = lock  # shared: no process evicts the folder while this one uses it
                self._used[key] = time.monotonic()
                # Leased before the key's guard is let go: `_let_go` never drops a lock handed out.
                self._leases[str(final)] = self._leases.get(str(final), 0) + 1
                if seconds is None:
                    self.stats.hits += 1
                    self.stats.count("hits", backend.scheme)
                    return str(final)
                size = resolved.config.size + resolved.weights.size
                self.stats.downloads += 1
                self.stats.bytes_downloaded += size
                self.stats.count("bytes", backend.scheme, size)
                self.stats.seconds.append((backend.scheme, seconds))
        log.info("fetched adapter %s (%d bytes) in %.2f s", source, size, seconds)
        return str(final)

    def _fill(self, lock: KeyLock, key: str, final: Path, source: RemoteSource, resolved: Resolved,
              backend: Backend) -> float | None:
        """Make `final` hold the content, the key's lock held shared on return: None when it was
        there (this process's or another's download), else the download's seconds. Another
        process downloading the key holds it exclusive: this one waits, then finds its folder."""
        seconds = None
        while True:
            lock.shared()
            if (final / WEIGHTS_FILE).is_file():
                return seconds
            lock.exclusive()
            if not (final / WEIGHTS_FILE).is_file():
                remove_leftovers(self.cache_dir, key)  # what a process killed mid-download left
                with self._lock:
                    self.stats.count("misses", backend.scheme)
                t0 = time.perf_counter()
                self._download(key, final, source, resolved, backend)
                seconds = time.perf_counter() - t0
            # Back to shared, then looked at again: it may have been evicted between the two locks.

    def _download(self, key: str, final: Path, source: RemoteSource, resolved: Resolved, backend: Backend) -> None:
        """Both files into a `.partial-KEY-*` folder beside the cache, renamed into place whole."""
        tmp = Path(tempfile.mkdtemp(prefix=f"{PARTIAL}{key}-", dir=self.cache_dir))
        try:
            for file in (resolved.config, resolved.weights):
                dest = tmp / file.name
                self.retrying(backend.scheme, lambda f=file, d=dest: backend.download(source, resolved, f, d))
                if dest.stat().st_size != file.size:  # every backend checks; a last net before the rename
                    raise AdapterError("changed", f"adapter source {source}: {file.name} is {dest.stat().st_size} "
                                       f"bytes, listed {file.size}; retry")
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _key_lock(self, key: str) -> threading.Lock:
        with self._lock:
            return self._key_locks.setdefault(key, threading.Lock())

    def retrying(self, scheme: str, call: Callable[[], T]) -> T:
        """`call()`, again after a back-off (0.5 s, 1 s, 2 s, ... at most 10 s, jittered) while it
        raises `TransientError`, at most `attempts` times in all."""
        for attempt in range(1, self.attempts + 1):
            try:
                return call()
            except TransientError as exc:
                if attempt == self.attempts:
                    raise TransientError(f"{exc} (gave up after {attempt} attempts)") from None
                delay = min(MAX_BACKOFF_S, self.backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
                with self._lock:
                    self.stats.count("retries", scheme)
                log.warning("%s; retrying in %.2f s (attempt %d of %d)", exc, delay, attempt + 1, self.attempts)
                time.sleep(delay)
        raise AssertionError("unreachable")

    # -- the cache -------------------------------------------------------------------------------
    def _evict(self, keep: set[str]) -> None:
        """Remove least recently used cache folders until the cache fits: never those in `keep` or
        leased, nor one another process holds (a worker sharing the cache folder). Folders this
        process no longer uses are let go first (their shared locks released)."""
        if not self.cache_dir.is_dir():
            return
        with self._lock:
            keep = keep | set(self._leases)
        kept = {os.path.realpath(p) for p in keep}
        self._let_go(kept)
        folders = []
        for entry in self.cache_dir.iterdir():
            if entry.name.startswith(".") or not entry.is_dir():
                continue
            try:
                size = sum(f.stat().st_size for f in entry.iterdir() if f.is_file())
                mtime = entry.stat().st_mtime
            except FileNotFoundError:  # another process evicted it meanwhile
                continue
            # Folders this process has not used (another's, or left by an earlier run) go first, oldest first.
            used = self._used.get(entry.name)
            folders.append(((0, mtime) if used is None else (1, used), entry, size))
        total = sum(size for _u, _e, size in folders)
        for _used, entry, size in sorted(folders, key=lambda f: f[0]):
            if total <= self.max_cache_bytes:
                break
            if os.path.realpath(entry) in kept or entry.name in self._held:
                continue
            if not remove_folder(self.cache_dir, entry.name):  # another process holds it
                continue
            total -= size
            with self._lock:
                self._used.pop(entry.name, None)
                self.stats.evictions += 1
            log.info("evicted cached adapter folder %s (%d bytes)", entry.name, size)

    def _let_go(self, kept: set[str]) -> None:
        """Release the shared locks of folders neither kept nor being fetched by another thread."""
        for key in list(self._held):
            if os.path.realpath(self.cache_dir / key) in kept:
                continue
            guard = self._key_lock(key)
            if not guard.acquire(blocking=False):  # a fetch of it is under way in this process
                continue
            try:
                with self._lock:
                    lock = self._held.pop(key, None)
                if lock is not None:
                    lock.close()
            finally:
                guard.release()
