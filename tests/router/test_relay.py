"""The stream relay (router/relay.py) on uvicorn's own response cycle: bytes written straight to the
client's transport as each upstream read arrives, the generic relay taking over while the client's
side is paused, the order and the chunked framing kept throughout, and the end written by uvicorn."""

from __future__ import annotations

import asyncio
import logging

import pytest
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from lorafleet.router.proxy import Upstream
from lorafleet.router.relay import on_disconnect, relay, write_response
from lorafleet.router.upstream import Pool, request_bytes

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class Transport:
    """What uvicorn writes to the client: every write, in order."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False


def _event(i: int) -> bytes:
    return b"data: {\"n\": %d}\n\n" % i


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _unchunk(body: bytes) -> tuple[bytes, bool]:
    """A chunked body's bytes, and whether it ended with the last (empty) chunk."""
    out, rest = b"", body
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return out, rest == b"\r\n"
        out, rest = out + rest[:n], rest[n + 2:]
    return out, False


def test_a_stream_is_written_as_it_comes_and_in_order_across_a_paused_client():
    async def run() -> tuple[list[bytes], list[bytes], list[bytes], bool]:
        sent: asyncio.Queue[bytes | None] = asyncio.Queue()

        async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(2)
            writer.write(HEAD)
            while (item := await sent.get()) is not None:
                writer.write(_chunk(item))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()

        server = await asyncio.start_server(upstream, "127.0.0.1", 0)
        key = ("127.0.0.1", server.sockets[0].getsockname()[1])
        pool = Pool(4, 1.0, 5.0)
        ex = await pool.post(key, request_bytes("POST", "h", "/v1/completions", {}, b"{}"))
        transport = Transport()
        flow = FlowControl(transport)  # type: ignore[arg-type]
        cycle = RequestResponseCycle(
            {"type": "http", "method": "POST", "path": "/v1/completions"},  # type: ignore[typeddict-item]
            transport, flow, logging.getLogger("t"), logging.getLogger("t"), False, [],  # type: ignore[arg-type]
            asyncio.Event(), False, True, lambda: None)
        task = asyncio.ensure_future(relay(cycle.send, Upstream(200, ex.raw_headers, ex.content_type, response=ex),
                                           [], responses_api=False))

        async def settle() -> None:
            for _ in range(20):
                await asyncio.sleep(0.01)

        await settle()
        head_writes = len(transport.writes)
        for i in range(3):  # streaming straight through
            await sent.put(_event(i))
            await settle()
        direct = transport.writes[head_writes:]
        assert ex.sink is not None  # written from the upstream callback, not by a task
        flow.pause_writing()  # the client stops reading
        for i in range(3, 6):
            await sent.put(_event(i))
        await settle()
        held = transport.writes[head_writes + len(direct):]
        assert ex.sink is None  # the generic relay waits for the drain
        flow.resume_writing()
        for i in range(6, 8):
            await sent.put(_event(i))
        await sent.put(None)
        await asyncio.wait_for(task, 5)
        ex.close()
        await pool.close()
        server.close()
        return direct, held, transport.writes[head_writes:], cycle.response_complete

    direct, held, body, complete = asyncio.run(run())
    assert direct == [_chunk(_event(i)) for i in range(3)]  # one chunk per upstream read, at once
    assert held == []  # nothing written while the client's side is paused
    # all of it, in order, and ended; the events held while paused went out together once resumed
    assert _unchunk(b"".join(body)) == (b"".join(_event(i) for i in range(8)), True)
    assert body[3] == _chunk(b"".join(_event(i) for i in range(3, 6)))
    assert complete


def _cycle(transport: Transport, keep_alive: bool = True, method: str = "POST") -> RequestResponseCycle:
    flow = FlowControl(transport)  # type: ignore[arg-type]
    return RequestResponseCycle(
        {"type": "http", "method": method, "path": "/v1/completions"},  # type: ignore[typeddict-item]
        transport, flow, logging.getLogger("t"), logging.getLogger("t"), False,  # type: ignore[arg-type]
        [(b"date", b"Mon, 07 Dec 2026 14:00:00 GMT"), (b"server", b"uvicorn")],
        asyncio.Event(), False, keep_alive, lambda: None)


@pytest.mark.parametrize("keep_alive", [True, False])
@pytest.mark.parametrize("status", [200, 404, 429, 503])
def test_a_whole_response_is_written_as_uvicorns_send_writes_it(status, keep_alive):
    """`write_response`: the same bytes as uvicorn's two ASGI sends, in one write, and the cycle
    left as they leave it (complete, its event set, the server told)."""
    body = b'{"ok": true}'
    headers = [(b"content-type", b"application/json"), (b"X-Lorafleet-Replica", b"w0"),
               (b"retry-after", b"1"), (b"content-length", str(len(body)).encode())]

    async def run() -> tuple[Transport, Transport, RequestResponseCycle, list[int]]:
        by_send, direct = Transport(), Transport()
        cycle = _cycle(by_send, keep_alive)
        await cycle.send({"type": "http.response.start", "status": status, "headers": list(headers)})
        await cycle.send({"type": "http.response.body", "body": body})
        told: list[int] = []
        fast = _cycle(direct, keep_alive)
        fast.on_response = lambda: told.append(1)
        assert write_response(fast.send, status, list(headers), body)
        return by_send, direct, fast, told

    by_send, direct, fast, told = asyncio.run(run())
    assert len(direct.writes) == 1
    assert direct.writes[0] == b"".join(by_send.writes)
    assert fast.response_started and fast.response_complete and fast.message_event.is_set() and told == [1]


@pytest.mark.parametrize("headers", [
    [(b"connection", b"close")],  # uvicorn acts on it
    [(b"bad name", b"x")],  # uvicorn refuses them
    [(b"x-ok", b"a\nb")],
])
def test_a_response_uvicorn_would_treat_otherwise_goes_through_its_send(headers):
    async def run() -> tuple[bool, Transport, RequestResponseCycle]:
        transport = Transport()
        cycle = _cycle(transport)
        return write_response(cycle.send, 200, headers, b""), transport, cycle

    written, transport, cycle = asyncio.run(run())
    assert not written and transport.writes == [] and not cycle.response_started
    assert not write_response(lambda _m: None, 200, [], b"")  # not uvicorn's cycle: the caller sends


def test_the_disconnect_future_completes_on_a_lost_connection_only():
    """`on_disconnect`: completed when uvicorn marks the cycle disconnected and sets its event, not
    when the event is set by the response's end."""
    async def run() -> tuple[bool, bool, bool]:
        ended = _cycle(Transport())
        gone_at_end = on_disconnect(ended.send)
        assert gone_at_end is not None
        await ended.send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await ended.send({"type": "http.response.body", "body": b""})
        await asyncio.sleep(0)
        lost = _cycle(Transport())
        gone = on_disconnect(lost.send)
        assert gone is not None
        lost.disconnected = True  # what uvicorn's connection_lost does
        lost.message_event.set()
        await asyncio.sleep(0)
        return gone_at_end.done(), gone.done(), on_disconnect(lost.send) is None

    done_at_end, done_when_lost, none_once_gone = asyncio.run(run())
    assert not done_at_end and done_when_lost and none_once_gone
