"""HTTP/1.1 on the router's port, byte for byte, with the proxied routes on the router's own protocol
(router/fast_http.py) and, for comparison, on plain uvicorn (`fast_http=False`): keep-alive and
pipelining across proxied and ASGI routes, chunked streams, 100-continue, bodies over the limit,
HTTP/1.0 and `Connection: close`, a client that reads slowly (backpressure)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from lorafleet.connection_guard import ConnectionLimits
from lorafleet.router import fast_http, generate, proxy, relay
from tests.router.conftest import CATALOG, RouterThread, router_settings, start_workers

LIMIT = 4096


@pytest.fixture(scope="module")
def worker() -> Iterator:
    # No delay between tokens: a stream of thousands of events fills the client's socket at once.
    (w,) = start_workers([{"name": "w0", "lora_modules": {"a": CATALOG["a"]}, "token_delay_s": 0.0}])
    yield w
    w.kill()


@pytest.fixture(params=[True, False], ids=["fast_http", "uvicorn"])
def router(request, worker) -> Iterator[RouterThread]:
    with RouterThread(router_settings([worker], fast_http=request.param, max_body_bytes=LIMIT,
                                         max_tokens_cap=5_000)) as r:
        yield r


class Client:
    """A raw HTTP/1.1 connection: what is sent is exactly what the test wrote."""

    def __init__(self, port: int, rcvbuf: int | None = None) -> None:
        self.sock = socket.socket()
        if rcvbuf:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.connect(("127.0.0.1", port))
        self.sock.settimeout(10)
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        self.buf += data
        return bool(data)

    def _until(self, sep: bytes) -> bytes:
        while sep not in self.buf:
            assert self._fill(), f"connection closed before {sep!r}"
        out, _, self.buf = self.buf.partition(sep)
        return out

    def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            assert self._fill(), "connection closed mid-body"
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def response(self) -> tuple[int, dict[str, str], bytes]:
        """The next response: status, headers (lower-case names), body (de-chunked)."""
        head = self._until(b"\r\n\r\n").decode("latin-1").split("\r\n")
        status = int(head[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
        if status == 100:
            return status, headers, b""
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while size := int(self._until(b"\r\n"), 16):
                body += self._exactly(size)
                assert self._exactly(2) == b"\r\n"
            assert self._exactly(2) == b"\r\n"
            return status, headers, body
        return status, headers, self._exactly(int(headers.get("content-length", "0")))

    def closed(self) -> bool:
        return not self.buf and not self._fill()

    def close(self) -> None:
        self.sock.close()


def post(path: str, body: dict | bytes, *extra: str, version: str = "1.1") -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = [f"POST {path} HTTP/{version}", "host: router", "content-type: application/json",
            f"content-length: {len(data)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + data


def events(body: bytes) -> list[str]:
    return [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]


def test_pipelined_requests_across_proxied_and_asgi_routes_answer_in_order(router):
    c = Client(router.port)
    try:
        c.send(post("/v1/completions", {"model": "a", "prompt": "x", "max_tokens": 3})
               + b"GET /health HTTP/1.1\r\nhost: router\r\n\r\n"
               + post("/v1/chat/completions", {"model": "a", "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 5, "stream": True})
               + b"GET /v1/completions HTTP/1.1\r\nhost: router\r\n\r\n"
               + post("/v1/completions", b"{not json"))
        status, headers, body = c.response()
        assert status == 200 and headers["content-type"] == "application/json"
        assert json.loads(body)["object"] == "text_completion" and headers["x-lorafleet-replica"]
        status, _, body = c.response()
        assert status == 200 and json.loads(body)["status"] == "ok"
        status, headers, body = c.response()
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        assert headers["transfer-encoding"] == "chunked"
        assert events(body)[-1] == "[DONE]" and len(events(body)) >= 6
        status, headers, body = c.response()
        assert status == 405 and headers["allow"] == "POST"
        status, _, body = c.response()
        assert status == 400 and json.loads(body)["error"]["message"] == "Request body must be a JSON object."
        c.send(post("/v1/completions", {"model": "nope", "prompt": "x"}))  # the connection is still open
        status, _, body = c.response()
        assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
    finally:
        c.close()


def test_expect_100_continue(router):
    c = Client(router.port)
    try:
        request = post("/v1/completions", {"model": "a", "prompt": "x", "max_tokens": 2}, "expect: 100-continue")
        head, _, body = request.partition(b"\r\n\r\n")
        c.send(head + b"\r\n\r\n")
        status, _, _ = c.response()
        assert status == 100
        c.send(body)
        status, _, body = c.response()
        assert status == 200 and json.loads(body)["object"] == "text_completion"
    finally:
        c.close()


def test_a_body_over_the_limit_is_refused_and_the_connection_goes_on(router):
    c = Client(router.port)
    try:
        big = json.dumps({"model": "a", "prompt": "x" * (2 * LIMIT)}).encode()
        chunked = (b"POST /v1/completions HTTP/1.1\r\nhost: router\r\ntransfer-encoding: chunked\r\n\r\n"
                   + b"".join(b"%x\r\n%s\r\n" % (len(big[i:i + 1000]), big[i:i + 1000]) for i in range(0, len(big), 1000))
                   + b"0\r\n\r\n")
        c.send(chunked)
        status, _, body = c.response()
        assert status == 413 and json.loads(body)["error"]["message"] == f"Request body larger than {LIMIT} bytes."
        c.send(post("/v1/completions", {"model": "a", "prompt": "x", "max_tokens": 1}))
        assert c.response()[0] == 200
        # Declared too large: refused before the body is sent.
        c.send(b"POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-length: %d\r\n\r\n" % (LIMIT + 1))
        assert c.response()[0] == 413
    finally:
        c.close()


@pytest.mark.parametrize("how", ["http/1.0", "connection: close"])
def test_the_connection_closes_after_the_answer_when_asked(router, how):
    c = Client(router.port)
    try:
        body = {"model": "a", "prompt": "x", "max_tokens": 1}
        c.send(post("/v1/completions", body, version="1.0") if how == "http/1.0"
               else post("/v1/completions", body, "connection: close"))
        status, headers, _ = c.response()
        assert status == 200
        if how == "connection: close":
            assert headers["connection"] == "close"
        assert c.closed()
    finally:
        c.close()


def test_a_slow_reader_gets_the_whole_stream_in_order(router, monkeypatch):
    # Small socket buffers on both sides and no reading until the router's side has paused: its
    # writes pause, and the generic relay takes over from the direct writer (counted here),
    # waiting for each drain instead of writing on.
    module = fast_http if router.settings.fast_http else relay
    took_over = []

    def counted(*args, **kwargs):
        took_over.append(1)
        return proxy.relay_stream(*args, **kwargs)

    made = HttpToolsProtocol.connection_made

    def small_send_buffer(self, transport):
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        made(self, transport)

    monkeypatch.setattr(module, "relay_stream", counted)
    monkeypatch.setattr(HttpToolsProtocol, "connection_made", small_send_buffer)
    c = Client(router.port, rcvbuf=4096)
    try:
        c.send(post("/v1/completions", {"model": "a", "prompt": "x", "max_tokens": 3000, "stream": True}))
        deadline = time.monotonic() + 20
        while not took_over:
            assert time.monotonic() < deadline, "the router never paused writing"
            time.sleep(0.05)
        status, _, body = c.response()
        assert status == 200
        got = events(body)
        assert got[-1] == "[DONE]"
        texts = [json.loads(e)["choices"][0]["text"] for e in got[:-1] if json.loads(e).get("choices")]
        assert len(texts) >= 3000
        assert took_over == [1]
        c.send(post("/v1/completions", {"model": "a", "prompt": "x", "max_tokens": 1}))
        assert c.response()[0] == 200
    finally:
        c.close()


def test_a_bug_answers_500_in_the_envelope_and_closes(router, monkeypatch):
    async def broken(*args, **kwargs):
        raise KeyError("bug")

    monkeypatch.setattr(generate, "proxy", broken)
    c = Client(router.port)
    try:
        c.send(post("/v1/completions", {"model": "a", "prompt": "x"}))
        status, _, body = c.response()
        assert status == 500
        assert json.loads(body)["error"] == {"message": "internal error: KeyError", "type": "server_error",
                                             "param": None, "code": None}
        assert c.closed()
    finally:
        c.close()


@pytest.mark.parametrize("fast", [True, False], ids=["fast_http", "uvicorn"])
def test_a_kept_alive_connection_closes_once_idle_for_the_keep_alive_timeout(worker, fast):
    limits = ConnectionLimits(keep_alive_timeout_s=0.5)
    with RouterThread(router_settings([worker], fast_http=fast, connection_limits=limits)) as r:
        c = Client(r.port)
        try:
            for _ in range(4):  # a request every 0.2 s: busy past the first response's 0.5 s
                c.send(post("/v1/completions", {"model": "a", "prompt": "x", "max_tokens": 1}))
                assert c.response()[0] == 200
                time.sleep(0.2)
            t0 = time.monotonic()
            assert c.closed()  # 0.5 s after the last response, 0.2 s of which were slept
            assert 0.15 < time.monotonic() - t0 < 1.5
        finally:
            c.close()
