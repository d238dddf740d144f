"""The proxied requests' HTTP/1.1 client: a keep-alive pool of asyncio protocols parsed by httptools.

A worker's answer is forwarded, not interpreted: the router needs its status, its headers and its
body's bytes as they arrive. This client does only that. Per relayed chunk it costs one protocol
callback (httptools' C parser calls `on_body`), a list append and, when the relay is waiting, one
future set; per request one write of the whole request and no per-request objects beyond the
exchange. (aiohttp's client, for comparison, runs its stream reader's Python methods several
times per chunk and builds request, URL and header objects per request: most of the router's CPU.)

`Pool.post` returns once the worker's headers arrived (`Exchange`); `Exchange.read()` then gives
the whole body, `Exchange.read_some()` the bytes that came since the last call (b"" at the end).
`Exchange.stream_to(sink)` hands the body's bytes to `sink` from the protocol callback instead, once
per read (no task switch per chunk: the relay's hot path); `sink` returning False (its side cannot
take more now) hands the rest back to `read_some`.
`Exchange.close()` returns a finished connection to the pool and closes an unfinished one, which
is what makes the worker abort a generation. A `gone` future (the client left) closes the
exchange too: the waiting call raises `Aborted`.

Failures are `UpstreamError(kind)`: "connect" (refused, unreachable, connect timeout), "timeout"
(no byte for `read_timeout_s`), "transport" (the connection dropped before the answer was
complete). A kept-alive connection the worker closed meanwhile is retried once on a new one when
no byte of an answer came back (the worker never read the request).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import httptools


class UpstreamError(Exception):
    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


class Aborted(Exception):
    """The exchange was closed from this side (the client left) while a call waited on it."""


class Conn(asyncio.Protocol):
    """One upstream connection; one exchange at a time (no pipelining)."""

    def __init__(self, pool: Pool, key: tuple[str, int]) -> None:
        self.pool, self.key = pool, key
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.exchange: Exchange | None = None
        self.idle_since = 0.0
        self.last_read = 0.0

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        ex = self.exchange
        if ex is None:  # bytes nobody asked for: the connection is not reusable
            self.close()
            return
        self.last_read = self.loop.time()
        ex.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            ex.fail(UpstreamError("transport", f"bad response: {exc}"))
            self.close()
            return
        if ex.sink is not None and ex.chunks:
            ex.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.pool.forget(self)
        if self.exchange is not None and not self.exchange.complete:
            self.exchange.fail(UpstreamError("transport", "connection closed by the worker"))

    def pause_writing(self) -> None:  # requests are small: written at once
        pass

    def resume_writing(self) -> None:
        pass

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.exchange is not None
        self.exchange.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        ex = self.exchange
        assert ex is not None
        ex.status = self.parser.get_status_code()
        ex.keep_alive = self.parser.should_keep_alive()
        ex.wake()

    def on_body(self, body: bytes) -> None:
        ex = self.exchange
        assert ex is not None
        ex.chunks.append(body)
        if ex.waiter is not None and ex.sink is None:
            ex.wake()

    def on_message_complete(self) -> None:
        ex = self.exchange
        assert ex is not None
        ex.complete = True
        ex.wake()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        self.pool.forget(self)


class Exchange:
    """One request's answer, read as it arrives."""

    __slots__ = ("conn", "status", "raw_headers", "keep_alive", "chunks", "complete", "received", "error",
                 "waiter", "closed", "gone_cb", "gone", "sink")

    def __init__(self, conn: Conn, gone: asyncio.Future | None) -> None:
        self.conn = conn
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = False
        self.chunks: list[bytes] = []
        self.complete = False
        self.received = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future | None = None
        self.closed = False
        self.gone = gone
        self.gone_cb = None
        self.sink: Callable[[bytes], bool] | None = None
        if gone is not None:
            self.gone_cb = lambda _f: self.abort()
            gone.add_done_callback(self.gone_cb)

    @property
    def content_type(self) -> str:
        for k, v in self.raw_headers:
            if k.lower() == b"content-type":
                return v.decode("latin-1")
        return ""

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.wake()

    def abort(self) -> None:
        """The client left: the waiting call raises Aborted, the connection closes (the worker
        aborts); the owner still closes the exchange, which gives its slot back."""
        self.fail(Aborted())
        self.conn.close()

    async def _wait(self) -> None:
        """Until the parser has news (headers, body bytes, the end) or the exchange failed."""
        if self.error is not None:
            raise self.error
        self.waiter = self.conn.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None
        if self.error is not None:
            raise self.error

    async def headers(self) -> None:
        while self.status == 0:
            await self._wait()

    async def read(self) -> bytes:
        """The rest of the body."""
        while not self.complete:
            await self._wait()
        body = b"".join(self.chunks)
        self.chunks.clear()
        return body

    async def read_some(self) -> bytes:
        """The body's bytes that came since the last call, waiting for some; b"" once it ended."""
        while not self.chunks:
            if self.complete:
                return b""
            await self._wait()
        chunks = self.chunks
        if len(chunks) == 1:
            return chunks.pop()
        data = b"".join(chunks)
        chunks.clear()
        return data

    def flush(self) -> None:
        """The bytes that came to the sink; a sink that refuses gives the relay back to `read_some`."""
        sink, chunks = self.sink, self.chunks
        assert sink is not None
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        if not sink(data):
            chunks.append(data)
            self.sink = None
            self.wake()

    async def stream_to(self, sink: Callable[[bytes], bool]) -> bool:
        """Hands the body to `sink` as it arrives, until the end (True) or until `sink` refuses
        (False: the rest is `read_some`'s). Raises as `read_some` does."""
        self.sink = sink
        try:
            if self.chunks:
                self.flush()
            while self.sink is not None and not self.complete:
                await self._wait()
        finally:
            done = self.sink is not None
            self.sink = None
        return done

    def watch(self) -> None:
        """Fail with "timeout" once no byte came for the pool's `read_timeout_s` (`Pool.sweep`)."""
        conn = self.conn
        conn.last_read = conn.loop.time()
        conn.pool.watch(self)

    def close(self) -> None:
        """A complete exchange's connection goes back to the pool; an unfinished one is closed."""
        if self.closed:
            return
        self.closed = True
        self.detach()
        self.conn.pool.slots.release()

    def detach(self) -> None:
        self.conn.pool.watched.discard(self)
        if self.gone is not None and self.gone_cb is not None:
            self.gone.remove_done_callback(self.gone_cb)
        conn = self.conn
        conn.exchange = None
        if self.complete and self.keep_alive and self.error is None and conn.transport is not None:
            conn.pool.put_back(conn)
        else:
            conn.close()


