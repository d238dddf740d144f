"""A deleted LoraAdapter leaves the placement store's catalog (routers stop cold-loading it)."""

from __future__ import annotations

from lorafleet.operator.fleet import Fleet
from lorafleet.operator.pool_state import ReconcilerSettings
from lorafleet.operator.reconciler import PoolReconciler
from lorafleet.operator.spec import parse_adapter
from lorafleet.placement_store import MemoryPlacementStore


async def test_unload_everywhere_removes_the_catalog_entry():
    store = MemoryPlacementStore()
    await store.set_catalog({"a": "/adapters/a", "b": "/adapters/b"})
    reconciler = PoolReconciler("ns", "pool", None, None, store, ReconcilerSettings())  # type: ignore[arg-type]
    reconciler.upsert_adapter(parse_adapter("ns", "a", {"pool": "pool", "source": "a"}), 1, None)
    assert await reconciler.unload_everywhere("a") == []
    assert await store.catalog() == {"b": "/adapters/b"}
    assert "a" not in reconciler.adapters


async def test_fleet_removes_an_adapter_no_pool_knows():
    store = MemoryPlacementStore()
    await store.set_catalog({"a": "/adapters/a"})
    await Fleet(None, None, store).remove_from_catalog("a")  # type: ignore[arg-type]
    assert await store.catalog() == {}
    await Fleet(None, None, None).remove_from_catalog("a")  # no store: nothing to do  # type: ignore[arg-type]
