"""The placement store: the same behaviour table against the in-memory store and the real Redis."""

from __future__ import annotations

import asyncio
import socket
import uuid

import pytest

from lorafleet.placement_store import (
    MemoryPlacementStore,
    RedisPlacementStore,
    in_scope,
    replica_key,
    residency_of,
)
from lorafleet.protocol import AdapterInfo, AdapterInventory

REDIS_URL = "redis://127.0.0.1:6379/0"


def _redis_answers() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 6379), timeout=0.3) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class FakeClock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "redis"])
async def store_and_clock(request):
    clock = FakeClock()
    if request.param == "memory":
        yield MemoryPlacementStore(clock=clock), clock
        return
    if not _redis_answers():
        pytest.skip("no Redis answers on 127.0.0.1:6379 (start redis-server to run the Redis cases)")
    store = RedisPlacementStore.from_url(REDIS_URL, prefix=f"lftest-{uuid.uuid4().hex[:8]}")
    store._clock = clock  # demand buckets follow the fake clock; TTLs are Redis's own
    yield store, clock
    keys = [k async for k in store._r.scan_iter(f"{store._p}:*")]
    if keys:
        await store._r.delete(*keys)
    await store.close()


async def test_publish_then_snapshot(store_and_clock):
    store, _ = store_and_clock
    await store.publish_replica("w0", "http://w0", "base", {"a": "gpu", "b": "cpu"}, ttl_s=30)
    await store.publish_replica("w1", "http://w1", "base", {}, ttl_s=30)
    snap = await store.snapshot()
    assert set(snap) == {"w0", "w1"}
    assert dict(snap["w0"].adapters) == {"a": "gpu", "b": "cpu"}
    assert snap["w0"].url == "http://w0" and snap["w0"].model == "base"
    assert dict(snap["w1"].adapters) == {}


async def test_publish_replaces_residency(store_and_clock):
    store, _ = store_and_clock
    await store.publish_replica("w0", "http://w0", "base", {"a": "gpu", "b": "cpu"}, ttl_s=30)
    await store.publish_replica("w0", "http://w0", "base", {"c": "cpu"}, ttl_s=30)
    assert dict((await store.snapshot())["w0"].adapters) == {"c": "cpu"}


@pytest.mark.parametrize(
    ("writes", "expected"),
    [
        ([("x", "cpu")], {"a": "gpu", "x": "cpu"}),
        ([("x", "cpu"), ("x", "gpu")], {"a": "gpu", "x": "gpu"}),
        ([("a", None)], {}),
        ([("x", "cpu"), ("a", None)], {"x": "cpu"}),
        ([("missing", None)], {"a": "gpu"}),
    ],
)
async def test_write_through(store_and_clock, writes, expected):
    store, _ = store_and_clock
    await store.publish_replica("w0", "http://w0", "base", {"a": "gpu"}, ttl_s=30)
    for adapter, tier in writes:
        await store.record_residency("w0", adapter, tier, ttl_s=30)
    assert dict((await store.snapshot())["w0"].adapters) == expected


async def test_ttl_expires_a_silent_replica(store_and_clock):
    store, clock = store_and_clock
    await store.publish_replica("w0", "http://w0", "base", {"a": "gpu"}, ttl_s=0.2)
    await store.publish_replica("w1", "http://w1", "base", {"b": "gpu"}, ttl_s=30)
    clock.now += 1.0
    if isinstance(store, RedisPlacementStore):
        await asyncio.sleep(0.3)  # Redis expires on its own clock
    snap = await store.snapshot()
    assert set(snap) == {"w1"}


async def test_demand_rates(store_and_clock):
    store, clock = store_and_clock
    clock.now = 60 * 1000 + 5
    await store.record_demand({"a": 30, "b": 6})
    clock.now += 60
    await store.record_demand({"a": 30})
    rates = await store.demand(window_s=120)
    # The window's buckets cover the last minute and 5 s of this one: 65 s, not 120.
    assert rates == pytest.approx({"a": 60 / 65, "b": 6 / 65})
    clock.now += 54  # a second before this minute's end: 119 s
    assert await store.demand(window_s=120) == pytest.approx({"a": 60 / 119, "b": 6 / 119})
    clock.now += 600
    assert await store.demand(window_s=120) == {}


async def test_catalog_roundtrip(store_and_clock):
    store, _ = store_and_clock
    assert await store.catalog() == {}
    await store.set_catalog({"a": "/adapters/a", "b": "/adapters/b"})
    await store.set_catalog({"c": "/adapters/c"})
    assert await store.catalog() == {"a": "/adapters/a", "b": "/adapters/b", "c": "/adapters/c"}
    assert await store.ping()


async def test_remove_catalog(store_and_clock):
    store, _ = store_and_clock
    await store.set_catalog({"a": "/adapters/a", "b": "/adapters/b"})
    await store.remove_catalog("a")
    await store.remove_catalog("never-there")  # deleting twice (a finalizer retried) is fine
    assert await store.catalog() == {"b": "/adapters/b"}
    await store.set_catalog({"a": "/adapters/a2"})  # re-created: back in the catalog
    assert await store.catalog() == {"a": "/adapters/a2", "b": "/adapters/b"}


def test_residency_of_skips_disk_tier():
    inv = AdapterInventory(
        model="base",
        max_loras=2,
        max_cpu_loras=4,
        max_lora_rank=16,
        max_loras_per_request=2,
        adapters=[
            AdapterInfo(name=n, tier=t, rank=8, alpha=16, digest="sha256:0", path=f"/a/{n}")
            for n, t in [("a", "gpu"), ("b", "cpu"), ("c", "disk")]
        ],
    )
    assert residency_of(inv) == {"a": "gpu", "b": "cpu"}


async def test_same_named_pods_of_two_namespaces_keep_their_own_residency(store_and_clock):
    """Pools named alike in two namespaces both have a pod `llama-0`: under scoped keys neither
    publish overwrites the other, and each scope reads back only its own."""
    store, _ = store_and_clock
    await store.publish_replica(replica_key("team-a", "llama-0"), "http://10.0.0.1:8000", "base", {"a": "gpu"}, 30)
    await store.publish_replica(replica_key("team-b", "llama-0"), "http://10.0.0.2:8000", "base", {"b": "cpu"}, 30)
    await store.publish_replica(replica_key("", "127.0.0.1:8101"), "http://127.0.0.1:8101", "base", {"c": "gpu"}, 30)
    await store.record_residency(replica_key("team-b", "llama-0"), "b2", "gpu", 30)
    snap = await store.snapshot()
    assert dict(in_scope(snap, "team-a")["llama-0"].adapters) == {"a": "gpu"}
    assert dict(in_scope(snap, "team-b")["llama-0"].adapters) == {"b": "cpu", "b2": "gpu"}
    assert set(in_scope(snap, "")) == {"127.0.0.1:8101"} and set(in_scope(snap, "team")) == set()


def test_replica_keys():
    assert replica_key("ns", "llama-0") == "ns/llama-0" and replica_key("", "127.0.0.1:8101") == "127.0.0.1:8101"
