"""A reverse proxy on loopback that passes requests to an upstream server (moto's S3) unchanged and
injects faults into the first N requests whose method and path match: an error status instead of
the upstream's answer, or the upstream's answer cut off halfway through its body (the connection
closed); `slow` holds matching requests a while before passing them on. Every request is recorded as (method, path, status sent; 0 for a cut)."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import httpx

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "content-length"}


@dataclass
class Fault:
    method: str
    path_part: str
    kind: str  # an HTTP status ("503") or "cut"
    times: int


class FlakyProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.faults: list[Fault] = []
        self.delays: list[tuple[str, str, float]] = []  # (method, path part, seconds held)
        self.requests: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()
        self._http = httpx.Client(timeout=60)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._http.close()

    def fail(self, method: str, path_part: str, kind: str = "503", times: int = 1) -> None:
        with self._lock:
            self.faults.append(Fault(method, path_part, kind, times))

    def slow(self, method: str, path_part: str, seconds: float) -> None:
        with self._lock:
            self.delays.append((method, path_part, seconds))

    def seen(self, method: str, path_part: str) -> list[int]:
        with self._lock:
            return [status for m, p, status in self.requests if m == method and path_part in p]

    def _fault(self, method: str, path: str) -> str | None:
        with self._lock:
            for fault in self.faults:
                if fault.times > 0 and fault.method == method and fault.path_part in path:
                    fault.times -= 1
                    return fault.kind
        return None


def _handler(proxy: FlakyProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_args) -> None:
            pass

        def _relay(self) -> None:
            method, path = self.command, urlsplit(self.path).path
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            fault = proxy._fault(method, path)
            with proxy._lock:
                held = sum(s for m, part, s in proxy.delays if m == method and part in path)
            time.sleep(held)
            if fault is not None and fault != "cut":
                with proxy._lock:
                    proxy.requests.append((method, path, int(fault)))
                payload = b"<Error><Code>ServiceUnavailable</Code><Message>injected</Message></Error>"
                self.send_response(int(fault))
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                return
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
            answer = proxy._http.request(method, proxy.upstream + self.path, headers=headers, content=body)
            with proxy._lock:
                proxy.requests.append((method, path, 0 if fault == "cut" else answer.status_code))
            self.send_response(answer.status_code)
            for k, v in answer.headers.items():
                if k.lower() not in HOP_BY_HOP and k.lower() != "content-encoding":
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(answer.content)))
            self.end_headers()
            if method == "HEAD":
                return
            if fault == "cut":
                self.wfile.write(answer.content[: len(answer.content) // 2])
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            self.wfile.write(answer.content)

        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _relay  # noqa: N815 - http.server's names

    return Handler
