"""Writing a response's body straight to uvicorn's transport, for the router's relay and the worker's streams.

Under uvicorn's httptools server, every body chunk sent through ASGI passes the application's
middleware `send` wrappers and uvicorn's `send` coroutine (flow-control checks, a framing write);
a stream of one small event per token pays that per token. Once the response's head has gone
through `send` (so middleware and uvicorn's bookkeeping saw it start), the body's chunks can be
written to the connection's transport in uvicorn's own chunked framing, and the end still goes
through `send` (keep-alive and completion stay uvicorn's). These functions reach into uvicorn's
`RequestResponseCycle`; a uvicorn that moved what they use gets None / False, and the caller
falls back to `send`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

_UVICORN_CYCLE = ("uvicorn.protocols.http.httptools_impl", "RequestResponseCycle")


def uvicorn_cycle(send: Any) -> Any | None:
    """The uvicorn httptools `RequestResponseCycle` whose `send` this is, else None."""
    cycle = getattr(send, "__self__", None)
    kind = type(cycle)
    return cycle if (kind.__module__, kind.__name__) == _UVICORN_CYCLE else None


def on_disconnect(send: Any) -> asyncio.Future[None] | None:
    """A future completed when the client's connection is lost, or None when `send` is not
    uvicorn's httptools cycle's (then `receive` says so). Call once the request's body is read:
    until the response completes, the cycle's event is set only by `connection_lost`."""
    cycle = uvicorn_cycle(send)
    try:
        event: asyncio.Event = cycle.message_event  # type: ignore[union-attr]
        waiters = event._waiters  # type: ignore[attr-defined]  # asyncio's: futures set by `set()`
        if cycle.disconnected or event.is_set():  # type: ignore[union-attr]
            return None
    except AttributeError:  # not uvicorn's, or a version that moved them: the caller's task
        return None
    cycle.flow.resume_reading()  # as `receive` does: a lost connection is noticed by reading
    loop = asyncio.get_running_loop()
    gone: asyncio.Future[None] = loop.create_future()
    woken: asyncio.Future[None] = loop.create_future()  # set with the event: a disconnect or the end

    def woke(_f: asyncio.Future[None]) -> None:
        if cycle.disconnected and not gone.done():
            gone.set_result(None)

    woken.add_done_callback(woke)
    waiters.append(woken)
    gone.add_done_callback(lambda _f: woken.cancel())  # (cancelled by the caller when it is done)
    return gone


def transport_writer(transport: Any, flow: Any, conn: Any,
                     see: Callable[[bytes], None] | None = None) -> Callable[[bytes], bool]:
    """Body bytes to `transport` as one HTTP/1.1 chunk each, shown to `see`; False (nothing
    written) while `flow` (uvicorn's flow control) has paused writing or `conn.disconnected`
    (uvicorn's cycle, or a server's own request object)."""

    def write(data: bytes) -> bool:
        if flow.write_paused or conn.disconnected:
            return False
        if see is not None:
            see(data)
        transport.write(b"%x\r\n%s\r\n" % (len(data), data))
        return True

    return write


def chunk_writer(send: Any, see: Callable[[bytes], None] | None = None) -> Callable[[bytes], bool] | None:
    """`transport_writer` on the connection of uvicorn's httptools cycle whose `send` this is,
    or None when it is not one with a started chunked response (then the caller waits in
    `send`). Call after the response's head was sent."""
    cycle = uvicorn_cycle(send)
    if cycle is None or getattr(cycle, "chunked_encoding", None) is not True:
        return None
    try:  # uvicorn's internals: a version that moved them gets `send`
        if not cycle.response_started or cycle.response_complete or cycle.scope["method"] == "HEAD":
            return None
        transport, flow = cycle.transport, cycle.flow
        flow.write_paused, cycle.disconnected  # noqa: B018  (read per write)
    except (AttributeError, KeyError):
        return None
    return transport_writer(transport, flow, cycle, see)
