"""Tenant limits: the local limiter, Redis, and the fail-open fallback when Redis is down."""

from __future__ import annotations

import contextlib
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


@contextlib.asynccontextmanager
async def redis_client():
    """(client, a key prefix of its own), the keys deleted after; skips without a Redis."""
    if not _redis_answers():
        pytest.skip("no Redis answers on 127.0.0.1:6379")
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url("redis://127.0.0.1:6379/0", decode_responses=True)
    prefix = f"lftest-{uuid.uuid4().hex[:8]}"
    try:
        yield client, prefix
    finally:
        keys = [k async for k in client.scan_iter(f"{prefix}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


@contextlib.asynccontextmanager
async def no_redis():
    yield None, "p"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("where", ["local", "redis"])
async def test_refused_requests_do_not_use_the_minute(where):
    """max_concurrency 1, 3 a minute: three requests refused for concurrency, then three admitted
    one after another, and only the fourth admitted-to-be is refused for the minute."""
    async with redis_client() if where == "redis" else no_redis() as (client, prefix):
        await _refused_requests_do_not_use_the_minute(client, prefix, where)


async def _refused_requests_do_not_use_the_minute(client, prefix: str, where: str) -> None:
    limiter = RateLimiter(client, RouterMetrics.create(), prefix, clock=Clock())
    tenant = Tenant("t", max_concurrency=1, requests_per_minute=3)
    held = await limiter.acquire(tenant)
    assert held.where == where
    for _ in range(3):
        with pytest.raises(Limited, match="max_concurrency"):
            await limiter.acquire(tenant)
    await held.release()
    for _ in range(2):
        await (await limiter.acquire(tenant)).release()
    with pytest.raises(Limited, match="requests_per_minute"):
        await limiter.acquire(tenant)
    limiter.local.clock = limiter._clock
    limiter._clock.now += 60  # the next minute; the refused request holds no lease
    await limiter.acquire(tenant)


async def test_a_lease_whose_release_is_lost_fades():
    """Releases that never reach Redis (a timeout) leave their leases counting only until
    LEASE_TTL_S after they were taken, however much the tenant keeps asking meanwhile."""
    async with redis_client() as (client, prefix):
        await _a_lease_whose_release_is_lost_fades(client, prefix)


async def _a_lease_whose_release_is_lost_fades(client, prefix: str) -> None:
    from lorafleet.router.ratelimit import LEASE_TTL_S

    clock = Clock()
    metrics = RouterMetrics.create()
    limiter = RateLimiter(client, metrics, prefix, clock=clock)
    tenant = Tenant("t", max_concurrency=2)
    leases = [await limiter.acquire(tenant) for _ in range(2)]

    async def lost(*args):
        raise TimeoutError("Redis did not answer")

    client.zrem, real = lost, client.zrem
    for lease in leases:
        await lease.release()
    client.zrem = real
    assert metrics.registry.get_sample_value("lorafleet_router_ratelimit_fail_open_total") == 2
    for _ in range(5):
        clock.now += LEASE_TTL_S / 6
        with pytest.raises(Limited, match="max_concurrency"):
            await limiter.acquire(tenant)
    clock.now += LEASE_TTL_S / 6 + 1
    await limiter.acquire(tenant)
    await limiter.acquire(tenant)
