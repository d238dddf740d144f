"""Adapters from S3 (and S3-compatible stores): listed, size-checked, downloaded once into a local
cache, then read like any local folder (the same validation, the same digest).

Credentials and endpoint come from boto3's standard chain (`AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`/
`AWS_SESSION_TOKEN`, profiles, IRSA/pod identity; `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` for
MinIO, R2 and the like); nothing here logs or reports them. The cache (`LORAFLEET_ADAPTER_CACHE_DIR`,
bounded by `LORAFLEET_ADAPTER_CACHE_BYTES`, least recently used folders evicted first) holds one
folder per (bucket, prefix, the two files' ETags and sizes): an object that changes gets a new folder,
never a silent swap. A download lands in a temporary folder beside the cache and is renamed into
place whole, so a partial download is never visible. Concurrent fetches of one source share one
download (single flight).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from lorafleet.worker import envs
from lorafleet.worker.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
from lorafleet.worker.lora.adapter_files import MAX_CONFIG_BYTES
from lorafleet.worker.lora.errors import AdapterError
from lorafleet.worker.lora.sources import S3Source

log = logging.getLogger(__name__)

PICKLE_NAMES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
DEFAULT_CACHE_BYTES = 20 << 30
_READ_BYTES = 8 << 20
_NOT_FOUND = {"NoSuchBucket", "NoSuchKey", "404", "NotFound"}
_DENIED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"}
_CHANGED = {"PreconditionFailed", "412"}


def _boto3():
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise AdapterError("sources_unavailable", "s3:// adapter sources need boto3: pip install 'lorafleet[sources]'") \
            from None
    return boto3, Config


@dataclass(frozen=True, slots=True)
class _Listed:
    key: str
    etag: str
    size: int


@dataclass
class FetchStats:
    downloads: int = 0  # sources downloaded (each once)
    hits: int = 0  # fetches answered from the cache
    bytes_downloaded: int = 0
    evictions: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # by reason


class S3Fetcher:
    """Fetches `s3://` adapter folders into a bounded local cache (thread-safe)."""

    def __init__(self, cache_dir: str | os.PathLike | None = None, max_cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.cache_dir = Path(cache_dir) if cache_dir else Path(tempfile.gettempdir()) / "lorafleet-adapters"
        self.max_cache_bytes = max_cache_bytes
        self.stats = FetchStats()
        self._lock = threading.Lock()
        self._flights: dict[S3Source, Future] = {}
        self._client = None
        self._used: dict[str, float] = {}  # cache folder name -> last use (monotonic), for LRU
        self._leases: dict[str, int] = {}  # folders handed out and not yet `release`d: never evicted

    @classmethod
    def from_env(cls) -> S3Fetcher:
        """From `LORAFLEET_ADAPTER_CACHE_DIR` (default: TMPDIR/lorafleet-adapters) and
        `LORAFLEET_ADAPTER_CACHE_BYTES` (default 20 GiB), read at start-up (`worker/envs.py`);
        touches nothing until the first fetch."""
        return cls(envs.ADAPTER_CACHE_DIR, envs.ADAPTER_CACHE_BYTES)

    def client(self):
        """The boto3 S3 client (created on first use, from the standard AWS environment)."""
        with self._lock:
            if self._client is None:
                boto3, config = _boto3()
                self._client = boto3.session.Session().client(
                    "s3", config=config(retries={"max_attempts": 5, "mode": "standard"}))
            return self._client

    def fetch(self, source: S3Source, max_bytes: int, protected: Callable[[], set[str]] = set) -> str:
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
        try:
            path = self._fetch(source, max_bytes)
        except BaseException as exc:
            reason = getattr(exc, "reason", type(exc).__name__)
            with self._lock:
                self.stats.errors[reason] = self.stats.errors.get(reason, 0) + 1
                del self._flights[source]
            flight.set_exception(exc)
            raise
        with self._lock:
            del self._flights[source]
        self._lease(path)
        flight.set_result(path)
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
    def _fetch(self, source: S3Source, max_bytes: int) -> str:
        listed = self._list(source)
        config, weights = self._pick(source, listed, max_bytes)
        key = hashlib.sha256(json.dumps([source.bucket, source.prefix, config.etag, config.size, weights.etag,
                                         weights.size]).encode()).hexdigest()[:40]
        final = self.cache_dir / key
        if (final / WEIGHTS_FILE).is_file():
            with self._lock:
                self.stats.hits += 1
                self._used[key] = time.monotonic()
            return str(final)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=self.cache_dir))
        try:
            t0 = time.perf_counter()
            for obj, name in ((config, CONFIG_FILE), (weights, WEIGHTS_FILE)):
                self._download(source, obj, tmp / name)
            try:
                os.rename(tmp, final)
            except OSError:  # another process put the same content there first
                if not (final / WEIGHTS_FILE).is_file():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        with self._lock:
            self.stats.downloads += 1
            self.stats.bytes_downloaded += config.size + weights.size
            self._used[key] = time.monotonic()
        log.info("fetched adapter %s (%d bytes) in %.2f s", source, config.size + weights.size,
                 time.perf_counter() - t0)
        return str(final)

    def _list(self, source: S3Source) -> dict[str, _Listed]:
        """The objects directly under the prefix, by file name."""
        out: dict[str, _Listed] = {}
        paginator = self.client().get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=source.bucket, Prefix=source.prefix, Delimiter="/"):
                for obj in page.get("Contents", ()):
                    name = obj["Key"][len(source.prefix):]
                    out[name] = _Listed(obj["Key"], obj["ETag"], int(obj["Size"]))
        except Exception as exc:  # noqa: BLE001 - botocore's errors become reasons
            raise _s3_error(source, exc) from None
        if not out:
            raise AdapterError("not_found", f"adapter source {source}: no objects under this prefix")
        return out

    @staticmethod
    def _pick(source: S3Source, listed: dict[str, _Listed], max_bytes: int) -> tuple[_Listed, _Listed]:
        config, weights = listed.get(CONFIG_FILE), listed.get(WEIGHTS_FILE)
        if config is None:
            raise AdapterError("missing_config", f"adapter source {source} has no {CONFIG_FILE}: not a PEFT adapter")
        if weights is None:
            pickled = [n for n in PICKLE_NAMES if n in listed]
            if pickled:
                raise AdapterError("pickle", f"adapter source {source}: {pickled[0]} is a pickle; only {WEIGHTS_FILE} "
                                   "is accepted (pickles can run code)")
            raise AdapterError("missing_weights", f"adapter source {source} has no {WEIGHTS_FILE}")
        if config.size > MAX_CONFIG_BYTES:
            raise AdapterError("too_large", f"{CONFIG_FILE} is {config.size} bytes, over the {MAX_CONFIG_BYTES}-byte cap")
        if weights.size > max_bytes:
            raise AdapterError("too_large", f"adapter weights are {weights.size} bytes, over the {max_bytes}-byte cap")
        return config, weights

    def _download(self, source: S3Source, obj: _Listed, dest: Path) -> None:
        """`obj` into `dest`, exactly its listed size and ETag (a changed object is refused)."""
        try:
            body = self.client().get_object(Bucket=source.bucket, Key=obj.key, IfMatch=obj.etag)["Body"]
            written = 0
            with open(dest, "wb") as out:
                while chunk := body.read(_READ_BYTES):
                    written += len(chunk)
                    if written > obj.size:
                        break
                    out.write(chunk)
            body.close()
        except AdapterError:
            raise
        except Exception as exc:  # noqa: BLE001 - botocore's errors become reasons
            raise _s3_error(source, exc) from None
        if written != obj.size:
            raise AdapterError("changed", f"adapter source {source}: {dest.name} changed while it was being fetched "
                               f"({written} bytes, listed {obj.size}); retry")

    # -- the cache -------------------------------------------------------------------------------
    def _evict(self, keep: set[str]) -> None:
        """Remove least recently used cache folders until the cache fits (never those in `keep`)."""
        if not self.cache_dir.is_dir():
            return
        folders = []
        for entry in self.cache_dir.iterdir():
            if entry.name.startswith(".") or not entry.is_dir():
                continue
            size = sum(f.stat().st_size for f in entry.iterdir() if f.is_file())
            # Folders this process has not used (left by an earlier run) go first, oldest first.
            used = self._used.get(entry.name)
            folders.append(((0, entry.stat().st_mtime) if used is None else (1, used), entry, size))
        total = sum(size for _u, _e, size in folders)
        with self._lock:
            keep = keep | set(self._leases)
        kept = {os.path.realpath(p) for p in keep}
        for _used, entry, size in sorted(folders, key=lambda f: f[0]):
            if total <= self.max_cache_bytes:
                break
            if os.path.realpath(entry) in kept:
                continue
            shutil.rmtree(entry, ignore_errors=True)
            total -= size
            with self._lock:
                self._used.pop(entry.name, None)
                self.stats.evictions += 1
            log.info("evicted cached adapter folder %s (%d bytes)", entry.name, size)


def _s3_error(source: S3Source, exc: Exception) -> AdapterError:
    """A botocore error as an AdapterError with a reason; the message names the source and S3's
    error code, never a credential."""
    code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", "")) if hasattr(exc, "response") else ""
    name = type(exc).__name__
    if code in _NOT_FOUND:
        return AdapterError("not_found", f"adapter source {source}: {code}")
    if code in _DENIED:
        return AdapterError("access_denied", f"adapter source {source}: access denied ({code}); check the "
                            "worker's AWS credentials")
    if code in _CHANGED:
        return AdapterError("changed", f"adapter source {source} changed while it was being fetched; retry")
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return AdapterError("no_credentials", f"adapter source {source}: no AWS credentials found (set "
                            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile, or a pod identity)")
    return AdapterError("fetch_failed", f"adapter source {source}: {code or name}")
