"""Header hygiene, the retry budget, and how a stream that breaks mid-way ends."""

from __future__ import annotations

import asyncio
import json

import pytest

from lorafleet.router.proxy import (
    RetryBudget,
    StreamBroken,
    downstream_headers,
    relay_stream,
    sse_error,
    upstream_headers,
)
from lorafleet.router.upstream import UpstreamError


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("client", "kept"),
    [
        ({"authorization": "Bearer sk-1", "content-type": "application/json"}, {"content-type"}),
        ({"X-LoraFleet-Replica": "evil", "x-lorafleet-tenant": "evil", "accept": "*/*"}, {"accept"}),
        ({"host": "router", "connection": "keep-alive", "content-length": "10", "cookie": "c"}, set()),
    ],
)
def test_upstream_headers_strip_keys_and_internal(client, kept):
    asgi = [(k.lower().encode(), v.encode()) for k, v in client.items()]  # as the ASGI scope has them
    out = upstream_headers(asgi, {"x-lorafleet-tenant": "acme"})
    assert set(out) == kept | {"x-lorafleet-tenant"}
    assert out["x-lorafleet-tenant"] == "acme"


def test_downstream_headers():
    raw = ((b"Content-Length", b"5"), (b"Content-Type", b"application/json"), (b"Content-Encoding", b"gzip"))
    out = downstream_headers(raw, {"x-lorafleet-replica": "r0"})
    assert out == [(b"content-type", b"application/json"), (b"x-lorafleet-replica", b"r0")]


def test_sse_error_is_an_sse_event_then_done():
    event = sse_error("boom")
    assert event.startswith(b"data: {") and event.endswith(b"\n\ndata: [DONE]\n\n") and b'"boom"' in event


class _Breaking:
    """An upstream exchange whose body gives `chunks`, then fails as a dropped connection does."""

    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = list(chunks)

    async def read_some(self) -> bytes:
        if self._chunks:
            return self._chunks.pop(0)
        raise UpstreamError("transport", "connection lost")


def _relayed(chunks: list[bytes], responses_api: bool) -> bytes:
    async def run() -> bytes:
        out = []
        with pytest.raises(StreamBroken):
            async for piece in relay_stream(_Breaking(chunks), responses_api):
                out.append(piece)
        return b"".join(out)

    return asyncio.run(run())


def _events(raw: bytes) -> list[dict]:
    """A Responses stream's events, checked as the openai client reads them."""
    from openai.types.responses import ResponseErrorEvent

    blocks = [b for b in raw.decode().split("\n\n") if b]
    events = []
    for block in blocks:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        events.append(json.loads(data.removeprefix("data: ")))
        assert events[-1]["type"] == name.removeprefix("event: ")
    ResponseErrorEvent.model_validate(events[-1])
    return events


def _response_event(n: int) -> bytes:
    return f'event: response.x\ndata: {{"type":"response.x","sequence_number":{n}}}\n\n'.encode()


@pytest.mark.parametrize("split", [1, 5, 40])
def test_a_broken_responses_stream_ends_in_an_error_event_numbered_after_the_rest(split):
    """The worker's events cut into chunks anywhere (a blank line split across two): the error
    event's sequence_number follows the last relayed event's."""
    raw = b"".join(_response_event(n) for n in range(3))
    chunks = [raw[i:i + split] for i in range(0, len(raw), split)]
    events = _events(_relayed(chunks, True))
    assert [e["sequence_number"] for e in events] == [0, 1, 2, 3]
    assert events[-1]["type"] == "error" and events[-1]["code"] == "502"


def test_an_event_cut_short_is_ended_before_the_error():
    raw = _relayed([b'data: {"id": 1}\n\n', b'data: {"id"'], False)
    message = "upstream failed mid-stream: transport: connection lost"
    assert raw.endswith(b'data: {"id"\n\n' + sse_error(message))
    assert _relayed([], False) == sse_error(message)
    assert [e["sequence_number"] for e in _events(_relayed([_response_event(0)[:-1]], True))][-1] == 1


@pytest.mark.parametrize(
    ("requests", "seconds", "expected_retries"),
    [
        (0, 0.0, 10),  # the initial allowance
        (100, 0.0, 30),  # + 20% of 100 requests
        (0, 2.0, 20),  # + 5/s for 2 s
        (10_000, 0.0, 100),  # capped
    ],
)
def test_retry_budget(requests, seconds, expected_retries):
    clock = Clock()
    budget = RetryBudget(ratio=0.2, min_per_s=5.0, cap=100.0, clock=clock)
    for _ in range(requests):
        budget.deposit()
    clock.now += seconds
    retries = 0
    while budget.try_spend():
        retries += 1
    assert retries == pytest.approx(expected_retries, abs=1)
