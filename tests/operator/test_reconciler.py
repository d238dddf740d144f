"""The reconcile loop against stub workers and a recording placement store (no HTTP, no kopf):
the order of store writes around loads and unloads, no flapping of copies in use, statuses of a
deleted pool, failures judged against the pool, and a loop that survives a round that raises.
How changed adapters roll out is in `test_rollout.py`."""

from __future__ import annotations

import asyncio

from lorafleet.operator.pool_state import ReconcilerSettings
from lorafleet.operator.spec import EngineSpec, PoolSpec, parse_adapter
from tests.operator.reconciler_stubs import (
    NOW,
    PODS,
    home_and_other,
    info,
    make,
)


async def test_an_unload_withdraws_the_residency_from_the_store_first():
    reconciler, workers, events = make({"a": (1, 1)})
    home, other = home_and_other("a")
    workers.held[home]["a"] = info("a")
    workers.held[other]["a"] = info("a")  # one copy too many, idle
    await reconciler.reconcile_once()
    assert "a" not in workers.held[other] and "a" in workers.held[home]
    withdrawn = events.index(("store", "ns/" + other, "a", None))  # the pod under its namespace
    assert withdrawn < events.index(("unload", other, "a")), events


async def test_residency_is_published_only_after_a_load_succeeded():
    reconciler, workers, events = make({"a": (1, 1), "bad": (1, 1)})
    workers.refuse.add("bad")
    await reconciler.reconcile_once()
    (home,) = [p for p in PODS if "a" in workers.held[p]]
    assert events.index(("load", home, "a")) < events.index(("store", "ns/" + home, "a", "cpu"))
    assert not [e for e in events if e[0] == "store" and e[2] == "bad"], events  # refused: never published
    assert reconciler.adapters["bad"].failure is not None


async def test_a_copy_in_use_beyond_the_placement_is_kept_until_idle():
    """A router's second copy under load (demand below one replica's worth) is not unloaded at every
    round, only once it has been idle for `idle_unload_s`, and only within the adapter's max."""
    reconciler, workers, events = make({"a": (1, 2), "b": (1, 1)})
    for name in ("a", "b"):
        home, other = home_and_other(name)
        workers.held[home][name] = info(name, last_used=NOW - 1)
        workers.held[other][name] = info(name, last_used=NOW - 1)  # the router's copy, serving
    for _ in range(3):
        reconciler.wake(resync=True)
        await reconciler.reconcile_once()
    assert [e[1:] for e in events if e[0] == "unload"] == [(home_and_other("b")[1], "b")]  # b's max is 1
    reconciler.clock = lambda: NOW - 1 + reconciler.settings.idle_unload_s  # idle long enough
    reconciler.wake(resync=True)
    await reconciler.reconcile_once()
    assert {p for p in PODS if "a" in workers.held[p]} == {home_and_other("a")[0]}


async def test_idleness_is_the_workers_own_as_of_its_poll():
    """The worker's `idle_s` decides, not the operator's clock against the worker's `last_used`
    (another machine's clock), and a round between polls does not count the inventory's age as
    idle time: a copy 30 s idle at the poll stays, whatever the clocks say, until a poll shows it
    idle for `idle_unload_s`."""
    reconciler, workers, events = make({"a": (1, 2)})
    home, other = home_and_other("a")
    skewed = NOW - 3600  # the worker's clock an hour behind the operator's
    workers.held[home]["a"] = info("a", last_used=skewed, idle_s=30.0)
    workers.held[other]["a"] = info("a", last_used=skewed, idle_s=30.0)  # the router's copy
    await reconciler.reconcile_once()
    reconciler.clock = lambda: NOW + 45  # a round woken by an event, on the same inventory
    reconciler.wake()
    await reconciler.reconcile_once()
    assert not [e for e in events if e[0] == "unload"], events
    workers.held[other]["a"] = info("a", last_used=skewed, idle_s=reconciler.settings.idle_unload_s)
    reconciler.wake(resync=True)  # a poll shows it idle long enough
    await reconciler.reconcile_once()
    assert [e[1:] for e in events if e[0] == "unload"] == [(other, "a")]


async def test_pool_dependent_failures_are_judged_again_when_the_pool_changes():
    reconciler, workers, events = make({})
    reconciler.upsert_adapter(parse_adapter("ns", "a", {"pool": "pool", "source": "a", "rank": 32}), 1, None)
    small = PoolSpec("ns", "pool", "img", "/model", "base", engine=EngineSpec(max_lora_rank=16))
    reconciler.set_pool(small, "token")
    await reconciler.reconcile_once()
    assert reconciler.adapters["a"].failure[0] == "RankTooHigh"
    reconciler.set_pool(PoolSpec("ns", "pool", "img", "/model", "base"), "token")  # maxLoraRank back to 64
    await reconciler.reconcile_once()
    assert reconciler.adapters["a"].failure is None
    assert any("a" in held for held in workers.held.values())


async def test_a_min_zero_adapter_of_a_deleted_pool_is_not_ready():
    reconciler, workers, events = make({"a": (0, 1)})
    await reconciler.reconcile_once()
    reconciler.set_pool(None, None)
    await reconciler.reconcile_once()
    status = reconciler.adapters["a"].status
    assert status["phase"] == "Pending" and status["conditions"][-1]["reason"] == "PoolNotFound", status


async def test_a_round_that_raises_does_not_end_the_pools_loop():
    """An unforeseen exception (a bug, an answer nobody expected) is logged and retried with
    backoff; the loop, which is the pool's kopf daemon, must not die with it."""
    reconciler, workers, events = make({"a": (1, 1)})
    reconciler.settings = ReconcilerSettings(retry_s=0.001)
    reconciler._crashes = 5000  # a bug that raised for hours: the backoff must not overflow (2.0 ** 5001)
    workers.broken = 4
    stopped = asyncio.Event()
    loop = asyncio.create_task(reconciler.run(stopped))
    try:
        for _ in range(100):
            if any("a" in held for held in workers.held.values()):
                break
            await asyncio.sleep(0.05)
        assert not loop.done(), loop
        assert any("a" in held for held in workers.held.values()), events
    finally:
        stopped.set()
        reconciler.wake()
        await asyncio.wait_for(loop, 2)
