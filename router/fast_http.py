"""The router's HTTP server: uvicorn's httptools protocol, with the proxied routes served by the router itself.

Every request on a connection is parsed by uvicorn's `HttpToolsProtocol` (httptools, C). A `POST` to a
proxied path (`generate.PROXIED`, by the exact path: anything else, a query string aside, goes the
ASGI way) is not turned into an ASGI request: no scope, no `RequestResponseCycle`, no event and no
ASGI messages. Its body is collected by the parser's callbacks, and once it is complete one task
runs `generate.answer` with a `FastRequest` as the reply, which writes the answer's bytes to the
connection's transport itself: a whole answer in one write, a stream's worker reads each written
as one HTTP/1.1 chunk from the upstream protocol's callback (no task switch per read). Every other
request (admin, metrics, health, a proxied path with another method) is built exactly as uvicorn
builds it and served by the ASGI app, on the same connection.

A `FastRequest` stands in for uvicorn's cycle on the protocol (`self.cycle`), so what uvicorn and
`common/connection_guard.py` do per connection stays theirs: keep-alive and its timeout,
pipelined requests (queued, started when the one before has answered), the head and body
deadlines, the connection caps, a graceful shutdown (`keep_alive` cleared, tasks awaited). HTTP/1.1
as uvicorn serves it: `Expect: 100-continue` answered when the request's turn comes and its body is
still to come; a body declared or grown past `max_body_bytes` answered 413 at once (the rest is
read and dropped, the connection kept); HTTP/1.0 or `Connection: close` closes after the answer;
backpressure: a whole answer waits for the client's side to drain before it is written, a stream
falls back to a task that waits for each drain (`relay.py`'s generic relay) while the client's
side is paused; a lost connection completes the request's `gone_future`, which aborts the upstream.

`RouterSettings.fast_http` (`--http-server`) turns this off: plain uvicorn and the ASGI path.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE, HttpToolsProtocol

from lorafleet.router.generate import PROXIED, answer, error_body
from lorafleet.router.proxy import StreamBroken, StreamTail, Upstream, relay_stream
from lorafleet.router.upstream import Aborted, UpstreamError
from lorafleet.uvicorn_direct import transport_writer

if TYPE_CHECKING:
    import uvicorn

    from lorafleet.router.gateway import Gateway
    from lorafleet.router.generate import ProxyRoutes
    from lorafleet.router.settings import RouterSettings

log = logging.getLogger("lorafleet.router")

FAST_PATHS = frozenset(p.encode() for p in PROXIED)
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_CHUNKED = b"transfer-encoding: chunked\r\n"
_CLOSE = b"connection: close\r\n"
_EVENT_STREAM = (b"content-type", b"text/event-stream")


class DefaultHead:
    """uvicorn's default headers (date, server) as a response's head has them, made once per list:
    uvicorn puts a new list in `server_state.default_headers` when the date changes (each second)."""

    __slots__ = ("headers", "head")

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] | None = None
        self.head = b""

    def of(self, headers: list[tuple[bytes, bytes]]) -> bytes:
        if headers is not self.headers:
            self.head = b"".join(b"%s: %s\r\n" % (name, value) for name, value in headers)
            self.headers = headers
        return self.head


DEFAULT_HEAD = DefaultHead()

# Response headers uvicorn's `send` would write, remembered: a proxied answer's few headers (the
# worker's content type, the replica, the route's reason) are the same from one answer to the next.
VALID_HEADERS: set[tuple[bytes, bytes]] = set()
_VALID_KEPT = 512


def check_headers(headers: list[tuple[bytes, bytes]]) -> None:
    """Raises as uvicorn's `send` does for a header it refuses; remembers those it takes."""
    if HEADER_RE.search(b"-".join(name for name, _ in headers)):
        raise RuntimeError("Invalid HTTP header name.")
    if HEADER_VALUE_RE.search(b"\t".join(value for _, value in headers)):
        raise RuntimeError("Invalid HTTP header value.")
    if len(VALID_HEADERS) < _VALID_KEPT:
        VALID_HEADERS.update(headers)


