"""The `lorafleet` policy decided on a `FleetIndex`: the same decisions, looking at few replicas.

`Policy.schedule` filters and scores every replica's `EndpointView`. This evaluates the same filters
and scorers, in the same order and floating-point operations, on the candidates that can win:

1. the replicas serving the model (`FleetIndex.eligible`; their load sum gives the load bound);
2. the replicas holding the request's adapters (`FleetIndex.holders`) that pass the load bound and
   the GPU-slot queue bound: if any, they are the candidates (residency outranks everything else).
   Where more than `holder_sample` replicas hold them, the policy's draw of that many
   (`Holders.names`, the same draw from the same generator) comes first;
3. else the first `cold_candidates` replicas in the key's rendezvous order that pass both bounds,
   walked lazily on the `SkeletonRing`; only a fleet where no replica passes walks it all.

So a decision costs O(holder_sample + cold_candidates), whatever the fleet's size. A one-adapter
request (nearly all of them) takes `_schedule_one`: the same steps with the general ones' loops and
calls written out, since at 1,024 replicas a cold decision's cost is mostly Python steps touching
data no other decision touched lately (see docs/benchmarks.md, "Routing at fleet scale"). Base-model
requests (no adapter: nothing to load, any replica will do) are scored over every eligible replica,
as `Policy.schedule` does. The tests hold this equal to `Policy.schedule` on random fleets
(`tests/router/scheduling/test_indexed.py`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from lorafleet.router.scheduling.admission import FrequencyAdmission
from lorafleet.router.scheduling.filters import Available, BoundedLoad, ServesModel, SlotQueue
from lorafleet.router.scheduling.fleet_index import FleetIndex, ReplicaState
from lorafleet.router.scheduling.frequency import FrequencySketch
from lorafleet.router.scheduling.hashing import bounded_load_limit
from lorafleet.router.scheduling.index_scoring import CANONICAL, IndexScoring
from lorafleet.router.scheduling.pickers import MaxScore
from lorafleet.router.scheduling.policies import Policy, draw
from lorafleet.router.scheduling.scorers import CacheVictim
from lorafleet.router.scheduling.types import (
    AdmissionPlan,
    Decision,
    NoEndpoint,
    Reason,
    RequestInfo,
    make_decision,
    make_plan,
)

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
    scoring: IndexScoring
    frequency: FrequencySketch
    admission: FrequencyAdmission | None
    name: str = "lorafleet"

    @classmethod
    def of(cls, policy: Policy) -> IndexedPolicy:
        kinds: list[type] = [type(f) for f in policy.filters]
        if kinds != [Available, ServesModel, BoundedLoad, SlotQueue] or not policy.cold_candidates:
            raise ValueError(f"policy {policy.name!r} is not lorafleet-shaped: no index for it")
        if any(type(s) not in CANONICAL for _, s in policy.scorers) or not isinstance(policy.picker, MaxScore):
            raise ValueError(f"policy {policy.name!r} has a scorer or picker the index does not evaluate")
        for _, s in policy.scorers:
            # The index keeps residents ordered by the policy's own sketch.
            if isinstance(s, CacheVictim) and s.frequency != policy.frequency.estimate:
                raise ValueError(f"policy {policy.name!r}: its cache-victim scorer reads another sketch")
        return cls(
            policy,
            policy.filters[2],  # type: ignore[arg-type]
            policy.filters[3],  # type: ignore[arg-type]
            policy.cold_candidates,
            IndexScoring.of(policy),
            policy.frequency,
            policy.admission,
            policy.name,
        )

    # ---- the decision ------------------------------------------------------------------------
    def schedule(self, req: RequestInfo, index: FleetIndex) -> Decision:
        adapters = req.adapters
        if len(adapters) == 1:
            return self._schedule_one(req, adapters[0], index)
        share = req.share
        key = req.key
        if adapters:
            p = self.policy
            if p.aging_per_slot is not None:
                self.frequency.age_with(index.cpu_slots, p.aging_per_slot, p.aging_floor)
            self.frequency.add(key)
            share = self.frequency.share(key)
        eligible = index.eligible.get(req.model)
        if not eligible:
            raise NoEndpoint("no replica serves the model")
        limit, fallback = self._load_bound(req.model, share, index, eligible)
        reps = index.replicas

        def bounded(i: int) -> bool:
            return i == fallback if fallback is not None else reps[i].load + 1 <= limit

        if not adapters:
            cands = self._slot_filter(adapters, [i for i in eligible if bounded(i)], reps)
        else:
            cands, _ = self._candidates(req, key, index, eligible, limit, fallback, bounded)
        if len(cands) == 1:
            chosen = cands[0]  # what MaxScore picks from one, whatever its score (no turn taken)
        else:
            chosen = self.scoring.tie_break(self.scoring.scored(req, key, index, cands), reps)
        r = reps[chosen]
        resident = r.resident
        missing = tuple(a for a in adapters if a not in resident)
        plan = _NO_PLAN
        if missing and self.admission is not None:
            spill = self._is_spill(share, index, missing, chosen, eligible)
            plan = self._admission_plan(adapters, missing, index, chosen, spill)
        return Decision(index.view(chosen), _reason(adapters, r), missing, plan)

    def _schedule_one(self, req: RequestInfo, a: str, index: FleetIndex) -> Decision:
        """`schedule` for a one-adapter request (nearly all of them): the same steps, with the key
        (the adapter itself), the reason and the spill test written out, and a cold adapter's
        candidates (no replica holds it) taken straight off the ring."""
        p = self.policy
        freq = self.frequency
        if p.aging_per_slot is not None:
            freq.age_with(index.cpu_slots, p.aging_per_slot, p.aging_floor)
        freq.add(a)
        share = freq.share(a)
        model = req.model
        eligible = index.eligible.get(model)
        if not eligible:
            raise NoEndpoint("no replica serves the model")
        limit, fallback = self._load_bound(model, share, index, eligible)
        reps = index.replicas
        held = index.holders.get(a)
        if held:
            def bounded(i: int) -> bool:
                return i == fallback if fallback is not None else reps[i].load + 1 <= limit

            cands, holding = self._candidates(req, a, index, eligible, limit, fallback, bounded)
        else:  # `_candidates` with no holders: the ring's first k in both bounds, else in the load bound
            holding = False
            cands, loaded = self._ring_passing(a, index, eligible, limit, fallback)
            if not cands:
                cands = loaded
        if len(cands) == 1:
            chosen = cands[0]  # what MaxScore picks from one, whatever its score (no turn taken)
        elif self.scoring.canonical:
            chosen = self.scoring.pick_one(a, index, cands, holding)
        else:
            chosen = self.scoring.tie_break(self.scoring.scored(req, a, index, cands), reps)
        r = reps[chosen]
        if a in r.resident:
            return make_decision(index.view(chosen), "hot" if a in r.gpu else "warm", (), _NO_PLAN)
        missing = (a,)
        plan = _NO_PLAN
        if self.admission is not None:
            rs = p.replicate_share
            spill = (
                rs is not None and share < rs and held is not None
                and any(i != chosen and i in eligible for i in held)
            )  # fmt: skip
            plan = self._admit_one(a, index, chosen, spill)
        return make_decision(index.view(chosen), "cold", missing, plan)

    def _ring_passing(
        self, a: str, index: FleetIndex, eligible: set[int], limit: int, fallback: int | None
    ) -> tuple[list[int], list[int]]:
        """(`_passing((a,), index.ring.walk(a), ..., self.k)`, and where that is empty
        `_first_k(a, ...)`), walking the ring's groups in place, once: where no replica passes the
        slot bound (a slot-bound fleet) the walk has gone through every replica, and the first k
        in the load bound were seen on the way."""
        ring = index.ring
        km, order = ring.key_order(a)
        reps = index.replicas
        max_over = self.slot_queue.max_over
        k = self.k
        out: list[int] = []
        loaded: list[int] = []  # the first k in the load bound, while `out` is empty
        for g in order:
            for i in ring.ranked(km, g):
                if i not in eligible:
                    continue
                r = reps[i]
                if (i != fallback) if fallback is not None else (r.load + 1 > limit):
                    continue
                if not out and len(loaded) < k:
                    loaded.append(i)
                if a not in r.active:
                    over = r.busy_n + (a not in r.waiting_adapters) - r.max_loras
                    if (over if over > 0 else 0) > max_over:
                        continue
                out.append(i)
                if len(out) == k:
                    return out, loaded
        return out, loaded

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
            one = index.holders.get(adapters[0])
            held = one if one is not None else ()
            names = one.names if one is not None else []
        else:
            held = self._holders(adapters, index)
            names = sorted(reps[i].name for i in held) if k is not None and len(held) > k else []
        drawn: list[int] | None = None
        if k is not None and len(held) > k:
            ids = index.ids
            drawn = [ids[names[j]] for j in draw(self.policy.rng, len(names), k)]
        if self._saturated(req.model, index, eligible):
            # The fleet is slot-bound (`SlotQueue.full_share`): no spill, the holders in the load
            # bound whatever their slot queue, as the slot filter keeps every replica then.
            cands = _bounded_holders(drawn, held, eligible, bounded)
            if cands:
                return cands, True
        if drawn is not None:
            cands = self._passing(adapters, drawn, reps, eligible, limit, fallback)
            if cands:
                return cands, True
        cands = self._passing(adapters, held, reps, eligible, limit, fallback)
        if cands:
            return cands, True
        loaded: list[int] | None = None
        if len(adapters) == 1:
            cands, loaded = self._ring_passing(adapters[0], index, eligible, limit, fallback)
        else:
            cands = self._passing(adapters, index.ring.walk(key), reps, eligible, limit, fallback, self.k)
        if cands:
            return cands, False
        # No replica in the bound has room in its GPU-slot queue: the slot filter keeps them all.
        cands = _bounded_holders(drawn, held, eligible, bounded)
        if cands:
            return cands, True
        return (loaded if loaded is not None else self._first_k(key, index, eligible, bounded)), False

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

    def _saturated(self, model: str, index: FleetIndex, eligible: set[int]) -> bool:
        """`SlotQueue.saturated` on the index's count of slot-full replicas serving the model."""
        share = self.slot_queue.full_share
        return share is not None and index.model_full.get(model, 0) >= share * len(eligible)

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

    def _admit_one(self, a: str, index: FleetIndex, i: int, transient: bool) -> AdmissionPlan:
        """`_admission_plan((a,), (a,), index, i, transient)`, written out for one adapter (not
        resident on replica `i`, so excluding it from the victims changes nothing)."""
        adm = self.admission
        assert adm is not None
        r = index.replicas[i]
        free = r.max_cpu_loras - len(r.resident)
        scratch = adm.scratch_slots
        if free - 1 >= scratch and not transient:
            return _ADMIT
        need = scratch + 1 - free
        overflow = 1 - free
        sketch = self.frequency
        m = max(need, overflow, 0)
        top = index.idle_top(i, sketch) if m == 1 else None
        victims = [top] if top is not None else index.least_popular_idle(i, m, sketch)
        return _victims_plan(victims, need, overflow, None if transient else sketch.estimate(a), adm.margin)

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
        freq = self.frequency.estimate
        return _victims_plan(victims, need, overflow, None if transient else min(freq(a) for a in missing), adm.margin)


