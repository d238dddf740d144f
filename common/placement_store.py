"""Placement store: which replica holds which adapter, shared by router replicas and the operator.

Lives beside the wire models (not in router/ or operator/) so neither component imports the other.
Two implementations with one async interface:

- `RedisPlacementStore`: several router replicas and the operator share one view. Every entry has a
  TTL, so a replica that stops publishing (pod gone, router gone) fades out on its own.
- `MemoryPlacementStore`: same semantics in process, for `lorafleet up` without Redis and for tests.

Key layout (prefix defaults to `lorafleet`; a replica is `namespace/pod` in a cluster, where pod
names repeat across namespaces, its bare name with one scope: `replica_key`):
  {p}:replicas              zset  replica -> unix seconds of its last publish
  {p}:replica:{name}        hash  url, model, updated_at                       (TTL)
  {p}:res:{name}            hash  adapter -> tier ("gpu" | "cpu")              (TTL)
  {p}:catalog               hash  adapter -> source path (operator / static catalog)
  {p}:demand:{minute}       hash  adapter -> requests routed in that minute     (TTL 15 min)

Errors from Redis are not swallowed here: callers decide the failure mode (the router fails open
and counts it; see `router/placement.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from lorafleet.protocol import AdapterInventory

DEMAND_BUCKET_S = 60
DEMAND_KEEP_S = 15 * 60


@dataclass(frozen=True, slots=True)
class ReplicaPlacement:
    """One replica's residency as the store knows it."""

    replica: str
    url: str
    model: str
    adapters: Mapping[str, str]  # adapter -> tier ("gpu" | "cpu")
    updated_at: float


def replica_key(scope: str, name: str) -> str:
    """A replica's name in the store: `scope/name` (scope: its namespace; two pools of one name in
    two namespaces both have a pod `llama-0`), `name` where there is one scope (static workers,
    `lorafleet up`: scope "")."""
    return f"{scope}/{name}" if scope else name


def in_scope(replicas: Mapping[str, ReplicaPlacement], scope: str) -> dict[str, ReplicaPlacement]:
    """The store's replicas of one scope, by their names within it (`replica_key` undone)."""
    if not scope:
        return {key: p for key, p in replicas.items() if "/" not in key}
    head = scope + "/"
    return {key.removeprefix(head): p for key, p in replicas.items() if key.startswith(head)}


def residency_of(inventory: AdapterInventory) -> dict[str, str]:
    """The adapters a worker holds in memory (disk-tier entries are not resident)."""
    return {a.name: a.tier for a in inventory.adapters if a.tier in ("gpu", "cpu")}


class PlacementStore(Protocol):
    async def ping(self) -> bool: ...

    async def publish_replica(
        self, replica: str, url: str, model: str, adapters: Mapping[str, str], ttl_s: float
    ) -> None:
        """Replace a replica's whole residency (after a poll of its inventory)."""

    async def record_residency(self, replica: str, adapter: str, tier: str | None, ttl_s: float) -> None:
        """Write-through after a load (tier) or an unload (tier None)."""

    async def snapshot(self) -> dict[str, ReplicaPlacement]: ...

    async def record_demand(self, counts: Mapping[str, int]) -> None: ...

    async def demand(self, window_s: float = 300.0) -> dict[str, float]:
        """Requests per second per adapter over the last `window_s` (whole minutes: the ones before
        this one, and this one so far)."""

    async def set_catalog(self, entries: Mapping[str, str]) -> None: ...

    async def catalog(self) -> dict[str, str]: ...

    async def remove_catalog(self, name: str) -> None:
        """The adapter was deleted: routers stop routing to it and never cold-load it again."""

    async def close(self) -> None: ...


