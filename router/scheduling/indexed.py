"""The `lorafleet` policy decided on a `FleetIndex`: the same decisions, looking at few replicas.

`Policy.schedule` filters and scores every replica's `EndpointView`. This evaluates the same filters
and scorers, in the same order and floating-point operations, on the candidates that can win:

1. the replicas serving the model (`FleetIndex.eligible`; their load sum gives the load bound);
2. the replicas holding the request's adapters (`FleetIndex.holders`) that pass the load bound and
   the GPU-slot queue bound: if any, they are the candidates (residency outranks everything else).
   Where more than `holder_sample` replicas hold them, the policy's draw of that many
   (`FleetIndex.holder_names`, the same draw from the same generator) comes first;
3. else the first `cold_candidates` replicas in the key's rendezvous order that pass both bounds,
   walked lazily on the `SkeletonRing`; only a fleet where no replica passes walks it all.

So a decision costs O(holder_sample + cold_candidates), whatever the fleet's size. Base-model
requests (no adapter: nothing to load, any replica will do) are scored over every eligible replica,
as `Policy.schedule` does. The tests hold this equal to `Policy.schedule` on random fleets
(`tests/router/scheduling/test_indexed.py`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import cast

from lorafleet.router.scheduling.admission import FrequencyAdmission
from lorafleet.router.scheduling.filters import Available, BoundedLoad, ServesModel, SlotQueue
from lorafleet.router.scheduling.fleet_index import FleetIndex, ReplicaState
from lorafleet.router.scheduling.frequency import FrequencySketch
from lorafleet.router.scheduling.hashing import bounded_load_limit, weight
from lorafleet.router.scheduling.pickers import MaxScore
from lorafleet.router.scheduling.policies import Policy, draw
from lorafleet.router.scheduling.scorers import (
    CacheVictim,
    HashAffinity,
    Load,
    Residency,
    SlotFree,
    SlotHeadroom,
)
from lorafleet.router.scheduling.types import AdmissionPlan, Decision, NoEndpoint, Reason, RequestInfo, Scorer

_U64 = float(2**64)
_TIE = 1e-9
_SCORERS: tuple[type, ...] = (Residency, SlotFree, CacheVictim, SlotHeadroom, Load, HashAffinity)
_NO_PLAN = AdmissionPlan()
_ADMIT = AdmissionPlan(admit=True)


@dataclass(slots=True)
class IndexedPolicy:
    """A `lorafleet`-shaped `Policy` (its filters, scorers, picker and admission) run on a `FleetIndex`.

    Build it with `IndexedPolicy.of(policy)`; it shares the policy's frequency sketch and random
    generator, so the two must not both decide the same requests.
    """

    policy: Policy
    bounded: BoundedLoad
    slot_queue: SlotQueue
    k: int
    picker: MaxScore
    frequency: FrequencySketch
    admission: FrequencyAdmission | None
    name: str = "lorafleet"
    # The scorers are lorafleet_policy's, in its order: single-adapter requests get the inlined
    # `_partial`, with each term's weight × clamped score where that is a constant (`_terms`).
    _canonical: bool = False
    _terms: tuple[float, ...] = ()
    _scratch: int = 0  # the cache-victim scorer's scratch slots

    @classmethod
    def of(cls, policy: Policy) -> IndexedPolicy:
        kinds: list[type] = [type(f) for f in policy.filters]
        if kinds != [Available, ServesModel, BoundedLoad, SlotQueue] or not policy.cold_candidates:
            raise ValueError(f"policy {policy.name!r} is not lorafleet-shaped: no index for it")
        if any(type(s) not in _SCORERS for _, s in policy.scorers) or not isinstance(policy.picker, MaxScore):
            raise ValueError(f"policy {policy.name!r} has a scorer or picker the index does not evaluate")
        for _, s in policy.scorers:
            # The index keeps residents ordered by the policy's own sketch.
            if isinstance(s, CacheVictim) and s.frequency != policy.frequency.estimate:
                raise ValueError(f"policy {policy.name!r}: its cache-victim scorer reads another sketch")
        canonical = tuple(type(sc) for _, sc in policy.scorers) == _SCORERS
        terms: tuple[float, ...] = ()
        scratch = 0
        if canonical:
            (w_res, res), (w_free, _), (w_victim, victim), (w_head, _), (w_load, _), _ = policy.scorers
            scratch = cast(CacheVictim, victim).scratch_slots
            gpu, cpu = cast(Residency, res).gpu, cast(Residency, res).cpu
            terms = (
                w_res * _clamp(gpu), w_res * _clamp(cpu), w_res * _clamp(0.0),
                w_free * 1.0, w_free * 0.0, w_victim, w_victim * 1.0, w_head, w_head * 1.0, w_load,
            )  # fmt: skip
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
            terms,
            scratch,
        )

    # ---- the decision ------------------------------------------------------------------------
    def schedule(self, req: RequestInfo, index: FleetIndex) -> Decision:
        adapters = req.adapters
        share = req.share
        key = req.key
        if adapters:
            self.frequency.add(key)
            share = self.frequency.share(key)
        eligible = index.eligible.get(req.model)
        if not eligible:
            raise NoEndpoint("no replica serves the model")
        limit, fallback = self._load_bound(req.model, share, index, eligible)
        reps = index.replicas

        def bounded(i: int) -> bool:
            return i == fallback if fallback is not None else reps[i].load + 1 <= limit

        holding = True
        if not adapters:
            cands = self._slot_filter(adapters, [i for i in eligible if bounded(i)], reps)
        else:
            cands, holding = self._candidates(req, key, index, eligible, limit, fallback, bounded)
        if len(cands) == 1:
            chosen = cands[0]  # what MaxScore picks from one, whatever its score (no turn taken)
        else:
            chosen = self._tie_break(self._scored(req, key, index, cands, holding), reps)
        r = reps[chosen]
        resident = r.resident
        if len(adapters) == 1:
            missing: tuple[str, ...] = () if adapters[0] in resident else adapters
        else:
            missing = tuple(a for a in adapters if a not in resident)
        plan = _NO_PLAN
        if missing and self.admission is not None:
            spill = self._is_spill(share, index, missing, chosen, eligible)
            plan = self._admission_plan(adapters, missing, index, chosen, spill)
        return Decision(index.view(chosen), _reason(adapters, r), missing, plan)

    def _candidates(
        self,
        req: RequestInfo,
        key: str,
        index: FleetIndex,
        eligible: set[int],
        limit: int,
        fallback: int | None,
        bounded: Callable[[int], bool],
    ) -> tuple[list[int], bool]:
        """(the replicas to score, whether they hold the request's adapters): what the filters and
        `Policy._narrow` leave, evaluated on the holders (or a draw of them) and the ring."""
        adapters = req.adapters
        reps = index.replicas
        k = self.policy.holder_sample
        held: Collection[int]
        if len(adapters) == 1:
            held = index.holders.get(adapters[0], ())
            names = index.holder_names.get(adapters[0], [])
        else:
            held = self._holders(adapters, index)
            names = sorted(reps[i].name for i in held) if k is not None and len(held) > k else []
        drawn: list[int] | None = None
        if k is not None and len(held) > k:
            ids = index.ids
            drawn = [ids[names[j]] for j in draw(self.policy.rng, len(names), k)]
            cands = self._passing(adapters, drawn, reps, eligible, limit, fallback)
            if cands:
                return cands, True
        cands = self._passing(adapters, held, reps, eligible, limit, fallback)
        if cands:
            return cands, True
        cands = self._passing(adapters, index.ring.walk(key), reps, eligible, limit, fallback, self.k)
        if cands:
            return cands, False
        # No replica in the bound has room in its GPU-slot queue: the slot filter keeps them all.
        if drawn is not None:
            cands = [i for i in drawn if i in eligible and bounded(i)]
            if cands:
                return cands, True
        cands = [i for i in held if i in eligible and bounded(i)]
        if cands:
            return cands, True
        return self._first_k(key, index, eligible, bounded), False

    def _passing(
        self,
        adapters: tuple[str, ...],
        ids: Iterable[int],
        reps: list[ReplicaState],
        eligible: set[int],
        limit: int,
        fallback: int | None,
        k: int = 0,
    ) -> list[int]:
        """Those of `ids` that serve the model and pass the load bound and the GPU-slot queue bound;
        the first `k` of them if `k`."""
        if len(adapters) != 1:
            kept = (
                i for i in ids
                if i in eligible and (i == fallback if fallback is not None else reps[i].load + 1 <= limit)
                and self._slot_ok(adapters, reps[i])
            )  # fmt: skip
            return list(itertools.islice(kept, k)) if k else list(kept)
        a = adapters[0]
        max_over = self.slot_queue.max_over
        out = []
        for i in ids:
            if i not in eligible:
                continue
            r = reps[i]
            if (i != fallback) if fallback is not None else (r.load + 1 > limit):
                continue
            if a not in r.active:
                over = r.busy_n + (a not in r.waiting_adapters) - r.max_loras
                if (over if over > 0 else 0) > max_over:
                    continue
            out.append(i)
            if len(out) == k:
                break
        return out

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
        if len(adapters) == 1:
            a = adapters[0]
            if a in r.active:
                return True
            extra = 0 if a in r.waiting_adapters else 1
        else:
            if not adapters or all(a in r.active for a in adapters):
                return True
            extra = sum(1 for a in set(adapters) if a not in r.active and a not in r.waiting_adapters)
        return max(0, r.busy_n + extra - r.max_loras) <= self.slot_queue.max_over

    def _slot_filter(self, adapters: tuple[str, ...], ids: list[int], reps: list[ReplicaState]) -> list[int]:
        kept = [i for i in ids if self._slot_ok(adapters, reps[i])]
        return kept or ids

    def _holders(self, adapters: tuple[str, ...], index: FleetIndex) -> list[int]:
        """Every replica present holding all of `adapters` (eligible or not)."""
        sets = [index.holders.get(a) for a in adapters]
        if any(not s for s in sets):
            return []
        smallest = min(sets, key=len)  # type: ignore[arg-type]
        return [i for i in smallest if all(i in s for s in sets)]  # type: ignore[operator, union-attr]

    def _first_k(self, key: str, index: FleetIndex, eligible: set[int], bounded: Callable[[int], bool]) -> list[int]:
        """The key's first `k` replicas in rendezvous order that serve the model and pass the load bound."""
        out: list[int] = []
        for i in index.ring.walk(key):
            if i in eligible and bounded(i):
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
            return _ADMIT
        need = adm.scratch_slots + len(missing) - free
        overflow = len(missing) - free
        victims = index.least_popular_idle(i, max(need, overflow, 0), self.frequency, frozenset(adapters))
        if not transient:
            freq = self.frequency.estimate
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
    def _scored(
        self, req: RequestInfo, key: str, index: FleetIndex, cands: list[int], holding: bool
    ) -> list[tuple[int, float]]:
        if not cands:
            raise NoEndpoint("no candidate replica")
        scorers = self.policy.scorers
        if not isinstance(scorers[-1][1], HashAffinity):
            return [(i, self._score(req, index, i, scorers)) for i in cands]
        # The rendezvous term (last, ≤ its weight) only decides near-ties: add it where it can matter.
        w_hash = scorers[-1][0]
        reps = index.replicas
        if len(req.adapters) == 1 and self._canonical:
            one = req.adapters[0]
            if holding:
                partial = [(i, self._partial(one, index, i, True)) for i in cands]
            else:
                partial = self._cold_partials(one, index, cands, w_hash)
        else:
            partial = [(i, self._score(req, index, i, scorers[:-1])) for i in cands]
        cut = max(s for _, s in partial) - w_hash - 1e-6
        return [
            (i, s + w_hash * min(1.0, max(0.0, weight(key, reps[i].name) / _U64)))
            for i, s in partial
            if s >= cut
        ]

    def _partial(self, one: str, index: FleetIndex, i: int, resident: bool) -> float:
        """`_score` without the rendezvous term for a one-adapter request, with lorafleet_policy's
        scorers inlined in their order: the same terms added in the same order, so the same float.
        Clamps are left out where the score is in [0, 1] already (counts are never negative), and
        `x if x > 0.0 else 0.0` is `max(0.0, x)` without the call.
        `resident`: the adapter is resident on replica `i`."""
        c_gpu, c_cpu, c_none, c_free, c_full, w_victim, c_victim, w_head, c_head, w_load = self._terms
        r = index.replicas[i]
        active = r.active
        running = one in active
        if resident:
            total = 0.0 + (c_gpu if one in r.gpu else c_cpu)
        else:
            total = 0.0 + c_none
        total += c_free if len(active) + (not running) <= r.max_loras else c_full
        if resident:
            total += c_victim
        else:
            total += w_victim * self._victim_one(one, index, r, i)
        if running:
            total += c_head
        else:
            maxl = r.max_loras
            head = (maxl - r.busy_n - (one not in r.waiting_adapters)) / (maxl if maxl > 1 else 1)
            total += w_head * (head if head > 0.0 else 0.0)
        cap = r.capacity
        spare = 1.0 - r.load / (cap if cap > 1 else 1)
        return total + w_load * (spare if spare > 0.0 else 0.0)

    def _cold_partials(
        self, one: str, index: FleetIndex, cands: list[int], w_hash: float
    ) -> list[tuple[int, float]]:
        """`_partial` for replicas not holding `one`, leaving out those that cannot come within
        `w_hash` of the best: the cache-victim term (a heap look-up) is computed best bound first.

        Each total is ((residency + slot-free) + victim) + headroom + load, added in that order; with
        the victim term at its largest (its weight) the same sum bounds the total from above, since
        rounding is monotone. A replica whose bound is below the best total so far less `w_hash`
        (and `_scored`'s margin) is below `_scored`'s cut, so it is not needed.
        """
        c_gpu, c_cpu, c_none, c_free, c_full, w_victim, c_victim, w_head, c_head, w_load = self._terms
        reps = index.replicas
        bounds: list[tuple[float, float, float, float, int]] = []
        for i in cands:
            r = reps[i]
            active = r.active
            running = one in active
            a = 0.0 + c_none
            a += c_free if len(active) + (not running) <= r.max_loras else c_full
            if running:
                b = c_head
            else:
                maxl = r.max_loras
                head = (maxl - r.busy_n - (one not in r.waiting_adapters)) / (maxl if maxl > 1 else 1)
                b = w_head * (head if head > 0.0 else 0.0)
            cap = r.capacity
            spare = 1.0 - r.load / (cap if cap > 1 else 1)
            c = w_load * (spare if spare > 0.0 else 0.0)
            bounds.append((((a + w_victim) + b) + c, a, b, c, i))
        bounds.sort(reverse=True)
        out: list[tuple[int, float]] = []
        best = -math.inf
        for bound, a, b, c, i in bounds:
            if bound < best - w_hash - 1e-6:
                break  # and so are the rest (sorted)
            total = ((a + w_victim * self._victim_one(one, index, reps[i], i)) + b) + c
            out.append((i, total))
            best = max(best, total)
        return out

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

    def _victim_one(self, one: str, index: FleetIndex, r: ReplicaState, i: int) -> float:
        """`_victim` for a one-adapter request whose adapter is not resident on replica `i`."""
        need = self._scratch + 1 - (r.max_cpu_loras - len(r.resident))
        if need <= 0:
            return 1.0
        sketch = self.frequency
        v: float | None = None
        heap = r.idle
        if need == 1 and heap and index.heaps_follow(sketch):
            # The heap's top, if current and idle, is the answer (`least_popular_idle`'s first step).
            c, a = heap[0]
            if a in r.resident and sketch.counts.get(a, 0.0) == c and not (
                a in r.active or a in r.waiting_adapters or a in r.pinned
            ):
                v = c / sketch.unit
        if v is None:
            idle = index.least_popular_idle(i, need, sketch)  # `one` is not there: nothing to exclude
            if len(idle) < need:
                return 0.0
            v = idle[need - 1][0]
        f = sketch.estimate(one)
        if f + v <= 0:
            return 1.0
        return f / (f + v)

    def _victim(
        self, scorer: CacheVictim, adapters: tuple[str, ...], index: FleetIndex, r: ReplicaState, i: int
    ) -> float:
        missing = [a for a in adapters if a not in r.resident]
        if not missing:
            return 1.0
        need = scorer.scratch_slots + len(missing) - (r.max_cpu_loras - len(r.resident))
        if need <= 0:
            return 1.0
        idle = index.least_popular_idle(i, need, self.frequency, frozenset(adapters))
        if len(idle) < need:
            return 0.0
        v = idle[need - 1][0]
        f = min(scorer.frequency(a) for a in missing)
        if f + v <= 0:
            return 1.0
        return f / (f + v)


def _clamp(x: float) -> float:
    return min(1.0, max(0.0, x))


def _reason(adapters: tuple[str, ...], r: ReplicaState) -> Reason:
    """`policies.reason_for` on the index's replica."""
    if not adapters:
        return "base"
    if any(a not in r.resident for a in adapters):
        return "cold"
    return "hot" if all(a in r.gpu for a in adapters) else "warm"