def _victims_plan(victims: list[tuple[float, str]], need: int, overflow: int, newcomer: float | None,
                  margin: float) -> AdmissionPlan:
    """The admission's plan from a replica's idle adapters, least popular first: the `need` of them
    that a newcomer of frequency `newcomer` beats by `margin` (admitted), else the `overflow` that
    must go to make room (not admitted; `newcomer` None: a transient load, never admitted)."""
    if newcomer is not None:
        chosen: list[str] = []
        for f, name in victims[: max(0, need)]:
            if newcomer <= f * margin:
                break
            chosen.append(name)
        if len(chosen) >= need:
            return make_plan(tuple(chosen), True)
    return make_plan(tuple(name for _, name in victims[: max(0, overflow)]), False)


def _reason(adapters: tuple[str, ...], r: ReplicaState) -> Reason:
    """`policies.reason_for` on the index's replica."""
    if not adapters:
        return "base"
    if any(a not in r.resident for a in adapters):
        return "cold"
    return "hot" if all(a in r.gpu for a in adapters) else "warm"


def _bounded_holders(drawn: list[int] | None, held: Iterable[int], eligible: set[int],
                     bounded: Callable[[int], bool]) -> list[int]:
    """The drawn holders that are eligible and in the load bound, else all such holders."""
    if drawn is not None:
        cands = [i for i in drawn if i in eligible and bounded(i)]
        if cands:
            return cands
    return [i for i in held if i in eligible and bounded(i)]
