"""The fleet's one-adapter-per-name rule across namespaces (pure bookkeeping, no HTTP, no kopf)."""

from __future__ import annotations

import pytest

from lorafleet.operator.fleet import Fleet
from lorafleet.operator.spec import parse_adapter
from lorafleet.placement_store import MemoryPlacementStore

OLD, NEW = "2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z"


def claim(fleet: Fleet, namespace: str, created: str | None) -> None:
    fleet.upsert_adapter(parse_adapter(namespace, "x", {"pool": "pool", "source": f"x-{namespace}"}), 1, None, created)


def conflict(fleet: Fleet, namespace: str) -> str | None:
    found = fleet.pool(namespace, "pool").adapters["x"].conflict
    return found[0] if found else None


@pytest.mark.parametrize("order", [("a", "b"), ("b", "a")])
def test_the_oldest_adapter_of_a_name_serves_whatever_the_order_seen(order: tuple[str, str]) -> None:
    """After a restart kopf resumes adapters in any order: the same one must keep the name."""
    fleet = Fleet(None, None, None)  # type: ignore[arg-type]
    for ns in order:
        claim(fleet, ns, {"a": OLD, "b": NEW}[ns])
    assert (conflict(fleet, "a"), conflict(fleet, "b")) == (None, "NameConflict")
    fleet.forget_adapter("a", "x")  # deleted: the name passes on
    assert conflict(fleet, "b") is None
    assert not fleet.name_shared("b", "x")


async def test_deleting_one_keeps_the_others_catalog_entry() -> None:
    store = MemoryPlacementStore()
    fleet = Fleet(None, None, store)  # type: ignore[arg-type]
    claim(fleet, "a", OLD)
    claim(fleet, "b", NEW)
    await store.set_catalog({"x": "/adapters/x-a"})
    for ns in ("b", "a"):  # what adapter_delete does: the entry goes with the last adapter of the name
        reconciler = fleet.forget_adapter(ns, "x")
        assert reconciler is not None
        await reconciler.unload_everywhere("x", keep_catalog=fleet.name_shared(ns, "x"))
        assert ("x" in await store.catalog()) is (ns == "b"), ns
