"""Bearer tokens for the workers' admin API, one per LoraPool, re-read when their files change.

The operator generates a `<pool>-admin-token` Secret per pool; the router gets them as files:
`--admin-token-dir DIR` (one file per pool name, e.g. a projected volume of every pool's Secret)
and/or `--admin-token-file FILE` (one token for every worker, and the fallback for a pool without a
file in DIR). Mounted Secrets rotate by swapping the files, so each lookup compares the file's
identity (inode, mtime, size) with the cached one and re-reads on change: a stat per poll or load.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("lorafleet.router")


@dataclass(slots=True)
class _Cached:
    key: tuple[int, int, int]
    token: str | None


@dataclass(slots=True)
class AdminTokens:
    file: Path | None = None
    directory: Path | None = None
    static: str | None = None  # a token given in settings (tests, `lorafleet up`): last fallback
    _cache: dict[Path, _Cached] = field(default_factory=dict)

    def for_pool(self, pool: str | None) -> str | None:
        if self.directory is not None and pool and _safe_name(pool):
            token = self._read(self.directory / pool)
            if token:
                return token
        if self.file is not None:
            token = self._read(self.file)
            if token:
                return token
        return self.static

    def headers(self, pool: str | None) -> dict[str, str]:
        token = self.for_pool(pool)
        return {"Authorization": f"Bearer {token}"} if token else {}

    def _read(self, path: Path) -> str | None:
        try:
            st = os.stat(path)  # follows the ..data symlink of a mounted Secret
        except OSError:
            self._cache.pop(path, None)
            return None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        cached = self._cache.get(path)
        if cached is not None and cached.key == key:
            return cached.token
        try:
            token = path.read_text().strip() or None
        except OSError as exc:
            log.warning("admin token %s unreadable: %s", path, exc)
            return cached.token if cached is not None else None
        if cached is not None and cached.token != token:
            log.info("admin token %s changed: using the new one", path)
        self._cache[path] = _Cached(key, token)
        return token


def _safe_name(pool: str) -> bool:
    """A pool name is a DNS label; anything else must not turn into a path outside the directory."""
    return "/" not in pool and not pool.startswith(".")
