"""The router's Redis behind one circuit breaker: the placement store and the tenant limiter share it.

A hung Redis (it accepts connections and never answers) would otherwise cost every rate-limited
request its socket timeout. Every call runs under a short timeout; a few failures in a row open
the breaker, after which requests skip Redis entirely (limits on the in-process fallback,
placement on the local view) until a background ping answers. The state is exported as
`lorafleet_router_placement_store_breaker_open` (gauge) and
`lorafleet_router_placement_store_breaker_transitions_total{state}`, and logged on each change.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

from lorafleet.breaker import CLOSED, OPEN, CircuitBreaker
from lorafleet.placement_store import PlacementStore, ReplicaPlacement
from lorafleet.router.metrics import RouterMetrics

log = logging.getLogger("lorafleet.router")
T = TypeVar("T")

# Background work (publishing a replica, reading the snapshot) moves more data than a request's
# lease: it may take this much longer before it counts as a failure.
BACKGROUND_TIMEOUT_FACTOR = 5.0


def redis_failure(exc: BaseException) -> bool:
    """Errors that say Redis is unwell (anything else raised inside a call is the caller's own)."""
    from redis.exceptions import RedisError

    return isinstance(exc, (RedisError, OSError, asyncio.TimeoutError))


def redis_breaker(
    redis_client, metrics: RouterMetrics, timeout_s: float, failures: int, cooldown_s: float
) -> CircuitBreaker:
    def changed(state: str, why: str) -> None:
        metrics.breaker_transitions.labels(state).inc()
        metrics.breaker_open.set(0 if state == CLOSED else 1)
        if state == OPEN:
            log.warning("Redis circuit breaker OPEN (%s): requests skip Redis, limits and placement "
                        "run on local fallbacks; probing every %gs", why, cooldown_s)
        elif state == CLOSED:
            log.warning("Redis circuit breaker CLOSED (%s): Redis in use again", why)

    metrics.breaker_open.set(0)
    return CircuitBreaker(
        "redis", timeout_s=timeout_s, failures_to_open=failures, cooldown_s=cooldown_s,
        probe=redis_client.ping, on_change=changed, is_failure=redis_failure,
    )


class GuardedPlacementStore:
    """A `PlacementStore` whose every call goes through the breaker (`BreakerOpen` while open; the
    router's placement sync already treats any store error as "routing on the local view")."""

    def __init__(self, store: PlacementStore, breaker: CircuitBreaker) -> None:
        self.store = store
        self.breaker = breaker
        self._slow = breaker.timeout_s * BACKGROUND_TIMEOUT_FACTOR

    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        return await self.breaker.call(fn, self._slow)

    async def ping(self) -> bool:
        return await self._call(self.store.ping)

    async def publish_replica(
        self, replica: str, url: str, model: str, adapters: Mapping[str, str], ttl_s: float
    ) -> None:
        await self._call(lambda: self.store.publish_replica(replica, url, model, adapters, ttl_s))

    async def record_residency(self, replica: str, adapter: str, tier: str | None, ttl_s: float) -> None:
        await self._call(lambda: self.store.record_residency(replica, adapter, tier, ttl_s))

    async def snapshot(self) -> dict[str, ReplicaPlacement]:
        return await self._call(self.store.snapshot)

    async def record_demand(self, counts: Mapping[str, int]) -> None:
        await self._call(lambda: self.store.record_demand(counts))

    async def demand(self, window_s: float = 300.0) -> dict[str, float]:
        return await self._call(lambda: self.store.demand(window_s))

    async def set_catalog(self, entries: Mapping[str, str]) -> None:
        await self._call(lambda: self.store.set_catalog(entries))

    async def catalog(self) -> dict[str, str]:
        return await self._call(self.store.catalog)

    async def remove_catalog(self, name: str) -> None:
        await self._call(lambda: self.store.remove_catalog(name))

    async def close(self) -> None:
        await self.breaker.aclose()
        await self.store.close()
