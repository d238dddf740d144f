"""Filters, table-driven."""

from __future__ import annotations

import dataclasses

import pytest

from lorafleet.router.scheduling.filters import Available, BoundedLoad, ServesModel, SlotQueue
from lorafleet.router.scheduling.types import EndpointView, FleetStats, RequestInfo


def ep(name: str, **kw) -> EndpointView:
    return EndpointView(name=name, **kw)


def names(eps: list[EndpointView]) -> list[str]:
    return [e.name for e in eps]


def run(f, req: RequestInfo, eps: list[EndpointView]) -> list[str]:
    return names(f(req, eps, FleetStats.of(eps)))


REQ = RequestInfo("base", ("x",))


@pytest.mark.parametrize(
    ("eps", "expected"),
    [
        ([ep("a"), ep("b")], ["a", "b"]),
        ([ep("a", healthy=False), ep("b")], ["b"]),
        ([ep("a", ejected=True), ep("b", ejected=True)], []),
        ([ep("a", healthy=False, ejected=True)], []),
    ],
)
def test_available(eps, expected):
    assert run(Available(), REQ, eps) == expected


@pytest.mark.parametrize(
    ("model", "eps", "expected"),
    [
        ("base", [ep("a"), ep("b", model="other")], ["a"]),
        ("other", [ep("a"), ep("b", model="other")], ["b"]),
        ("third", [ep("a")], []),
    ],
)
def test_serves_model(model, eps, expected):
    assert run(ServesModel(), RequestInfo(model, ("x",)), eps) == expected


@pytest.mark.parametrize(
    ("loads", "factor", "expected"),
    [
        ([0, 0, 0, 0], 1.25, ["a", "b", "c", "d"]),  # idle: ceil(1.25 · 1/4) = 1 → load 0 fits
        ([1, 1, 1, 1], 1.25, ["a", "b", "c", "d"]),  # ceil(1.25 · 5/4) = 2
        ([6, 1, 1, 0], 1.25, ["b", "c", "d"]),  # ceil(1.25 · 9/4) = 3: a is over
        ([6, 1, 1, 0], 3.0, ["a", "b", "c", "d"]),  # ceil(3 · 9/4) = 7
        ([40, 40, 40, 40], 0.5, ["a"]),  # nobody fits: the least loaded (first by name) stays
    ],
)
def test_bounded_load(loads, factor, expected):
    eps = [ep(n, inflight=load) for n, load in zip("abcd", loads, strict=True)]
    assert run(BoundedLoad(factor), REQ, eps) == expected


@pytest.mark.parametrize(
    ("share", "expected"),
    [
        (0.5, ["b", "c", "d"]),  # hot: held to 1.25 and spills
        (0.001, ["a", "b", "c", "d"]),  # not hot: the looser 2.0 bound, ceil(2 · 9/4) = 5 ... a=6 over
    ],
)
def test_bounded_load_is_looser_for_keys_that_are_not_hot(share, expected):
    eps = [ep(n, inflight=load) for n, load in zip("abcd", [4, 2, 2, 0], strict=True)]
    req = RequestInfo("base", ("x",), share=share)
    assert run(BoundedLoad(1.25, cold_factor=2.0, hot_share=0.02), req, eps) == expected


def test_bounded_load_empty_in_empty_out():
    assert run(BoundedLoad(), REQ, []) == []


def slots(name: str, active: str = "", waiting: str = "", max_loras: int = 2) -> EndpointView:
    """A replica whose running / queued adapters are the letters of `active` / `waiting`."""
    return ep(name, active=frozenset(active), waiting_adapters=frozenset(waiting), max_loras=max_loras)


@pytest.mark.parametrize(
    ("adapters", "endpoint", "expected"),
    [
        (("x",), slots("a"), 0),
        (("x",), slots("a", "pq"), 1),  # slots full: x is first in the queue
        (("x",), slots("a", "pq", "rs"), 3),  # behind r and s
        (("x",), slots("a", "xq", "rs"), 2),  # x already runs: the queue is r, s (x joins the batch)
        (("x",), slots("a", "pq", "x"), 1),  # x already queued: no extra place
        (("x", "y"), slots("a", "p"), 1),  # composed: two new slots wanted, one free
        ((), slots("a", "pq", "rs"), 0),  # base model needs no slot
    ],
)
def test_slots_over(adapters, endpoint, expected):
    assert endpoint.slots_over(adapters) == expected


@pytest.mark.parametrize(
    ("eps", "max_over", "expected"),
    [
        ([slots("a", "pq", "rst"), slots("b", "p")], 3, ["b"]),  # a: x would be 4th over the limit
        ([slots("a", "pq", "rs"), slots("b", "p")], 3, ["a", "b"]),  # a: 3rd, within the bound
        ([slots("a", "pq", "rs"), slots("b", "p")], 0, ["b"]),
        ([slots("a", "xq", "rstu"), slots("b", "p")], 0, ["a", "b"]),  # x runs on a: joins the batch
        ([slots("a", "pq", "rstu"), slots("b", "pq", "rstu")], 3, ["a", "b"]),  # saturated: keep all
    ],
)
def test_slot_queue(eps, max_over, expected):
    assert run(SlotQueue(max_over), REQ, eps) == expected


def held(name: str, active: str, waiting: str = "", **kw) -> EndpointView:
    """`slots` with x resident in the CPU cache (not running)."""
    return dataclasses.replace(slots(name, active, waiting), cpu=frozenset({"x"}), **kw)


@pytest.mark.parametrize(
    ("eps", "full_share", "expected"),
    [
        # x's home a is 4 over its slots; b, c have free slots; 1 of 3 replicas slot-full
        ([held("a", "pq", "rst"), slots("b", "p"), slots("c", "p")], 0.5, ["b", "c"]),  # spills
        ([held("a", "pq", "rst"), slots("b", "p"), slots("c", "p")], 0.3, ["a", "b", "c"]),  # slot-bound
        ([held("a", "pq", "rst"), slots("b", "p"), slots("c", "p")], None, ["b", "c"]),  # no gate
        # 2 of 3 slot-full: no spill, whoever holds x is kept with the rest
        ([held("a", "pq", "rst"), slots("b", "pq", "rs"), slots("c", "p")], 0.5, ["a", "b", "c"]),
        # nobody holds x: a first load, the slot bound applies as without the gate
        ([slots("a", "pq", "rst"), slots("b", "pq", "rs"), slots("c", "p")], 0.5, ["b", "c"]),
        # a slot-full replica serving another model does not count: 1 of 2, not 2 of 3
        ([held("a", "pq", "rst"), dataclasses.replace(slots("b", "pq", "rs"), model="m2"), slots("c", "p")], 0.6, ["c"]),
    ],
)
def test_slot_queue_no_spill_while_the_fleet_is_slot_bound(eps, full_share, expected):
    f = SlotQueue(3, full_share)
    serving = [e for e in eps if e.model == "base"]
    assert names(f(REQ, serving, FleetStats.of(eps, "base"))) == expected
