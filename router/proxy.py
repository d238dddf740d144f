"""Forwarding to a worker: the upstream client, header hygiene, the retry budget, SSE passthrough.

Retries happen only before the client has seen a byte. A non-streamed request is retried on
connection errors, dropped connections and 503s (generation has no side effects to undo); a
streamed one is retried until its first byte, after which a failure ends the stream as the worker
ends one on an error (the client already holds a partial answer): completions and chat with the
error object then `[DONE]`, the Responses API with OpenAI's `error` event. A worker's 404 for a request that names
adapters is stale routing, not an answer: the adapter left that worker after the view the router
routed on (the operator moved it, the worker evicted it), so the request is scheduled again.

A client that goes away cancels the attempt; cancelling closes the upstream connection, which is
what makes the worker abort the generation.

The upstream client is aiohttp: its C response parser and plain keep-alive pool cost a fraction of
httpx's per request, which is most of the router's budget at 1,000 req/s per core. (httpx stays for
the control calls: inventory polls, loads, unloads.)
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field

import aiohttp

from lorafleet.protocol import INTERNAL_HEADER_PREFIX, ErrorResponse

# Hop-by-hop (RFC 9110 §7.6.1) plus what the router owns: the client's key never reaches a worker.
_DROP_REQUEST = {
    "host", "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "content-length", "authorization", "cookie",
}  # fmt: skip
# aiohttp decodes a compressed body, so its content-encoding no longer applies.
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


def upstream_headers(client: Iterable[tuple[bytes, bytes]], internal: Mapping[str, str]) -> dict[str, str]:
    """The client's (ASGI, lower-case) headers a worker may see, plus the router's own."""
    out = {}
    for k, v in client:
        name = k.decode("latin-1").lower()
        if name not in _DROP_REQUEST and not name.startswith(INTERNAL_HEADER_PREFIX):
            out[name] = v.decode("latin-1")
    out.update(internal)
    return out


def downstream_headers(
    upstream: Iterable[tuple[bytes, bytes]], extra: Mapping[str, str]
) -> list[tuple[bytes, bytes]]:
    """The worker's raw headers the client may see (ASGI form), plus the router's own."""
    out = [(k.lower(), v) for k, v in upstream if k.lower() not in _DROP_RESPONSE]
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
) -> aiohttp.ClientSession:
    """The pooled client for proxied requests; made in the app's lifespan, closed at shutdown.

    Idle connections are dropped after `keepalive_s`, below uvicorn's 5 s on the worker side, so the
    router does not reuse a connection the worker is closing (a spurious failure and retry).
    """
    connector = aiohttp.TCPConnector(
        limit=max_connections, limit_per_host=0, keepalive_timeout=keepalive_s, ttl_dns_cache=60
    )
    timeout = aiohttp.ClientTimeout(
        total=None, connect=connect_timeout_s, sock_connect=connect_timeout_s, sock_read=read_timeout_s
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("User-Agent",),
    )


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
    raw_headers: tuple[tuple[bytes, bytes], ...]
    content_type: str
    body: bytes = b""
    response: aiohttp.ClientResponse | None = None


async def send_once(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: dict[str, str],
    stream: bool,
    adapters: tuple[str, ...] = (),
) -> Upstream:
    """One attempt. Raises UpstreamFailed for failures that are safe to retry elsewhere.

    `adapters`: the request's; a 404 naming some of them means they are not loaded there (stale
    routing: UpstreamFailed "not_loaded" with those names), any other 404 is the answer.
    Cancelled (the client left), it closes the upstream connection: the worker aborts the request.
    """
    try:
        response = await session.post(url, data=body, headers=headers)
    except aiohttp.ClientConnectorError as exc:
        raise UpstreamFailed("connect", unreachable=True) from exc
    except asyncio.TimeoutError as exc:
        raise UpstreamFailed("timeout", unreachable=False) from exc
    except aiohttp.ClientError as exc:  # e.g. the worker closed a kept-alive connection meanwhile
        raise UpstreamFailed("transport", unreachable=False) from exc
    status = response.status
    if status in RETRYABLE_STATUS:
        response.close()
        raise UpstreamFailed(f"http_{status}", unreachable=False, status=status)
    out = Upstream(status, response.raw_headers, response.headers.get("content-type", ""))
    if stream and not (status == NOT_LOADED_STATUS and adapters):
        out.response = response
        return out
    try:
        out.body = await response.read()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # died mid-answer: the client saw nothing
        response.close()
        raise UpstreamFailed("dropped", unreachable=False) from exc
    except BaseException:  # cancelled: drop the connection rather than finish reading the answer
        response.close()
        raise
    response.release()
    if status == NOT_LOADED_STATUS and adapters:
        missing = not_loaded(out.body, adapters)
        if missing:
            raise UpstreamFailed("not_loaded", unreachable=False, status=status, missing=missing)
    return out


async def relay_stream(response: aiohttp.ClientResponse, responses_api: bool = False) -> AsyncIterator[bytes]:
    """Chunks as they arrive; a failure after the first byte ends the stream as the route's
    streams end on an error (`sse_error`; `responses_api`: `sse_error_event`), then raises
    StreamBroken.

    The caller closes `response` (also when the client goes away mid-stream).
    """
    # Each event ends in a blank line (JSON data holds no raw newline): counted, they number the error event.
    events, tail = 0, b"\n\n"
    try:
        async for chunk in response.content.iter_any():
            if responses_api:
                events += (tail[-1:] + chunk).count(b"\n\n")
            tail = (tail + chunk)[-2:]
            yield chunk
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        message = f"upstream failed mid-stream: {type(exc).__name__}"
        cut = tail != b"\n\n"  # an event cut short: ended first (and numbered) so the error stands alone
        end = sse_error_event(message, events + cut) if responses_api else sse_error(message)
        yield (b"\n" if tail.endswith(b"\n") else b"\n\n") + end if cut else end
        raise StreamBroken from exc


class StreamBroken(Exception):
    """The upstream failed after the first byte (the client got an SSE error event)."""
