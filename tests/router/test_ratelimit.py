"""Tenant limits: the local limiter, Redis, and the fail-open fallback when Redis is down."""

from __future__ import annotations

import uuid

import pytest

from lorafleet.router.metrics import RouterMetrics
from lorafleet.router.ratelimit import Limited, LocalLimits, RateLimiter
from lorafleet.router.tenants import Tenant
from tests.common.test_placement_store import _redis_answers

LIMITED = Tenant("t", max_concurrency=2, requests_per_minute=3)


@pytest.mark.parametrize(
    ("ops", "expected"),
    [
        (["acq", "acq"], ["ok", "ok"]),
        (["acq", "acq", "acq"], ["ok", "ok", "max_concurrency"]),
        (
            ["acq", "rel", "acq", "rel", "acq", "rel", "acq"],
            ["ok", "-", "ok", "-", "ok", "-", "requests_per_minute"],
        ),
    ],
)
def test_local_limits(ops, expected):
    limits = LocalLimits(clock=lambda: 120.0)
    got = []
    for op in ops:
        if op == "rel":
            limits.release(LIMITED)
            got.append("-")
            continue
        try:
            limits.acquire(LIMITED)
            got.append("ok")
        except Limited as exc:
            got.append(exc.limit)
    assert got == expected


async def test_redis_limits_are_shared_between_limiters():
    if not _redis_answers():
        pytest.skip("no Redis answers on 127.0.0.1:6379")
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url("redis://127.0.0.1:6379/0", decode_responses=True)
    prefix = f"lftest-{uuid.uuid4().hex[:8]}"
    one, two = (
        RateLimiter(client, RouterMetrics.create(), prefix),
        RateLimiter(client, RouterMetrics.create(), prefix),
    )
    tenant = Tenant("t", max_concurrency=2)
    a = await one.acquire(tenant)
    await two.acquire(tenant)
    with pytest.raises(Limited):
        await one.acquire(tenant)  # the other router's lease counts
    await a.release()
    await two.acquire(tenant)
    keys = [k async for k in client.scan_iter(f"{prefix}:*")]
    await client.delete(*keys)
    await client.aclose()


async def test_redis_down_fails_open_to_local_limits():
    import redis.asyncio as aioredis

    from tests.router.fake_worker import free_port

    dead = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.2)
    metrics = RouterMetrics.create()
    limiter = RateLimiter(dead, metrics)
    tenant = Tenant("t", max_concurrency=1)
    lease = await limiter.acquire(tenant)  # Redis refused: the local limiter decides
    with pytest.raises(Limited):
        await limiter.acquire(tenant)
    await lease.release()
    await limiter.acquire(tenant)
    assert metrics.registry.get_sample_value("lorafleet_router_ratelimit_fail_open_total") >= 3
    await dead.aclose()
