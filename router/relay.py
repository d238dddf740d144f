"""A worker's stream relayed to the client: the bytes as they came, written where they arrive.

The generic relay is a task that wakes per upstream read and passes the bytes through the ASGI
`send` (`proxy.relay_stream`). Under uvicorn's httptools server (what `lorafleet router` runs), once
the response has started the body is written straight from the upstream protocol's callback to the
client's transport in uvicorn's own chunked framing (`direct_writer`): per relayed read one parse,
one write and no task switch. uvicorn's `send` still writes the response's head and its end, so its
bookkeeping (keep-alive, completion) is its own. When the client's side pauses writing (a slow
reader) or is gone, the direct writer refuses and the generic relay, which waits for the drain,
takes the rest.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import Send

from lorafleet.router.proxy import StreamBroken, StreamTail, Upstream, relay_stream
from lorafleet.router.upstream import UpstreamError

_UVICORN_CYCLE = ("uvicorn.protocols.http.httptools_impl", "RequestResponseCycle")


def direct_writer(send: Send, tail: StreamTail) -> Callable[[bytes], bool] | None:
    """A function writing body bytes to the client as one HTTP/1.1 chunk each (False when the
    client's side cannot take them now), or None when `send` is not uvicorn's httptools cycle's
    with a started chunked response. Call after the response's head was sent."""
    cycle = getattr(send, "__self__", None)
    kind = type(cycle)
    if (kind.__module__, kind.__name__) != _UVICORN_CYCLE or getattr(cycle, "chunked_encoding", None) is not True:
        return None
    try:  # uvicorn's internals: a version that moved them gets the generic relay
        if not cycle.response_started or cycle.response_complete or cycle.scope["method"] == "HEAD":
            return None
        transport, flow = cycle.transport, cycle.flow
        flow.write_paused, cycle.disconnected  # noqa: B018  (read per write below)
    except (AttributeError, KeyError):
        return None
    see = tail.see

    def write(data: bytes) -> bool:
        if flow.write_paused or cycle.disconnected:
            return False
        see(data)
        transport.write(b"%x\r\n%s\r\n" % (len(data), data))
        return True

    return write


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
        write = direct_writer(send, tail)
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
