"""The proxied requests' HTTP/1.1 client (router/upstream.py) against raw asyncio servers: keep-alive
reuse, a kept-alive connection the worker closed, answers cut short, read timeouts, a client that leaves."""

from __future__ import annotations

import asyncio

import pytest

from lorafleet.router.upstream import Aborted, Pool, UpstreamError, request_bytes

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


async def _server(handler) -> tuple[asyncio.AbstractServer, tuple[str, int]]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, ("127.0.0.1", server.sockets[0].getsockname()[1])


def _request(key: tuple[str, int], body: bytes = b"{}") -> bytes:
    return request_bytes("POST", f"{key[0]}:{key[1]}", "/v1/completions", {"content-type": "application/json"}, body)


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    return head + await reader.readexactly(length)


def test_answers_reuse_one_kept_alive_connection():
    connections = []

    async def handler(reader, writer):
        connections.append(writer)
        while True:
            try:
                req = await _read_request(reader)
            except asyncio.IncompleteReadError:
                return
            assert req.startswith(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:")
            writer.write(OK)

    async def run():
        server, key = await _server(handler)
        async with server:
            pool = Pool(8, 1.0, 5.0)
            for _ in range(3):
                ex = await pool.post(key, _request(key))
                assert ex.status == 200 and ex.content_type == "application/json"
                assert await ex.read() == b"{}"
                ex.close()
            await pool.close()
        return len(connections)

    assert asyncio.run(run()) == 1


def test_a_kept_alive_connection_the_worker_closed_is_retried_on_a_new_one():
    served = []

    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(OK)
        served.append(1)
        await writer.drain()
        writer.close()  # no keep-alive header, yet closes: the pooled connection is stale

    async def run():
        server, key = await _server(handler)
        async with server:
            pool = Pool(8, 1.0, 5.0)
            for _ in range(2):
                ex = await pool.post(key, _request(key))
                assert await ex.read() == b"{}"
                ex.close()
                await asyncio.sleep(0.05)
            await pool.close()

    asyncio.run(run())
    assert len(served) == 2


def test_a_stream_cut_short_fails_as_transport_after_its_bytes():
    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(b"6\r\ndata: \r\n")
        await writer.drain()
        writer.close()

    async def run():
        server, key = await _server(handler)
        async with server:
            pool = Pool(8, 1.0, 5.0)
            ex = await pool.post(key, _request(key))
            assert ex.status == 200
            assert await ex.read_some() == b"data: "
            with pytest.raises(UpstreamError) as err:
                await ex.read_some()
            ex.close()
            await pool.close()
        return err.value.kind

    assert asyncio.run(run()) == "transport"


def test_no_answer_is_a_timeout_and_a_refused_connection_is_connect():
    async def handler(reader, writer):
        await _read_request(reader)
        await asyncio.sleep(5)

    async def run():
        server, key = await _server(handler)
        async with server:
            pool = Pool(8, 1.0, 0.2)
            with pytest.raises(UpstreamError) as timeout:
                await pool.post(key, _request(key))
        with pytest.raises(UpstreamError) as refused:
            await pool.post(key, _request(key))  # the server is closed now
        await pool.close()
        return timeout.value.kind, refused.value.kind, pool.slots._value

    assert asyncio.run(run()) == ("timeout", "connect", 8)  # every slot given back


def test_a_client_that_leaves_closes_the_upstream_connection():
    seen: list[str] = []

    async def handler(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        seen.append("started")
        data = await reader.read()  # b"" once the router closed its end
        seen.append("closed" if data == b"" else "data")

    async def run():
        server, key = await _server(handler)
        async with server:
            pool = Pool(8, 1.0, 5.0)
            gone = asyncio.get_running_loop().create_future()
            ex = await pool.post(key, _request(key), gone)
            asyncio.get_running_loop().call_later(0.05, gone.set_result, None)
            with pytest.raises(Aborted):
                await ex.read_some()
            ex.close()
            for _ in range(100):
                if len(seen) == 2:
                    break
                await asyncio.sleep(0.01)
            await pool.close()
        return pool.slots._value

    assert asyncio.run(run()) == 8
    assert seen == ["started", "closed"]


def test_a_connection_lost_before_its_first_write_is_a_connect_failure():
    """A worker dying as it accepts: the connection is lost after it opened but before the request
    was written. That is a connect failure (retried elsewhere), not a crash of the request."""

    async def run() -> str:
        pool = Pool(4, 1.0, 5.0)
        loop = asyncio.get_running_loop()

        class Lost:
            def close(self) -> None:
                pass

        async def open_then_lose(factory, host, port):
            protocol = factory()
            protocol.connection_made(Lost())
            protocol.connection_lost(ConnectionResetError())  # before the caller resumes
            return Lost(), protocol

        loop.create_connection = open_then_lose  # type: ignore[method-assign]
        try:
            await pool.post(("127.0.0.1", 9), _request(("127.0.0.1", 9)))
        except UpstreamError as exc:
            assert pool.slots._value == 4 and not pool.open  # the slot given back, nothing kept
            return exc.kind
        finally:
            del loop.create_connection
        return "answered"

    assert asyncio.run(run()) == "connect"
