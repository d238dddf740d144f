"""Router metrics: one registry per app (no module-level collectors), exposed on /metrics.

The per-request metrics (requests, routes, added latency) are counted in plain ints on the event
loop and folded into their prometheus collectors when the registry is collected (`Folded*`):
prometheus_client validates and takes a lock on every `inc` / `observe`, five calls a request.
The exposition is the same: same names, help, labels, values and `_created` times.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from lorafleet.router.tenants import Tenant

_LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class _Folded:
    """A prometheus metric (made with `registry=None`) counted in plain numbers by a subclass and
    registered in its place: collecting it folds those numbers in first (`fold`, under `_lock`)."""

    def __init__(self, metric: Counter | Histogram, registry: CollectorRegistry) -> None:
        self.metric = metric
        self._lock = threading.Lock()
        registry.register(self)

    def fold(self) -> None:
        raise NotImplementedError

    def describe(self) -> Iterable[Metric]:
        return self.metric.describe()

    def collect(self) -> Iterable[Metric]:
        self.fold()
        return self.metric.collect()


class FoldedCounter(_Folded):
    """A labelled `Counter` counted by `inc(*labels)` in plain ints, folded into it when collected.

    One thread counts (the event loop); any may collect: the counts only grow, and a collection
    adds what they grew by since the last one."""

    metric: Counter

    def __init__(self, counter: Counter, registry: CollectorRegistry) -> None:
        self.counts: dict[tuple[str, ...], int] = {}
        self._folded: dict[tuple[str, ...], int] = {}
        super().__init__(counter, registry)

    def inc(self, *labels: str) -> None:
        counts = self.counts
        n = counts.get(labels)
        if n is None:
            self.metric.labels(*labels)  # made now, so its `_created` is the first count's time
            n = 0
        counts[labels] = n + 1

    def fold(self) -> None:
        with self._lock:
            folded = self._folded
            for labels, n in list(self.counts.items()):
                grown = n - folded.get(labels, 0)
                if grown:
                    self.metric.labels(*labels).inc(grown)
                    folded[labels] = n


class FoldedHistogram(_Folded):
    """An unlabelled `Histogram` observed by `observe(amount)` (not NaN) in plain numbers, folded
    into it when collected. The sum is added up in the histogram's own order, so it is the same
    float; the folding sets the histogram's sum and bucket counts (prometheus_client's `_sum` and
    `_buckets`: `tests/router/test_metrics.py` checks the exposition against `observe`'s)."""

    metric: Histogram

    def __init__(self, histogram: Histogram, registry: CollectorRegistry) -> None:
        self.bounds = tuple(histogram._upper_bounds)
        self.buckets = [0] * len(self.bounds)
        self.sum = 0.0
        self._folded = [0] * len(self.bounds)
        super().__init__(histogram, registry)

    def observe(self, amount: float) -> None:
        self.sum += amount
        self.buckets[bisect_left(self.bounds, amount)] += 1  # the first bound >= amount, as `observe`'s

    def fold(self) -> None:
        with self._lock:
            h, folded = self.metric, self._folded
            h._sum.set(self.sum)
            for i, n in enumerate(list(self.buckets)):
                if n != folded[i]:
                    h._buckets[i].inc(n - folded[i])
                    folded[i] = n


@dataclass(slots=True)
class RouterMetrics:
    registry: CollectorRegistry
    requests: FoldedCounter
    routes: FoldedCounter
    cold_loads: Counter
    load_failures: Counter
    unloads: Counter
    retries: Counter
    ejections: Counter
    added_latency: FoldedHistogram
    store_errors: Counter
    store_up: Gauge
    store_resyncs: Counter
    ratelimit_fail_open: Counter
    ratelimited: Counter
    breaker_open: Gauge
    breaker_transitions: Counter
    index_checks: Counter
    # Tenant labels: names only where /metrics needs a token (--metrics-token-file), else the
    # tenant's opaque `label`, so an unauthenticated scrape learns no tenant names.
    tenant_names: bool = False

    def tenant(self, tenant: Tenant) -> str:
        return tenant.name if self.tenant_names or not tenant.label else tenant.label

    def count_request(self, tenant: Tenant, adapter: str, status: str) -> None:
        self.requests.inc(self.tenant(tenant), adapter, status)

    def count_route(self, reason: str) -> None:
        self.routes.inc(reason)

    @classmethod
    def create(cls, tenant_names: bool = False) -> RouterMetrics:
        r = CollectorRegistry()
        p = "lorafleet_router_"
        return cls(
            registry=r,
            # Adapter names are a label: bounded by the catalog, which the operator bounds.
            requests=FoldedCounter(Counter(
                p + "requests",
                "Requests by tenant (name, or opaque label without --metrics-token-file), adapter and status",
                ["tenant", "adapter", "status"],
                registry=None,
            ), r),
            routes=FoldedCounter(Counter(
                p + "routes", "Routing decisions by reason (hot/warm/cold/base)", ["reason"], registry=None
            ), r),
            cold_loads=Counter(
                p + "cold_loads", "Adapter loads the router asked a replica for", ["replica"], registry=r
            ),
            load_failures=Counter(
                p + "load_failures", "Adapter loads that failed or timed out", ["replica"], registry=r
            ),
            unloads=Counter(
                p + "unloads", "Adapter unloads issued by cache admission", ["replica"], registry=r
            ),
            retries=Counter(p + "retries", "Requests retried on another replica", ["reason"], registry=r),
            ejections=Counter(
                p + "ejections", "Replicas ejected after consecutive failures", ["replica"], registry=r
            ),
            added_latency=FoldedHistogram(Histogram(
                p + "added_latency_seconds",
                "Time spent in the router (total minus upstream)",
                buckets=_LATENCY_BUCKETS,
                registry=None,
            ), r),
            store_errors=Counter(
                p + "placement_store_errors",
                "Placement store (Redis) operations that failed",
                ["op"],
                registry=r,
            ),
            store_up=Gauge(
                p + "placement_store_up",
                "1 when the placement store answers, 0 when routing on the local view",
                registry=r,
            ),
            store_resyncs=Counter(
                p + "placement_store_resyncs", "Full republishes after the store came back", registry=r
            ),
            ratelimit_fail_open=Counter(
                p + "ratelimit_fail_open",
                "Rate-limit checks done by the local fallback because Redis failed",
                registry=r,
            ),
            ratelimited=Counter(
                p + "ratelimited", "Requests refused by a tenant limit", ["tenant", "limit"], registry=r
            ),
            breaker_open=Gauge(
                p + "placement_store_breaker_open",
                "1 while the Redis circuit breaker is open (Redis calls skipped, local fallbacks used)",
                registry=r,
            ),
            breaker_transitions=Counter(
                p + "placement_store_breaker_transitions",
                "Redis circuit breaker state changes, by the state entered",
                ["state"],
                registry=r,
            ),
            index_checks=Counter(
                p + "index_checks",
                "--verify-index: indexed decisions compared with the plain policy's, by result (agree/disagree)",
                ["result"],
                registry=r,
            ),
            tenant_names=tenant_names,
        )
