"""The indexed policy decides exactly as the plain O(replicas) `Policy.schedule` (the reference).

Random fleets of every shape the filters care about (unhealthy, ejected, two base models, saturated
GPU slots, full CPU caches, pinned adapters, loads past the bound), driven through a sequence of
requests with the view changing between decisions as it does in service.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from lorafleet.router.scheduling.fleet_index import FleetIndex
from lorafleet.router.scheduling.indexed import IndexedPolicy
from lorafleet.router.scheduling.policies import chwbl_policy, lorafleet_policy
from lorafleet.router.scheduling.skeleton import SkeletonRing, group_of, skeleton_order
from lorafleet.router.scheduling.types import (
    AdmissionPlan,
    Decision,
    EndpointView,
    NoEndpoint,
    RequestInfo,
    make_decision,
    make_plan,
    make_view,
)


def random_view(rng: random.Random, name: str, pool: list[str], busy_fleet: bool) -> EndpointView:
    max_loras = rng.randint(2, 6)
    max_cpu = rng.randint(3, 10)
    resident = set(rng.sample(pool, rng.randint(0, min(max_cpu, len(pool)))))
    gpu = set(rng.sample(sorted(resident), min(len(resident), rng.randint(0, max_loras))))
    active = set(rng.sample(sorted(gpu), rng.randint(0, len(gpu))))
    waiting = set(rng.sample(pool, rng.randint(0, 3 if busy_fleet else 1)))
    running = rng.randint(0, 40 if busy_fleet else 8)
    return EndpointView(
        name=name,
        model="m2" if rng.random() < 0.1 else "base",
        healthy=rng.random() > 0.05,
        ejected=rng.random() < 0.05,
        gpu=frozenset(gpu),
        cpu=frozenset(resident - gpu if rng.random() < 0.3 else resident),
        active=frozenset(active),
        waiting_adapters=frozenset(waiting),
        running=running,
        waiting=rng.randint(0, 5),
        inflight=rng.randint(0, running + 6),
        max_loras=max_loras,
        max_cpu_loras=max_cpu,
        capacity=rng.choice([8, 16, 64]),
        pinned=frozenset(rng.sample(sorted(resident), min(1, len(resident)))) if rng.random() < 0.2 else frozenset(),
    )


def random_request(rng: random.Random, pool: list[str]) -> RequestInfo:
    u = rng.random()
    model = "m2" if u < 0.05 else "base"
    if u < 0.1:
        return RequestInfo(model)
    n = 2 if u > 0.93 else 1
    weights = [1 / (i + 1) ** 1.1 for i in range(len(pool))]
    return RequestInfo(model, tuple(dict.fromkeys(rng.choices(pool, weights, k=n))))


def perturb(rng: random.Random, index: FleetIndex, chosen: int, req: RequestInfo, pool: list[str]) -> None:
    """What service does between decisions: the request starts; now and then residency and load move."""
    r = index.replicas[chosen]
    index.set_counts(chosen, r.running, r.waiting, r.inflight + 1)
    for a in req.adapters:
        index.set_tier(chosen, a, "gpu" if rng.random() < 0.5 else "cpu")
        index.set_active(chosen, a, True)
    i = rng.choice(sorted(index.ids.values()))
    r = index.replicas[i]
    op = rng.random()
    if op < 0.3:
        index.set_tier(i, rng.choice(pool), rng.choice(["gpu", "cpu", None]))
    elif op < 0.5 and r.active:
        index.set_active(i, rng.choice(sorted(r.active)), False)
    elif op < 0.6:
        index.set_waiting_adapter(i, rng.choice(pool), rng.random() < 0.5)
    elif op < 0.8:
        index.set_counts(i, max(0, r.running - 1), r.waiting, max(0, r.inflight - 2))
    elif op < 0.85 and i != 0:
        index.set_health(i, healthy=rng.random() < 0.8, ejected=rng.random() < 0.2)


def same(a, b) -> tuple:
    return (a.endpoint.name, a.reason, a.needs_load, a.admission)


# 2: most popular adapters' holders are drawn (and some draws leave none, falling back to all)
@pytest.mark.parametrize("holder_sample", [None, 2, 8])
@pytest.mark.parametrize("seed", range(24))
def test_indexed_decisions_equal_the_reference(seed, holder_sample):
    rng = random.Random(seed)
    n = rng.choice([1, 3, 8, 20, 45])
    k = rng.choice([1, 2, 3, 8])
    pool = [f"a{i}" for i in range(rng.choice([6, 30, 120]))]
    busy = rng.random() < 0.5
    views = [random_view(rng, f"r{i}", pool, busy) for i in range(n)]
    views[0] = dataclasses.replace(views[0], healthy=True, ejected=False, model="base")  # one always serves
    index = FleetIndex.of(views)
    # the slot-bound gate on spills: off, and at shares the random fleets cross both ways
    gate = {"spill_full_share": [None, 0.2, 0.5, 0.9][seed % 4]}
    reference = lorafleet_policy(cold_candidates=k, holder_sample=holder_sample, **gate)
    indexed = IndexedPolicy.of(lorafleet_policy(cold_candidates=k, holder_sample=holder_sample, **gate))
    for p in (reference, indexed.policy):
        # ages during the run: cached popularity orders go stale. Every 40 requests, or (two seeds
        # in three) every 40 / (the start's healthy CPU slots) requests per healthy CPU slot: ~40,
        # moved by the health changes between decisions.
        p.frequency.halve_every = 40
        p.aging_per_slot = None if seed % 3 == 0 else 40 / index.cpu_slots
        p.aging_floor = 5
        p.frequency.min_total = 5.0  # shares count early: hot and cold load bounds both in play
    decided = 0
    for _ in range(150):
        req = random_request(rng, pool)
        views = index.views()
        try:
            want = reference.schedule(req, views)
        except NoEndpoint:
            with pytest.raises(NoEndpoint):
                indexed.schedule(req, index)
            continue
        got = indexed.schedule(req, index)
        assert same(got, want) == same(want, want), (req, [v.name for v in views])
        assert got.endpoint == want.endpoint
        decided += 1
        perturb(rng, index, index.ids[got.endpoint.name], req, pool)
        for r in index.replicas:  # kept incrementally: GPU slots taken or asked for
            assert r.busy_n == len(r.active | r.waiting_adapters)
        assert index.cpu_slots == sum(v.max_cpu_loras for v in index.views() if v.healthy and not v.ejected)
        for model, ids in index.eligible.items():  # and the slot-full replicas serving each model
            full = sum(index.replicas[i].busy_n >= index.replicas[i].max_loras for i in ids)
            assert index.model_full.get(model, 0) == full
    assert decided > 50


@pytest.mark.parametrize("seed", range(3))
def test_indexed_decisions_equal_the_reference_on_a_larger_fleet(seed):
    """200 replicas: the ring's groups have several members, so a cold adapter's candidates come
    from ranking them (`SkeletonRing.ranked`), often across two groups when bounds drop some."""
    rng = random.Random(100 + seed)
    pool = [f"a{i}" for i in range(600)]
    views = [random_view(rng, f"r{i}", pool, busy_fleet=seed == 1) for i in range(200)]
    views[0] = dataclasses.replace(views[0], healthy=True, ejected=False, model="base")
    index = FleetIndex.of(views)
    scratch = {"scratch_slots": seed % 2}  # a slot kept free: admission and the victim term need two
    reference = lorafleet_policy(**scratch)
    indexed = IndexedPolicy.of(lorafleet_policy(**scratch))
    for p in (reference, indexed.policy):
        p.frequency.min_total = 5.0
    cold = 0
    for _ in range(120):
        req = random_request(rng, pool)
        try:
            want = reference.schedule(req, index.views())
        except NoEndpoint:
            with pytest.raises(NoEndpoint):
                indexed.schedule(req, index)
            continue
        got = indexed.schedule(req, index)
        assert same(got, want) == same(want, want), req
        assert got.endpoint == want.endpoint
        cold += got.reason == "cold"
        perturb(rng, index, index.ids[got.endpoint.name], req, pool)
    assert cold > 20


def test_positional_maker_builds_what_the_constructor_builds():
    view = EndpointView("r1", "m", True, False, frozenset({"a"}), frozenset({"a", "b"}), frozenset({"a"}),
                        frozenset(), 3, 1, 5, 4, 8, 16, frozenset({"b"}))  # fmt: skip
    values = [getattr(view, f.name) for f in dataclasses.fields(EndpointView)]
    made = make_view(*values)
    assert type(made) is EndpointView and made == view and hash(made) == hash(view)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.running = 4  # type: ignore[misc]
    plan = make_plan(("x",), False)
    assert plan == AdmissionPlan(unload_before=("x",), admit=False)
    assert make_decision(made, "cold", ("c",), plan) == Decision(view, "cold", ("c",), plan)


def test_small_fleet_scores_every_replica_as_before():
    """With no more replicas than `cold_candidates`, narrowing changes nothing."""
    rng = random.Random(7)
    pool = [f"a{i}" for i in range(40)]
    for _ in range(30):
        views = [random_view(rng, f"r{i}", pool, busy_fleet=True) for i in range(8)]
        req = random_request(rng, pool)
        try:
            want = lorafleet_policy(cold_candidates=None).schedule(req, views)
        except NoEndpoint:
            continue
        assert same(lorafleet_policy(cold_candidates=8).schedule(req, views), want) == same(want, want)


def test_other_policies_have_no_index():
    with pytest.raises(ValueError, match="not lorafleet-shaped"):
        IndexedPolicy.of(chwbl_policy())


@pytest.mark.parametrize("n", [1, 5, 33, 200, 600])  # 600: groups past _SMALL_GROUP (numpy)
def test_ring_walk_is_the_skeleton_order_through_churn(n):
    rng = random.Random(n)
    names = [f"replica-{i}" for i in range(n)]
    ring = SkeletonRing()
    for i, name in enumerate(names):
        ring.add(name, i)
    for _ in range(3):
        for key in [f"k{j}" for j in range(20)]:
            assert [names[i] for i in ring.walk(key)] == skeleton_order(key, [names[i] for i in ring_ids(ring)])
        if len(ring) > 1:
            ring.remove(names[rng.choice(ring_ids(ring))])


def ring_ids(ring: SkeletonRing) -> list[int]:
    return sorted(i for g in ring._groups.values() for i in g.ids)


def test_skeleton_order_spreads_first_choices_evenly_and_moves_few_keys_on_churn():
    names = [f"r{i}" for i in range(64)]
    keys = [f"adapter-{j}" for j in range(6400)]
    first = {k: skeleton_order(k, names)[0] for k in keys}
    counts = {n: 0 for n in names}
    for v in first.values():
        counts[v] += 1
    assert max(counts.values()) < 2.0 * 100 and min(counts.values()) > 0.4 * 100
    after = {k: skeleton_order(k, names[:-1])[0] for k in keys}  # r63 leaves
    moved = [k for k in keys if first[k] != after[k]]
    # r63's keys move, and some of its group's (the group is lighter now): about 2/n of all keys,
    # against 1/n for flat rendezvous; no key moves between two other groups.
    assert all(group_of(first[k]) == group_of("r63") for k in moved)
    assert all(k in moved for k in keys if first[k] == "r63")
    assert len(moved) < 3 * len(keys) / len(names)


@pytest.mark.parametrize("seed", range(6))
def test_least_popular_idle_is_the_sorted_idle_residents_through_churn(seed):
    """The popularity heap (busy residents parked off it, lower-bound entries, dead tops popped)
    answers as sorting the idle residents by estimate would, whatever happened since it was built."""
    from lorafleet.router.scheduling.frequency import FrequencySketch

    rng = random.Random(seed)
    pool = [f"a{i}" for i in range(40)]
    sketch = FrequencySketch(halve_every=rng.choice([7, 50, 1000]), max_keys=rng.choice([30, 1000]))
    index = FleetIndex()
    i = index.upsert("r0", max_cpu_loras=20)
    for _ in range(600):
        op = rng.random()
        a = rng.choice(pool)
        if op < 0.35:
            sketch.add(a)
        elif op < 0.55:
            index.set_tier(i, a, rng.choice(["gpu", "cpu", None]))
        elif op < 0.7:
            index.set_active(i, a, rng.random() < 0.5)
        elif op < 0.8:
            index.set_waiting_adapter(i, a, rng.random() < 0.5)
        elif op < 0.85:
            index.set_pinned(i, a, rng.random() < 0.3)
        else:
            r = index.replicas[i]
            m = rng.randint(1, 4)
            exclude = frozenset(rng.sample(pool, rng.randint(0, 2)))
            busy = r.active | r.waiting_adapters | r.pinned | exclude
            want = sorted((sketch.estimate(x), x) for x in r.resident if x not in busy)[:m]
            top = index.idle_top(i, sketch)  # None where the heap's top needs work first
            idle = sorted((sketch.estimate(x), x) for x in r.resident if x not in r.active | r.waiting_adapters | r.pinned)
            assert top is None or top == idle[0]
            assert index.least_popular_idle(i, m, sketch, exclude) == want
