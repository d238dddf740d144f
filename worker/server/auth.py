"""The admin bearer token: read from `--admin-token-file`, re-read when the file changes (a mounted
Kubernetes Secret rotates in place), compared in constant time, never logged or echoed. And vLLM's
`--api-key` guard of the public API (`ApiKeyGuard`)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from lorafleet.worker.server.errors import error_response

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


# vLLM's guarded prefixes (vllm/entrypoints/serve/middleware/authenticate.py): /health, /ready,
# /metrics, /tokenize and /detokenize stay open, as there.
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")


class ApiKeyGuard:
    """vLLM's `--api-key` as pure ASGI middleware: a request under a guarded prefix (but OPTIONS, and
    the admin routes, which check the admin token themselves) needs `Authorization: Bearer <key>`
    with one of the keys, else 401. Keys are kept hashed and compared in constant time, as vLLM does."""

    def __init__(self, app: Any, keys: Sequence[str], exempt: Iterable[str] = ()) -> None:
        self.app = app
        self._hashes = [hashlib.sha256(k.encode()).digest() for k in keys]
        self._exempt = frozenset(exempt)

    def allowed(self, authorization: str | None) -> bool:
        if not authorization:
            return False
        scheme, _, presented = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(presented.encode()).digest()
        match = False
        for h in self._hashes:  # every key compared: the time does not say which one matched
            match |= hmac.compare_digest(digest, h)
        return match

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket") and scope.get("method") != "OPTIONS":
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            if path.startswith(GUARDED_PREFIXES) and path not in self._exempt:
                headers = dict(scope.get("headers") or ())
                raw = headers.get(b"authorization")
                if not self.allowed(raw.decode("latin-1") if raw is not None else None):
                    response = error_response(401, "missing or wrong API key: send `Authorization: Bearer KEY` "
                                                   "with a key of the worker's --api-key",
                                              headers={"WWW-Authenticate": "Bearer"})
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)
