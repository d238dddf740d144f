"""Live state of the replicas: last inventory, write-through overlay, in-flight counts, ejection.

Mutated only by the gateway's event loop (no locks needed); `views()` turns it into the pure
`EndpointView`s the scheduler reads, `index()` into the incremental `FleetIndex` the indexed policy
reads. Whatever changes a replica's view calls `Replica.touch()` (its own methods do): the index
re-reads only the replicas touched since the last decision, and those whose ejection ran out.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from lorafleet.protocol import AdapterInventory
from lorafleet.router.discovery import Endpoint
from lorafleet.router.scheduling.fleet_index import FleetIndex
from lorafleet.router.scheduling.types import EndpointView
from lorafleet.vllm_inventory import VllmLimits

POLL_TIMEOUTS_UNREACHABLE = 3


@dataclass(slots=True)
class Replica:
    name: str
    url: str  # public API
    admin_url: str = ""  # admin API (inventory, load/unload); "" means the public URL
    pool: str | None = None  # LoraPool: picks the admin token
    kind: str | None = None  # "lorafleet" | "vllm" (router/worker_kinds.py); None until probed
    limits: VllmLimits = field(default_factory=VllmLimits)  # a vLLM replica's flags its metrics lack
    inventory: AdapterInventory | None = None
    polled_at: float = 0.0
    reachable: bool = False  # last poll answered (or a request just succeeded)
    poll_timeouts: int = 0  # consecutive polls that timed out (a busy worker, not a dead one)
    failures: int = 0  # consecutive request failures
    ejected_until: float = 0.0
    # Residency learned after the last poll (our loads/unloads, other routers' via the store):
    # adapter -> (tier or None for unloaded, when learned). Entries older than a poll are dropped.
    overlay: dict[str, tuple[str | None, float]] = field(default_factory=dict)
    shared: Mapping[str, str] = field(default_factory=dict)  # from the placement store
    loading: dict[str, asyncio.Future[None]] = field(default_factory=dict)
    unloading: dict[str, asyncio.Future[None]] = field(default_factory=dict)  # done when the unload is
    inflight: int = 0
    inflight_by_adapter: Counter[str] = field(default_factory=Counter)
    transient: set[str] = field(default_factory=set)  # loaded but not admitted: unload when idle
    # residency() is read several times per request and changes only on a poll, a note or a store
    # sync: cached, and dropped by those three.
    _residency: dict[str, str] | None = None
    _touched: set[str] | None = None  # the fleet's set of replicas whose view changed
    _inventory_active: frozenset[str] | None = None  # adapters the last poll saw running

    def __post_init__(self) -> None:
        if not self.admin_url:
            self.admin_url = self.url

    def touch(self) -> None:
        """Its view changed (counts, residency, loads, health): the fleet's index re-reads it."""
        if self._touched is not None:
            self._touched.add(self.name)

    def residency(self) -> dict[str, str]:
        """adapter -> tier ("gpu" | "cpu"); shared, do not mutate."""
        if self._residency is None:
            self._residency = self._compute_residency()
        return self._residency

    def set_shared(self, adapters: Mapping[str, str]) -> None:
        self.shared = adapters
        self._residency = None
        self.touch()

    def _compute_residency(self) -> dict[str, str]:
        tiers: dict[str, str] = dict(self.shared)
        if self.inventory is not None:
            tiers.update({a.name: a.tier for a in self.inventory.adapters if a.tier in ("gpu", "cpu")})
        for name, (tier, _) in self.overlay.items():
            if tier is None:
                tiers.pop(name, None)
            else:
                tiers.setdefault(name, tier)
        return tiers

    def apply_poll(self, inventory: AdapterInventory, started_at: float) -> None:
        self.inventory = inventory
        self.polled_at = started_at
        self.reachable = True
        self.poll_timeouts = 0
        self.overlay = {k: v for k, v in self.overlay.items() if v[1] > started_at}
        self._residency = None
        self._inventory_active = None
        self.touch()

    def poll_failed(self, timed_out: bool) -> None:
        """A poll that got no inventory. Refused, reset or malformed: unreachable at once. Timed
        out: a worker busy enough to answer slowly still serves its requests, so it stays in
        rotation on its last inventory until POLL_TIMEOUTS_UNREACHABLE polls in a row time out."""
        self.poll_timeouts = self.poll_timeouts + 1 if timed_out else 0
        if not timed_out or self.poll_timeouts >= POLL_TIMEOUTS_UNREACHABLE:
            self.reachable = False
            self.touch()

    def note(self, adapter: str, tier: str | None, now: float) -> None:
        self.overlay[adapter] = (tier, now)
        self._residency = None
        self.touch()

    def eject_until(self, until: float) -> None:
        self.ejected_until = until
        self.touch()

    def inventory_active(self) -> frozenset[str]:
        if self._inventory_active is None:
            inv = self.inventory
            self._inventory_active = frozenset(
                a.name for a in inv.adapters if a.requests_in_flight > 0) if inv else frozenset()
        return self._inventory_active

    def view(self, now: float, capacity: int) -> EndpointView:
        inv = self.inventory
        tiers = self.residency()
        gpu = frozenset(n for n, t in tiers.items() if t == "gpu")
        cpu = frozenset(tiers) | frozenset(self.loading)  # a request joins a load under way
        active = self.inventory_active()
        return EndpointView(
            name=self.name,
            model=inv.model if inv else "",
            healthy=self.reachable and inv is not None,
            ejected=self.ejected_until > now,
            gpu=gpu,
            cpu=cpu,
            active=active | frozenset(a for a, n in self.inflight_by_adapter.items() if n > 0),
            running=inv.num_requests_running if inv else 0,
            waiting=inv.num_requests_waiting if inv else 0,
            inflight=self.inflight,
            max_loras=inv.max_loras if inv else 1,
            max_cpu_loras=inv.max_cpu_loras if inv else 1,
            capacity=capacity,
            pinned=frozenset(a.name for a in inv.adapters if a.pinned) if inv else frozenset(),
        )


