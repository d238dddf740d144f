"""The router's share of the placement store is its namespace's (`placement_store.replica_key`):
pods named alike in another namespace (a pool of the same name) neither feed its view nor get
overwritten by its publishes."""

from __future__ import annotations

import httpx

from lorafleet.placement_store import MemoryPlacementStore, replica_key
from lorafleet.router.discovery import Endpoint, StaticDiscovery
from lorafleet.router.fleet import Fleet
from lorafleet.router.metrics import RouterMetrics
from lorafleet.router.placement import PlacementSync
from tests.router.test_fleet import inventory


async def test_the_router_reads_and_writes_only_its_namespace():
    store = MemoryPlacementStore()
    # llama-1's residency as the operator (or another router replica) published it, in both namespaces
    await store.publish_replica(replica_key("team-a", "llama-1"), "http://a", "base", {"x": "cpu"}, 30)
    await store.publish_replica(replica_key("team-b", "llama-1"), "http://b", "base", {"y": "cpu"}, 30)
    await store.publish_replica(replica_key("team-b", "llama-0"), "http://b0", "base", {"v": "gpu"}, 30)
    fleet = Fleet()
    fleet.set_endpoints([Endpoint(f"llama-{i}", f"http://10.0.0.{i}:8000", f"http://10.0.0.{i}:8000") for i in (0, 1)])
    async with httpx.AsyncClient() as http:
        sync = PlacementSync(fleet, store, StaticDiscovery([]), http, RouterMetrics.create(), 30.0, {}, scope="team-a")
        polled, unpolled = fleet.replicas["llama-0"], fleet.replicas["llama-1"]
        polled.apply_poll(inventory(z="gpu"), started_at=0.0)
        await sync._exchange()
        assert unpolled.residency() == {"x": "cpu"}, "its own namespace's entry, not team-b's"
        assert polled.residency() == {"z": "gpu"}
        await sync.write_through(polled, "w", "cpu")
    snap = await store.snapshot()
    assert dict(snap["team-a/llama-0"].adapters) == {"z": "gpu", "w": "cpu"}
    assert dict(snap["team-b/llama-0"].adapters) == {"v": "gpu"}, "the other namespace's pod is untouched"
    assert "llama-0" not in snap
