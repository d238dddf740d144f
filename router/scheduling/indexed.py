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

import numpy as np

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
# A single adapter held on more replicas than this is scored with array operations.
VECTOR_MIN = 12
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

        chosen: int | None = None
        if not req.adapters:
            cands = self._slot_filter(req, [i for i in eligible if bounded(i)], reps)
        elif len(req.adapters) == 1 and len(index.holders.get(req.adapters[0], ())) > VECTOR_MIN:
            chosen, cands = self._many_holders(req, index, limit, fallback, eligible, bounded)
        else:
            holders = self._holders(req, index, eligible)
            in_bound = [i for i in holders if bounded(i)]
            cands = [i for i in in_bound if self._slot_ok(req, reps[i])]
            if not cands:
                cands = self._first_k(req, index, eligible, bounded, slots=True)
                if not cands:  # nobody passes the slot bound: the filter keeps everyone in the bound
                    cands = in_bound or self._first_k(req, index, eligible, bounded, slots=False)
        if chosen is None:
            chosen = self._pick(req, index, cands)
        view = index.view(chosen)
        missing = tuple(a for a in req.adapters if a not in reps[chosen].resident)
        plan = AdmissionPlan()
        if missing and self.admission is not None:
            spill = self._is_spill(req, index, missing, chosen, eligible)
            plan = self.admission.plan(req.adapters, view, self.frequency.estimate, transient=spill)
        return Decision(view, reason_for(req, view), missing, plan)

    def _many_holders(
        self,
        req: RequestInfo,
        index: FleetIndex,
        limit: int,
        fallback: int | None,
        eligible: set[int],
        bounded: Callable[[int], bool],
    ) -> tuple[int | None, list[int]]:
        """The holders path of `schedule` for a popular adapter, on arrays: (chosen, []) when a holder
        wins, else (None, the cold candidates)."""
        h = index.holder_arrays(req.adapters[0])
        assert h is not None
        arr = index.arrays
        ids = h.ids
        ok = arr.model[ids] == index.model_codes.get(req.model, -2)
        in_bound = ok & ((arr.load[ids] + 1 <= limit) if fallback is None else (ids == fallback))
        extra = ~(h.active | h.waiting)
        over = np.maximum(0, arr.busy[ids] + extra - arr.max_loras[ids])
        sel = in_bound & (h.active | (over <= self.slot_queue.max_over))
        if sel.any():
            return self._pick_holders(req, index, ids[sel], h.gpu[sel], h.active[sel], extra[sel]), []
        cands = self._first_k(req, index, eligible, bounded, slots=True)
        if cands:
            return None, cands
        kept = ids[in_bound].tolist()
        return None, kept or self._first_k(req, index, eligible, bounded, slots=False)

    def _pick_holders(
        self, req: RequestInfo, index: FleetIndex, c: np.ndarray, gpu: np.ndarray, act: np.ndarray, extra: np.ndarray
    ) -> int:
        """`_pick` over holders of one adapter: the scorers' arithmetic, element-wise, in their order."""
        arr = index.arrays
        total = np.zeros(len(c))
        scorers = self.policy.scorers
        hash_last = isinstance(scorers[-1][1], HashAffinity)
        for w, scorer in scorers[:-1] if hash_last else scorers:
            if isinstance(scorer, Residency):
                s = np.where(gpu, scorer.gpu, scorer.cpu)
            elif isinstance(scorer, SlotFree):
                s = (arr.n_active[c] + ~act <= arr.max_loras[c]).astype(np.float64)
            elif isinstance(scorer, CacheVictim):
                s = np.ones(len(c))  # resident: nothing to evict
            elif isinstance(scorer, SlotHeadroom):
                maxl = arr.max_loras[c]
                s = np.where(act, 1.0, np.maximum(0.0, (maxl - (arr.busy[c] + extra)) / np.maximum(1, maxl)))
            elif isinstance(scorer, Load):
                s = np.maximum(0.0, 1.0 - arr.load[c] / np.maximum(1, arr.capacity[c]))
            elif isinstance(scorer, HashAffinity):
                s = np.array([weight(req.key, index.replicas[i].name) / _U64 for i in c.tolist()])
            else:
                raise TypeError(scorer)
            total = total + w * np.minimum(1.0, np.maximum(0.0, s))
        reps = index.replicas
        if hash_last:
            # The rendezvous term adds at most its weight: only replicas within it of the best can win.
            w_hash = scorers[-1][0]
            near = np.nonzero(total >= total.max() - w_hash - 1e-6)[0].tolist()
            scored = [
                (i, float(total[j]) + w_hash * min(1.0, max(0.0, weight(req.key, reps[i].name) / _U64)))
                for j, i in ((j, int(c[j])) for j in near)
            ]
        else:
            scored = list(zip(c.tolist(), total.tolist(), strict=True))
        return self._tie_break(scored, reps)

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
        return self._tie_break(scored, index.replicas)

    def _tie_break(self, scored: list[tuple[int, float]], reps: list[ReplicaState]) -> int:
        """MaxScore's rule (and its turn counter): the best; exact ties rotate in name order."""
        best = max(s for _, s in scored)
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
