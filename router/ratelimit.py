"""Per-tenant concurrency and request-rate limits, shared through Redis.

Failure mode (documented): when Redis does not answer, limits are enforced by an in-process
fallback with the same numbers, *per router process* — so with N router replicas a tenant may get
up to N× its limit until Redis returns. Each fallback decision is counted in
`lorafleet_router_ratelimit_fail_open_total`. We fail open on purpose: an outage of the limiter
must not become an outage of inference. A hung Redis costs a request at most the breaker's
timeout, and nothing once the breaker is open (`redis_guard.py`): while open, Redis is not asked.

Only admitted requests count towards `requests_per_minute`: one refused by either limit does not.

Redis keys: `{p}:leases:{tenant}`, a sorted set of the tenant's leases by expiry: a lease whose
release never reached Redis (a timeout, a crashed router) stops counting `LEASE_TTL_S` after it
was taken, whatever traffic follows; and `{p}:rpm:{tenant}:{minute}` (fixed one-minute windows).
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from lorafleet.breaker import CircuitBreaker
from lorafleet.router.metrics import RouterMetrics
from lorafleet.router.tenants import Tenant

# A lease not released in Redis stops counting after this (so must outlast the longest request).
LEASE_TTL_S = 600


class Limited(Exception):
    def __init__(self, limit: str, retry_after_s: int) -> None:
        super().__init__(limit)
        self.limit = limit
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class LocalLimits:
    """In-process limits: the fallback, and the only limiter when no Redis is configured."""

    clock: Callable[[], float] = time.time
    concurrency: Counter[str] = field(default_factory=Counter)
    window: dict[str, tuple[int, int]] = field(default_factory=dict)  # tenant -> (minute, count)

    def acquire(self, tenant: Tenant) -> None:
        if tenant.max_concurrency is not None and self.concurrency[tenant.name] >= tenant.max_concurrency:
            raise Limited("max_concurrency", 1)
        if tenant.requests_per_minute is not None:
            minute = int(self.clock() // 60)
            seen_minute, count = self.window.get(tenant.name, (minute, 0))
            count = count + 1 if seen_minute == minute else 1
            if count > tenant.requests_per_minute:
                raise Limited("requests_per_minute", 60 - int(self.clock() % 60))
            self.window[tenant.name] = (minute, count)
        if tenant.max_concurrency is not None:
            self.concurrency[tenant.name] += 1

    def release(self, tenant: Tenant) -> None:
        if tenant.max_concurrency is not None and self.concurrency[tenant.name] > 0:
            self.concurrency[tenant.name] -= 1


class RateLimiter:
    def __init__(
        self, redis, metrics: RouterMetrics, prefix: str = "lorafleet", clock: Callable[[], float] = time.time,
        breaker: CircuitBreaker | None = None,
    ):
        self._r = redis  # redis.asyncio.Redis or None
        # Without the router's shared breaker (tests), one of its own: a refusal is Redis answering.
        self._breaker = breaker or CircuitBreaker(
            "redis", timeout_s=0.25, is_failure=lambda exc: not isinstance(exc, Limited)
        )
        self._metrics = metrics
        self._p = prefix
        self._clock = clock
        self.local = LocalLimits(clock)

    async def acquire(self, tenant: Tenant) -> Lease:
        """Raises `Limited`. Returns a lease to release when the request ends."""
        if tenant.max_concurrency is None and tenant.requests_per_minute is None:
            return Lease(self, tenant, where="none")
        if self._r is None:
            self.local.acquire(tenant)
            return Lease(self, tenant, where="local")
        try:
            lease_id = await self._breaker.call(lambda: self._acquire_redis(tenant))
            return Lease(self, tenant, where="redis", id=lease_id)
        except Limited:
            self._metrics.ratelimited.labels(self._metrics.tenant(tenant), "redis").inc()
            raise
        except Exception:
            self._metrics.ratelimit_fail_open.inc()
            self.local.acquire(tenant)
            return Lease(self, tenant, where="local")

    async def _acquire_redis(self, tenant: Tenant) -> str | None:
        """The lease's id in the tenant's set (None: no concurrency limit); Limited if refused,
        with nothing of the refused request left counting."""
        now = self._clock()
        lease_id = None
        leases = f"{self._p}:leases:{tenant.name}"
        if tenant.max_concurrency is not None:
            lease_id = uuid.uuid4().hex
            async with self._r.pipeline(transaction=True) as pipe:
                pipe.zremrangebyscore(leases, "-inf", now)  # leases whose release was lost
                pipe.zadd(leases, {lease_id: now + LEASE_TTL_S})
                pipe.zcard(leases)
                pipe.expire(leases, LEASE_TTL_S)
                _, _, count, _ = await pipe.execute()
            if count > tenant.max_concurrency:
                await self._r.zrem(leases, lease_id)
                raise Limited("max_concurrency", 1)
        if tenant.requests_per_minute is not None:
            key = f"{self._p}:rpm:{tenant.name}:{int(now // 60)}"
            async with self._r.pipeline(transaction=True) as pipe:
                pipe.incr(key)
                pipe.expire(key, 120)
                count, _ = await pipe.execute()
            if count > tenant.requests_per_minute:
                async with self._r.pipeline(transaction=True) as pipe:
                    pipe.decr(key)
                    if lease_id is not None:
                        pipe.zrem(leases, lease_id)
                    await pipe.execute()
                raise Limited("requests_per_minute", 60 - int(now % 60))
        return lease_id

    async def _release(self, lease: Lease) -> None:
        if lease.tenant.max_concurrency is None:
            return
        if lease.where == "local":
            self.local.release(lease.tenant)
            return
        try:
            await self._breaker.call(lambda: self._r.zrem(f"{self._p}:leases:{lease.tenant.name}", lease.id))
        except Exception:
            self._metrics.ratelimit_fail_open.inc()  # the lease fades LEASE_TTL_S after it was taken


@dataclass(slots=True)
class Lease:
    limiter: RateLimiter
    tenant: Tenant
    where: str
    id: str | None = None  # in Redis: the lease's member of the tenant's set
    released: bool = False

    async def release(self) -> None:
        if self.released or self.where == "none":
            return
        self.released = True
        await self.limiter._release(self)
