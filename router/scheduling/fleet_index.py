"""The fleet as the scheduler reads it, kept incrementally: what a decision needs in O(holders + k).

`EndpointView`s are snapshots, rebuilt per request: reading them is O(replicas). `FleetIndex` is the
same information kept up to date as it changes (a poll, a load or unload, a request sent or
finished), indexed for the questions a decision asks:

- adapter → replicas holding it, with the tier (`holders`);
- base model → replicas that can serve it now, and their total load (`eligible`, `model_load`);
- a key's rendezvous candidates, first k only (`ring`, a `SkeletonRing`);
- per replica, its idle residents in a popularity heap (the cache-victim score and admission).

Replicas get a stable integer id; `view(id)` builds the `EndpointView` of one replica. Pure state:
no I/O, no clock. Whoever owns the live state (the gateway's fleet, the simulator) calls the
setters as things change.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from lorafleet.router.scheduling.skeleton import SkeletonRing
from lorafleet.router.scheduling.types import EndpointView


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
    # residents as a heap of (frequency lower bound, name), see `least_popular_idle`; None: build
    idle: list[tuple[float, str]] | None = None


@dataclass(slots=True)
class HolderArrays:
    """One adapter's holders as arrays, for scoring many at once (a popular adapter's copies)."""

    ids: np.ndarray  # replica ids
    gpu: np.ndarray  # bool: in a GPU slot there
    active: np.ndarray  # bool: has requests running there
    waiting: np.ndarray  # bool: has requests queued there
    pos: dict[int, int]  # replica id -> position


# Columns of `ReplicaArrays.table`.
LOAD, BUSY, N_ACTIVE, MAX_LORAS, CAPACITY, MODEL = range(6)


@dataclass(slots=True)
class ReplicaArrays:
    """Per replica numbers as one table indexed by id: a candidate set is one gather, not a loop.

    Columns: load, |active ∪ waiting adapters|, |active|, max_loras, capacity, the model's code
    (-1 while the replica is not eligible: unhealthy, ejected or gone).
    """

    table: np.ndarray = field(default_factory=lambda: np.zeros((0, 6), dtype=np.int64))

    def grow(self, n: int) -> None:
        if n <= len(self.table):
            return
        new: np.ndarray = np.zeros((max(n, 2 * len(self.table), 16), 6), dtype=np.int64)
        new[:, MODEL] = -1
        new[: len(self.table)] = self.table
        self.table = new


@dataclass(slots=True)
class FleetIndex:
    replicas: list[ReplicaState] = field(default_factory=list)
    ids: dict[str, int] = field(default_factory=dict)
    holders: dict[str, dict[int, str]] = field(default_factory=dict)  # adapter -> {replica id: tier}
    eligible: dict[str, set[int]] = field(default_factory=dict)  # model -> ids healthy, not ejected
    model_load: dict[str, int] = field(default_factory=dict)  # model -> sum of eligible loads
    ring: SkeletonRing = field(default_factory=SkeletonRing)
    arrays: ReplicaArrays = field(default_factory=ReplicaArrays)
    model_codes: dict[str, int] = field(default_factory=dict)
    _holder_arrays: dict[str, HolderArrays] = field(default_factory=dict)
    _freq_generation: int = -1

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
            self.arrays.grow(i + 1)
        r = self.replicas[i]
        self._uncount(i)
        r.model, r.healthy, r.ejected = model, healthy, ejected
        r.max_loras, r.max_cpu_loras, r.capacity = max_loras, max_cpu_loras, capacity
        self.arrays.table[i, MAX_LORAS], self.arrays.table[i, CAPACITY] = max_loras, capacity
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
            self.arrays.table[i, MODEL] = self.model_codes.setdefault(r.model, len(self.model_codes))
            r.counted = True

    def _uncount(self, i: int) -> None:
        r = self.replicas[i]
        if r.counted:
            self.eligible[r.model].discard(i)
            self.model_load[r.model] -= r.load
            self.arrays.table[i, MODEL] = -1
            r.counted = False

    # ---- load --------------------------------------------------------------------------------
    def set_counts(self, i: int, running: int, waiting: int, inflight: int) -> None:
        r = self.replicas[i]
        r.running, r.waiting, r.inflight = running, waiting, inflight
        load = max(running + waiting, inflight)
        if r.counted:
            self.model_load[r.model] += load - r.load
        r.load = load
        self.arrays.table[i, LOAD] = load

    # ---- residency and activity -------------------------------------------------------------
    def set_tier(self, i: int, adapter: str, tier: str | None) -> None:
        """`tier`: "gpu", "cpu" or None (not resident)."""
        r = self.replicas[i]
        if tier is None:
            if adapter not in r.resident:
                return
            r.resident.discard(adapter)
            r.gpu.discard(adapter)
            self._holder_arrays.pop(adapter, None)
            held = self.holders.get(adapter)
            if held is not None:
                held.pop(i, None)
                if not held:
                    del self.holders[adapter]
        else:
            if adapter in r.resident and (adapter in r.gpu) == (tier == "gpu"):
                return
            if adapter not in r.resident and r.idle is not None:
                heapq.heappush(r.idle, (0.0, adapter))  # a lower bound: fixed when it surfaces
            r.resident.add(adapter)
            if tier == "gpu":
                r.gpu.add(adapter)
            else:
                r.gpu.discard(adapter)
            self.holders.setdefault(adapter, {})[i] = tier
        self._holder_arrays.pop(adapter, None)

    def set_active(self, i: int, adapter: str, on: bool) -> None:
        if self._flag(i, self.replicas[i].active, adapter, on):
            self.arrays.table[i, N_ACTIVE] = len(self.replicas[i].active)
            h = self._holder_arrays.get(adapter)
            if h is not None and i in h.pos:
                h.active[h.pos[i]] = on

    def set_waiting_adapter(self, i: int, adapter: str, on: bool) -> None:
        if self._flag(i, self.replicas[i].waiting_adapters, adapter, on):
            h = self._holder_arrays.get(adapter)
            if h is not None and i in h.pos:
                h.waiting[h.pos[i]] = on

    def holder_arrays(self, adapter: str) -> HolderArrays | None:
        """The adapter's holders as arrays (built on first use after its holders changed)."""
        h = self._holder_arrays.get(adapter)
        if h is None:
            held = self.holders.get(adapter)
            if not held:
                return None
            ids = np.fromiter(held, dtype=np.int64, count=len(held))
            reps = self.replicas
            h = HolderArrays(
                ids,
                np.fromiter((t == "gpu" for t in held.values()), dtype=bool, count=len(held)),
                np.fromiter((adapter in reps[i].active for i in held), dtype=bool, count=len(held)),
                np.fromiter((adapter in reps[i].waiting_adapters for i in held), dtype=bool, count=len(held)),
                {i: j for j, i in enumerate(held)},
            )
            self._holder_arrays[adapter] = h
        return h

    def set_pinned(self, i: int, adapter: str, on: bool) -> None:
        r = self.replicas[i]
        if (adapter in r.pinned) != on:
            (r.pinned.add if on else r.pinned.discard)(adapter)

    def _flag(self, i: int, flags: set[str], adapter: str, on: bool) -> bool:
        if (adapter in flags) == on:
            return False
        r = self.replicas[i]
        (flags.add if on else flags.discard)(adapter)
        r.busy_n = len(r.active | r.waiting_adapters)
        self.arrays.table[i, BUSY] = r.busy_n
        return True

    # ---- idle residents by popularity ---------------------------------------------------------
    def least_popular_idle(
        self,
        i: int,
        m: int,
        frequency: Callable[[str], float],
        generation: int,
        exclude: frozenset[str] | set[str] = frozenset(),
    ) -> list[tuple[float, str]]:
        """The `m` least popular idle residents of replica `i` (not active, waiting, pinned or in
        `exclude`) as (frequency, name), in the order `sorted` gives.

        A heap of (estimate, name) per replica over all its residents, kept across requests: between
        two agings of the sketch (`generation`) estimates only grow, so an entry is a lower bound,
        and a popped entry whose estimate moved is pushed back with the new one; the first current
        entry is the true minimum. A new resident enters at 0 (a lower bound too); entries of
        adapters no longer resident, and duplicates, are dropped as they surface; busy ones are set
        aside and put back. A request for a popular adapter or a replica's busy set changing costs
        no work here; only an aging of the sketch rebuilds the heaps.
        """
        if generation != self._freq_generation:
            for r in self.replicas:
                r.idle = None
            self._freq_generation = generation
        r = self.replicas[i]
        heap = r.idle
        if heap is None or len(heap) > 2 * len(r.resident) + 16:  # built, or rebuilt past dead entries
            heap = [(frequency(a), a) for a in r.resident]
            heapq.heapify(heap)
            r.idle = heap
        resident, active, waiting, pinned = r.resident, r.active, r.waiting_adapters, r.pinned
        if m == 1:  # the common case (one slot to free): look at the top without popping it
            while heap:
                f, a = heap[0]
                if a not in resident:
                    heapq.heappop(heap)
                    continue
                now = frequency(a)
                if now != f:
                    heapq.heapreplace(heap, (now, a))
                elif a in active or a in waiting or a in pinned or a in exclude:
                    break  # the general path below sets it aside
                else:
                    return [(f, a)]
        out: list[tuple[float, str]] = []
        aside: list[tuple[float, str]] = []
        seen: set[str] = set()
        while heap and len(out) < m:
            f, a = heapq.heappop(heap)
            if a not in resident or a in seen:
                continue  # gone, or a duplicate from an unload and reload: drop it
            now = frequency(a)
            if now != f:
                heapq.heappush(heap, (now, a))
                continue
            seen.add(a)
            aside.append((f, a))
            if not (a in active or a in waiting or a in pinned or a in exclude):
                out.append((f, a))
        for entry in aside:
            heapq.heappush(heap, entry)
        return out

    # ---- views -------------------------------------------------------------------------------
    def view(self, i: int) -> EndpointView:
        r = self.replicas[i]
        return EndpointView(
            name=r.name,
            model=r.model,
            healthy=r.healthy,
            ejected=r.ejected,
            gpu=frozenset(r.gpu),
            cpu=frozenset(r.resident),
            active=frozenset(r.active),
            waiting_adapters=frozenset(r.waiting_adapters),
            running=r.running,
            waiting=r.waiting,
            inflight=r.inflight,
            max_loras=r.max_loras,
            max_cpu_loras=r.max_cpu_loras,
            capacity=r.capacity,
            pinned=frozenset(r.pinned),
        )

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
