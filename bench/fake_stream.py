"""A fake streaming worker at a known rate: the reference the load generator and the router are measured against.

Raw asyncio (one protocol per connection, no framework), so it costs far less per token than what it
measures. It speaks enough of the worker's HTTP API for `lorafleet router` to route to it:
`GET /health`, `/ready`, `/v1/models`, `/v1/adapters` (one adapter `a`), and
`POST /v1/completions` / `/v1/chat/completions`. A streamed request gets its first SSE event
`ttft_ms` after its body arrived, then one event every `interval_ms` (each one token, as the
worker's chunks are), `max_tokens` in all, a usage chunk when `stream_options.include_usage`, then
`data: [DONE]`; chunked transfer encoding, keep-alive. A non-streamed request is answered at once.
A client that disconnects stops its stream (as the worker aborts).

Two ways to pace the streams:
- staggered (the default): each stream on its own schedule from its request's arrival, so the
  streams' tokens are spread over the interval (one write, and one read at the other end, per token);
- `--step-sync`: as a batched engine emits them. One clock ticks every `interval_ms` (a decode
  step) and each tick writes the next token of every running stream, all in one callback; a
  request's first token comes at the first tick at least `ttft_ms` after it arrived (it joins the
  batch at a step boundary). The worker does this: its engine thread hands all of a step's outputs
  to the HTTP loop in one call (`worker/engine/async_engine.py`, `_dispatch`), where every
  stream's response writes its chunk in the same loop iteration. A relay in front then finds all
  the streams' sockets readable at once, once per step.

    python -m bench.fake_stream --port 8100 --interval-ms 8 --ttft-ms 5 [--step-sync]
"""

from __future__ import annotations

import argparse
import asyncio
import json

INVENTORY = json.dumps({
    "model": "base", "max_loras": 16, "max_cpu_loras": 64, "max_lora_rank": 16, "max_loras_per_request": 2,
    "adapters": [{"name": "a", "tier": "gpu", "rank": 8, "alpha": 16, "digest": "sha256:0", "path": "/a"}],
}).encode()
MODELS = b'{"object":"list","data":[{"id":"base","object":"model","created":0,"owned_by":"lorafleet"}]}'
TOKEN_EVENT = (b'data: {"id":"cmpl-fake","object":"text_completion","created":0,"model":"base",'
               b'"choices":[{"index":0,"text":" tok","logprobs":null,"finish_reason":null}]}\n\n')
DONE = b"data: [DONE]\n\n"
COMPLETION = (b'{"id":"cmpl-fake","object":"text_completion","created":0,"model":"base","choices":[{"index":0,'
              b'"text":"ok","logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":1,'
              b'"completion_tokens":1,"total_tokens":2}}')


def chunk(data: bytes) -> bytes:
    """One HTTP/1.1 chunk."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def usage_event(tokens: int) -> bytes:
    body = {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "base", "choices": [],
            "usage": {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1}}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


class StepClock:
    """A batched engine's decode steps: every `interval_s`, one token for every running stream.

    Runs while any stream does; a tick that comes late delays the next (an engine's steps do not
    catch up), and a stream that has sent its last token leaves the batch."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.loop = asyncio.get_running_loop()
        self.running: dict[FakeStream, float] = {}  # stream -> when it may join (arrival + ttft)
        self.timer: asyncio.TimerHandle | None = None

    def join(self, stream: FakeStream, at: float) -> None:
        self.running[stream] = at
        if self.timer is None:  # idle: the first step starts when this request can join
            self.timer = self.loop.call_at(at, self.tick, at)

    def leave(self, stream: FakeStream) -> None:
        self.running.pop(stream, None)

    def tick(self, due: float) -> None:
        now = self.loop.time()
        for stream, joins in list(self.running.items()):
            if joins <= now + 1e-4 and not stream.step():
                self.running.pop(stream, None)
        if not self.running:
            self.timer = None
            return
        nxt = max(due + self.interval_s, now)
        self.timer = self.loop.call_at(nxt, self.tick, nxt)


