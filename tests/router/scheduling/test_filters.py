"""Filters, table-driven."""

from __future__ import annotations

import pytest

from lorafleet.router.scheduling.filters import Available, BoundedLoad, ServesModel
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
