"""Adapter placement: a pure function from desired and observed state to load/unload actions.

No kopf, no HTTP, no clock: the operator and the local fleet (`lorafleet up`) both call `plan()`.

Rules, in order:
1. Replicas per adapter: `ceil(demand / requests_per_replica)` clamped to `[min, max]`
   (pinned adapters always get `max`), and never more than there are usable pods.
2. Which pods: rendezvous (highest-random-weight) hashing of `(adapter, pod)`, so a pod that
   leaves moves only the adapters it held, and a pod that joins takes only the adapters it now
   wins. Pods that are full (`capacity` adapters already assigned) are skipped.
3. Capacity is shared fairly: every adapter gets its `min` first (pinned adapters first, then by
   name), then the replicas above `min` that demand asks for, so a busy adapter cannot starve
   another adapter's `min`, and a demand change does not reshuffle the `min` replicas.
4. Make-before-break: an adapter is unloaded from a pod it should leave only once every one of its
   wanted replicas is loaded on a serving pod (or it is not wanted anywhere any more). A draining
   pod keeps its adapters until their replacements are loaded and serve.
5. Never more loaded adapters on a pod than its capacity: a load that would overflow a pod waits
   for that pod's unloads. If nothing at all could proceed (two adapters swapping full pods), the
   unload blocking the first waiting load is let through, so the fleet cannot deadlock.
6. Hysteresis: a copy beyond the desired pods, on a usable pod, is kept while it is in use (the
   caller says which: requests in flight or used lately) and the adapter stays within its `max`.
   Such copies come from the routers, which load a busy adapter on a second replica before the
   demand average the placement reads catches up, or from a demand that just dropped; unloading
   them at once would make routers load them back, round after round. A kept copy still yields
   its slot to a desired load on that pod.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True, slots=True)
class AdapterWant:
    """What one adapter asks of the placement."""

    name: str
    min_replicas: int = 1
    max_replicas: int = 1
    pinned: bool = False


@dataclass(frozen=True, slots=True)
class PodView:
    """A worker as the placement sees it."""

    name: str
    capacity: int  # adapters the worker may hold at once (its max_cpu_loras)
    ready: bool = True
    draining: bool = False  # terminating or cordoned: keep serving, take nothing new
    # Routers send it requests (Kubernetes Ready). A pod that is ready but not serving yet (held at
    # its readiness gate) takes loads, but its copies replace none elsewhere until it serves.
    serving: bool = True

    @property
    def usable(self) -> bool:
        return self.ready and not self.draining


@dataclass(frozen=True, slots=True)
class Action:
    kind: Literal["load", "unload"]
    adapter: str
    pod: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class PlacementSettings:
    requests_per_replica: float = 5.0


@dataclass(slots=True)
class Assignment:
    """Desired pods per adapter, and the replica count each adapter wanted before capacity cut it."""

    pods: dict[str, tuple[str, ...]] = field(default_factory=dict)
    wanted: dict[str, int] = field(default_factory=dict)  # before capacity and pod count cut it


def rendezvous_score(adapter: str, pod: str) -> int:
    """Stable across processes and Python versions (unlike `hash()`)."""
    digest = hashlib.blake2b(f"{adapter}\x00{pod}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def replicas_for(want: AdapterWant, demand_rps: float, settings: PlacementSettings) -> int:
    if want.pinned:
        return want.max_replicas
    by_demand = math.ceil(max(demand_rps, 0.0) / settings.requests_per_replica)
    return max(want.min_replicas, min(want.max_replicas, by_demand))


def assign(
    adapters: Iterable[AdapterWant],
    pods: Iterable[PodView],
    demand: Mapping[str, float] | None = None,
    settings: PlacementSettings = PlacementSettings(),
) -> Assignment:
    """Desired placement (rules 1-3). Deterministic for the same inputs, whatever their order."""
    demand = demand or {}
    usable = sorted((p for p in pods if p.usable), key=lambda p: p.name)
    free = {p.name: p.capacity for p in usable}
    wants = sorted(adapters, key=lambda a: (not a.pinned, a.name))
    result = Assignment()
    ranked: dict[str, list[str]] = {}
    chosen: dict[str, list[str]] = {}
    for want in wants:
        result.wanted[want.name] = replicas_for(want, demand.get(want.name, 0.0), settings)
        ranked[want.name] = sorted(free, key=lambda pod, a=want.name: rendezvous_score(a, pod), reverse=True)
        chosen[want.name] = []

    def take(name: str, upto: int) -> None:
        picked = chosen[name]
        for pod in ranked[name]:
            if len(picked) >= upto:
                return
            if pod not in picked and free[pod] > 0:
                picked.append(pod)
                free[pod] -= 1

    # Rule 3: everyone's min (or pinned max) first, then demand-driven extras.
    for want in wants:
        take(want.name, result.wanted[want.name] if want.pinned else want.min_replicas)
    for want in sorted(wants, key=lambda a: (-demand.get(a.name, 0.0), a.name)):
        take(want.name, result.wanted[want.name])
    for want in wants:
        # Keep pods in rendezvous order so the first replica is the adapter's "home" pod.
        order = {pod: i for i, pod in enumerate(ranked[want.name])}
        result.pods[want.name] = tuple(sorted(chosen[want.name], key=order.__getitem__))
    return result


def plan(
    adapters: Iterable[AdapterWant],
    pods: Iterable[PodView],
    inventories: Mapping[str, Iterable[str]],
    demand: Mapping[str, float] | None = None,
    settings: PlacementSettings = PlacementSettings(),
    in_use: Mapping[str, Iterable[str]] | None = None,
) -> list[Action]:
    """Actions that move the observed placement towards the desired one (rules 4-6).

    `inventories` maps a pod name to the adapter names its worker reports loaded; a pod missing
    from it is unknown (not yet polled) and gets no action. Adapters found on a pod but not in
    `adapters` (deleted, or loaded by hand) are unloaded: the operator owns the workers' adapters.
    `in_use` maps a pod to the adapters serving traffic there (rule 6).
    Unloads come before loads (a load may count on an unload's room); execute them in order, or
    all unloads concurrently and then all loads.
    """
    pods = list(pods)
    adapters = list(adapters)
    by_name = {p.name: p for p in pods}
    max_of = {a.name: a.max_replicas for a in adapters}
    busy = {pod: set(names) for pod, names in (in_use or {}).items()}
    target = assign(adapters, pods, demand, settings)
    observed: dict[str, set[str]] = {}
    for pod, names in inventories.items():
        if pod in by_name:
            for name in names:
                observed.setdefault(name, set()).add(pod)

    loads: list[Action] = []
    unloads: list[Action] = []
    kept: dict[str, list[str]] = {}  # pod -> copies kept by rule 6 (they yield to a desired load)
    for name in sorted(set(observed) | set(target.pods)):
        want = set(target.pods.get(name, ()))
        have = observed.get(name, set())
        for pod in sorted(want - have):
            if pod in inventories:
                loads.append(Action("load", name, pod, "placed"))
        extra = have - want
        if not extra:
            continue
        # Make-before-break: every wanted replica is loaded (and one is wanted somewhere at all,
        # so an adapter whose pods all drain keeps serving until a new pod appears).
        settled = want <= have and all(by_name[p].serving for p in want) and (bool(want) or target.wanted.get(name, 0) == 0)
        spare = max_of.get(name, 0) - len(want)  # copies rule 6 may keep beyond the desired pods
        for pod in sorted(extra):
            if name not in target.pods:
                unloads.append(Action("unload", name, pod, "not wanted"))
            elif not settled:
                continue
            elif spare > 0 and by_name[pod].usable and name in busy.get(pod, ()):
                kept.setdefault(pod, []).append(name)
                spare -= 1
            else:
                reason = "drained" if not by_name[pod].usable else "moved"
                unloads.append(Action("unload", name, pod, reason))

    # Rule 5: a load must fit next to what stays loaded on its pod.
    unloading: dict[str, int] = {}
    for a in unloads:
        unloading[a.pod] = unloading.get(a.pod, 0) + 1
    loaded_count = {pod: len(set(names)) for pod, names in inventories.items() if pod in by_name}
    admitted: list[Action] = []
    blocked: list[Action] = []
    adding: dict[str, int] = {}
    for a in loads:
        room = by_name[a.pod].capacity - loaded_count[a.pod] + unloading.get(a.pod, 0) - adding.get(a.pod, 0)
        if room <= 0 and kept.get(a.pod):
            unloads.append(Action("unload", kept[a.pod].pop(0), a.pod, "make room"))
            unloading[a.pod] = unloading.get(a.pod, 0) + 1
            room += 1
        if room > 0:
            admitted.append(a)
            adding[a.pod] = adding.get(a.pod, 0) + 1
        else:
            blocked.append(a)
    if not admitted and not unloads and blocked:
        # Deadlock breaker: evict from the first blocked load's pod an adapter that is not wanted there.
        first = blocked[0]
        stale = sorted(
            n for n in inventories[first.pod] if first.pod not in target.pods.get(n, ())
        )
        if stale:
            unloads.append(Action("unload", stale[0], first.pod, "make room"))
    # Unloads first: every one of them is safe already (rule 4), and loads may need their room.
    return unloads + admitted


def placement_of(inventories: Mapping[str, Iterable[str]], ready_pods: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Observed placement to publish for the router: adapter -> ready pods that really hold it."""
    ready = set(ready_pods)
    result: dict[str, list[str]] = {}
    for pod in sorted(inventories):
        if pod in ready:
            for name in inventories[pod]:
                result.setdefault(name, []).append(pod)
    return {name: tuple(pods) for name, pods in result.items()}
