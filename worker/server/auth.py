"""The admin bearer token: read from `--admin-token-file`, re-read when the file changes (a mounted
Kubernetes Secret rotates in place), compared in constant time, never logged or echoed."""

from __future__ import annotations

import hmac
import logging
import os
import threading

log = logging.getLogger("lorafleet.worker.server.auth")


class AdminToken:
    def __init__(self, path: str | None) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._token: bytes | None = None
        if path is not None:
            self._refresh()
            if self._token is None:
                raise ValueError(f"--admin-token-file {path}: the file is missing or empty")

    @property
    def enabled(self) -> bool:
        return self._path is not None

    def __repr__(self) -> str:  # never show the secret
        return f"AdminToken(path={self._path!r})"

    def _refresh(self) -> None:
        assert self._path is not None
        try:
            st = os.stat(self._path)
        except OSError:
            return  # keep the last good token while a rotation swaps files
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        with self._lock:
            try:
                with open(self._path, "rb") as f:
                    token = f.read().strip()
            except OSError:
                return
            if token:
                self._token, self._stamp = token, stamp
                log.info("admin token loaded from %s", self._path)

    def check(self, authorization: str | None) -> bool:
        """True when the header is `Bearer <token>`; constant-time in the token's content."""
        if self._path is None or authorization is None:
            return False
        self._refresh()
        scheme, _, presented = authorization.partition(" ")
        if scheme.lower() != "bearer" or self._token is None:
            return False
        return hmac.compare_digest(presented.strip().encode(), self._token)