class FastRequest:
    """One proxied request on a `FastProtocol` connection: its head and body as parsed, and its
    reply (`generate.Reply`). Has the attributes uvicorn's protocol and the connection guard read
    on `self.cycle` (`response_complete`, `more_body`, `disconnected`, `keep_alive`,
    `message_event.set()`, which here is the request's own `set`)."""

    __slots__ = ("proto", "path", "headers", "keep_alive", "expect_100", "chunks", "size", "too_large",
                 "more_body", "turn", "started", "response_started", "response_complete", "disconnected", "gone",
                 "message_event")

    def __init__(self, proto: FastProtocol, path: str, headers: list[tuple[bytes, bytes]], keep_alive: bool,
                 expect_100: bool, too_large: bool) -> None:
        self.proto = proto
        self.path = path
        self.headers = headers
        self.keep_alive = keep_alive
        self.expect_100 = expect_100
        self.chunks: list[bytes] = []
        self.size = 0
        self.too_large = too_large
        self.more_body = True
        self.turn = False  # the request before it on the connection has answered
        self.started = False
        self.response_started = False
        self.response_complete = False
        self.disconnected = False
        self.gone: asyncio.Future[None] | None = None
        self.message_event = self

    # ---- the protocol's side -------------------------------------------------------------------

    def set(self) -> None:
        """uvicorn's `connection_lost` (and nothing else here): the client is gone."""
        gone = self.gone
        if gone is not None and not gone.done():
            gone.set_result(None)

    def take_turn(self) -> None:
        """Its turn on the connection: start now if the body is in (or will be refused)."""
        self.turn = True
        if self.expect_100 and self.more_body and not self.too_large:
            self.proto.transport.write(CONTINUE)
        self.maybe_start()

    def maybe_start(self) -> None:
        if self.turn and (not self.more_body or self.too_large) and not self.started:
            self.started = True
            proto = self.proto
            task = proto.loop.create_task(self.run(proto.gateway()))
            task.add_done_callback(proto.tasks.discard)
            proto.tasks.add(task)

    async def run(self, gw: Gateway) -> None:
        chunks = self.chunks
        body = None if self.too_large else chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.chunks = []
        try:
            await answer(gw, self.path, self.headers, body, self)
        except Exception as exc:  # a bug: 500 in the API's envelope when nothing was sent, as uvicorn does
            log.error("exception serving %s", self.path, exc_info=exc)
            if not self.response_started and not self.disconnected:
                self.keep_alive = False
                await self.respond(500, [(b"content-type", b"application/json")],
                                   error_body(f"internal error: {type(exc).__name__}", "server_error"))
            else:
                self.proto.transport.close()

    # ---- the reply -----------------------------------------------------------------------------

    def gone_future(self) -> asyncio.Future[None]:
        proto = self.proto
        gone = self.gone = proto.loop.create_future()
        if self.disconnected:
            gone.set_result(None)
        else:
            proto.flow.resume_reading()  # a lost connection is noticed by reading
        return gone

    def _head(self, status: int, headers: list[tuple[bytes, bytes]], framing: bytes) -> list[bytes]:
        """The response's head (uvicorn's default headers first, as its `send` writes them); raises
        as uvicorn's `send` does for a header it would refuse."""
        if not VALID_HEADERS.issuperset(headers):
            check_headers(headers)
        parts = [STATUS_LINE[status], DEFAULT_HEAD.of(self.proto.server_state.default_headers)]
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        parts.append(framing)
        if not self.keep_alive:
            parts.append(_CLOSE)
        parts.append(b"\r\n")
        return parts

    async def _writable(self) -> bool:
        """Waits while the client's side is paused; False when the client is gone."""
        flow = self.proto.flow
        if flow.write_paused and not self.disconnected:
            await flow.drain()
        return not self.disconnected

    def _complete(self) -> None:
        self.response_complete = True
        proto = self.proto
        if not self.keep_alive:
            proto.transport.close()
        proto.on_response_complete()

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        if self.proto.flow.write_paused and not await self._writable():  # (no coroutine when not paused)
            return
        if self.disconnected:
            return
        parts = self._head(status, headers, b"content-length: %d\r\n" % len(body))
        parts.append(body)
        self.response_started = True
        self.proto.transport.write(b"".join(parts))
        self._complete()

    async def relay(self, upstream: Upstream, headers: list[tuple[bytes, bytes]], responses_api: bool) -> None:
        """The worker's stream as it comes, one chunk per upstream read; a failure after the first
        byte ends it with the route's error event, then raises StreamBroken; `Aborted` (the client
        left) passes through. The caller closes the exchange."""
        ex = upstream.response
        assert ex is not None
        if not upstream.content_type:
            headers.append(_EVENT_STREAM)
        if not await self._writable():
            raise Aborted  # the client left before the head: counted as gone, as the ASGI relay's exchange is
        head = self._head(upstream.status, headers, _CHUNKED)
        self.response_started = True
        transport = self.proto.transport
        transport.write(b"".join(head))
        tail = StreamTail(responses_api)
        try:
            try:
                if await ex.stream_to(self._writer(tail)):
                    return
            except UpstreamError as exc:
                await self._chunk(tail.error_end(exc))
                raise StreamBroken from exc
            async for chunk in relay_stream(ex, responses_api, tail):  # the client's side paused
                await self._chunk(chunk)
        finally:  # also after StreamBroken (its error event sent): the response is complete, not cut off
            if await self._writable():
                transport.write(b"0\r\n\r\n")
                self._complete()

    def _writer(self, tail: StreamTail) -> Any:
        """Body bytes to the client as one chunk each, from the upstream protocol's callback;
        False (nothing written) while the client's side is paused or gone."""
        return transport_writer(self.proto.transport, self.proto.flow, self, tail.see)

    async def _chunk(self, data: bytes) -> None:
        if await self._writable():
            self.proto.transport.write(b"%x\r\n%s\r\n" % (len(data), data))


class FastProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the proxied routes served by `FastRequest` (module doc).
    Made per server by `fast_protocol`, which names the app whose gateway serves them."""

    routes: ProxyRoutes
    _gateway: Gateway | None = None
    # uvicorn's keep-alive timeout with one timer per connection, not one made and cancelled per
    # request: the response's end notes the time (`_idle_since`), a request's bytes clear it, and
    # the timer (uvicorn's `timeout_keep_alive_task`), when it fires, closes the connection if it
    # has been idle `timeout_keep_alive` seconds, waits on if idle for less, and stops if busy.
    _idle_since: float | None = None

    def gateway(self) -> Gateway:
        gw = self._gateway
        if gw is None:  # built in the app's lifespan, before any connection is served
            gw = self._gateway = self.routes.state.gateway
        return gw

    # ---- the keep-alive timeout ----------------------------------------------------------------

    def _unset_keepalive_if_required(self) -> None:
        """uvicorn's, on a request's bytes (and a response's end): busy; the timer, if armed, stays."""
        self._idle_since = None

    def on_response_complete(self) -> None:
        """uvicorn's, but arming the keep-alive timeout only when no timer is armed."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self._idle_since = None
        self.flow.resume_reading()
        if self.pipeline:  # the next pipelined request starts
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        now = self._idle_since = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_at(now + self.timeout_keep_alive,
                                                             self.timeout_keep_alive_handler)

    def timeout_keep_alive_handler(self) -> None:
        self.timeout_keep_alive_task = None
        if self._idle_since is None:
            return  # busy: the next response's end arms it again
        due = self._idle_since + self.timeout_keep_alive
        if self.loop.time() < due - 0.001:  # busy since it was armed, idle again now: not long enough
            self.timeout_keep_alive_task = self.loop.call_at(due, self.timeout_keep_alive_handler)
            return
        super().timeout_keep_alive_handler()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._idle_since = None
        if self.timeout_keep_alive_task is not None:
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None

    def on_message_begin(self) -> None:
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self.scope = None  # type: ignore[assignment]  # built in on_headers_complete for the ASGI app

    def on_headers_complete(self) -> None:
        parser, url = self.parser, self.url
        q = url.find(b"?")
        path = url if q < 0 else url[:q]
        if (path not in FAST_PATHS or parser.get_method() != b"POST" or parser.should_upgrade()
                or self.limit_concurrency is not None):
            self._asgi_scope()
            super().on_headers_complete()
            return
        limit = self.gateway().settings.max_body_bytes
        too_large = False
        for name, value in self.headers:
            if name == b"content-length":
                too_large = value.isdigit() and int(value) > limit
                break
        keep_alive = parser.get_http_version() != "1.0" and parser.should_keep_alive()
        request = FastRequest(self, path.decode("ascii"), self.headers, keep_alive, self.expect_100_continue,
                              too_large)
        existing, self.cycle = self.cycle, request  # type: ignore[assignment]
        if existing is None or existing.response_complete:
            request.take_turn()
        else:  # pipelined: started by on_response_complete once the one before has answered
            self.flow.pause_reading()
            self.pipeline.appendleft((request, None))  # type: ignore[arg-type]

    def _asgi_scope(self) -> None:
        """The scope uvicorn's `on_message_begin` builds, for a request the ASGI app serves."""
        self.scope = {  # type: ignore[typeddict-item]
            "type": "http",
            "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": "1.1",
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,  # type: ignore[typeddict-item]
            "root_path": self.root_path,
            "headers": self.headers,
            "state": self.app_state.copy(),
        }

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        if type(cycle) is FastRequest:
            cycle.take_turn()
        else:
            super()._start_asgi_task(cycle, app)

    def on_body(self, body: bytes) -> None:
        request = self.cycle
        if type(request) is not FastRequest:
            super().on_body(body)
            return
        if request.response_complete or request.too_large:
            return  # answered (413) or being refused: the rest is read and dropped
        request.size += len(body)
        if request.size > self.gateway().settings.max_body_bytes:
            request.too_large = True
            request.chunks = []
            request.maybe_start()
        else:
            request.chunks.append(body)

    def on_message_complete(self) -> None:
        request = self.cycle
        if type(request) is not FastRequest:
            super().on_message_complete()
            return
        if request.response_complete:
            return
        request.more_body = False
        request.maybe_start()


def fast_protocol(routes: ProxyRoutes) -> type[FastProtocol]:
    """A `FastProtocol` serving `routes`' proxied paths with its gateway (one class per server)."""
    return type("FastProtocol", (FastProtocol,), {"routes": routes})


def server_config(app: ProxyRoutes, settings: RouterSettings, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's config for the router: the connection guard's limits around `FastProtocol`
    (`settings.fast_http`), else around uvicorn's default protocol."""
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from lorafleet.connection_guard import guarded_protocol, within_file_limit

    limits = within_file_limit(settings.connection_limits)
    base = fast_protocol(app) if settings.fast_http else AutoHTTPProtocol
    return uvicorn.Config(app, host=settings.host, port=settings.port, http=guarded_protocol(base, limits),
                          timeout_keep_alive=limits.keep_alive_timeout_s, **kwargs)
