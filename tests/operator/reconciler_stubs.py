"""Stub workers (in memory: one digest per source folder) and a recording placement store for the
reconcile-loop tests (`test_reconciler.py`, `test_rollout.py`): no HTTP, no kopf."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from lorafleet.operator import placement
from lorafleet.operator.pool_state import PodState, ReconcilerSettings
from lorafleet.operator.reconciler import PoolReconciler
from lorafleet.operator.spec import PoolSpec, parse_adapter
from lorafleet.operator.worker_client import LoadRefused, WorkerBusy
from lorafleet.placement_store import MemoryPlacementStore
from lorafleet.protocol import AdapterInfo, AdapterInventory

NOW = 1_000_000.0


PODS = ("p0", "p1")


@dataclass(slots=True)
class StubWorkers:
    """`WorkerClient`'s interface over in-memory workers; a worker's URL is its pod's name."""

    events: list[tuple]
    held: dict[str, dict[str, AdapterInfo]] = field(default_factory=lambda: {p: {} for p in PODS})
    refuse: set[str] = field(default_factory=set)  # adapter names, or source paths, whose loads are refused
    broken: int = 0  # inventory calls left that raise what no worker client should (a bug)
    changed: dict[str, str] = field(default_factory=dict)  # source path -> the digest it gives now (an object replaced)

    async def inventory(self, url: str, token: str) -> AdapterInventory:
        if self.broken > 0:
            self.broken -= 1
            raise RuntimeError("unforeseen")
        return AdapterInventory(
            model="base",
            max_loras=4,
            max_cpu_loras=8,
            max_lora_rank=64,
            max_loras_per_request=4,
            adapters=list(self.held[url].values()),
        )

    async def load(self, url: str, token: str, name: str, path: str, inplace: bool = False,
                   sha256: str | None = None) -> AdapterInventory:
        old = self.held[url].get(name)
        self.events.append(("reload" if inplace and old is not None else "load", url, name))
        if name in self.refuse or path in self.refuse:
            raise LoadRefused(400, "not an adapter")
        new = info(name, path=path)
        if path in self.changed:
            new = new.model_copy(update={"digest": self.changed[path]})
        want = None if sha256 is None else "sha256:" + sha256.lower().removeprefix("sha256:")
        if want is not None and new.digest != want:  # as the real worker: refused before it serves
            raise LoadRefused(400, f"digest mismatch for {path}: expected {want}, got {new.digest}", "DigestMismatch")
        if old is not None and old.digest != new.digest:
            if not inplace:
                raise LoadRefused(409, f"{name} is loaded with different content")
            if old.requests_in_flight:
                raise WorkerBusy(f"{name} has requests in flight")
        self.held[url][name] = new
        return await self.inventory(url, token)

    async def unload(self, url: str, token: str, name: str) -> AdapterInventory:
        self.events.append(("unload", url, name))
        self.held[url].pop(name, None)
        return await self.inventory(url, token)


class RecordingStore(MemoryPlacementStore):
    def __init__(self, events: list[tuple]) -> None:
        super().__init__()
        self.events = events

    async def record_residency(self, replica: str, adapter: str, tier: str | None, ttl_s: float) -> None:
        self.events.append(("store", replica, adapter, tier))
        await super().record_residency(replica, adapter, tier, ttl_s)


def digest_of(path: str) -> str:
    """The stub's content: one digest per source folder."""
    return "sha256:" + hashlib.sha256(path.encode()).hexdigest()


def info(name: str, last_used: float | None = None, in_flight: int = 0, idle_s: float | None = None,
         path: str | None = None, tier: str = "cpu") -> AdapterInfo:
    path = path or f"/adapters/{name}"
    return AdapterInfo(
        name=name,
        tier=tier,
        rank=8,
        alpha=16.0,
        digest=digest_of(path),
        path=path,
        requests_in_flight=in_flight,
        last_used=last_used,
        idle_s=idle_s,
    )


def make(adapters: dict[str, tuple[int, int]]) -> tuple[PoolReconciler, StubWorkers, list[tuple]]:
    events: list[tuple] = []
    workers = StubWorkers(events)
    reconciler = PoolReconciler(
        "ns",
        "pool",
        workers,
        None,
        RecordingStore(events),
        ReconcilerSettings(),  # type: ignore[arg-type]
        url_of=lambda pod, _port: pod.name,
        clock=lambda: NOW,
    )
    reconciler.set_pool(PoolSpec("ns", "pool", "img", "/model", "base"), "token")
    for pod in PODS:
        reconciler.observe_pod(PodState(pod, "10.0.0.1", ready=True, draining=False))
    for name, (lo, hi) in adapters.items():
        spec = parse_adapter("ns", name, {"pool": "pool", "source": name, "replicas": {"min": lo, "max": hi}})
        reconciler.upsert_adapter(spec, 1, None)
    return reconciler, workers, events


def home_and_other(name: str) -> tuple[str, str]:
    views = [placement.PodView(p, 8) for p in PODS]
    (home,) = placement.assign([placement.AdapterWant(name)], views).pods[name]
    return home, next(p for p in PODS if p != home)


def respec(reconciler: PoolReconciler, name: str, status: dict | None = None, **spec: object) -> None:
    full = {"pool": "pool", "source": name, "replicas": {"min": 1, "max": 1}, **spec}
    reconciler.upsert_adapter(parse_adapter("ns", name, full), 2, status)


async def one_busy_copy() -> tuple[PoolReconciler, StubWorkers, list[tuple], list[float], str, str]:
    """Adapter `a` (one replica) loaded on its home pod, which now always has requests in flight;
    the reconciler's clock is `now[0]`."""
    reconciler, workers, events = make({"a": (1, 1)})
    now = [NOW]
    reconciler.clock = lambda: now[0]
    await reconciler.reconcile_once()
    home, other = home_and_other("a")
    workers.held[home]["a"] = info("a", in_flight=3)
    return reconciler, workers, events, now, home, other