class FakeStream(asyncio.Protocol):
    def __init__(self, interval_s: float, ttft_s: float, clock: StepClock | None = None) -> None:
        self.interval_s, self.ttft_s = interval_s, ttft_s
        self.clock = clock
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.loop = asyncio.get_running_loop()
        self.sent, self.tokens, self.usage = 0, 0, False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a TCP transport (uvloop's is no asyncio.Transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.clock is not None:
            self.clock.leave(self)
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while not self.streaming:  # one request at a time per connection (HTTP/1.1, no pipelining)
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1").split("\r\n")
            length = 0
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            body, self.buf = self.buf[end + 4:end + 4 + length], self.buf[end + 4 + length:]
            method, path = head[0].split(" ")[:2]
            self.handle(method, path, body)

    def respond(self, status: str, body: bytes, content_type: bytes = b"application/json") -> None:
        assert self.transport is not None
        self.transport.write(b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: " + content_type
                             + b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    def handle(self, method: str, path: str, body: bytes) -> None:
        if method == "GET":
            answers = {"/health": b'{"status":"ok"}', "/ready": b'{"ready":true}', "/v1/models": MODELS,
                       "/v1/adapters": INVENTORY}
            return self.respond("200 OK", answers[path]) if path in answers else self.respond("404 Not Found", b"{}")
        try:
            req = json.loads(body)
        except ValueError:
            return self.respond("400 Bad Request", b'{"error":{"message":"bad json"}}')
        if not req.get("stream"):
            return self.respond("200 OK", COMPLETION)
        assert self.transport is not None
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
        self.sent, self.tokens = 0, int(req.get("max_tokens") or 16)
        self.usage = bool((req.get("stream_options") or {}).get("include_usage"))
        first = self.loop.time() + self.ttft_s
        if self.clock is not None:
            self.clock.join(self, first)
        else:
            self.timer = self.loop.call_at(first, self.tick, first)

    @property
    def streaming(self) -> bool:
        return self.tokens > 0

    def step(self) -> bool:
        """Writes the stream's next token (the last with its usage and [DONE]); False once it ended."""
        if self.transport is None:
            self.tokens = 0
            return False
        self.sent += 1
        if self.sent < self.tokens:
            self.transport.write(chunk(TOKEN_EVENT))
            return True
        self.transport.write(chunk(TOKEN_EVENT + (usage_event(self.tokens) if self.usage else b"") + DONE)
                             + b"0\r\n\r\n")
        self.tokens = 0
        if self.buf:  # a request that came meanwhile (the next one on this connection)
            self.loop.call_soon(self.data_received, b"")
        return False

    def tick(self, due: float) -> None:
        """The staggered mode: each token due on the stream's own fixed schedule (a late tick does
        not delay the next)."""
        self.timer = None
        if self.step():
            self.timer = self.loop.call_at(due + self.interval_s, self.tick, due + self.interval_s)


async def serve(port: int, interval_ms: float, ttft_ms: float, host: str = "127.0.0.1",
                step_sync: bool = False) -> None:
    loop = asyncio.get_running_loop()
    clock = StepClock(interval_ms / 1e3) if step_sync else None
    server = await loop.create_server(lambda: FakeStream(interval_ms / 1e3, ttft_ms / 1e3, clock), host, port,
                                      reuse_address=True, backlog=1024)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--interval-ms", type=float, default=8.0, help="time between a stream's tokens")
    p.add_argument("--ttft-ms", type=float, default=0.0, help="time from a request to its first token")
    p.add_argument("--step-sync", action="store_true",
                   help="every running stream's next token at one step tick every --interval-ms (a batched engine)")
    args = p.parse_args(argv)
    try:
        from uvloop import run
    except ImportError:
        run = asyncio.run
    run(serve(args.port, args.interval_ms, args.ttft_ms, step_sync=args.step_sync))


if __name__ == "__main__":
    main()
