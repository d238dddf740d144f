"""Frequency sketch and rendezvous hashing."""

from __future__ import annotations

from collections import Counter

import pytest

from lorafleet.router.scheduling.frequency import FrequencySketch
from lorafleet.router.scheduling.hashing import bounded_load_limit, rendezvous_order


@pytest.mark.parametrize(
    ("adds", "halve_every", "expected"),
    [
        (["a", "a", "b"], 100, {"a": 2.0, "b": 1.0}),
        (["a", "a", "a", "b"], 4, {"a": 1.5, "b": 0.5}),  # halved on the 4th add
        (["a", "b", "b", "b", "b", "b"], 2, {"a": 0.125, "b": 1.625}),  # a: 1 → .5 → .25 → .125
        (["a", "b", "b", "b", "c", "c"], 3, {"a": 0.25, "b": 1.0, "c": 1.0}),  # halved twice
    ],
)
def test_sketch_ages(adds, halve_every, expected):
    s = FrequencySketch(halve_every=halve_every)
    for key in adds:
        s.add(key)
    assert {k: s.estimate(k) for k in expected} == expected


@pytest.mark.parametrize(("slots", "expected"), [(0, 50_000), (512, 51_200), (4_096, 409_600), (16_384, 1_638_400)])
def test_aging_period_follows_the_fleets_cache(slots, expected):
    s = FrequencySketch()
    s.age_with(slots, 100.0, 50_000)
    assert s.halve_every == expected


def test_policy_ages_with_the_healthy_replicas_cache():
    from lorafleet.router.scheduling.policies import lorafleet_policy
    from lorafleet.router.scheduling.types import EndpointView, RequestInfo

    p = lorafleet_policy(aging_per_slot=100.0)
    views = [EndpointView(f"r{i}", max_cpu_loras=1_000, healthy=i != 3) for i in range(8)]
    p.schedule(RequestInfo("base", ("a",)), views)
    assert p.frequency.halve_every == 700_000  # 7 healthy × 1,000 slots × 100
    p.schedule(RequestInfo("base", ("a",)), views[:2])
    assert p.frequency.halve_every == 200_000
    p.schedule(RequestInfo("base", ("a",)), views[:1])
    assert p.frequency.halve_every == 100_000
    p.schedule(RequestInfo("base", ("a",)), [EndpointView("x", max_cpu_loras=64)])
    assert p.frequency.halve_every == 50_000  # the floor: the sketch's own period


def test_halving_keeps_the_counts_order_and_the_generation():
    s = FrequencySketch(halve_every=3)
    for key in ["a", "b", "b", "c", "c", "c", "a"]:
        s.add(key)
    assert s.generation == 0 and s.unit == 4.0  # two halvings: the unit doubled twice
    assert [s.estimate(k) for k in "abc"] == [0.25 + 1.0, 0.5, 1.5]
    assert sorted("abc", key=s.count) == sorted("abc", key=s.estimate)


def test_rescale_drops_what_decayed_and_bumps_the_generation(monkeypatch):
    from lorafleet.router.scheduling import frequency

    monkeypatch.setattr(frequency, "_RESCALE_AT", 8.0)
    s = FrequencySketch(halve_every=2, min_total=0)
    for key in ["a", "b", "b", "b", "b", "b"]:  # halvings at adds 2, 4, 6: unit 8 → rescaled
        s.add(key)
    assert s.generation == 1 and s.unit == 1.0
    assert s.estimate("a") == 0.0 and s.estimate("b") == 1.625  # a (0.125) is dropped
    assert len(s) == 1 and s.share("b") == 1.0


def test_an_aging_with_many_keys_drops_the_one_offs():
    s = FrequencySketch(halve_every=40, max_keys=60)
    for i in range(39):
        s.add(f"once-{i}")
    s.add("once-39")  # the 40th add ages: 40 keys > 60 // 2, so the counts are rescaled
    assert s.generation == 1 and s.unit == 1.0 and len(s) == 40  # 0.5 each: kept
    for _ in range(40):
        s.add("hot")
    assert s.generation == 2 and len(s) == 1 and s.estimate("hot") == 20.0  # 0.25 each: dropped


def test_share_needs_enough_history():
    s = FrequencySketch(min_total=10)
    s.add("a")
    assert s.share("a") == 0.0  # one request is not "100% of traffic"
    for _ in range(9):
        s.add("b")
    assert s.share("a") == pytest.approx(0.1) and s.share("b") == pytest.approx(0.9)


def test_sketch_memory_is_bounded():
    s = FrequencySketch(max_keys=100)
    for i in range(1000):
        s.add(f"k{i}")
    assert len(s) <= 100


def test_rendezvous_moves_only_the_leavers_keys():
    nodes = [f"r{i}" for i in range(8)]
    keys = [f"adapter-{i}" for i in range(2000)]
    before = {k: rendezvous_order(k, nodes)[0] for k in keys}
    after = {k: rendezvous_order(k, [n for n in nodes if n != "r3"])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == "r3" for k in moved)
    spread = Counter(before.values())
    assert min(spread.values()) > 2000 / 8 * 0.75  # roughly even


@pytest.mark.parametrize(
    ("total", "n", "factor", "expected"), [(0, 4, 1.25, 0.3125), (7, 4, 1.25, 2.5), (0, 0, 1.0, 0.0)]
)
def test_bounded_load_limit(total, n, factor, expected):
    assert bounded_load_limit(total, n, factor) == pytest.approx(expected)
