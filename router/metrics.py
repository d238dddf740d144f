"""Router metrics: one registry per app (no module-level collectors), exposed on /metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from lorafleet.router.tenants import Tenant

_LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


@dataclass(slots=True)
class RouterMetrics:
    registry: CollectorRegistry
    requests: Counter
    routes: Counter
    cold_loads: Counter
    load_failures: Counter
    unloads: Counter
    retries: Counter
    ejections: Counter
    added_latency: Histogram
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
    # The per-request counters' children by label values: prometheus_client's `labels()` validates
    # and locks on every call; a child, once made, is the same object for the registry's life.
    _children: dict[tuple[Any, ...], Any] = field(default_factory=dict)

    def tenant(self, tenant: Tenant) -> str:
        return tenant.name if self.tenant_names or not tenant.label else tenant.label

    def count_request(self, tenant: Tenant, adapter: str, status: str) -> None:
        label = self.tenant(tenant)
        key = (label, adapter, status)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.requests.labels(label, adapter, status)
        child.inc()

    def count_route(self, reason: str) -> None:
        child = self._children.get(reason)
        if child is None:
            child = self._children[reason] = self.routes.labels(reason)
        child.inc()

    @classmethod
    def create(cls, tenant_names: bool = False) -> RouterMetrics:
        r = CollectorRegistry()
        p = "lorafleet_router_"
        return cls(
            registry=r,
            # Adapter names are a label: bounded by the catalog, which the operator bounds.
            requests=Counter(
                p + "requests",
                "Requests by tenant (name, or opaque label without --metrics-token-file), adapter and status",
                ["tenant", "adapter", "status"],
                registry=r,
            ),
            routes=Counter(
                p + "routes", "Routing decisions by reason (hot/warm/cold/base)", ["reason"], registry=r
            ),
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
            added_latency=Histogram(
                p + "added_latency_seconds",
                "Time spent in the router (total minus upstream)",
                buckets=_LATENCY_BUCKETS,
                registry=r,
            ),
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
