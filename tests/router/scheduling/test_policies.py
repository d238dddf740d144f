"""Policies end to end on hand-built fleets: the decisions the gateway and the simulator act on."""

from __future__ import annotations

import pytest

from lorafleet.router.scheduling.hashing import rendezvous_order
from lorafleet.router.scheduling.policies import POLICIES, lorafleet_policy
from lorafleet.router.scheduling.types import EndpointView, NoEndpoint, RequestInfo

NAMES = ["r0", "r1", "r2", "r3"]


def fleet(**per: dict) -> list[EndpointView]:
    return [EndpointView(n, **per.get(n, {})) for n in NAMES]


@pytest.mark.parametrize(
    ("eps", "adapters", "replica", "reason", "needs_load"),
    [
        # GPU-resident beats CPU-resident beats the rendezvous home.
        (
            fleet(r2={"gpu": frozenset({"x"}), "cpu": frozenset({"x"})}, r1={"cpu": frozenset({"x"})}),
            ("x",),
            "r2",
            "hot",
            (),
        ),
        (fleet(r1={"cpu": frozenset({"x"})}), ("x",), "r1", "warm", ()),
        # Nowhere: its rendezvous home, to be loaded.
        (fleet(), ("x",), rendezvous_order("x", NAMES)[0], "cold", ("x",)),
        # Base model only.
        (fleet(), (), None, "base", ()),
        # Composed: goes where both live.
        (
            fleet(r3={"cpu": frozenset({"x", "y"})}, r0={"cpu": frozenset({"x"})}),
            ("x", "y"),
            "r3",
            "warm",
            (),
        ),
    ],
)
def test_lorafleet_decisions(eps, adapters, replica, reason, needs_load):
    d = lorafleet_policy().schedule(RequestInfo("base", adapters), eps)
    assert d.reason == reason and d.needs_load == needs_load
    if replica is not None:
        assert d.endpoint.name == replica


def test_hot_adapter_spills_past_the_bound():
    policy = lorafleet_policy()
    for _ in range(200):  # make "x" hot in the sketch
        policy.frequency.add("x")
    holder = {"gpu": frozenset({"x"}), "cpu": frozenset({"x"}), "inflight": 30}
    d = policy.schedule(RequestInfo("base", ("x",)), fleet(r0=holder))
    assert d.endpoint.name != "r0" and d.reason == "cold"


def test_rare_adapter_stays_home_under_moderate_imbalance():
    home = rendezvous_order("rare", NAMES)[0]
    loads = {n: {"inflight": 30 if n == home else 16} for n in NAMES}
    d = lorafleet_policy().schedule(RequestInfo("base", ("rare",)), fleet(**loads))
    assert d.endpoint.name == home  # 31 ≤ ⌈2.0 × 79/4⌉ = 40; plain CHWBL (⌈1.25 × 79/4⌉ = 25) would move it
    chwbl = POLICIES["chwbl"]().schedule(RequestInfo("base", ("rare",)), fleet(**loads))
    assert chwbl.endpoint.name != home


def test_unavailable_fleet_raises():
    with pytest.raises(NoEndpoint):
        lorafleet_policy().schedule(RequestInfo("base", ("x",)), [EndpointView("r0", healthy=False)])


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_only_picks_serving_replicas(name):
    eps = [
        EndpointView("r0", healthy=False),
        EndpointView("r1", model="other"),
        EndpointView("r2"),
        EndpointView("r3"),
    ]
    policy = POLICIES[name]()
    picked = {policy.schedule(RequestInfo("base", (f"a{i}",)), eps).endpoint.name for i in range(20)}
    assert picked <= {"r2", "r3"}


def test_gie_prefers_active_then_free_slot():
    eps = [
        EndpointView("r0", active=frozenset({"p", "q"}), max_loras=2),
        EndpointView("r1", active=frozenset({"x", "q"}), max_loras=2),
        EndpointView("r2", active=frozenset({"p"}), max_loras=2),
    ]
    policy = POLICIES["gie-lora-affinity"]()
    assert policy.schedule(RequestInfo("base", ("x",)), eps).endpoint.name == "r1"
    assert policy.schedule(RequestInfo("base", ("y",)), eps).endpoint.name == "r2"