def _minute(now: float) -> int:
    return int(now // DEMAND_BUCKET_S)


def _window(now: float, window_s: float) -> tuple[range, float]:
    """The minute buckets a demand window reads, and the seconds they cover: the whole minutes
    before this one and this one's part so far (dividing by whole minutes under-read a rate by up
    to a minute's worth early in each minute: 20% of a 5-minute window)."""
    minutes = max(1, int(window_s // DEMAND_BUCKET_S))
    current = _minute(now)
    covered = (minutes - 1) * DEMAND_BUCKET_S + max(1.0, now - current * DEMAND_BUCKET_S)
    return range(current - minutes + 1, current + 1), covered


@dataclass(slots=True)
class _Expiring:
    value: dict[str, str]
    expires_at: float


@dataclass(slots=True)
class MemoryPlacementStore:
    """In-process store with the Redis store's semantics (TTL included); `clock` is injectable."""

    clock: Callable[[], float] = time.time
    _replicas: dict[str, _Expiring] = field(default_factory=dict)
    _residency: dict[str, _Expiring] = field(default_factory=dict)
    _catalog: dict[str, str] = field(default_factory=dict)
    _demand: dict[int, dict[str, int]] = field(default_factory=dict)

    async def ping(self) -> bool:
        return True

    async def publish_replica(
        self, replica: str, url: str, model: str, adapters: Mapping[str, str], ttl_s: float
    ) -> None:
        now = self.clock()
        meta = {"url": url, "model": model, "updated_at": repr(now)}
        self._replicas[replica] = _Expiring(meta, now + ttl_s)
        self._residency[replica] = _Expiring(dict(adapters), now + ttl_s)

    async def record_residency(self, replica: str, adapter: str, tier: str | None, ttl_s: float) -> None:
        now = self.clock()
        entry = self._residency.get(replica)
        if entry is None or entry.expires_at <= now:
            entry = self._residency[replica] = _Expiring({}, now + ttl_s)
        if tier is None:
            entry.value.pop(adapter, None)
        else:
            entry.value[adapter] = tier
        entry.expires_at = max(entry.expires_at, now + ttl_s)

    async def snapshot(self) -> dict[str, ReplicaPlacement]:
        now = self.clock()
        out: dict[str, ReplicaPlacement] = {}
        for name, meta in list(self._replicas.items()):
            if meta.expires_at <= now:
                del self._replicas[name]
                continue
            res = self._residency.get(name)
            adapters = dict(res.value) if res is not None and res.expires_at > now else {}
            out[name] = ReplicaPlacement(
                name, meta.value["url"], meta.value["model"], adapters, float(meta.value["updated_at"])
            )
        return out

    async def record_demand(self, counts: Mapping[str, int]) -> None:
        now = self.clock()
        bucket = self._demand.setdefault(_minute(now), {})
        for name, n in counts.items():
            bucket[name] = bucket.get(name, 0) + n
        oldest = _minute(now - DEMAND_KEEP_S)
        for minute in [m for m in self._demand if m < oldest]:
            del self._demand[minute]

    async def demand(self, window_s: float = 300.0) -> dict[str, float]:
        buckets, covered = _window(self.clock(), window_s)
        totals: dict[str, int] = {}
        for minute in buckets:
            for name, n in self._demand.get(minute, {}).items():
                totals[name] = totals.get(name, 0) + n
        return {name: n / covered for name, n in totals.items()}

    async def set_catalog(self, entries: Mapping[str, str]) -> None:
        self._catalog.update(entries)

    async def catalog(self) -> dict[str, str]:
        return dict(self._catalog)

    async def remove_catalog(self, name: str) -> None:
        self._catalog.pop(name, None)

    async def close(self) -> None:
        return None


class RedisPlacementStore:
    """The shared store. `client` is a `redis.asyncio.Redis` made by the caller's lifespan hook."""

    def __init__(self, client, prefix: str = "lorafleet", clock: Callable[[], float] = time.time) -> None:
        self._r = client
        self._p = prefix
        self._clock = clock

    @classmethod
    def from_url(cls, url: str, prefix: str = "lorafleet", timeout_s: float = 0.5) -> RedisPlacementStore:
        import redis.asyncio as aioredis

        # Short timeouts: a Redis outage must cost the request path milliseconds, not seconds.
        client = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=True
        )
        return cls(client, prefix)

    def _k(self, *parts: str) -> str:
        return ":".join((self._p, *parts))

    async def ping(self) -> bool:
        return bool(await self._r.ping())

    async def publish_replica(
        self, replica: str, url: str, model: str, adapters: Mapping[str, str], ttl_s: float
    ) -> None:
        now = self._clock()
        ttl_ms = max(1, int(ttl_s * 1000))
        meta_key, res_key = self._k("replica", replica), self._k("res", replica)
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.hset(meta_key, mapping={"url": url, "model": model, "updated_at": repr(now)})
            pipe.pexpire(meta_key, ttl_ms)
            pipe.delete(res_key)
            if adapters:
                pipe.hset(res_key, mapping=dict(adapters))
                pipe.pexpire(res_key, ttl_ms)
            pipe.zadd(self._k("replicas"), {replica: now})
            await pipe.execute()

    async def record_residency(self, replica: str, adapter: str, tier: str | None, ttl_s: float) -> None:
        res_key = self._k("res", replica)
        async with self._r.pipeline(transaction=True) as pipe:
            if tier is None:
                pipe.hdel(res_key, adapter)
            else:
                pipe.hset(res_key, adapter, tier)
                # Never shorten a TTL set by a fuller publish.
                pipe.pexpire(res_key, max(1, int(ttl_s * 1000)), gt=True)
                pipe.pexpire(res_key, max(1, int(ttl_s * 1000)), nx=True)
            await pipe.execute()

    async def snapshot(self) -> dict[str, ReplicaPlacement]:
        names: list[str] = await self._r.zrange(self._k("replicas"), 0, -1)
        if not names:
            return {}
        async with self._r.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hgetall(self._k("replica", name))
                pipe.hgetall(self._k("res", name))
            rows = await pipe.execute()
        out: dict[str, ReplicaPlacement] = {}
        gone: list[str] = []
        for i, name in enumerate(names):
            meta, res = rows[2 * i], rows[2 * i + 1]
            if not meta:
                gone.append(name)  # its TTL ran out: the replica stopped publishing
                continue
            out[name] = ReplicaPlacement(name, meta["url"], meta["model"], res, float(meta["updated_at"]))
        if gone:
            await self._r.zrem(self._k("replicas"), *gone)
        return out

    async def record_demand(self, counts: Mapping[str, int]) -> None:
        if not counts:
            return
        key = self._k("demand", str(_minute(self._clock())))
        async with self._r.pipeline(transaction=False) as pipe:
            for name, n in counts.items():
                pipe.hincrby(key, name, n)
            pipe.expire(key, DEMAND_KEEP_S)
            await pipe.execute()

    async def demand(self, window_s: float = 300.0) -> dict[str, float]:
        buckets, covered = _window(self._clock(), window_s)
        async with self._r.pipeline(transaction=False) as pipe:
            for minute in buckets:
                pipe.hgetall(self._k("demand", str(minute)))
            rows = await pipe.execute()
        totals: dict[str, int] = {}
        for row in rows:
            for name, n in row.items():
                totals[name] = totals.get(name, 0) + int(n)
        return {name: n / covered for name, n in totals.items()}

    async def set_catalog(self, entries: Mapping[str, str]) -> None:
        if entries:
            await self._r.hset(self._k("catalog"), mapping=dict(entries))

    async def catalog(self) -> dict[str, str]:
        return dict(await self._r.hgetall(self._k("catalog")))

    async def remove_catalog(self, name: str) -> None:
        await self._r.hdel(self._k("catalog"), name)

    async def close(self) -> None:
        await self._r.aclose()