class Pool:
    """Keep-alive connections per (host, port), at most `max_connections` exchanges at a time."""

    def __init__(self, max_connections: int, connect_timeout_s: float, read_timeout_s: float,
                 keepalive_s: float = 4.0) -> None:
        self.loop = asyncio.get_running_loop()
        self.connect_timeout_s, self.read_timeout_s, self.keepalive_s = connect_timeout_s, read_timeout_s, keepalive_s
        self.idle: dict[tuple[str, int], list[Conn]] = {}
        self.slots = asyncio.Semaphore(max_connections)
        self.open: set[Conn] = set()
        # Exchanges waiting on the worker, checked for the read timeout by one timer for them all
        # (a timer per exchange cost a schedule and a cancel per request): an exchange fails
        # between `read_timeout_s` and `read_timeout_s` + `sweep_s` after its last byte.
        self.watched: set[Exchange] = set()
        self.sweep_s = min(1.0, read_timeout_s / 4)
        self.sweeper: asyncio.TimerHandle | None = None

    def watch(self, ex: Exchange) -> None:
        self.watched.add(ex)
        if self.sweeper is None:
            self.sweeper = self.loop.call_later(self.sweep_s, self.sweep)

    def sweep(self) -> None:
        """Fails the watched exchanges that had no byte for `read_timeout_s`; runs while any is watched."""
        self.sweeper = None
        now = self.loop.time()
        for ex in [ex for ex in self.watched if now - ex.conn.last_read >= self.read_timeout_s]:
            self.watched.discard(ex)
            if not (ex.closed or ex.complete):
                ex.fail(UpstreamError("timeout", f"no answer for {self.read_timeout_s:g}s"))
                ex.conn.close()
        if self.watched:
            self.sweeper = self.loop.call_later(self.sweep_s, self.sweep)

    def forget(self, conn: Conn) -> None:
        self.open.discard(conn)
        idle = self.idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def put_back(self, conn: Conn) -> None:
        conn.idle_since = self.loop.time()
        self.idle.setdefault(conn.key, []).append(conn)

    async def _connect(self, key: tuple[str, int]) -> Conn:
        conn = Conn(self, key)
        try:
            await asyncio.wait_for(self.loop.create_connection(lambda: conn, key[0], key[1]), self.connect_timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            raise UpstreamError("connect", f"{type(exc).__name__}: {exc}") from exc
        if conn.transport is None:  # lost before this task resumed (a worker dying as it accepts)
            raise UpstreamError("connect", "connection closed by the worker as it opened")
        self.open.add(conn)
        return conn

    def _reuse(self, key: tuple[str, int]) -> Conn | None:
        idle = self.idle.get(key)
        now = self.loop.time()
        while idle:
            conn = idle.pop()  # the most recent: least likely to be closing on the worker's side
            if conn.transport is not None and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.close()
        return None

    async def post(self, key: tuple[str, int], request: bytes, gone: asyncio.Future | None = None) -> Exchange:
        """Sends `request` (the whole HTTP/1.1 request's bytes) and returns once the headers came;
        the exchange holds one of the `max_connections` slots until it is closed."""
        await self.slots.acquire()
        try:
            return await self._exchange(key, request, gone)
        except BaseException:
            self.slots.release()
            raise

    async def _exchange(self, key: tuple[str, int], request: bytes, gone: asyncio.Future | None) -> Exchange:
        conn = self._reuse(key)
        while True:
            reused = conn is not None
            if conn is None:
                conn = await self._connect(key)
            ex = Exchange(conn, gone)
            conn.exchange = ex  # (a reused connection's parser ended its last answer: it reads the next)
            assert conn.transport is not None
            conn.transport.write(request)
            ex.watch()
            try:
                await ex.headers()
                return ex
            except BaseException as exc:
                ex.closed = True
                ex.detach()  # closes the connection: the answer is unfinished
                if reused and isinstance(exc, UpstreamError) and exc.kind == "transport" and not ex.received:
                    conn = None  # a kept-alive connection the worker had closed: once more, on a new one
                    continue
                raise

    async def close(self) -> None:
        if self.sweeper is not None:
            self.sweeper.cancel()
            self.sweeper = None
        for conn in list(self.open):
            conn.close()
        self.idle.clear()


def request_bytes(method: str, host: str, path: str, headers: Mapping[str, str], body: bytes) -> bytes:
    head = [f"{method} {path} HTTP/1.1\r\nhost: {host}\r\n"]
    head += [f"{k}: {v}\r\n" for k, v in headers.items()]
    head.append(f"content-length: {len(body)}\r\n\r\n")
    return "".join(head).encode("latin-1") + body
