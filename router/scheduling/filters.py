"""Filters: drop replicas that must not take the request. A filter never invents replicas."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from lorafleet.router.scheduling.hashing import bounded_load_limit, rendezvous_order
from lorafleet.router.scheduling.types import EndpointView, FleetStats, RequestInfo


@dataclass(frozen=True, slots=True)
class Available:
    """Healthy and not ejected by the failure detector."""

    name: str = "available"

    def __call__(
        self, req: RequestInfo, endpoints: Sequence[EndpointView], stats: FleetStats
    ) -> list[EndpointView]:
        return [e for e in endpoints if e.healthy and not e.ejected]


@dataclass(frozen=True, slots=True)
class ServesModel:
    """Serves the request's base model (adapters only run on the base they were trained on)."""

    name: str = "serves-model"

    def __call__(
        self, req: RequestInfo, endpoints: Sequence[EndpointView], stats: FleetStats
    ) -> list[EndpointView]:
        return [e for e in endpoints if e.model == req.model]


@dataclass(frozen=True, slots=True)
class BoundedLoad:
    """CHWBL's bound: keep replicas whose load after this request stays ≤ ⌈factor × mean⌉.

    The mean counts only the replicas that survived the earlier filters. Never returns an empty
    list while given a non-empty one: the least-loaded replica always satisfies the bound.
    """

    factor: float = 1.25
    # Looser bound for requests whose key is not hot (share of recent traffic < `hot_share`).
    # Only hot adapters carry enough traffic to overload a replica; spilling a rare adapter away
    # from its rendezvous home just blurs each replica's slice of the catalog and the caches
    # thrash. None: `factor` for every request (plain CHWBL).
    cold_factor: float | None = None
    hot_share: float = 0.02
    name: str = "bounded-load"

    def __call__(
        self, req: RequestInfo, endpoints: Sequence[EndpointView], stats: FleetStats
    ) -> list[EndpointView]:
        if not endpoints:
            return []
        factor = self.factor
        if self.cold_factor is not None and req.share < self.hot_share:
            factor = self.cold_factor
        limit = math.ceil(bounded_load_limit(sum(e.load for e in endpoints), len(endpoints), factor))
        kept = [e for e in endpoints if e.load + 1 <= limit]
        return kept or [min(endpoints, key=lambda e: (e.load, e.name))]


@dataclass(frozen=True, slots=True)
class SlotQueue:
    """Drop replicas where the request would queue for a GPU slot behind too many adapters.

    Keeps a replica if the request's adapters all run there already or if at most `max_over`
    adapters would be over its `max_loras` (`EndpointView.slots_over`, the request's own adapter
    included). In the fleet simulation at 70% load each position costs ~200 ms of time to first
    token, against ~60 ms for a cold load elsewhere — so a warm adapter spills off a saturated
    home rather than wait there. If no replica qualifies the fleet is saturated everywhere and
    spilling would only add cold loads: all are kept.

    `full_share`: while at least this share of the replicas serving the model have every GPU slot
    taken or asked for (`FleetStats.slot_full` / `serving`), nothing spills: where some replica given
    holds the request's adapters, every replica is kept (residency then decides). The fleet is
    slot-bound then: a spill copy takes one of the few free slots, which the first loads of adapters
    held nowhere need, and adds a cold load. Measured at 64 replicas × 8,000 adapters, 90% load
    (320,000 requests, `bench/fleet_sim.py`): spill copies were 28 of 85.5 cold loads per 1k; with
    the gate at 0.5, 2.2 of 56.8, and p99 TTFT 3.7 s against 3.9 s.
    None: no gate.
    """

    max_over: int = 3
    full_share: float | None = None
    name: str = "slot-queue"

    def saturated(self, stats: FleetStats) -> bool:
        """The fleet is slot-bound: spills are off (see `full_share`)."""
        return (
            self.full_share is not None
            and stats.serving > 0
            and stats.slot_full >= self.full_share * stats.serving
        )

    def __call__(
        self, req: RequestInfo, endpoints: Sequence[EndpointView], stats: FleetStats
    ) -> list[EndpointView]:
        if req.adapters and self.saturated(stats):
            if any(all(a in e.resident for a in req.adapters) for e in endpoints):
                return list(endpoints)
        kept = [
            e
            for e in endpoints
            if all(a in e.active for a in req.adapters) or e.slots_over(req.adapters) <= self.max_over
        ]
        return kept or list(endpoints)


@dataclass(slots=True)
class DemandReplicaSet:
    """NVIDIA Dynamo's LoRA placement: each adapter on the first R replicas of its rendezvous order.

    From ai-dynamo/dynamo `lib/llm/src/lora/controller.rs` (`compute_active_replica_counts`,
    `recompute_per_lora`), `lib/llm/src/lora/routing/hrw.rs` and `lib/llm/src/lora/load_estimator.rs`:
    an adapter's load is its arrivals in a sliding window (30 s by default); an adapter with load
    gets R = ceil(its share of the load × the fleet's GPU LoRA slots), at least 1 and at most the
    replicas; if those add up to more than the slots, all are scaled to fit (floors, at least 1,
    the leftover slots to the largest remainders); an adapter without load is pinned to its first
    replica. The controller recomputes on a timer. A policy has no clock, so the window here is
    counted in requests: `window_per_replica` × the replicas (≈ 30 s of arrivals per replica at
    70% of the simulated fleet's capacity), recomputed six times per window.
    """

    window_per_replica: int = 350
    name: str = "demand-replica-set"
    _arrivals: Counter[str] = field(default_factory=Counter)  # in the window under way
    _window: list[Counter[str]] = field(default_factory=list)  # the last six sixths
    _replicas: dict[str, int] = field(default_factory=dict)  # the controller's last answer
    _seen: int = 0

    def __call__(
        self, req: RequestInfo, endpoints: Sequence[EndpointView], stats: FleetStats
    ) -> list[EndpointView]:
        if not req.adapters or not endpoints:
            return list(endpoints)
        self._arrivals[req.key] += 1
        self._seen += 1
        if self._seen % max(1, self.window_per_replica * len(endpoints) // 6) == 0:
            self._window = [*self._window[-5:], self._arrivals]
            self._arrivals = Counter()
            self._replicas = self._recompute(endpoints)
        count = self._replicas.get(req.key, 1)
        keep = set(rendezvous_order(req.key, [e.name for e in endpoints])[:count])
        return [e for e in endpoints if e.name in keep]

    def _recompute(self, endpoints: Sequence[EndpointView]) -> dict[str, int]:
        load: Counter[str] = Counter()
        for part in self._window:
            load.update(part)
        total = sum(load.values())
        slots = sum(e.max_loras for e in endpoints)
        n = len(endpoints)
        if total == 0 or slots == 0:
            return {}
        raw = {k: min(float(n), max(1.0, math.ceil(c / total * slots))) for k, c in load.items()}
        if sum(raw.values()) <= slots:
            return {k: max(1, min(n, int(c))) for k, c in raw.items()}
        scale = slots / sum(raw.values())
        scaled = {k: max(1.0, c * scale) for k, c in raw.items()}
        floored = {k: max(1, math.floor(c)) for k, c in scaled.items()}
        leftover = max(0, slots - sum(floored.values()))
        for k in sorted(scaled, key=lambda k: scaled[k] - math.floor(scaled[k]), reverse=True):
            if leftover == 0:
                break
            if floored[k] < n:
                floored[k] += 1
                leftover -= 1
        return {k: max(1, min(n, c)) for k, c in floored.items()}
