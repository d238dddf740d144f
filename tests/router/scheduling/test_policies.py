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


def test_rare_adapter_stays_where_resident_under_moderate_imbalance():
    holder = rendezvous_order("rare", NAMES)[0]
    loads = {n: {"inflight": 30 if n == holder else 16} for n in NAMES}
    loads[holder]["cpu"] = frozenset({"rare"})
    d = lorafleet_policy().schedule(RequestInfo("base", ("rare",)), fleet(**loads))
    assert d.endpoint.name == holder  # 31 ≤ ⌈2.0 × 79/4⌉ = 40; plain CHWBL (⌈1.25 × 79/4⌉ = 25) would move it
    chwbl = POLICIES["chwbl"]().schedule(RequestInfo("base", ("rare",)), fleet(**loads))
    assert chwbl.endpoint.name != holder


def busy(n_active: int, queued: int = 0, **kw) -> dict:
    """A replica whose GPU slots (max_loras=4) run `n_active` other adapters, `queued` more waiting."""
    active = frozenset(f"a{i}" for i in range(n_active))
    waiting = frozenset(f"w{i}" for i in range(queued))
    return {"active": active, "waiting_adapters": waiting, "max_loras": 4, **kw}


@pytest.mark.parametrize(
    ("per", "replica", "reason", "transient"),
    [
        # Cold adapter: the replica with most free GPU slots, not the rendezvous home.
        ({"r0": busy(3), "r1": busy(1), "r2": busy(3), "r3": busy(2)}, "r1", "cold", False),
        # Warm on r0, whose slots are full with 2 adapters already waiting (x would be 3rd over): stays.
        ({"r0": busy(4, 2, cpu=frozenset({"x"}))}, "r0", "warm", None),
        # 3 already waiting (x would be 4th over the limit): spills, and the spill copy is transient.
        (
            {"r0": busy(4, 3, cpu=frozenset({"x"})), "r1": busy(2), "r2": busy(3), "r3": busy(3)},
            "r1",
            "cold",
            True,
        ),
        # Running on r0: joins the batch however long the slot queue there.
        (
            {"r0": busy(4, 5, cpu=frozenset({"x"}), active=frozenset({"x", "a1", "a2", "a3"}))},
            "r0",
            "warm",
            None,
        ),
        # Every replica saturated: no spill, it waits at home.
        (
            {n: busy(4, 5, cpu=frozenset({"x"}) if n == "r2" else frozenset()) for n in NAMES},
            "r2",
            "warm",
            None,
        ),
    ],
)
def test_lorafleet_slot_queue(per, replica, reason, transient):
    d = lorafleet_policy().schedule(RequestInfo("base", ("x",)), fleet(**per))
    assert (d.endpoint.name, d.reason) == (replica, reason)
    if transient is not None:
        assert d.admission.admit is not transient


def test_hot_adapter_spill_copy_is_admitted():
    """Hot adapters may keep several homes: their spill copies go through admission as usual."""
    policy = lorafleet_policy()
    for _ in range(200):
        policy.frequency.add("x")
    eps = fleet(r0=busy(4, 3, cpu=frozenset({"x"})), r1=busy(2), r2=busy(3), r3=busy(3))
    d = policy.schedule(RequestInfo("base", ("x",)), eps)
    assert d.endpoint.name == "r1" and d.admission.admit


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


def test_cold_adapter_goes_where_the_cache_loses_least():
    """Fleet-wide LFU: among replicas with equal slot room, the one whose least popular idle
    resident is least popular takes the load, and the newcomer is admitted over that victim."""
    policy = lorafleet_policy()
    for key, n in {"x": 10, "popular": 50, "rare": 1}.items():
        for _ in range(n):
            policy.frequency.add(key)
    full = {"max_cpu_loras": 1}
    home = rendezvous_order("x", NAMES)[0]
    victim_of = {n: "rare" if n != home else "popular" for n in NAMES}
    # The home holds only a popular adapter; every other replica a rare one.
    eps = fleet(**{n: {**full, "cpu": frozenset({victim_of[n]})} for n in NAMES})
    d = policy.schedule(RequestInfo("base", ("x",)), eps)
    assert d.endpoint.name != home and d.reason == "cold"
    assert d.admission.admit and d.admission.unload_before == ("rare",)
