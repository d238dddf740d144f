"""Scorers, table-driven: each returns [0, 1]."""

from __future__ import annotations

import pytest

from lorafleet.router.scheduling.hashing import rendezvous_order
from lorafleet.router.scheduling.scorers import (
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
