"""Filters: drop replicas that must not take the request. A filter never invents replicas."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lorafleet.router.scheduling.hashing import bounded_load_limit
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
    """

    max_over: int = 3
    name: str = "slot-queue"

    def __call__(
        self, req: RequestInfo, endpoints: Sequence[EndpointView], stats: FleetStats
    ) -> list[EndpointView]:
        kept = [
            e
            for e in endpoints
            if all(a in e.active for a in req.adapters) or e.slots_over(req.adapters) <= self.max_over
        ]
        return kept or list(endpoints)
