"""Forwarding to a worker: the upstream client, header hygiene, the retry budget, SSE passthrough.

Retries happen only before the client has seen a byte. A non-streamed request is retried on
connection errors, dropped connections and 503s (generation has no side effects to undo); a
streamed one is retried until its first byte, after which a failure ends the stream as the worker
ends one on an error (the client already holds a partial answer): completions and chat with the
error object then `[DONE]`, the Responses API with OpenAI's `error` event. A worker's 404 for a request that names
adapters is stale routing, not an answer: the adapter left that worker after the view the router
routed on (the operator moved it, the worker evicted it), so the request is scheduled again.

A client that goes away (`gone`) closes the upstream connection, which is what makes the worker
abort the generation; the waiting call raises `Aborted`.

Bytes are forwarded, not re-encoded: the worker's SSE chunks reach the client as they came, and
only what routing, metrics and errors need is read (the status, the headers, a 404's message, the
tail of a stream that breaks). The upstream client is `router/upstream.py`'s: a keep-alive pool of
asyncio protocols parsed by httptools, a fraction of aiohttp's CPU per request and per chunk (httpx
stays for the control calls: inventory polls, loads, unloads).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

from lorafleet.protocol import INTERNAL_HEADER_PREFIX, ErrorResponse
from lorafleet.router.upstream import Exchange, Pool, UpstreamError, request_bytes

# Hop-by-hop (RFC 9110 §7.6.1) plus what the router owns: the client's key never reaches a worker.
# accept-encoding too: the body is relayed as it comes and read in part (errors), so uncompressed;
# expect too: the router has the whole body before it forwards it (a worker's `100 Continue` would
# be taken for its answer).
_DROP_REQUEST = {
    "host", "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "content-length", "authorization", "cookie", "accept-encoding", "expect",
}  # fmt: skip
# A worker asked for no encoding sends none; a content-encoding would not describe what is relayed.
_DROP_RESPONSE = {
    b"connection",
    b"keep-alive",
    b"transfer-encoding",
    b"content-length",
    b"content-encoding",
    b"server",
    b"date",
}
_INTERNAL = INTERNAL_HEADER_PREFIX.encode()


# The two filters' verdicts by raw header name, remembered: a request's few names are the same from
# one request to the next. Up to `_NAMES_KEPT` names each (the client and the worker choose them).
_NAMES_KEPT = 512
_UNSEEN = object()
_FORWARDED: dict[bytes, str | None] = {}
_RETURNED: dict[bytes, bytes | None] = {}


def _forwarded_name(raw: bytes) -> str | None:
    """A client's header name as a worker gets it (lower-case), None for one it does not get."""
    name = raw.decode("latin-1").lower()
    return None if name in _DROP_REQUEST or name.startswith(INTERNAL_HEADER_PREFIX) else name


def _returned_name(raw: bytes) -> bytes | None:
    """A worker's header name as the client gets it (lower-case), None for one it does not get."""
    name = raw.lower()
    return None if name in _DROP_RESPONSE else name


def _remember(cache: dict[bytes, Any], raw: bytes, verdict: Any) -> Any:
    if len(cache) < _NAMES_KEPT:
        cache[raw] = verdict
    return verdict


def upstream_headers(client: Iterable[tuple[bytes, bytes]], internal: Mapping[str, str]) -> dict[str, str]:
    """The client's (ASGI, lower-case) headers a worker may see, plus the router's own."""
    out = {}
    for k, v in client:
        name = _FORWARDED.get(k, _UNSEEN)
        if name is _UNSEEN:
            name = _remember(_FORWARDED, k, _forwarded_name(k))
        if name is not None:
            out[name] = v.decode("latin-1")
    out.update(internal)
    return out


def downstream_headers(
    upstream: Iterable[tuple[bytes, bytes]], extra: Mapping[str, str]
) -> list[tuple[bytes, bytes]]:
    """The worker's raw headers the client may see (ASGI form), plus the router's own."""
    out = []
    for k, v in upstream:
        name = _RETURNED.get(k, _UNSEEN)
        if name is _UNSEEN:
            name = _remember(_RETURNED, k, _returned_name(k))
        if name is not None:
            out.append((name, v))
    out += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()]
    return out


def sse_error(message: str, code: int = 502) -> bytes:
    """A completions/chat stream's end after a failure, as the worker ends its own: the error
    object, then `[DONE]`."""
    body = ErrorResponse.of(message, "upstream_error", code).model_dump()
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


def sse_error_event(message: str, sequence_number: int, code: int = 502) -> bytes:
    """A Responses API stream's end after a failure: OpenAI's `error` event, numbered after the
    events relayed."""
    body = {"type": "error", "code": str(code), "message": message, "param": None, "sequence_number": sequence_number}
    return f"event: error\ndata: {json.dumps(body)}\n\n".encode()


def upstream_session(
    max_connections: int, connect_timeout_s: float, read_timeout_s: float, keepalive_s: float = 4.0
) -> Pool:
    """The pooled client for proxied requests; made in the app's lifespan, closed at shutdown.

    Idle connections are dropped after `keepalive_s`, below uvicorn's 5 s on the worker side, so the
    router does not reuse a connection the worker is closing (a spurious failure and retry).
    """
    return Pool(max_connections, connect_timeout_s, read_timeout_s, keepalive_s)


