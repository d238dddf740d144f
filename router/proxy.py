"""Forwarding to a worker: header hygiene, the retry budget, and SSE passthrough.

Retries happen only before the client has seen a byte. A non-streamed request is retried on
connection errors, dropped connections and 503s (generation has no side effects to undo); a
streamed one is retried until its first byte, after which a failure ends the stream with an SSE
error event (the client already holds a partial answer).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field

import httpx

from lorafleet.protocol import INTERNAL_HEADER_PREFIX, ErrorResponse

# Hop-by-hop (RFC 9110 §7.6.1) plus what the router owns: the client's key never reaches a worker.
_DROP_REQUEST = {
    "host", "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "content-length", "authorization", "cookie",
}  # fmt: skip
_DROP_RESPONSE = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "content-encoding",
    "server",
    "date",
}


def upstream_headers(client_headers: Mapping[str, str], internal: Mapping[str, str]) -> dict[str, str]:
    out = {
        k: v
        for k, v in client_headers.items()
        if k.lower() not in _DROP_REQUEST and not k.lower().startswith(INTERNAL_HEADER_PREFIX)
    }
    out.update(internal)
    return out


def downstream_headers(upstream: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    out = {k: v for k, v in upstream.items() if k.lower() not in _DROP_RESPONSE}
    out.update(extra)
    return out


def sse_error(message: str, code: int = 502) -> bytes:
    body = ErrorResponse.of(message, "upstream_error", code).model_dump()
    return f"data: {json.dumps(body)}\n\n".encode()


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

    def __init__(self, reason: str, unreachable: bool, response: httpx.Response | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.unreachable = unreachable
        self.response = response


RETRYABLE_STATUS = {502, 503}


async def send_once(
    http: httpx.AsyncClient, url: str, body: bytes, headers: dict[str, str], stream: bool
) -> httpx.Response:
    """One attempt. Raises UpstreamFailed for failures that are safe to retry elsewhere."""
    request = http.build_request("POST", url, content=body, headers=headers)
    try:
        response = await http.send(request, stream=True)
    except httpx.ConnectError as exc:
        raise UpstreamFailed("connect", unreachable=True) from exc
    except httpx.TimeoutException as exc:
        raise UpstreamFailed("timeout", unreachable=False) from exc
    except httpx.TransportError as exc:
        raise UpstreamFailed("transport", unreachable=False) from exc
    if response.status_code in RETRYABLE_STATUS:
        await response.aread()
        await response.aclose()
        raise UpstreamFailed(f"http_{response.status_code}", unreachable=False, response=response)
    if not stream:
        try:
            await response.aread()
        except httpx.TransportError as exc:  # the worker died mid-answer: nothing reached the client
            await response.aclose()
            raise UpstreamFailed("dropped", unreachable=False) from exc
        await response.aclose()
    return response


async def relay_stream(response: httpx.Response, on_close: Callable[[bool], object]) -> AsyncIterator[bytes]:
    """Chunks as they arrive; a failure after the first byte ends the stream with an SSE error."""
    ok = False
    try:
        async for chunk in response.aiter_raw():
            yield chunk
        ok = True
    except httpx.TransportError as exc:
        yield sse_error(f"upstream failed mid-stream: {type(exc).__name__}")
    finally:
        await response.aclose()
        result = on_close(ok)
        if hasattr(result, "__await__"):
            await result  # type: ignore[misc]
