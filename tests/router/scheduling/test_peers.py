"""The newest peers, as their sources define them: llm-d's LoRA load-state scorer and NVIDIA Dynamo's
demand-proportional rendezvous replica sets."""

from __future__ import annotations

from collections import Counter

import pytest

from lorafleet.router.scheduling.filters import DemandReplicaSet
from lorafleet.router.scheduling.hashing import rendezvous_order
from lorafleet.router.scheduling.policies import POLICIES
from lorafleet.router.scheduling.scorers import LoraLoadState
from lorafleet.router.scheduling.types import EndpointView, FleetStats, RequestInfo

STATS = FleetStats(0, 1)
F = frozenset


@pytest.mark.parametrize(
    ("view", "adapters", "score"),
    [
        (EndpointView("e", gpu=F({"x"}), cpu=F({"x"})), ("x",), 1.0),  # in a GPU slot
        (EndpointView("e", cpu=F({"x"})), ("x",), 0.7),  # CPU cache only
        (EndpointView("e", max_loras=2, gpu=F({"a"})), ("x",), 0.6),  # a GPU slot free
        (EndpointView("e", max_loras=2, gpu=F({"a", "b"}), active=F({"a"})), ("x",), 0.3),  # b idle: evictable
        (EndpointView("e", max_loras=2, gpu=F({"a", "b"}), active=F({"a", "b"})), ("x",), 0.0),  # saturated
        (EndpointView("e", max_loras=2, gpu=F({"a", "b"}), active=F({"a"}), pinned=F({"b"})), ("x",), 0.0),
        (EndpointView("e", max_loras=4, active=F({"a"})), (), 0.75),  # base: share of slots not serving
    ],
)
def test_lora_load_state_tiers(view, adapters, score):
    assert LoraLoadState()(RequestInfo("base", adapters), view, STATS) == score


def fleet(n: int, max_loras: int = 2) -> list[EndpointView]:
    return [EndpointView(f"w{i}", max_loras=max_loras) for i in range(n)]


def test_replica_counts_follow_demand_and_fit_the_slots():
    f = DemandReplicaSet(window_per_replica=10)
    f._window = [Counter({"hot": 60, "warm": 30, "rare": 10})]
    counts = f._recompute(fleet(5, max_loras=2))  # 10 slots: ceil(6)=6→5 replicas, 3, 1 = 9 ≤ 10
    assert counts == {"hot": 5, "warm": 3, "rare": 1}
    f._window = [Counter({f"a{i}": 1 for i in range(30)})]  # 30 adapters, 4 slots: scaled to 1 each
    assert set(f._recompute(fleet(2)).values()) == {1}


def test_proportional_math_matches_dynamos_own_example():
    # controller.rs test_proportional_allocation_math: loads 60/30/10, 12 slots, 5 workers.
    f = DemandReplicaSet()
    f._window = [Counter({"lora-a": 60, "lora-b": 30, "lora-c": 10})]
    counts = f._recompute([EndpointView(f"w{i}", max_loras=12 // 5 + (i < 12 % 5)) for i in range(5)])
    assert 1 <= counts["lora-c"] <= counts["lora-b"] <= counts["lora-a"] <= 5
    assert sum(counts.values()) <= 12


def test_an_adapter_without_load_is_pinned_to_its_first_replica_and_a_hot_one_spreads():
    eps = fleet(6, max_loras=1)  # 6 GPU slots
    f = DemandReplicaSet(window_per_replica=12)  # recomputes every 12 requests
    f._window = [Counter({"other": 5})]
    f._replicas = f._recompute(eps)  # the controller's last answer: "cold" had no load
    f._seen = 1  # the next request does not start a new tick
    req = RequestInfo("base", ("cold",))
    assert [e.name for e in f(req, eps, STATS)] == rendezvous_order("cold", [e.name for e in eps])[:1]
    for _ in range(20):  # one recompute, at the 12th request: "hot" has most of the load
        kept = f(RequestInfo("base", ("hot",)), eps, STATS)
    assert 1 < len(kept) < len(eps) and [e.name for e in kept] == [
        e.name for e in eps if e.name in rendezvous_order("hot", [e.name for e in eps])[: len(kept)]
    ]


@pytest.mark.parametrize("name", ["dynamo-lora-hrw", "llm-d-lora-load-state"])
def test_peers_are_selectable_and_route(name):
    eps = [EndpointView(f"w{i}", gpu=F({"x"}) if i == 2 else F(), cpu=F({"x"}) if i == 2 else F()) for i in range(4)]
    d = POLICIES[name]().schedule(RequestInfo("base", ("x",)), eps)
    assert d.endpoint.name in {e.name for e in eps}
