"""The gateway's routing decision: the policy evaluated on the fleet's incremental index.

`Policy.schedule` reads an `EndpointView` of every replica: O(replicas) per request. For a
`lorafleet`-shaped policy the gateway decides with `IndexedPolicy` on `Fleet.index()` instead, which
re-reads only the replicas that changed since the last decision and looks at the candidates that
can win (`router/scheduling/indexed.py`); other policies, and the rare decision that must leave
replicas out (a retry after a failure, workers that cannot take the request), use the plain path.
The two make the same decisions (`tests/router/scheduling/test_indexed.py` on random fleets,
`tests/router/test_live_index.py` on a router in front of fake workers).

`verify`: every decision is also made by an independent plain copy of the policy (its own
frequency sketch, fed the same requests) on `Fleet.views()`, and the two are compared
(`lorafleet_router_index_checks_total{result}`); for tests and audits: it costs the plain path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Set
from dataclasses import dataclass

from prometheus_client import Counter

from lorafleet.router.fleet import Fleet
from lorafleet.router.scheduling.indexed import IndexedPolicy
from lorafleet.router.scheduling.policies import Policy
from lorafleet.router.scheduling.types import Decision, NoEndpoint, RequestInfo

log = logging.getLogger("lorafleet.router")


@dataclass(slots=True)
class Decider:
    fleet: Fleet
    policy: Policy
    indexed: IndexedPolicy | None  # None: the policy is not lorafleet-shaped (plain path only)
    shadow: Policy | None = None  # `verify`: the plain reference
    checks: Counter | None = None

    @classmethod
    def of(cls, fleet: Fleet, make_policy: Callable[[], Policy], verify: bool = False,
           checks: Counter | None = None) -> Decider:
        policy = make_policy()
        try:
            indexed: IndexedPolicy | None = IndexedPolicy.of(policy)
        except ValueError:
            indexed = None
        return cls(fleet, policy, indexed, make_policy() if verify and indexed is not None else None, checks)

    def schedule(self, req: RequestInfo, exclude: Set[str] = frozenset()) -> Decision:
        """The policy's decision over the fleet less `exclude`; NoEndpoint when none can serve."""
        if self.indexed is None or exclude:
            if self.shadow is not None:  # keep the reference's sketch in step
                try:
                    self.shadow.schedule(req, self.fleet.views(exclude))
                except NoEndpoint:
                    pass
            return self.policy.schedule(req, self.fleet.views(exclude))
        if self.shadow is None:
            return self.indexed.schedule(req, self.fleet.index())
        return self._verified(req)

    def _verified(self, req: RequestInfo) -> Decision:
        assert self.indexed is not None and self.shadow is not None
        try:
            reference: Decision | NoEndpoint = self.shadow.schedule(req, self.fleet.views())
        except NoEndpoint as exc:
            reference = exc
        try:
            decision: Decision | NoEndpoint = self.indexed.schedule(req, self.fleet.index())
        except NoEndpoint as exc:
            decision = exc
        same = summary(decision) == summary(reference)
        if self.checks is not None:
            self.checks.labels("agree" if same else "disagree").inc()
        if not same:
            log.warning("indexed decision %s differs from the plain policy's %s for %s",
                        summary(decision), summary(reference), req)
        if isinstance(decision, NoEndpoint):
            raise decision
        return decision


def summary(d: Decision | NoEndpoint) -> tuple:
    """What a decision does: where, why, what it loads and what admission says."""
    if isinstance(d, NoEndpoint):
        return ("none",)
    return (d.endpoint.name, d.reason, d.needs_load, d.admission.unload_before, d.admission.admit)
