"""Bounded connections for the router's and the worker's HTTP servers (uvicorn).

uvicorn closes a connection idle *between* requests (`timeout_keep_alive`), but nothing bounds a
connection that never sends a request, sends its head a byte at a time, or trickles its body: each
is held for ever, and enough of them exhaust the process's file descriptors while other users wait.
`guarded_protocol(base, limits)` subclasses uvicorn's HTTP protocol (httptools or h11) with:

- a head deadline: a request's head must arrive within `header_timeout_s` of the connection
  opening, or of the previous response ending (else 408 and close);
- a body deadline: its body within `body_timeout_s` of the head (else the connection is closed: the
  application sees a disconnect);
- a per-client cap (`max_client_connections` open connections per remote IP) and a server cap
  (`max_connections`): a connection over either gets 429 / 503 with `Connection: close` at once.

A deadline is for the whole head or body, not per read: a client sending a byte a second keeps
nothing open past it. Requests already read (the application working, a response streaming) are
not timed here. 0 disables a limit. Behind a proxy every connection comes from the proxy's
address: raise or disable the per-client cap there.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("lorafleet.connections")


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keep_alive_timeout_s: float = 5.0
    # One client may open as many as a thundering herd of a thousand requests needs, not the server's all.
    max_client_connections: int = 1024
    max_connections: int = 4096


@dataclass(slots=True)
class ConnectionTable:
    """Open connections of one server, by client address (shared by its protocol instances)."""

    total: int = 0
    by_client: Counter[str] = field(default_factory=Counter)
    refused: int = 0
    timed_out: int = 0


def _response(status: bytes, body: bytes) -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


TOO_MANY_FROM_CLIENT = _response(b"429 Too Many Requests", b"too many open connections from this client")
TOO_MANY = _response(b"503 Service Unavailable", b"too many open connections")
HEAD_TIMEOUT = _response(b"408 Request Timeout", b"the request head did not arrive in time")


def guarded_protocol(base: type[asyncio.Protocol], limits: ConnectionLimits,
                     table: ConnectionTable | None = None) -> type[asyncio.Protocol]:
    """A subclass of uvicorn's `base` HTTP protocol enforcing `limits` (one table per server)."""
    table = table if table is not None else ConnectionTable()

    class Guarded(base):  # type: ignore[misc, valid-type]
        _phase: str | None = None
        # One timer per connection, re-armed only when it fires early: a kept-alive connection's
        # every request changes the phase twice (head -> app -> head), and a timer cancelled and
        # made anew each time cost more than the rest of the tracking.
        _deadline: asyncio.TimerHandle | None = None
        _deadline_at = 0.0  # when `_deadline` fires
        _due = 0.0  # when the current phase's deadline passes; 0: it has none
        _counted: str | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            client = self.client[0] if self.client else ""
            if limits.max_connections and table.total >= limits.max_connections:
                return self._refuse(TOO_MANY)
            if limits.max_client_connections and table.by_client[client] >= limits.max_client_connections:
                return self._refuse(TOO_MANY_FROM_CLIENT)
            table.total += 1
            table.by_client[client] += 1
            self._counted = client
            self._track()

        def _refuse(self, response: bytes) -> None:
            table.refused += 1
            self.transport.write(response)
            self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._counted is not None:
                table.total -= 1
                table.by_client[self._counted] -= 1
                if table.by_client[self._counted] <= 0:
                    del table.by_client[self._counted]
                self._counted = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._track()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._track()

        # ---- deadlines -------------------------------------------------------------------

        def _current_phase(self) -> str:
            cycle = getattr(self, "cycle", None)
            if cycle is None or cycle.response_complete:
                return "head"  # waiting for a request (the first, or the next on a kept-alive connection)
            if cycle.more_body:
                return "body"
            return "app"

        def _track(self) -> None:
            if self._counted is None or self.transport is None or self.transport.is_closing():
                return
            phase = self._current_phase()
            if phase == self._phase:
                return  # a deadline covers the whole phase: more bytes do not extend it
            self._phase = phase
            timeout = limits.header_timeout_s if phase == "head" else limits.body_timeout_s if phase == "body" else 0.0
            if timeout <= 0:
                self._due = 0.0  # a timer still armed finds nothing due
                return
            due = self._due = self.loop.time() + timeout
            if self._deadline is not None:
                if self._deadline_at <= due:
                    return  # it fires first, then waits on for `due`
                self._deadline.cancel()
            self._arm(due)

        def _arm(self, at: float) -> None:
            self._deadline_at = at
            self._deadline = self.loop.call_at(at, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            due, phase = self._due, self._phase
            if not due or self.transport is None or self.transport.is_closing() or self._current_phase() != phase:
                return
            if self.loop.time() < due - 0.001:  # armed for an earlier phase: this one's deadline is later
                self._arm(due)
                return
            table.timed_out += 1
            if phase == "head":
                self.transport.write(HEAD_TIMEOUT)
            log.info("closed a connection from %s: its request %s did not arrive in time",
                     self.client[0] if self.client else "?", phase)
            self.transport.close()

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    Guarded.table = table  # type: ignore[attr-defined]
    return Guarded


def uvicorn_config(app: Any, host: str, port: int, limits: ConnectionLimits, **kwargs: Any):
    """A `uvicorn.Config` serving `app` with the guarded form of uvicorn's default HTTP protocol."""
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    limits = within_file_limit(limits)
    return uvicorn.Config(
        app, host=host, port=port, http=guarded_protocol(AutoHTTPProtocol, limits),
        timeout_keep_alive=limits.keep_alive_timeout_s, **kwargs,  # type: ignore[arg-type]
    )


def within_file_limit(limits: ConnectionLimits, spare: int = 256) -> ConnectionLimits:
    """The server cap lowered below the process's open-file limit (less `spare` for upstream
    connections, files and sockets of its own): past it, accept() fails and nobody is served."""
    import resource
    from dataclasses import replace

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft - spare <= 0:
        return limits
    room = soft - spare
    if limits.max_connections == 0 or limits.max_connections > room:
        log.warning("--max-server-connections lowered to %d: the open-file limit is %d (ulimit -n)", room, soft)
        return replace(limits, max_connections=room)
    return limits


def add_connection_flags(parser: Any, defaults: ConnectionLimits = ConnectionLimits()) -> None:
    """The flags of `ConnectionLimits` (the router's and the worker's), on a parser or group."""
    d = defaults
    parser.add_argument("--header-timeout", type=float, default=d.header_timeout_s, metavar="S",
                        help="seconds a client has to send a request's head, from connecting or from the end of "
                             "the previous response (else 408 and close); 0: no limit")
    parser.add_argument("--body-timeout", type=float, default=d.body_timeout_s, metavar="S",
                        help="seconds a client has to send a request's body once its head is in (else the "
                             "connection is closed); 0: no limit")
    parser.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_timeout_s, metavar="S",
                        help="seconds an idle kept-alive connection stays open between requests")
    parser.add_argument("--max-client-connections", type=int, default=d.max_client_connections, metavar="N",
                        help="open connections per client IP; more get 429 and are closed (behind a proxy, "
                             "every client is the proxy: raise it or 0); 0: no limit")
    parser.add_argument("--max-server-connections", type=int, default=d.max_connections, metavar="N",
                        help="open connections in all; more get 503 and are closed; 0: no limit (either way "
                             "kept below the open-file limit, ulimit -n)")


def limits_from_args(args: Any) -> ConnectionLimits:
    for flag in ("header_timeout", "body_timeout", "keep_alive_timeout", "max_client_connections",
                 "max_server_connections"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 0")
    return ConnectionLimits(
        header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
        keep_alive_timeout_s=args.keep_alive_timeout, max_client_connections=args.max_client_connections,
        max_connections=args.max_server_connections,
    )
