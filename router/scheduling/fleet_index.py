"""The fleet as the scheduler reads it, kept incrementally: what a decision needs in O(holders + k).

`EndpointView`s are snapshots, rebuilt per request: reading them is O(replicas). `FleetIndex` is the
same information kept up to date as it changes (a poll, a load or unload, a request sent or
finished), indexed for the questions a decision asks:

- adapter → replicas holding it, with the tier, and their names in sorted order (`holders`, a
  `Holders` each: a uniform sample of k holders in O(k), see `policies.Policy.holder_sample`);
- base model → replicas that can serve it now, and their total load (`eligible`, `model_load`);
- a key's rendezvous candidates, first k only (`ring`, a `SkeletonRing`);
- per replica, its idle residents in a popularity heap (the cache-victim score and admission).

Replicas get a stable integer id; `view(id)` builds the `EndpointView` of one replica. Pure state:
no I/O, no clock. Whoever owns the live state (the gateway's fleet, the simulator) calls the
setters as things change.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field

from lorafleet.router.scheduling.frequency import FrequencySketch
from lorafleet.router.scheduling.skeleton import SkeletonRing
from lorafleet.router.scheduling.types import EndpointView, make_view


@dataclass(slots=True)
class ReplicaState:
    name: str
    model: str = "base"
    healthy: bool = True
    ejected: bool = False
    max_loras: int = 16
    max_cpu_loras: int = 64
    capacity: int = 64
    running: int = 0
    waiting: int = 0
    inflight: int = 0
    gpu: set[str] = field(default_factory=set)
    resident: set[str] = field(default_factory=set)  # gpu ∪ cpu
    active: set[str] = field(default_factory=set)
    waiting_adapters: set[str] = field(default_factory=set)
    pinned: set[str] = field(default_factory=set)
    busy_n: int = 0  # |active ∪ waiting_adapters|: GPU slots taken or asked for
    load: int = 0  # max(running + waiting, inflight), as EndpointView.load
    counted: bool = False  # included in its model's eligible set and load sum
    # residents as a heap of (count lower bound, name), see `least_popular_idle`; None: build
    idle: list[tuple[float, str]] | None = None
    # residents taken off that heap while busy (active, waiting or pinned), with their count then:
    # pushed back when they go idle, so a busy resident is not set aside at every look-up
    parked: dict[str, float] = field(default_factory=dict)
    # (gpu, resident) and (active, waiting_adapters, pinned) frozen for `view`; None: changed since.
    # Apart: a request starting or ending changes the second, and the first (64 names) stays.
    frozen: tuple[frozenset[str], frozenset[str]] | None = None
    frozen_flags: tuple[frozenset[str], frozenset[str], frozenset[str]] | None = None


class Holders(dict[int, str]):
    """The replicas holding one adapter: replica id → tier, and their names in sorted order
    (`names`: a uniform sample of k holders in O(k), see `policies.Policy.holder_sample`). One
    object per adapter, so an update or a decision looks the adapter up once."""

    __slots__ = ("names",)
    names: list[str]


@dataclass(slots=True)
class FleetIndex:
    replicas: list[ReplicaState] = field(default_factory=list)
    ids: dict[str, int] = field(default_factory=dict)
    holders: dict[str, Holders] = field(default_factory=dict)  # adapter -> {replica id: tier}, names
    eligible: dict[str, set[int]] = field(default_factory=dict)  # model -> ids healthy, not ejected
    model_load: dict[str, int] = field(default_factory=dict)  # model -> sum of eligible loads
    # model -> eligible replicas with every GPU slot taken or asked for (busy_n ≥ max_loras)
    model_full: dict[str, int] = field(default_factory=dict)
    cpu_slots: int = 0  # sum of max_cpu_loras over the replicas counted (healthy, not ejected, present)
    ring: SkeletonRing = field(default_factory=SkeletonRing)
    # the sketch (and its generation) the popularity heaps are ordered by
    _sketch: FrequencySketch | None = None
    _sketch_generation: int = -1

    # ---- replicas -------------------------------------------------------------------------
    def upsert(
        self,
        name: str,
        model: str = "base",
        healthy: bool = True,
        ejected: bool = False,
        max_loras: int = 16,
        max_cpu_loras: int = 64,
        capacity: int = 64,
    ) -> int:
        i = self.ids.get(name)
        if i is None:
            i = len(self.replicas)
            self.replicas.append(ReplicaState(name))
            self.ids[name] = i
            self.ring.add(name, i)
        r = self.replicas[i]
        self._uncount(i)
        r.model, r.healthy, r.ejected = model, healthy, ejected
        r.max_loras, r.max_cpu_loras, r.capacity = max_loras, max_cpu_loras, capacity
        self._count(i)
        return i

    def remove(self, name: str) -> None:
        """The replica leaves: out of every index; its id is not reused."""
        i = self.ids.pop(name, None)
        if i is None:
            return
        r = self.replicas[i]
        self._uncount(i)
        for a in list(r.resident):
            self.set_tier(i, a, None)
        r.healthy = False
        self.ring.remove(name)

    def set_health(self, i: int, healthy: bool, ejected: bool) -> None:
        r = self.replicas[i]
        if (r.healthy, r.ejected) != (healthy, ejected):
            self._uncount(i)
            r.healthy, r.ejected = healthy, ejected
            self._count(i)

    def _count(self, i: int) -> None:
        r = self.replicas[i]
        if r.healthy and not r.ejected and r.name in self.ids and not r.counted:
            self.eligible.setdefault(r.model, set()).add(i)
            self.model_load[r.model] = self.model_load.get(r.model, 0) + r.load
            self.model_full[r.model] = self.model_full.get(r.model, 0) + (r.busy_n >= r.max_loras)
            self.cpu_slots += r.max_cpu_loras
            r.counted = True

    def _uncount(self, i: int) -> None:
        r = self.replicas[i]
        if r.counted:
            self.eligible[r.model].discard(i)
            self.model_load[r.model] -= r.load
            self.model_full[r.model] -= r.busy_n >= r.max_loras
            self.cpu_slots -= r.max_cpu_loras
            r.counted = False

    # ---- load --------------------------------------------------------------------------------
    def set_counts(self, i: int, running: int, waiting: int, inflight: int) -> None:
        r = self.replicas[i]
        r.running, r.waiting, r.inflight = running, waiting, inflight
        load = max(running + waiting, inflight)
        if r.counted:
            self.model_load[r.model] += load - r.load
        r.load = load

    # ---- residency and activity -------------------------------------------------------------
    def set_tier(self, i: int, adapter: str, tier: str | None) -> None:
        """`tier`: "gpu", "cpu" or None (not resident)."""
        r = self.replicas[i]
        if tier is None:
            if adapter not in r.resident:
                return
            r.resident.discard(adapter)
            r.gpu.discard(adapter)
            r.frozen = None
            r.parked.pop(adapter, None)
            heap = r.idle
            while heap and heap[0][1] not in r.resident:  # an unloaded victim leaves the top at once
                heapq.heappop(heap)
            held = self.holders[adapter]
            if len(held) == 1:
                del self.holders[adapter]
                return
            del held[i]
            names = held.names
            del names[bisect.bisect_left(names, r.name)]
            return
        if adapter in r.resident:
            if (adapter in r.gpu) == (tier == "gpu"):
                return
            self.holders[adapter][i] = tier
        else:
            if r.idle is not None:
                heapq.heappush(r.idle, (0.0, adapter))  # a lower bound: fixed when it surfaces
            r.resident.add(adapter)
            entry = self.holders.get(adapter)
            if entry is None:
                entry = self.holders[adapter] = Holders()
                entry[i] = tier
                entry.names = [r.name]
            else:
                entry[i] = tier
                bisect.insort(entry.names, r.name)
        if tier == "gpu":
            r.gpu.add(adapter)
        else:
            r.gpu.discard(adapter)
        r.frozen = None

    def set_active(self, i: int, adapter: str, on: bool) -> None:
        r = self.replicas[i]
        self._flag(r, r.active, r.waiting_adapters, adapter, on)

    def set_waiting_adapter(self, i: int, adapter: str, on: bool) -> None:
        r = self.replicas[i]
        self._flag(r, r.waiting_adapters, r.active, adapter, on)

    def set_pinned(self, i: int, adapter: str, on: bool) -> None:
        r = self.replicas[i]
        if (adapter in r.pinned) != on:
            (r.pinned.add if on else r.pinned.discard)(adapter)
            r.frozen_flags = None
            if not on:
                self._unpark(r, adapter)

    def _flag(self, r: ReplicaState, flags: set[str], other: set[str], adapter: str, on: bool) -> None:
        """Set or clear `adapter` in `flags` (active or waiting), keeping |active ∪ waiting| in step."""
        if (adapter in flags) == on:
            return
        if on:
            flags.add(adapter)
        else:
            flags.discard(adapter)
        if adapter not in other:
            full = r.busy_n >= r.max_loras
            r.busy_n += 1 if on else -1
            if r.counted and (r.busy_n >= r.max_loras) != full:
                self.model_full[r.model] += -1 if full else 1
            if not on:
                self._unpark(r, adapter)
        r.frozen_flags = None

    @staticmethod
    def _unpark(r: ReplicaState, adapter: str) -> None:
        """A resident parked off the popularity heap while busy goes back on it once idle."""
        if adapter in r.parked and not (adapter in r.active or adapter in r.waiting_adapters or adapter in r.pinned):
            count = r.parked.pop(adapter)
            if r.idle is not None and adapter in r.resident:
                heapq.heappush(r.idle, (count, adapter))  # still a lower bound: counts only grow

    # ---- idle residents by popularity ---------------------------------------------------------
    def heaps_follow(self, sketch: FrequencySketch) -> bool:
        """The popularity heaps are ordered by this sketch's counts, of its current generation."""
        return sketch is self._sketch and sketch.generation == self._sketch_generation

    def idle_top(self, i: int, sketch: FrequencySketch) -> tuple[float, str] | None:
        """Replica `i`'s least popular idle resident as (estimate, name) where its heap's top is
        that already (current, idle), with no heap work; else None (`least_popular_idle` answers).
        The top is the heap's minimum and a lower bound of every count below it: if current and
        idle, it is the first entry `least_popular_idle` returns."""
        heap = self.replicas[i].idle
        if not heap or not self.heaps_follow(sketch):
            return None
        r = self.replicas[i]
        c, a = heap[0]
        if a in r.resident and sketch.counts.get(a, 0.0) == c and not (
            a in r.active or a in r.waiting_adapters or a in r.pinned
        ):
            return c / sketch.unit, a
        return None

    def least_popular_idle(
        self, i: int, m: int, sketch: FrequencySketch, exclude: frozenset[str] | set[str] = frozenset()
    ) -> list[tuple[float, str]]:
        """The `m` least popular idle residents of replica `i` (not active, waiting, pinned or in
        `exclude`) as (estimate, name), in the order `sorted` gives.

        A heap of (count, name) per replica over all its residents, kept across requests: within a
        generation of the sketch counts only grow (`FrequencySketch.count`; an aging changes the
        unit, not the counts), so an entry is a lower bound, and a popped entry whose count moved is
        pushed back with the new one; the first current entry is the true minimum. A new resident
        enters at 0 (a lower bound too); entries of adapters no longer resident, and duplicates, are
        dropped as they surface; busy ones (active, waiting, pinned) are parked off the heap until they
        go idle (`_unpark`), those in `exclude` set aside and put back. A request for a popular
        adapter, a replica's busy set changing or an aging costs no work here; a new sketch or
        generation (a rescale, a trim) rebuilds every replica's heap at once (`_rebuild`).
        """
        if not self.heaps_follow(sketch):
            self._sketch, self._sketch_generation = sketch, sketch.generation
            for rep in self.replicas:
                self._rebuild(rep, sketch)
        unit = sketch.unit
        r = self.replicas[i]
        heap = r.idle
        if heap is None or len(heap) > 2 * len(r.resident) + 16:  # a replica added since, or past dead entries
            heap = self._rebuild(r, sketch)
        count = sketch.counts.get
        resident, active, waiting, pinned, parked = r.resident, r.active, r.waiting_adapters, r.pinned, r.parked
        if m == 1:  # the common case (one slot to free): the top, once it is current and idle
            while heap:
                c, a = heap[0]
                if a not in resident:
                    heapq.heappop(heap)
                    continue
                now = count(a, 0.0)
                if now != c:
                    heapq.heapreplace(heap, (now, a))
                elif a in active or a in waiting or a in pinned:
                    heapq.heappop(heap)
                    parked[a] = c
                elif a in exclude:
                    break  # the general path below sets it aside
                else:
                    return [(c / unit, a)]
        out: list[tuple[float, str]] = []
        aside: list[tuple[float, str]] = []
        seen: set[str] = set()
        while heap and len(out) < m:
            c, a = heapq.heappop(heap)
            if a not in resident or a in seen:
                continue  # gone, or a duplicate from an unload and reload: drop it
            now = count(a, 0.0)
            if now != c:
                heapq.heappush(heap, (now, a))
                continue
            seen.add(a)
            if a in active or a in waiting or a in pinned:
                parked[a] = c
                continue
            aside.append((c, a))
            if a not in exclude:
                out.append((c / unit, a))
        for entry in aside:
            heapq.heappush(heap, entry)
        return out

    @staticmethod
    def _rebuild(r: ReplicaState, sketch: FrequencySketch) -> list[tuple[float, str]]:
        """`r`'s popularity heap from its residents' current counts. Done for every replica when the
        sketch changes generation, not at each replica's next cold decision: one O(fleet) pause at a
        rescale (about every `halve_every` requests on a large catalog) instead of a build inside
        each of the next ~fleet-size cold decisions, where it set the decision p99."""
        count = sketch.counts.get
        heap = [(count(a, 0.0), a) for a in r.resident]
        heapq.heapify(heap)
        r.idle = heap
        r.parked.clear()
        return heap

    # ---- views -------------------------------------------------------------------------------
    def view(self, i: int) -> EndpointView:
        r = self.replicas[i]
        tiers = r.frozen
        if tiers is None:
            tiers = r.frozen = (frozenset(r.gpu), frozenset(r.resident))
        flags = r.frozen_flags
        if flags is None:
            flags = r.frozen_flags = (frozenset(r.active), frozenset(r.waiting_adapters), frozenset(r.pinned))
        gpu, resident = tiers
        active, waiting, pinned = flags
        return make_view(
            r.name, r.model, r.healthy, r.ejected, gpu, resident, active, waiting,
            r.running, r.waiting, r.inflight, r.max_loras, r.max_cpu_loras, r.capacity, pinned,
        )  # fmt: skip

    def views(self) -> list[EndpointView]:
        """Every replica present, in id order (O(replicas): the reference path and tests)."""
        return [self.view(i) for i in sorted(self.ids.values())]

    def sync(self, v: EndpointView) -> int:
        """Bring one replica in line with a view (adds it if new); O(its adapters), not O(fleet)."""
        i = self.upsert(v.name, v.model, v.healthy, v.ejected, v.max_loras, v.max_cpu_loras, v.capacity)
        r = self.replicas[i]
        self._uncount(i)
        self.set_counts(i, v.running, v.waiting, v.inflight)
        self._count(i)
        resident = v.gpu | v.cpu
        for a in r.resident - resident:
            self.set_tier(i, a, None)
        for a in resident:
            self.set_tier(i, a, "gpu" if a in v.gpu else "cpu")
        for flags, want, setter in (
            (r.active, v.active, self.set_active),
            (r.waiting_adapters, v.waiting_adapters, self.set_waiting_adapter),
            (r.pinned, v.pinned, self.set_pinned),
        ):
            for a in flags - want:
                setter(i, a, False)
            for a in want - flags:
                setter(i, a, True)
        return i

    @classmethod
    def of(cls, views: list[EndpointView]) -> FleetIndex:
        index = cls()
        for v in views:
            index.sync(v)
        return index
