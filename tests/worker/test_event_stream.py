"""worker/server/event_stream.py: SSE events written to uvicorn's transport, byte for byte what
Starlette's StreamingResponse sends; a client that leaves stops the events; other servers get `send`."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import Request

from lorafleet.worker.server.event_stream import EventStreamResponse, WorkerApp


class CountBodies:
    """Middleware counting the body messages that pass through the application's `send`."""

    def __init__(self, app, counts: dict) -> None:
        self.app, self.counts = app, counts

    async def __call__(self, scope, receive, send):
        async def counted(message):
            if message["type"] == "http.response.body":
                self.counts["bodies"] += 1
            await send(message)

        await self.app(scope, receive, counted)


def make_app(state: dict) -> WorkerApp:
    app = WorkerApp()
    app.add_middleware(CountBodies, counts=state)

    @app.post("/events/{n}")
    async def events(n: int, request: Request):
        await request.body()  # as the worker's routes read theirs
        async def gen():
            try:
                for i in range(n):
                    yield f'data: {{"i":{i},"text":"é"}}\n\n'
                    await asyncio.sleep(0.001 if n < 1000 else 60)  # a long wait: only the disconnect future can notice
                yield "data: [DONE]\n\n"
            finally:
                state["closed"] = state.get("closed", 0) + 1

        return EventStreamResponse(gen())

    return app


def serve(app, http: str):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=http, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(params=["httptools", "h11"])
def served(request):
    state = {"bodies": 0}
    server, thread, url = serve(make_app(state), request.param)
    yield request.param, state, url
    server.should_exit = True
    thread.join(10)


def test_events_arrive_whole_and_in_order(served):
    http, state, url = served
    with httpx.Client(timeout=10) as client:
        for _ in range(2):  # the connection kept alive between streams
            r = client.post(f"{url}/events/20", json={})
            assert r.status_code == 200
            assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
            assert r.headers["cache-control"] == "no-cache" and r.headers["transfer-encoding"] == "chunked"
            want = "".join(f'data: {{"i":{i},"text":"é"}}\n\n' for i in range(20)) + "data: [DONE]\n\n"
            assert r.text == want
    # httptools: only each response's end passes the application's `send`; h11: every event does.
    assert state["bodies"] == (2 if http == "httptools" else 2 * 22)
    assert state["closed"] == 2


def test_a_client_that_leaves_stops_the_events(served):
    _http, state, url = served
    with httpx.Client(timeout=10) as client, client.stream("POST", f"{url}/events/100000", json={}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 5  # the generator is closed (its `finally` is where requests abort)
    while state.get("closed") != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert state.get("closed") == 1
