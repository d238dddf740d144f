"""The per-request metrics counted in plain numbers (`FoldedCounter`, `FoldedHistogram`) expose
what prometheus_client's own `inc` / `observe` would, folded at every collection."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from lorafleet.router.metrics import FoldedCounter, FoldedHistogram, RouterMetrics
from lorafleet.router.tenants import Tenant

BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


def _without_created(text: bytes) -> list[str]:
    return [line for line in text.decode().splitlines() if "_created" not in line]


def test_folded_metrics_expose_what_prometheus_would() -> None:
    direct, folded = CollectorRegistry(), CollectorRegistry()
    c_direct = Counter("c", "a counter", ["a", "b"], registry=direct)
    h_direct = Histogram("h", "a histogram", buckets=BUCKETS, registry=direct)
    c = FoldedCounter(Counter("c", "a counter", ["a", "b"], registry=None), folded)
    h = FoldedHistogram(Histogram("h", "a histogram", buckets=BUCKETS, registry=None), folded)
    rng = random.Random(7)
    for step in range(3):  # collected between rounds: each fold adds only what came since
        for _ in range(500):
            labels = (rng.choice("xyz"), rng.choice(("200", "503")))
            c_direct.labels(*labels).inc()
            c.inc(*labels)
            amount = rng.choice((0.0, 0.0002, 0.0003, 2.0, rng.expovariate(2000.0)))
            h_direct.observe(amount)
            h.observe(amount)
        assert _without_created(generate_latest(folded)) == _without_created(generate_latest(direct)), step
    assert folded.get_sample_value("h_sum") == direct.get_sample_value("h_sum")  # the same float


def test_router_metrics_keep_their_names_and_order() -> None:
    m = RouterMetrics.create()
    m.count_request(Tenant(name="t", label="L"), "a", "200")
    m.count_route("hot")
    m.added_latency.observe(0.0001)
    assert m.registry.get_sample_value("lorafleet_router_requests_total",
                                       {"tenant": "L", "adapter": "a", "status": "200"}) == 1.0
    assert m.registry.get_sample_value("lorafleet_router_routes_total", {"reason": "hot"}) == 1.0
    assert m.registry.get_sample_value("lorafleet_router_added_latency_seconds_bucket", {"le": "0.0002"}) == 1.0
    assert m.registry.get_sample_value("lorafleet_router_requests_created",
                                       {"tenant": "L", "adapter": "a", "status": "200"}) is not None
    names = [line.split()[2] for line in generate_latest(m.registry).decode().splitlines()
             if line.startswith("# HELP") and not line.split()[2].endswith("_created")]
    assert names[:3] == ["lorafleet_router_requests_total", "lorafleet_router_routes_total",
                         "lorafleet_router_cold_loads_total"]
    assert names.index("lorafleet_router_added_latency_seconds") == 7
