"""The `lorafleet` scorers evaluated on a `FleetIndex`'s replicas: the same terms, added in the same
order, so the same floats as `Policy._score` (and the same pick as `MaxScore`, turn counter included).

`IndexedPolicy` finds the candidates; this scores them. A one-adapter request on lorafleet_policy's
scorers gets them inlined and the pick made in one call (`pick_one`), cold candidates best upper
bound first (`_cold_partials`), and the rendezvous term only where it can break a near-tie; anything
else goes through `_score`, one scorer at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

from lorafleet.router.scheduling.fleet_index import FleetIndex, ReplicaState
from lorafleet.router.scheduling.frequency import FrequencySketch
from lorafleet.router.scheduling.hashing import weight
from lorafleet.router.scheduling.pickers import MaxScore
from lorafleet.router.scheduling.policies import Policy
from lorafleet.router.scheduling.scorers import (
    CacheVictim,
    HashAffinity,
    Load,
    Residency,
    SlotFree,
    SlotHeadroom,
)
from lorafleet.router.scheduling.types import NoEndpoint, RequestInfo, Scorer

_U64 = float(2**64)
_TIE = 1e-9
CANONICAL: tuple[type, ...] = (Residency, SlotFree, CacheVictim, SlotHeadroom, Load, HashAffinity)


@dataclass(slots=True)
class IndexScoring:
    scorers: tuple[tuple[float, Scorer], ...]
    frequency: FrequencySketch  # the policy's sketch (the cache-victim scorer reads it)
    picker: MaxScore
    # The scorers are lorafleet_policy's, in its order: each term's weight × clamped score where
    # that is a constant (`terms`), and the cache-victim scorer's scratch slots.
    canonical: bool = False
    terms: tuple[float, ...] = ()
    scratch: int = 0

    @classmethod
    def of(cls, policy: Policy) -> IndexScoring:
        canonical = tuple(type(sc) for _, sc in policy.scorers) == CANONICAL
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
        return cls(policy.scorers, policy.frequency, policy.picker, canonical, terms, scratch)  # type: ignore[arg-type]

    def scored(self, req: RequestInfo, key: str, index: FleetIndex, cands: list[int]) -> list[tuple[int, float]]:
        if not cands:
            raise NoEndpoint("no candidate replica")
        scorers = self.scorers
        if not isinstance(scorers[-1][1], HashAffinity):
            return [(i, self._score(req, index, i, scorers)) for i in cands]
        # The rendezvous term (last, ≤ its weight) only decides near-ties: add it where it can matter.
        return self._near(key, index, [(i, self._score(req, index, i, scorers[:-1])) for i in cands])

    def pick_one(self, one: str, index: FleetIndex, cands: list[int], holding: bool) -> int:
        """`tie_break(scored(...))` for a one-adapter request on lorafleet_policy's scorers
        (`canonical`; the key is the adapter itself), with the scorers inlined in their order: the
        same terms added in the same order, so the same floats. Clamps are left out where the score
        is in [0, 1] already (counts are never negative), and `x if x > 0.0 else 0.0` is
        `max(0.0, x)` without the call. `holding`: every candidate holds `one`; else none does."""
        if not cands:
            raise NoEndpoint("no candidate replica")
        if not holding:
            partial, best = self._cold_partials(one, index, cands, self.scorers[-1][0])
        else:
            c_gpu, c_cpu, _, c_free, c_full, _, c_victim, w_head, c_head, w_load = self.terms
            reps = index.replicas
            partial = []
            best = -math.inf
            for i in cands:  # resident: the cache-victim term is 1
                r = reps[i]
                active = r.active
                running = one in active
                total = 0.0 + (c_gpu if one in r.gpu else c_cpu)
                total += c_free if len(active) + (not running) <= r.max_loras else c_full
                total += c_victim
                if running:
                    total += c_head
                else:
                    maxl = r.max_loras
                    head = (maxl - r.busy_n - (one not in r.waiting_adapters)) / (maxl if maxl > 1 else 1)
                    total += w_head * (head if head > 0.0 else 0.0)
                cap = r.capacity
                spare = 1.0 - r.load / (cap if cap > 1 else 1)
                total += w_load * (spare if spare > 0.0 else 0.0)
                partial.append((i, total))
                if total > best:
                    best = total
        if len(partial) == 1:
            return partial[0][0]
        near = self._near(one, index, partial, best)
        return near[0][0] if len(near) == 1 else self.tie_break(near, index.replicas)

    def _near(
        self, key: str, index: FleetIndex, partial: list[tuple[int, float]], best: float | None = None
    ) -> list[tuple[int, float]]:
        """`scored`'s end: the rendezvous term added to the partial scores it can decide between.
        `best`: the largest partial score, if known. The term's score, weight / 2 ** 64, is in
        [0, 1] as a float (2 ** 64 - 1 rounds to 2 ** 64): its clamp is left out."""
        w_hash = self.scorers[-1][0]
        reps = index.replicas
        cut = (max(s for _, s in partial) if best is None else best) - w_hash - 1e-6
        near = [(i, s) for i, s in partial if s >= cut]
        if len(near) == 1:
            return near  # the pick whatever the rendezvous term adds: no hash needed
        return [(i, s + w_hash * (weight(key, reps[i].name) / _U64)) for i, s in near]

    def _cold_partials(
        self, one: str, index: FleetIndex, cands: list[int], w_hash: float
    ) -> tuple[list[tuple[int, float]], float]:
        """`pick_one`'s partial scores (and the best) for replicas not holding `one`, leaving out those
        that cannot come within `w_hash` of the best: the cache-victim term (a heap look-up) is
        computed best bound first.

        Each total is ((residency + slot-free) + victim) + headroom + load, added in that order; with
        the victim term at its largest (its weight) the same sum bounds the total from above, since
        rounding is monotone. A replica whose bound is below the best total so far less `w_hash`
        (and `_scored`'s margin) is below `_scored`'s cut, so it is not needed.
        """
        c_gpu, c_cpu, c_none, c_free, c_full, w_victim, c_victim, w_head, c_head, w_load = self.terms
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
            if total > best:
                best = total
        return out, best

    def tie_break(self, scored: list[tuple[int, float]], reps: list[ReplicaState]) -> int:
        """MaxScore's rule (and its turn counter): the best; exact ties rotate in name order."""
        best = max(s for _, s in scored)
        tied = [i for i, s in scored if s >= best - _TIE]
        if len(tied) == 1:
            return tied[0]
        tied.sort(key=lambda i: reps[i].name)
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
        need = self.scratch + 1 - (r.max_cpu_loras - len(r.resident))
        if need <= 0:
            return 1.0
        sketch = self.frequency
        v: float | None = None
        if need == 1:
            top = index.idle_top(i, sketch)
            if top is not None:
                v = top[0]
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
