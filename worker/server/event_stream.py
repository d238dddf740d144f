"""A streamed answer's server-sent events, written to the connection where they are produced.

Per token, a stream used to pass Starlette's `StreamingResponse` (a task group with a second
task reading `receive` for the disconnect), every middleware's `send` wrapper and uvicorn's
`send` coroutine before one `transport.write`: most of the HTTP loop's ~50 µs of CPU a token on
a 2-core machine, and that loop shares the GIL with the engine thread, which waits for it to
launch the next step. Under uvicorn's httptools server (what `lorafleet worker` runs),
`EventStreamResponse` sends the head through `send` (middleware and uvicorn see the response
start), writes each event as one chunk on the transport (`lorafleet.uvicorn_direct`), and sends
the end through `send`. A client gone is noticed from uvicorn's `connection_lost` (a future, no
task per request; the routes have read their bodies, as it needs), or at the next event, and stops
the events, whose `finally` aborts the requests. Where the server is
not uvicorn's httptools one, or the client reads slower than the stream (uvicorn's flow control
paused writing), the events go through `send`, which waits for the drain.

The server's own `send` reaches the response through the scope (`RAW_SEND`), put there by
`WorkerApp`, the outermost application: the `send` a route's response gets is the middleware's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from lorafleet.uvicorn_direct import chunk_writer, on_disconnect, uvicorn_cycle

RAW_SEND = "lorafleet.raw_send"  # scope key: the server's own `send` for this request

HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
           (b"x-accel-buffering", b"no")]


class WorkerApp(FastAPI):
    """FastAPI, with the server's `send` kept in the scope for `EventStreamResponse`."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[RAW_SEND] = send
        await super().__call__(scope, receive, send)


class EventStreamResponse(Response):
    """`text/event-stream` of `events` (each a complete event, `data: ...\\n\\n`). A Starlette
    `Response` (FastAPI passes those through), whose body is the events."""

    def __init__(self, events: AsyncIterator[str]) -> None:  # Response's __init__ renders a body: not called
        self.events = events
        self.status_code = 200
        self.background = None
        self.raw_headers = list(HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = scope.get(RAW_SEND)
        cycle = uvicorn_cycle(raw) if raw is not None else None
        if cycle is None or scope.get("method") == "HEAD":
            plain = StreamingResponse(self.events)
            plain.raw_headers = self.raw_headers
            await plain(scope, receive, send)
            return
        await self._direct(raw, cycle, send)

    async def _direct(self, raw: Any, cycle: Any, send: Send) -> None:
        task = asyncio.current_task()
        gone = on_disconnect(raw)
        streaming = True

        def left(f: asyncio.Future[None]) -> None:  # only while this response streams, only on a disconnect
            if streaming and not f.cancelled() and task is not None:
                task.cancel()

        if gone is not None:
            gone.add_done_callback(left)
        events = self.events
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            write = chunk_writer(raw)
            async for event in events:
                data = event.encode()
                if write is None or not write(data):
                    if cycle.disconnected:  # uvicorn's `send` would drop the events silently
                        return
                    await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if gone is None or not gone.done() or task is None:
                raise
            task.uncancel()  # the client left: the events' `finally` aborted the requests
        finally:
            streaming = False
            if gone is not None and not gone.done():
                gone.cancel()
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()
