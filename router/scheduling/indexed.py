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
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np

from lorafleet.router.scheduling.admission import FrequencyAdmission
from lorafleet.router.scheduling.filters import Available, BoundedLoad, ServesModel, SlotQueue
from lorafleet.router.scheduling.fleet_index import BUSY, LOAD, MAX_LORAS, MODEL, FleetIndex, ReplicaState
from lorafleet.router.scheduling.frequency import FrequencySketch
from lorafleet.router.scheduling.hashing import bounded_load_limit, weight
from lorafleet.router.scheduling.holder_scoring import score_holders
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
from lorafleet.router.scheduling.types import AdmissionPlan, Decision, NoEndpoint, RequestInfo, Scorer

_U64 = float(2**64)
_TIE = 1e-9
# A single adapter held on more replicas than this is scored with array operations.
VECTOR_MIN = 12
_SCORERS: tuple[type, ...] = (Residency, SlotFree, CacheVictim, SlotHeadroom, Load, HashAffinity)


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
    # The scorers are lorafleet_policy's, in its order: holders get the inlined `_holder_partial`.
    _canonical: bool = False

    @classmethod
    def of(cls, policy: Policy) -> IndexedPolicy:
        kinds: list[type] = [type(f) for f in policy.filters]
        if kinds != [Available, ServesModel, BoundedLoad, SlotQueue] or policy.cold_candidates is None:
            raise ValueError(f"policy {policy.name!r} is not lorafleet-shaped: no index for it")
        if any(type(s) not in _SCORERS for _, s in policy.scorers) or not isinstance(policy.picker, MaxScore):
            raise ValueError(f"policy {policy.name!r} has a scorer or picker the index does not evaluate")
        canonical = tuple(type(sc) for _, sc in policy.scorers) == _SCORERS
        return cls(
            policy,
            policy.filters[2],  # type: ignore[arg-type]
            policy.filters[3],  # type: ignore[arg-type]
            policy.cold_candidates,
            policy.picker,
            policy.frequency,
            policy.admission,
            policy.name,
            canonical,
        )

    # ---- the decision ------------------------------------------------------------------------
    def schedule(self, req: RequestInfo, index: FleetIndex) -> Decision:
        adapters = req.adapters
        share = req.share
        if adapters:
            self.frequency.add(req.key)
            share = self.frequency.share(req.key)
        eligible = index.eligible.get(req.model)
        if not eligible:
            raise NoEndpoint("no replica serves the model")
        limit, fallback = self._load_bound(req.model, share, index, eligible)
        reps = index.replicas

        def bounded(i: int) -> bool:
            return i == fallback if fallback is not None else reps[i].load + 1 <= limit

        scored: list[tuple[int, float]] | None = None
        if not adapters:
            cands = self._slot_filter(adapters, [i for i in eligible if bounded(i)], reps)
        elif len(adapters) == 1 and len(index.holders.get(adapters[0], ())) > VECTOR_MIN:
            scored, cands = self._many_holders(req, index, limit, fallback, eligible, bounded)
        else:
            holders = self._holders(adapters, index, eligible)
            in_bound = [i for i in holders if bounded(i)]
            cands = [i for i in in_bound if self._slot_ok(adapters, reps[i])]
            if not cands:
                cands = self._first_k(req, index, eligible, bounded, slots=True)
                if not cands:  # nobody passes the slot bound: the filter keeps everyone in the bound
                    cands = in_bound or self._first_k(req, index, eligible, bounded, slots=False)
        if scored is None and len(cands) == 1:
            chosen = cands[0]  # what MaxScore picks from one, whatever its score (no turn taken)
        else:
            if scored is None:
                scored = self._scored(req, index, cands)
            chosen = self._tie_break(scored, reps)
        view = index.view(chosen)
        missing = tuple(a for a in adapters if a not in reps[chosen].resident)
        plan = AdmissionPlan()
        if missing and self.admission is not None:
            spill = self._is_spill(share, index, missing, chosen, eligible)
            plan = self._admission_plan(adapters, missing, index, chosen, spill)
        return Decision(view, reason_for(req, view), missing, plan)

    def _many_holders(
        self,
        req: RequestInfo,
        index: FleetIndex,
        limit: int,
        fallback: int | None,
        eligible: set[int],
        bounded: Callable[[int], bool],
    ) -> tuple[list[tuple[int, float]] | None, list[int]]:
        """The holders step for a popular adapter, on arrays: (scored holders, []) when some pass
        both bounds, else (None, the candidates to score instead)."""
        h = index.holder_arrays(req.adapters[0])
        assert h is not None
        rows = index.arrays.table[h.ids]
        ok = rows[:, MODEL] == index.model_codes.get(req.model, -2)
        in_bound = ok & ((rows[:, LOAD] + 1 <= limit) if fallback is None else (h.ids == fallback))
        extra = ~(h.active | h.waiting)
        over = np.maximum(0, rows[:, BUSY] + extra - rows[:, MAX_LORAS])
        sel = in_bound & (h.active | (over <= self.slot_queue.max_over))
        if sel.any():
            scored = score_holders(
                self.policy.scorers, req.key, index, h.ids[sel], rows[sel], h.gpu[sel], h.active[sel], extra[sel]
            )
            return scored, []
        cands = self._first_k(req, index, eligible, bounded, slots=True)
        if cands:
            return None, cands
        return None, h.ids[in_bound].tolist() or self._first_k(req, index, eligible, bounded, slots=False)

    def _load_bound(
        self, model: str, share: float, index: FleetIndex, eligible: set[int]
    ) -> tuple[int, int | None]:
        """(ceiling on load + 1, the one replica BoundedLoad keeps when none is under it, else None)."""
        b = self.bounded
        factor = b.factor
        if b.cold_factor is not None and share < b.hot_share:
            factor = b.cold_factor
        total = index.model_load[model]
        limit = math.ceil(bounded_load_limit(total, len(eligible), factor))
        # Some replica's load is at most the mean's floor: if that passes, the bound keeps someone.
        if total // len(eligible) + 1 <= limit:
            return limit, None
        reps = index.replicas
        if any(reps[i].load + 1 <= limit for i in eligible):
            return limit, None
        return limit, min(eligible, key=lambda i: (reps[i].load, reps[i].name))

    def _slot_ok(self, adapters: tuple[str, ...], r: ReplicaState) -> bool:
        if not adapters or all(a in r.active for a in adapters):
            return True
        extra = sum(1 for a in set(adapters) if a not in r.active and a not in r.waiting_adapters)
        return max(0, r.busy_n + extra - r.max_loras) <= self.slot_queue.max_over

    def _slot_filter(self, adapters: tuple[str, ...], ids: list[int], reps: list[ReplicaState]) -> list[int]:
        kept = [i for i in ids if self._slot_ok(adapters, reps[i])]
        return kept or ids

    def _holders(self, adapters: tuple[str, ...], index: FleetIndex, eligible: set[int]) -> list[int]:
        sets = [index.holders.get(a) for a in adapters]
        if any(not s for s in sets):
            return []
        smallest = min(sets, key=len)  # type: ignore[arg-type]
        return [i for i in smallest if i in eligible and all(i in s for s in sets)]  # type: ignore[operator, union-attr]

    def _first_k(
        self, req: RequestInfo, index: FleetIndex, eligible: set[int], bounded: Callable[[int], bool], slots: bool
    ) -> list[int]:
        out: list[int] = []
        reps = index.replicas
        for i in index.ring.walk(req.key):
            if i in eligible and bounded(i) and (not slots or self._slot_ok(req.adapters, reps[i])):
                out.append(i)
                if len(out) >= self.k:
                    break
        return out

    def _is_spill(
        self, share: float, index: FleetIndex, missing: tuple[str, ...], chosen: int, eligible: set[int]
    ) -> bool:
        p = self.policy
        if p.replicate_share is None or share >= p.replicate_share:
            return False
        return any(i != chosen and i in eligible for a in missing for i in index.holders.get(a, ()))

    def _admission_plan(
        self, adapters: tuple[str, ...], missing: tuple[str, ...], index: FleetIndex, i: int, transient: bool
    ) -> AdmissionPlan:
        """`FrequencyAdmission.plan` on the index: the victims come from the replica's popularity heap."""
        adm = self.admission
        assert adm is not None
        r = index.replicas[i]
        free = r.max_cpu_loras - len(r.resident)
        if free - len(missing) >= adm.scratch_slots and not transient:
            return AdmissionPlan(admit=True)
        freq = self.frequency.estimate
        need = adm.scratch_slots + len(missing) - free
        overflow = len(missing) - free
        victims = index.least_popular_idle(
            i, max(need, overflow, 0), freq, self.frequency.generation, frozenset(adapters)
        )
        if not transient:
            newcomer = min(freq(a) for a in missing)
            chosen: list[str] = []
            for f, name in victims[: max(0, need)]:
                if newcomer <= f * adm.margin:
                    break
                chosen.append(name)
            if len(chosen) >= need:
                return AdmissionPlan(unload_before=tuple(chosen), admit=True)
        return AdmissionPlan(unload_before=tuple(name for _, name in victims[: max(0, overflow)]), admit=False)

    # ---- scoring, as the scorers compute it ------------------------------------------------------
    def _scored(self, req: RequestInfo, index: FleetIndex, cands: list[int]) -> list[tuple[int, float]]:
        if not cands:
            raise NoEndpoint("no candidate replica")
        scorers = self.policy.scorers
        if len(cands) == 1 or not isinstance(scorers[-1][1], HashAffinity):
            return [(i, self._score(req, index, i, scorers)) for i in cands]
        # The rendezvous term (last, ≤ its weight) only decides near-ties: add it where it can matter.
        w_hash = scorers[-1][0]
        reps = index.replicas
        one = req.adapters[0] if len(req.adapters) == 1 and self._canonical else None
        partial = [
            (i, self._holder_partial(one, reps[i]))
            if one is not None and one in reps[i].resident
            else (i, self._score(req, index, i, scorers[:-1]))
            for i in cands
        ]
        cut = max(s for _, s in partial) - w_hash - 1e-6
        return [
            (i, s + w_hash * min(1.0, max(0.0, weight(req.key, reps[i].name) / _U64)))
            for i, s in partial
            if s >= cut
        ]

    def _holder_partial(self, one: str, r: ReplicaState) -> float:
        """`_score` without the rendezvous term for a replica holding the request's one adapter, with
        lorafleet_policy's scorers inlined in their order (same operations, so the same float)."""
        (w_res, res), (w_free, _), (w_victim, _), (w_head, _), (w_load, _), _ = self.policy.scorers
        active = one in r.active
        total = 0.0
        total += w_res * min(1.0, max(0.0, res.gpu if one in r.gpu else res.cpu))  # type: ignore[attr-defined]
        total += w_free * (1.0 if len(r.active) + (not active) <= r.max_loras else 0.0)
        total += w_victim * 1.0  # resident: nothing to evict
        if active:
            head = 1.0
        else:
            taken = r.busy_n + (one not in r.waiting_adapters)
            head = max(0.0, (r.max_loras - taken) / max(1, r.max_loras))
        total += w_head * min(1.0, head)
        total += w_load * max(0.0, 1.0 - r.load / max(1, r.capacity))
        return total

    def _tie_break(self, scored: list[tuple[int, float]], reps: list[ReplicaState]) -> int:
        """MaxScore's rule (and its turn counter): the best; exact ties rotate in name order."""
        best = max(s for _, s in scored)
        tied = sorted((i for i, s in scored if s >= best - _TIE), key=lambda i: reps[i].name)
        if len(tied) == 1:
            return tied[0]
        self.picker._turn += 1
        return tied[self.picker._turn % len(tied)]

    def _score(
        self, req: RequestInfo, index: FleetIndex, i: int, scorers: tuple[tuple[float, Scorer], ...]
    ) -> float:
        total = 0.0
        r = index.replicas[i]
        adapters = req.adapters
        one = adapters[0] if len(adapters) == 1 else None  # the common case, without the loops
        for w, scorer in scorers:
            kind: type = type(scorer)
            if kind is Residency:
                res = cast(Residency, scorer)
                if one is not None:
                    s = res.gpu if one in r.gpu else res.cpu if one in r.resident else 0.0
                else:
                    s = 1.0
                    for a in adapters:
                        s = min(s, res.gpu if a in r.gpu else res.cpu if a in r.resident else 0.0)
            elif kind is SlotFree:
                new = (one not in r.active) if one is not None else sum(1 for a in adapters if a not in r.active)
                s = 1.0 if len(r.active) + new <= r.max_loras else 0.0
            elif kind is CacheVictim:
                s = self._victim(scorer, adapters, index, r, i)  # type: ignore[arg-type]
            elif kind is SlotHeadroom:
                if all(a in r.active for a in adapters):
                    s = 1.0
                else:
                    taken = r.busy_n + sum(
                        1 for a in set(adapters) if a not in r.active and a not in r.waiting_adapters
                    )
                    s = max(0.0, (r.max_loras - taken) / max(1, r.max_loras))
            elif kind is Load:
                s = max(0.0, 1.0 - r.load / max(1, r.capacity))
            elif kind is HashAffinity:
                s = weight(req.key, r.name) / _U64
            else:
                raise TypeError(scorer)
            total += w * min(1.0, max(0.0, s))
        return total

    def _victim(
        self, scorer: CacheVictim, adapters: tuple[str, ...], index: FleetIndex, r: ReplicaState, i: int
    ) -> float:
        missing = [a for a in adapters if a not in r.resident]
        if not missing:
            return 1.0
        need = scorer.scratch_slots + len(missing) - (r.max_cpu_loras - len(r.resident))
        if need <= 0:
            return 1.0
        idle = index.least_popular_idle(i, need, scorer.frequency, self.frequency.generation, frozenset(adapters))
        if len(idle) < need:
            return 0.0
        v = idle[need - 1][0]
        f = min(scorer.frequency(a) for a in missing)
        if f + v <= 0:
            return 1.0
        return f / (f + v)
