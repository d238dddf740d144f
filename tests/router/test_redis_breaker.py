"""The Redis circuit breaker: the state machine on a fake clock, then a real redis-server that is
SIGSTOPped (hung, not down) under a limiter and under a whole router."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time

import httpx
import pytest

from lorafleet.breaker import CLOSED, HALF_OPEN, OPEN, BreakerOpen, CircuitBreaker
from lorafleet.router.metrics import RouterMetrics
from lorafleet.router.ratelimit import RateLimiter
from lorafleet.router.redis_guard import redis_breaker
from lorafleet.router.tenants import Tenant, hash_api_key
from tests.router.conftest import RouterThread, router_settings


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def hang() -> None:
    await asyncio.sleep(3600)


async def answer() -> str:
    return "ok"


async def test_opens_after_failures_then_fails_fast_without_calling():
    clock, calls = Clock(), []
    changes: list[str] = []
    b = CircuitBreaker("t", timeout_s=0.01, failures_to_open=3, cooldown_s=1.0, clock=clock,
                       probe=hang, on_change=lambda s, _w: changes.append(s))

    async def counted_hang() -> None:
        calls.append(1)
        await hang()

    for _ in range(3):
        with pytest.raises(asyncio.TimeoutError):
            await b.call(counted_hang)
    assert b.state == OPEN and changes == [OPEN]
    for _ in range(10):
        with pytest.raises(BreakerOpen):
            await b.call(counted_hang)
    assert len(calls) == 3  # open: the service is not asked


async def test_success_resets_the_count_and_non_failures_do_not_count():
    b = CircuitBreaker("t", timeout_s=0.01, failures_to_open=2, is_failure=lambda e: not isinstance(e, KeyError))

    async def refuse() -> None:
        raise KeyError("the caller's own refusal: the service answered")

    for _ in range(3):
        with pytest.raises(asyncio.TimeoutError):
            await b.call(hang)
        assert await b.call(answer) == "ok"
    for _ in range(5):
        with pytest.raises(KeyError):
            await b.call(refuse)
    assert b.state == CLOSED


async def test_half_open_probe_closes_or_reopens():
    clock = Clock()
    healthy = False
    changes: list[str] = []

    async def probe() -> None:
        if not healthy:
            raise ConnectionError("still down")

    b = CircuitBreaker("t", timeout_s=0.01, failures_to_open=1, cooldown_s=1.0, clock=clock, probe=probe,
                       on_change=lambda s, _w: changes.append(s))
    with pytest.raises(asyncio.TimeoutError):
        await b.call(hang)
    clock.now += 0.5
    with pytest.raises(BreakerOpen):
        await b.call(answer)  # cooling down: no probe yet
    assert changes == [OPEN]
    clock.now += 1.0
    with pytest.raises(BreakerOpen):
        await b.call(answer)  # starts the probe; this call does not wait for it
    await asyncio.sleep(0.05)
    assert changes == [OPEN, HALF_OPEN, OPEN] and b.state == OPEN  # the probe failed: open again
    healthy = True
    clock.now += 1.0
    with pytest.raises(BreakerOpen):
        await b.call(answer)
    await asyncio.sleep(0.05)
    assert b.state == CLOSED and changes[-2:] == [HALF_OPEN, CLOSED]
    assert await b.call(answer) == "ok"


# ---- a real Redis, hung with SIGSTOP -------------------------------------------------------------


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rpartition(" ")[2])
    raise KeyError(name)


async def test_limiter_stops_waiting_on_a_hung_redis(redis_server, caplog):
    import redis.asyncio as aioredis

    url, proc = redis_server
    client = aioredis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5, decode_responses=True)
    metrics = RouterMetrics.create()
    breaker = redis_breaker(client, metrics, timeout_s=0.2, failures=3, cooldown_s=0.3)
    limiter = RateLimiter(client, metrics, "lfbreaker", breaker=breaker)
    tenant = Tenant("t", max_concurrency=100, requests_per_minute=10_000)
    caplog.set_level(logging.WARNING, "lorafleet.router")
    lease = await limiter.acquire(tenant)
    assert lease.where == "redis"
    await lease.release()
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        for _ in range(3):  # each pays the timeout: the breaker has not noticed yet
            assert (await limiter.acquire(tenant)).where == "local"
        assert breaker.state == OPEN and metrics.breaker_open._value.get() == 1
        assert any("breaker OPEN" in r.message for r in caplog.records)
        started = time.perf_counter()
        for _ in range(50):  # open: none of these asks Redis (each would otherwise wait 0.2 s)
            lease = await limiter.acquire(tenant)
            assert lease.where == "local"
            await lease.release()
        assert time.perf_counter() - started < 0.2 * 3
        await asyncio.sleep(0.5)  # past the cooldown: this call starts a probe and does not wait for it
        lease = await limiter.acquire(tenant)
        assert lease.where == "local"
        await lease.release()
        await asyncio.sleep(0.3)
        assert breaker.state != CLOSED  # the probe hung too
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while breaker.state != CLOSED and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        lease = await limiter.acquire(tenant)  # nudges a probe once the cooldown is over
        await lease.release()
    assert breaker.state == CLOSED and metrics.breaker_open._value.get() == 0
    assert any("breaker CLOSED" in r.message for r in caplog.records)
    assert (await limiter.acquire(tenant)).where == "redis"
    await breaker.aclose()
    await client.aclose()


def test_router_serves_through_a_hung_redis(two_workers, redis_server, tmp_path):
    url, proc = redis_server
    tenants = tmp_path / "tenants.json"  # a limited tenant: every request takes a lease in Redis
    tenants.write_text(json.dumps({"tenants": [{"name": "t", "api_key_sha256": hash_api_key("k"),
                                                "max_concurrency": 100, "requests_per_minute": 100000}]}))
    settings = router_settings(two_workers, redis_url=url, tenants_file=tenants, redis_timeout_s=0.2,
                               redis_breaker_cooldown_s=0.5)
    headers = {"Authorization": "Bearer k"}

    def complete() -> httpx.Response:
        return httpx.post(router.url + "/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 1},
                          headers=headers, timeout=30)

    with RouterThread(settings) as router:
        assert complete().status_code == 200
        assert metric(httpx.get(router.url + "/metrics").text, "lorafleet_router_placement_store_breaker_open") == 0
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                assert complete().status_code == 200  # served on the local fallback throughout
                text = httpx.get(router.url + "/metrics").text
                if metric(text, "lorafleet_router_placement_store_breaker_open") == 1:
                    break
            assert metric(text, "lorafleet_router_placement_store_breaker_open") == 1
            assert router.metric("lorafleet_router_placement_store_breaker_transitions_total", state="open") >= 1
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            assert complete().status_code == 200
            if metric(httpx.get(router.url + "/metrics").text, "lorafleet_router_placement_store_breaker_open") == 0:
                break
            time.sleep(0.1)
        assert metric(httpx.get(router.url + "/metrics").text, "lorafleet_router_placement_store_breaker_open") == 0
        assert router.metric("lorafleet_router_placement_store_breaker_transitions_total", state="closed") >= 1
