"""Per-tenant concurrency and request-rate limits, shared through Redis.

Failure mode (documented): when Redis does not answer, limits are enforced by an in-process
fallback with the same numbers, *per router process* — so with N router replicas a tenant may get
up to N× its limit until Redis returns. Each fallback decision is counted in
`lorafleet_router_ratelimit_fail_open_total`. We fail open on purpose: an outage of the limiter
must not become an outage of inference.

Redis keys: `{p}:conc:{tenant}` (a counter with a safety TTL, so a crashed router's leases fade)
and `{p}:rpm:{tenant}:{minute}` (fixed one-minute windows).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from lorafleet.router.metrics import RouterMetrics
from lorafleet.router.tenants import Tenant

CONCURRENCY_KEY_TTL_S = 600


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
        if tenant.requests_per_minute is not None:
            minute = int(self.clock() // 60)
            seen_minute, count = self.window.get(tenant.name, (minute, 0))
            count = count + 1 if seen_minute == minute else 1
            if count > tenant.requests_per_minute:
                raise Limited("requests_per_minute", 60 - int(self.clock() % 60))
            self.window[tenant.name] = (minute, count)
        if tenant.max_concurrency is not None:
            if self.concurrency[tenant.name] >= tenant.max_concurrency:
                raise Limited("max_concurrency", 1)
            self.concurrency[tenant.name] += 1

    def release(self, tenant: Tenant) -> None:
        if tenant.max_concurrency is not None and self.concurrency[tenant.name] > 0:
            self.concurrency[tenant.name] -= 1


class RateLimiter:
    def __init__(
        self, redis, metrics: RouterMetrics, prefix: str = "lorafleet", clock: Callable[[], float] = time.time
    ):
        self._r = redis  # redis.asyncio.Redis or None
        self._metrics = metrics
        self._p = prefix
        self._clock = clock
        self.local = LocalLimits(clock)
        self._leases_in_redis: set[int] = set()

    async def acquire(self, tenant: Tenant) -> Lease:
        """Raises `Limited`. Returns a lease to release when the request ends."""
        if tenant.max_concurrency is None and tenant.requests_per_minute is None:
            return Lease(self, tenant, where="none")
        if self._r is None:
            self.local.acquire(tenant)
            return Lease(self, tenant, where="local")
        try:
            await self._acquire_redis(tenant)
            return Lease(self, tenant, where="redis")
        except Limited:
            self._metrics.ratelimited.labels(tenant.name, "redis").inc()
            raise
        except Exception:
            self._metrics.ratelimit_fail_open.inc()
            self.local.acquire(tenant)
            return Lease(self, tenant, where="local")

    async def _acquire_redis(self, tenant: Tenant) -> None:
        now = self._clock()
        if tenant.requests_per_minute is not None:
            key = f"{self._p}:rpm:{tenant.name}:{int(now // 60)}"
            async with self._r.pipeline(transaction=True) as pipe:
                pipe.incr(key)
                pipe.expire(key, 120)
                count, _ = await pipe.execute()
            if count > tenant.requests_per_minute:
                raise Limited("requests_per_minute", 60 - int(now % 60))
        if tenant.max_concurrency is not None:
            key = f"{self._p}:conc:{tenant.name}"
            async with self._r.pipeline(transaction=True) as pipe:
                pipe.incr(key)
                pipe.expire(key, CONCURRENCY_KEY_TTL_S)
                count, _ = await pipe.execute()
            if count > tenant.max_concurrency:
                await self._r.decr(key)
                raise Limited("max_concurrency", 1)

    async def _release(self, lease: Lease) -> None:
        if lease.tenant.max_concurrency is None:
            return
        if lease.where == "local":
            self.local.release(lease.tenant)
            return
        try:
            await self._r.decr(f"{self._p}:conc:{lease.tenant.name}")
        except Exception:
            self._metrics.ratelimit_fail_open.inc()  # the key's TTL cleans up the lost decrement


@dataclass(slots=True)
class Lease:
    limiter: RateLimiter
    tenant: Tenant
    where: str
    released: bool = False

    async def release(self) -> None:
        if self.released or self.where == "none":
            return
        self.released = True
        await self.limiter._release(self)