@lru_cache(maxsize=1024)
def _split(url: str) -> tuple[tuple[str, int], str, str]:
    """A worker URL + path -> ((host, port), the host header, the path with its query)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"unsupported worker URL {url!r}: http://host[:port] only")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return (parts.hostname, parts.port or 80), parts.netloc, path


@dataclass(slots=True)
class RetryBudget:
    """Retries may be at most `ratio` of requests, plus `min_per_s` so a quiet fleet can still retry.

    Tokens accrue per request and per second, capped; a retry spends one. Stops a failing fleet
    from being hit by N× its traffic.
    """

    ratio: float = 0.2
    min_per_s: float = 5.0
    cap: float = 100.0
    clock: Callable[[], float] = time.monotonic
    _tokens: float = 10.0
    _last: float = field(default=0.0)

    def __post_init__(self) -> None:
        self._last = self.clock()

    def _refill(self) -> None:
        now = self.clock()
        self._tokens = min(self.cap, self._tokens + (now - self._last) * self.min_per_s)
        self._last = now

    def deposit(self) -> None:
        self._refill()
        self._tokens = min(self.cap, self._tokens + self.ratio)

    def try_spend(self) -> bool:
        self._refill()
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


class UpstreamFailed(Exception):
    """The replica failed before the client saw a byte: the request may go elsewhere."""

    def __init__(
        self, reason: str, unreachable: bool, status: int | None = None, missing: tuple[str, ...] = ()
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.unreachable = unreachable
        self.status = status
        self.missing = missing  # "not_loaded": the request's adapters the worker says it lacks


RETRYABLE_STATUS = {502, 503}
NOT_LOADED_STATUS = 404


def not_loaded(body: bytes, adapters: tuple[str, ...]) -> tuple[str, ...]:
    """The request's adapters a worker's 404 body names: our worker's "adapter 'x' is not loaded on
    this worker" and vLLM's "The model `x` does not exist." (any other 404 names none of them)."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return ()
    if not isinstance(message, str):
        return ()
    return tuple(a for a in adapters if f"'{a}'" in message or f"`{a}`" in message or f'"{a}"' in message)


@dataclass(slots=True)
class Upstream:
    """A worker's answer: `body` read for a non-streamed request; `response` still open for a stream."""

    status: int
    raw_headers: list[tuple[bytes, bytes]]
    content_type: str
    body: bytes = b""
    response: Exchange | None = None


async def send_once(
    session: Pool,
    url: str,
    body: bytes,
    headers: dict[str, str],
    stream: bool,
    adapters: tuple[str, ...] = (),
    gone: asyncio.Future | None = None,
) -> Upstream:
    """One attempt. Raises UpstreamFailed for failures that are safe to retry elsewhere.

    `adapters`: the request's; a 404 naming some of them means they are not loaded there (stale
    routing: UpstreamFailed "not_loaded" with those names), any other 404 is the answer.
    `gone` done (the client left), the upstream connection is closed (the worker aborts) and
    `Aborted` is raised; so it is when this call is cancelled.
    """
    key, host, path = _split(url)
    try:
        ex = await session.post(key, request_bytes("POST", host, path, headers, body), gone)
    except UpstreamError as exc:
        reason = {"connect": "connect", "timeout": "timeout"}.get(exc.kind, "transport")
        raise UpstreamFailed(reason, unreachable=exc.kind == "connect") from exc
    status = ex.status
    if status in RETRYABLE_STATUS:
        ex.close()
        raise UpstreamFailed(f"http_{status}", unreachable=False, status=status)
    out = Upstream(status, ex.raw_headers, ex.content_type)
    if stream and not (status == NOT_LOADED_STATUS and adapters):
        out.response = ex
        return out
    try:
        out.body = await ex.read()
    except UpstreamError as exc:  # died mid-answer: the client saw nothing
        raise UpstreamFailed("dropped", unreachable=False) from exc
    finally:  # also when cancelled or aborted: an unfinished answer's connection is dropped
        ex.close()
    if status == NOT_LOADED_STATUS and adapters:
        missing = not_loaded(out.body, adapters)
        if missing:
            raise UpstreamFailed("not_loaded", unreachable=False, status=status, missing=missing)
    return out


class StreamTail:
    """What ending a relayed stream on an error needs: the events relayed so far (the Responses
    API numbers its error event after them) and whether the last one was cut short. Each event
    ends in a blank line (JSON data holds no raw newline)."""

    __slots__ = ("responses_api", "events", "tail")

    def __init__(self, responses_api: bool = False) -> None:
        self.responses_api = responses_api
        self.events = 0
        self.tail = b"\n\n"

    def see(self, chunk: bytes) -> None:
        if self.responses_api:
            self.events += (self.tail[-1:] + chunk).count(b"\n\n")
        self.tail = chunk[-2:] if len(chunk) > 1 else self.tail[-1:] + chunk

    def error_end(self, exc: Exception) -> bytes:
        """The stream's end after `exc`: an event cut short is ended first (and numbered) so the
        error stands alone."""
        message = f"upstream failed mid-stream: {exc}"
        cut = self.tail != b"\n\n"
        end = sse_error_event(message, self.events + cut) if self.responses_api else sse_error(message)
        return (b"\n" if self.tail.endswith(b"\n") else b"\n\n") + end if cut else end


async def relay_stream(
    response: Exchange, responses_api: bool = False, tail: StreamTail | None = None
) -> AsyncIterator[bytes]:
    """The body's bytes as they arrive; a failure after the first byte ends the stream as the
    route's streams end on an error (`sse_error`; `responses_api`: `sse_error_event`), then raises
    StreamBroken. `Aborted` (the client left) passes through. `tail`: what was relayed before.

    The caller closes `response` (also when the client goes away mid-stream).
    """
    tail = tail if tail is not None else StreamTail(responses_api)
    try:
        while chunk := await response.read_some():
            tail.see(chunk)
            yield chunk
    except UpstreamError as exc:
        yield tail.error_end(exc)
        raise StreamBroken from exc


class StreamBroken(Exception):
    """The upstream failed after the first byte (the client got an SSE error event)."""

