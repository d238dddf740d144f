"""Header hygiene and the retry budget."""

from __future__ import annotations

import pytest

from lorafleet.router.proxy import RetryBudget, downstream_headers, sse_error, upstream_headers


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


def test_sse_error_is_an_sse_event():
    event = sse_error("boom")
    assert event.startswith(b"data: {") and event.endswith(b"\n\n") and b'"boom"' in event


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
