"""Pickers, table-driven."""

from __future__ import annotations

import pytest

from lorafleet.router.scheduling.pickers import MaxScore, RoundRobin
from lorafleet.router.scheduling.types import EndpointView, NoEndpoint, RequestInfo

REQ = RequestInfo("base", ("x",))


def scored(*pairs: tuple[str, float]) -> list[tuple[EndpointView, float]]:
    return [(EndpointView(n), s) for n, s in pairs]


@pytest.mark.parametrize(
    ("candidates", "expected"),
    [
        (scored(("a", 0.1), ("b", 0.9), ("c", 0.5)), ["b", "b", "b"]),
        (scored(("a", 0.5), ("b", 0.5), ("c", 0.1)), ["b", "a", "b"]),  # ties rotate
        (scored(("a", 1.0)), ["a", "a", "a"]),
    ],
)
def test_max_score(candidates, expected):
    picker = MaxScore()
    assert [picker(REQ, candidates).name for _ in expected] == expected


@pytest.mark.parametrize(
    ("candidates", "expected"),
    [
        (scored(("b", 0.0), ("a", 1.0), ("c", 0.5)), ["a", "b", "c", "a"]),  # ignores scores, name order
        (scored(("a", 0.0)), ["a", "a"]),
    ],
)
def test_round_robin(candidates, expected):
    picker = RoundRobin()
    assert [picker(REQ, candidates).name for _ in expected] == expected


@pytest.mark.parametrize("picker", [MaxScore(), RoundRobin()])
def test_no_candidates(picker):
    with pytest.raises(NoEndpoint):
        picker(REQ, [])
