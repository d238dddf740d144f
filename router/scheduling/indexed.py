"""The `lorafleet` policy decided on a `FleetIndex`: the same decisions, looking at few replicas.

`Policy.schedule` filters and scores every replica's `EndpointView`. This evaluates the same filters
and scorers, in the same order and floating-point operations, on the candidates that can win:

1. the replicas serving the model (`FleetIndex.eligible`; their load sum gives the load bound);
2. the replicas holding the request's adapters (`FleetIndex.holders`) that pass the load bound and
   the GPU-slot queue bound: if any, they are the candidates (residency outranks everything else);
3. else the first `cold_candidates` replicas in the key's rendezvous order that pass both bounds,
   walked lazily on the `SkeletonRing`; only a fleet where no replica passes walks it all.

Base-model requests (no adapter: nothing to load, any replica will do) are scored over every
eligible replica, as `Policy.schedule` does. The tests hold this equal to `Policy.schedule` on
random fleets (`tests/router/scheduling/test_indexed.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from lorafleet.router.scheduling.admission import FrequencyAdmission
from lorafleet.router.scheduling.filters import Available, BoundedLoad, ServesModel, SlotQueue
from lorafleet.router.scheduling.fleet_index import FleetIndex, ReplicaState
from lorafleet.router.scheduling.frequency import FrequencySketch
from lorafleet.router.scheduling.hashing import bounded_load_limit, weight
from lorafleet.router.scheduling.pickers import MaxScore
from lorafleet.router.scheduling.policies import Policy, reason_for
from lorafleet.router.scheduling.scorers import (
    CacheVictim,
    HashAffinity,
    Load,
    Residency,
    SlotFree,
    SlotHeadroom,
)
from lorafleet.router.scheduling.types import AdmissionPlan, Decision, NoEndpoint, RequestInfo

_U64 = float(2**64)
_TIE = 1e-9
_SCORERS = (Residency, SlotFree, CacheVictim, SlotHeadroom, Load, HashAffinity)


@dataclass(slots=True)
class IndexedPolicy:
    """A `lorafleet`-shaped `Policy` (its filters, scorers, picker and admission) run on a `FleetIndex`.

    Build it with `IndexedPolicy.of(policy)`; it shares the policy's frequency sketch, so the two
    must not both record the same requests.
    """

    policy: Policy
    bounded: BoundedLoad
    slot_queue: SlotQueue
    k: int
    picker: MaxScore
    frequency: FrequencySketch
    admission: FrequencyAdmission | None
    name: str = "lorafleet"

    @classmethod
    def of(cls, policy: Policy) -> IndexedPolicy:
        kinds = [type(f) for f in policy.filters]
        if kinds != [Available, ServesModel, BoundedLoad, SlotQueue] or policy.cold_candidates is None:
            raise ValueError(f"policy {policy.name!r} is not lorafleet-shaped: no index for it")
        if any(not isinstance(s, _SCORERS) for _, s in policy.scorers) or not isinstance(policy.picker, MaxScore):
            raise ValueError(f"policy {policy.name!r} has a scorer or picker the index does not evaluate")
        return cls(
            policy,
            policy.filters[2],  # type: ignore[arg-type]
            policy.filters[3],  # type: ignore[arg-type]
            policy.cold_candidates,
            policy.picker,
            policy.frequency,
            policy.admission,
            policy.name,
        )

    # ---- the decision ------------------------------------------------------------------------
    def schedule(self, req: RequestInfo, index: FleetIndex) -> Decision:
        if req.adapters:
            self.frequency.add(req.key)
            index.popularity_changed(req.key)
            req = replace(req, share=self.frequency.share(req.key))
        eligible = index.eligible.get(req.model)
        if not eligible:
            raise NoEndpoint("no replica serves the model")
        limit, fallback = self._load_bound(req, index, eligible)
        reps = index.replicas

        def bounded(i: int) -> bool:
            return i == fallback if fallback is not None else reps[i].load + 1 <= limit

        if not req.adapters:
            cands = self._slot_filter(req, [i for i in eligible if bounded(i)], reps)
        else:
            holders = self._holders(req, index, eligible)
            in_bound = [i for i in holders if bounded(i)]
            cands = [i for i in in_bound if self._slot_ok(req, reps[i])]
            if not cands:
                cands = self._first_k(req, index, eligible, bounded, slots=True)
                if not cands:  # nobody passes the slot bound: the filter keeps everyone in the bound
                    cands = in_bound or self._first_k(req, index, eligible, bounded, slots=False)
        chosen = self._pick(req, index, cands)
        view = index.view(chosen)
        missing = tuple(a for a in req.adapters if a not in reps[chosen].resident)
        plan = AdmissionPlan()
        if missing and self.admission is not None:
            spill = self._is_spill(req, index, missing, chosen, eligible)
            plan = self.admission.plan(req.adapters, view, self.frequency.estimate, transient=spill)
        return Decision(view, reason_for(req, view), missing, plan)

    def _load_bound(self, req: RequestInfo, index: FleetIndex, eligible: set[int]) -> tuple[int, int | None]:
        """(ceiling on load + 1, the one replica BoundedLoad keeps when none is under it, else None)."""
        b = self.bounded
        factor = b.factor
        if b.cold_factor is not None and req.share < b.hot_share:
            factor = b.cold_factor
        total = index.model_load[req.model]
        limit = math.ceil(bounded_load_limit(total, len(eligible), factor))
        # Some replica's load is at most the mean's floor: if that passes, the bound keeps someone.
        if total // len(eligible) + 1 <= limit:
            return limit, None
        reps = index.replicas
        if any(reps[i].load + 1 <= limit for i in eligible):
            return limit, None
        return limit, min(eligible, key=lambda i: (reps[i].load, reps[i].name))

    def _slot_ok(self, req: RequestInfo, r: ReplicaState) -> bool:
        adapters = req.adapters
        if all(a in r.active for a in adapters):
            return True
        if not adapters:
            return True
        extra = sum(1 for a in set(adapters) if a not in r.active and a not in r.waiting_adapters)
        return max(0, r.busy_n + extra - r.max_loras) <= self.slot_queue.max_over

    def _slot_filter(self, req: RequestInfo, ids: list[int], reps: list[ReplicaState]) -> list[int]:
        kept = [i for i in ids if self._slot_ok(req, reps[i])]
        return kept or ids

    def _holders(self, req: RequestInfo, index: FleetIndex, eligible: set[int]) -> list[int]:
        sets = [index.holders.get(a) for a in req.adapters]
        if any(not s for s in sets):
            return []
        smallest = min(sets, key=len)  # type: ignore[arg-type]
        return [i for i in smallest if i in eligible and all(i in s for s in sets)]  # type: ignore[operator]

    def _first_k(
        self, req: RequestInfo, index: FleetIndex, eligible: set[int], bounded: Callable[[int], bool], slots: bool
    ) -> list[int]:
        out: list[int] = []
        reps = index.replicas
        for i in index.ring.walk(req.key):
            if i in eligible and bounded(i) and (not slots or self._slot_ok(req, reps[i])):
                out.append(i)
                if len(out) >= self.k:
                    break
        return out

    def _is_spill(
        self, req: RequestInfo, index: FleetIndex, missing: tuple[str, ...], chosen: int, eligible: set[int]
    ) -> bool:
        p = self.policy
        if p.replicate_share is None or req.share >= p.replicate_share:
            return False
        return any(i != chosen and i in eligible for a in missing for i in index.holders.get(a, ()))

    # ---- scoring, as the scorers compute it ------------------------------------------------------
    def _pick(self, req: RequestInfo, index: FleetIndex, cands: Iterable[int]) -> int:
        scored = [(i, self._score(req, index, i)) for i in cands]
        if not scored:
            raise NoEndpoint("no candidate replica")
        best = max(s for _, s in scored)
        reps = index.replicas
        tied = sorted((i for i, s in scored if s >= best - _TIE), key=lambda i: reps[i].name)
        if len(tied) == 1:
            return tied[0]
        self.picker._turn += 1
        return tied[self.picker._turn % len(tied)]

    def _score(self, req: RequestInfo, index: FleetIndex, i: int) -> float:
        total = 0.0
        r = index.replicas[i]
        for w, scorer in self.policy.scorers:
            total += w * min(1.0, max(0.0, self._one(scorer, req, index, r, i)))
        return total

    def _one(self, scorer: object, req: RequestInfo, index: FleetIndex, r: ReplicaState, i: int) -> float:
        adapters = req.adapters
        if isinstance(scorer, Residency):
            score = 1.0
            for a in adapters:
                tier = "gpu" if a in r.gpu else "cpu" if a in r.resident else None
                score = min(score, scorer.gpu if tier == "gpu" else scorer.cpu if tier == "cpu" else 0.0)
            return score
        if isinstance(scorer, SlotFree):
            new = sum(1 for a in adapters if a not in r.active)
            return 1.0 if len(r.active) + new <= r.max_loras else 0.0
        if isinstance(scorer, SlotHeadroom):
            if all(a in r.active for a in adapters):
                return 1.0
            taken = r.busy_n + sum(1 for a in set(adapters) if a not in r.active and a not in r.waiting_adapters)
            return max(0.0, (r.max_loras - taken) / max(1, r.max_loras))
        if isinstance(scorer, Load):
            return max(0.0, 1.0 - r.load / max(1, r.capacity))
        if isinstance(scorer, HashAffinity):
            return weight(req.key, r.name) / _U64
        if isinstance(scorer, CacheVictim):
            return self._victim(scorer, req, index, r, i)
        raise TypeError(scorer)

    def _victim(self, scorer: CacheVictim, req: RequestInfo, index: FleetIndex, r: ReplicaState, i: int) -> float:
        missing = [a for a in req.adapters if a not in r.resident]
        if not missing:
            return 1.0
        need = scorer.scratch_slots + len(missing) - (r.max_cpu_loras - len(r.resident))
        if need <= 0:
            return 1.0
        idle = index.idle_by_popularity(i, scorer.frequency, self.frequency.generation)
        own = set(req.adapters)
        if own & r.resident:
            idle = [p for p in idle if p[1] not in own]
        if len(idle) < need:
            return 0.0
        v = idle[need - 1][0]
        f = min(scorer.frequency(a) for a in missing)
        if f + v <= 0:
            return 1.0
        return f / (f + v)
