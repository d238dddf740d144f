"""A worker's stream relayed to the client: the bytes as they came, written where they arrive.

The generic relay is a task that wakes per upstream read and passes the bytes through the ASGI
`send` (`proxy.relay_stream`). Under uvicorn's httptools server (what `lorafleet router` runs), once
the response has started the body is written straight from the upstream protocol's callback to the
client's transport in uvicorn's own chunked framing (`lorafleet.uvicorn_direct.chunk_writer`): per relayed read one parse,
one write and no task switch. uvicorn's `send` still writes the response's head and its end, so its
bookkeeping (keep-alive, completion) is its own. When the client's side pauses writing (a slow
reader) or is gone, the direct writer refuses and the generic relay, which waits for the drain,
takes the rest.

Two more shortcuts on the same cycle, for every proxied request: `write_response` writes a whole
non-streamed answer (head and body) in one transport write with uvicorn's own completion
bookkeeping, instead of two ASGI `send`s that validate each header by regex; `on_disconnect`
gives a future (from `lorafleet.uvicorn_direct`) that completes when the client's connection is lost (uvicorn's
`connection_lost` sets the cycle's event), instead of a task per request waiting in `receive`.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE

from lorafleet.router.proxy import StreamBroken, StreamTail, Upstream, relay_stream
from lorafleet.router.upstream import UpstreamError
from lorafleet.uvicorn_direct import chunk_writer, on_disconnect, uvicorn_cycle


def write_response(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
    """A whole non-streamed response (`headers` already holding its content-length) written to
    uvicorn's transport at once, as uvicorn's `send` would write it; False (nothing written) when
    `send` is not uvicorn's httptools cycle's or its response has started."""
    cycle = uvicorn_cycle(send)
    if cycle is None:
        return False
    try:
        if (cycle.response_started or cycle.disconnected or cycle.flow.write_paused or cycle.access_log
                or cycle.scope["method"] == "HEAD"):
            return False
        parts = [STATUS_LINE[status]]
        for name, value in cycle.default_headers:
            parts += (name, b": ", value, b"\r\n")
        names = [name.lower() for name, _ in headers]
        # What uvicorn's `send` checks header by header, in one search each ("-" and "\t" are
        # allowed in names and values): one it would refuse, or a `connection` header it would
        # act on, goes to its `send`.
        if (b"connection" in names or HEADER_RE.search(b"-".join(names))
                or HEADER_VALUE_RE.search(b"\t".join(value for _, value in headers))):
            return False
        for name, (_, value) in zip(names, headers):
            parts += (name, b": ", value, b"\r\n")
        keep_alive = cycle.keep_alive
        if not keep_alive:
            parts.append(b"connection: close\r\n")
        parts += (b"\r\n", body)
        transport, event, on_response = cycle.transport, cycle.message_event, cycle.on_response
    except (AttributeError, KeyError):  # a uvicorn that moved them (or a status it has no line for)
        return False
    cycle.response_started = True
    cycle.waiting_for_100_continue = False
    cycle.chunked_encoding = False
    transport.write(b"".join(parts))
    cycle.response_complete = True
    event.set()
    if not keep_alive:
        transport.close()
    on_response()
    return True


async def relay(send: Send, upstream: Upstream, headers: list[tuple[bytes, bytes]], responses_api: bool) -> None:
    """A streamed answer to the client, as the worker sends it (no parsing, no re-encoding).

    A failure after the first byte ends the stream with the route's error event, then raises
    StreamBroken; `Aborted` (the client left) passes through. The caller closes the exchange."""
    ex = upstream.response
    assert ex is not None
    if not upstream.content_type:
        headers.append((b"content-type", b"text/event-stream"))
    await send({"type": "http.response.start", "status": upstream.status, "headers": headers})
    tail = StreamTail(responses_api)
    try:
        write = chunk_writer(send, tail.see)  # uvicorn's cycle: straight to its transport
        if write is not None:
            try:
                if await ex.stream_to(write):
                    return
            except UpstreamError as exc:
                await send({"type": "http.response.body", "body": tail.error_end(exc), "more_body": True})
                raise StreamBroken from exc
        async for chunk in relay_stream(ex, responses_api, tail):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    finally:  # also after StreamBroken (its error event sent): the response is complete, not cut off
        await send({"type": "http.response.body", "body": b""})


class ClientGone(Exception):
    """The client disconnected (before its request was read, or while it was being served)."""


class Reply(Protocol):
    """Where a proxied request's answer goes (`router/generate.py`)."""

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A whole answer; `headers` without a content-length (added here)."""

    async def relay(self, upstream: Upstream, headers: list[tuple[bytes, bytes]], responses_api: bool) -> None:
        """A streamed answer, as `relay` below."""

    def gone_future(self) -> asyncio.Future[None]:
        """Done when the client's connection is lost; call once the body is read, cancel when done."""


class AsgiReply:
    """A reply through the ASGI `send`, with the uvicorn shortcuts above where they apply."""

    __slots__ = ("scope", "receive", "send")

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scope, self.receive, self.send = scope, receive, send

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        headers.append((b"content-length", str(len(body)).encode()))
        if write_response(self.send, status, headers, body):  # uvicorn's cycle: one write, no ASGI messages
            return
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        await self.send({"type": "http.response.body", "body": body})

    async def relay(self, upstream: Upstream, headers: list[tuple[bytes, bytes]], responses_api: bool) -> None:
        await relay(self.send, upstream, headers, responses_api)

    def gone_future(self) -> asyncio.Future[None]:
        gone = on_disconnect(self.send)  # uvicorn's cycle: a future its connection_lost completes
        if gone is None:
            gone = asyncio.get_running_loop().create_task(disconnected(self.receive))
        return gone


async def disconnected(receive: Receive) -> None:
    """Returns when the client disconnects; call only once the body is read (the rest is that)."""
    while (await receive())["type"] != "http.disconnect":
        pass
