"""Scorers, table-driven: each returns [0, 1]."""

from __future__ import annotations

import pytest

from lorafleet.router.scheduling.hashing import rendezvous_order
from lorafleet.router.scheduling.scorers import (
    CacheVictim,
    HashAffinity,
    Load,
    LoraAffinity,
    Residency,
    SlotFree,
    SlotHeadroom,
)
from lorafleet.router.scheduling.types import EndpointView, FleetStats, RequestInfo

STATS = FleetStats(0, 1)


@pytest.mark.parametrize(
    ("adapters", "gpu", "cpu", "expected"),
    [
        ((), set(), set(), 1.0),  # base model: everywhere is "resident"
        (("x",), {"x"}, {"x"}, 1.0),
        (("x",), set(), {"x"}, 0.7),
        (("x",), set(), set(), 0.0),
        (("x", "y"), {"x"}, {"x", "y"}, 0.7),  # composed: the worst-placed adapter counts
        (("x", "y"), {"x", "y"}, {"x", "y"}, 1.0),
        (("x", "y"), {"x"}, {"x"}, 0.0),
    ],
)
def test_residency(adapters, gpu, cpu, expected):
    e = EndpointView("e", gpu=frozenset(gpu), cpu=frozenset(cpu))
    assert Residency()(RequestInfo("base", adapters), e, STATS) == expected


@pytest.mark.parametrize(
    ("running", "waiting", "inflight", "capacity", "expected"),
    [
        (0, 0, 0, 64, 1.0),
        (32, 0, 0, 64, 0.5),
        (30, 2, 0, 64, 0.5),
        (0, 0, 48, 64, 0.25),  # the router's own count when fresher than the poll
        (70, 10, 0, 64, 0.0),  # clamped
    ],
)
def test_load(running, waiting, inflight, capacity, expected):
    e = EndpointView("e", running=running, waiting=waiting, inflight=inflight, capacity=capacity)
    assert Load()(RequestInfo("base", ("x",)), e, STATS) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("active", "waiting", "max_loras", "expected"),
    [
        ({"x"}, set(), 1, 1.0),  # running there
        (set(), set(), 4, 0.8),  # a free slot
        ({"p", "q"}, {"x"}, 2, 0.6),  # full, but already waiting there
        ({"p", "q"}, set(), 2, 0.0),
        # Loaded but idle looks absent: the signal is in-flight requests (the known weakness).
        ({"p", "q"}, set(), 2, 0.0),
    ],
)
def test_lora_affinity_matches_the_published_scorer(active, waiting, max_loras, expected):
    e = EndpointView(
        "e",
        active=frozenset(active),
        waiting_adapters=frozenset(waiting),
        max_loras=max_loras,
        cpu=frozenset({"x"}),
    )
    assert LoraAffinity()(RequestInfo("base", ("x",)), e, STATS) == expected


@pytest.mark.parametrize("key", ["x", "adapter-0042", "a+b"])
def test_hash_affinity_ranks_like_rendezvous(key):
    names = [f"r{i}" for i in range(8)]
    req = RequestInfo("base", tuple(key.split("+")))
    scores = {n: HashAffinity()(req, EndpointView(n), STATS) for n in names}
    assert all(0.0 <= s < 1.0 for s in scores.values())
    assert sorted(names, key=scores.__getitem__, reverse=True) == rendezvous_order(req.key, names)


@pytest.mark.parametrize(
    ("adapters", "active", "max_loras", "expected"),
    [
        (("x",), set(), 2, 1.0),
        (("x",), {"p", "q"}, 2, 0.0),  # every slot runs another adapter: x would be deferred
        (("x",), {"x", "q"}, 2, 1.0),  # x already runs: joins the batch
        (("x", "y"), {"p"}, 2, 0.0),  # composed: needs two more slots, one free
        (("x", "y"), {"x"}, 2, 1.0),
        ((), {"p", "q"}, 2, 1.0),  # base model needs no slot
    ],
)
def test_slot_free(adapters, active, max_loras, expected):
    e = EndpointView("e", active=frozenset(active), max_loras=max_loras)
    assert SlotFree()(RequestInfo("base", adapters), e, STATS) == expected


@pytest.mark.parametrize(
    ("adapters", "active", "waiting", "max_loras", "expected"),
    [
        (("x",), set(), set(), 4, 0.75),  # x takes one of 4
        (("x",), {"p"}, {"q"}, 4, 0.25),  # a queued adapter counts as taking a slot
        (("x",), {"p", "q"}, {"r"}, 2, 0.0),  # clamped: over the limit
        (("x",), {"x", "q"}, {"r"}, 2, 1.0),  # x runs already: needs nothing
        (("x", "y"), {"x"}, set(), 4, 0.5),
        ((), {"p", "q"}, set(), 2, 1.0),  # base model needs no slot
    ],
)
def test_slot_headroom(adapters, active, waiting, max_loras, expected):
    e = EndpointView("e", active=frozenset(active), waiting_adapters=frozenset(waiting), max_loras=max_loras)
    assert SlotHeadroom()(RequestInfo("base", adapters), e, STATS) == pytest.approx(expected)


FREQ = {"x": 6.0, "y": 2.0, "p": 1.0, "q": 3.0, "r": 12.0}


@pytest.mark.parametrize(
    ("adapters", "cpu", "active", "max_cpu", "scratch", "expected"),
    [
        (("x",), {"x"}, set(), 2, 0, 1.0),  # resident: nothing to evict
        (("x",), {"p"}, set(), 2, 0, 1.0),  # a free slot
        (("x",), {"p"}, set(), 2, 1, 6.0 / 7.0),  # the free slot is the scratch reserve: p must go
        (("x",), {"p", "q"}, set(), 2, 0, 6.0 / 7.0),  # full: the least popular idle resident (p)
        (("x",), {"p", "q"}, {"p"}, 2, 0, 6.0 / 9.0),  # p is running: q must go
        (("x",), {"r", "q"}, {"q"}, 2, 0, 6.0 / 18.0),  # only a more popular one to lose
        (("x",), {"p", "q"}, {"p", "q"}, 2, 0, 0.0),  # nothing idle to evict
        (
            ("x", "y"),
            {"p", "q"},
            set(),
            3,
            0,
            2.0 / 3.0,
        ),  # two missing, one free slot: p goes; f = least popular missing (y)
        (("z",), {"p", "q"}, set(), 2, 0, 0.0),  # never seen (f = 0) against a known victim
    ],
)
def test_cache_victim(adapters, cpu, active, max_cpu, scratch, expected):
    e = EndpointView("e", cpu=frozenset(cpu), active=frozenset(active), max_cpu_loras=max_cpu)
    scorer = CacheVictim(lambda a: FREQ.get(a, 0.0), scratch)
    assert scorer(RequestInfo("base", adapters), e, STATS) == pytest.approx(expected)


def test_cache_victim_orders_replicas_by_what_they_lose():
    scorer = CacheVictim(lambda a: FREQ.get(a, 0.0), scratch_slots=0)
    req = RequestInfo("base", ("x",))
    loses_p = EndpointView("a", cpu=frozenset({"p", "r"}), max_cpu_loras=2)
    loses_q = EndpointView("b", cpu=frozenset({"q", "r"}), max_cpu_loras=2)
    assert scorer(req, loses_p, STATS) > scorer(req, loses_q, STATS)