@dataclass(slots=True)
class Fleet:
    capacity: int = 64
    eject_after: int = 3
    cooldown_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    replicas: dict[str, Replica] = field(default_factory=dict)
    _index: FleetIndex = field(default_factory=FleetIndex)
    _touched: set[str] = field(default_factory=set)  # replicas whose view the index has not seen
    _ejected: set[str] = field(default_factory=set)  # replicas the index holds ejected

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        """Adopt the discovered endpoints; replicas that left or moved are dropped, state kept for the rest."""
        wanted = {e.name: e for e in endpoints}
        for name, r in list(self.replicas.items()):
            e = wanted.get(name)
            if e is None or (r.url, r.admin_url, r.pool) != (e.url, e.admin_url, e.pool) or (
                    e.kind is not None and e.kind != r.kind):
                del self.replicas[name]
                self._touched.add(name)
        for name, e in wanted.items():
            if name not in self.replicas:
                self.replicas[name] = Replica(name, e.url, e.admin_url, e.pool, kind=e.kind, limits=e.limits,
                                              _touched=self._touched)
                self._touched.add(name)

    def index(self) -> FleetIndex:
        """The index of `views()` (all replicas), brought up to date: O(replicas touched since the
        last call, and their adapters). Its replica entries equal `views()`'s."""
        now = self.clock()
        touched = self._touched
        for name in [n for n in self._ejected if self.replicas.get(n) is None
                     or self.replicas[n].ejected_until <= now]:
            touched.add(name)
        index = self._index
        for name in touched:
            replica = self.replicas.get(name)
            if replica is None:
                index.remove(name)
                self._ejected.discard(name)
                continue
            view = replica.view(now, self.capacity)
            index.sync(view)
            (self._ejected.add if view.ejected else self._ejected.discard)(name)
        touched.clear()
        return index

    def claim(self, replica: Replica, adapters: tuple[str, ...]) -> None:
        """A request sent to `replica`: its in-flight counts."""
        replica.inflight += 1
        for a in adapters:
            replica.inflight_by_adapter[a] += 1
        self._follow_counts(replica, adapters)

    def release(self, replica: Replica, adapters: tuple[str, ...]) -> list[str]:
        """A request on `replica` finished (or failed): its in-flight counts; returns the adapters
        it left with no request in flight there."""
        replica.inflight = max(0, replica.inflight - 1)
        idle = []
        for a in adapters:
            replica.inflight_by_adapter[a] -= 1
            if replica.inflight_by_adapter[a] <= 0:
                del replica.inflight_by_adapter[a]
                idle.append(a)
        self._follow_counts(replica, adapters)
        return idle

    def _follow_counts(self, replica: Replica, adapters: tuple[str, ...]) -> None:
        """The index follows a count change without re-reading the whole replica: its load and the
        adapters' activity (running per the last poll, or in flight from here), as `view` has them."""
        name = replica.name
        i = self._index.ids.get(name)
        if name in self._touched or i is None:
            self._touched.add(name)
            return
        index = self._index
        state = index.replicas[i]
        index.set_counts(i, state.running, state.waiting, replica.inflight)
        polled = replica.inventory_active()
        for a in adapters:
            index.set_active(i, a, a in polled or replica.inflight_by_adapter.get(a, 0) > 0)

    def views(self, exclude: Iterable[str] = ()) -> list[EndpointView]:
        now = self.clock()
        skip = set(exclude)
        return [r.view(now, self.capacity) for r in self.replicas.values() if r.name not in skip]

    def base_models(self) -> set[str]:
        return {r.inventory.model for r in self.replicas.values() if r.inventory is not None}

    def max_loras_per_request(self, model: str) -> int | None:
        """The most adapters one request may compose on any replica serving `model` (None: no
        replica of it has answered a poll yet, so nothing is known)."""
        known = [r.inventory.max_loras_per_request for r in self.replicas.values()
                 if r.inventory is not None and r.inventory.model == model]
        return max(known, default=None)

    def too_narrow(self, adapters: int) -> set[str]:
        """Replicas whose workers refuse a request composing this many adapters."""
        return {r.name for r in self.replicas.values()
                if r.inventory is not None and r.inventory.max_loras_per_request < adapters}

    def record_success(self, name: str) -> None:
        replica = self.replicas.get(name)
        if replica is not None:
            if not replica.reachable:
                replica.touch()
            replica.failures = 0
            replica.reachable = True

    def record_failure(self, name: str, unreachable: bool) -> bool:
        """Count a failure; returns True when this failure ejects the replica."""
        replica = self.replicas.get(name)
        if replica is None:
            return False
        if unreachable:
            replica.reachable = False  # connection refused: no point trying until a poll answers
            replica.touch()
        replica.failures += 1
        if replica.failures >= self.eject_after and replica.ejected_until <= self.clock():
            replica.eject_until(self.clock() + self.cooldown_s)
            return True
        return False

    def due_for_probe(self) -> list[Replica]:
        now = self.clock()
        return [
            r for r in self.replicas.values() if r.failures >= self.eject_after and r.ejected_until <= now
        ]

    def readmit(self, name: str) -> None:
        replica = self.replicas.get(name)
        if replica is not None:
            replica.failures = 0
            replica.eject_until(0.0)
