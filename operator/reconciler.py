"""Per-pool reconcile loop: observe workers, plan placement, load/unload, publish, write status.

No kopf here: the kopf handlers feed it (adapters, pods, the pool spec) and wake it; a kopf daemon
runs `run()` and a kopf timer calls `wake(resync=True)` so drift is repaired level-triggered even
when nothing changes in Kubernetes.

One loop per pool, not one per adapter: placement is pool-wide (capacity is shared), and a loop
that polls each worker once per round scales to thousands of adapters with a handful of requests.
The records it keeps, and the pure read-outs of them (verification, readiness, statuses), are in
`pool_state`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lorafleet.operator import placement, pool_state
from lorafleet.operator.kube import KubeClient, KubeError, NotFound
from lorafleet.operator.pool_state import (
    AdapterRecord,
    PodState,
    ReconcilerSettings,
    RoundResult,
    UrlOf,
    pod_url,
)
from lorafleet.operator.spec import API_VERSION, AdapterSpec, PoolSpec, SpecError, check_against_pool
from lorafleet.operator.worker_client import LoadRefused, WorkerClient, WorkerError, resident
from lorafleet.protocol import AdapterInventory

log = logging.getLogger("lorafleet.operator")


@dataclass(slots=True)
class PoolReconciler:
    """The reconcile loop of one pool.

    `url_of` is how the loop reaches a worker (see `UrlOf`). The default suits Kubernetes; a
    deployment whose workers share one address on distinct ports (`lorafleet up`) passes its own map.
    """

    namespace: str
    name: str
    workers: WorkerClient
    kube: KubeClient | None
    store: Any | None  # lorafleet.placement_store.PlacementStore
    settings: ReconcilerSettings = ReconcilerSettings()
    url_of: UrlOf = pod_url
    pool: PoolSpec | None = None
    token: str | None = None
    # set_pool has been called in this process (a None pool then means deleted or invalid); before
    # that, after an operator restart, rounds write no statuses (they would read "PoolNotFound").
    pool_known: bool = False
    adapters: dict[str, AdapterRecord] = field(default_factory=dict)
    pods: dict[str, PodState] = field(default_factory=dict)
    inventories: dict[str, AdapterInventory] = field(default_factory=dict)
    loaded: dict[str, set[str]] = field(default_factory=dict)  # pod -> resident adapters (verified)
    digests: dict[str, str] = field(default_factory=dict)  # adapter -> digest a worker reported
    pool_status: dict[str, Any] | None = None
    clock: Callable[[], float] = time.time  # unix seconds, as the workers' `last_used`
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _resync: bool = True
    _round_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    # ---- inputs from the handlers -------------------------------------------------------------

    def set_pool(self, pool: PoolSpec | None, token: str | None) -> None:
        self.pool, self.token, self.pool_known = pool, token, True
        self.wake(resync=True)

    def upsert_adapter(self, spec: AdapterSpec, generation: int | None, status: Mapping[str, Any] | None) -> None:
        old = self.adapters.get(spec.name)
        record = AdapterRecord(spec, generation, dict(status) if status else None)
        if old is not None and old.spec == spec:
            record.failure = old.failure
            record.status = old.status if record.status is None else record.status
        self.adapters[spec.name] = record
        self.wake()

    def forget_adapter(self, name: str) -> None:
        if self.adapters.pop(name, None) is not None:
            self.wake()

    def observe_pod(self, pod: PodState) -> None:
        if self.pods.get(pod.name) != pod:
            self.pods[pod.name] = pod
            self.wake(resync=True)

    def remove_pod(self, name: str) -> None:
        self.pods.pop(name, None)
        self.inventories.pop(name, None)
        self.loaded.pop(name, None)
        self.wake()

    def wake(self, resync: bool = False) -> None:
        self._resync = self._resync or resync
        self._wake.set()

    # ---- the loop ----------------------------------------------------------------------------

    async def run(self, stopped: asyncio.Event | None = None) -> None:
        while stopped is None or not stopped.is_set():
            try:
                # The kopf timer wakes us every resync_s; the timeout is only a fallback.
                await asyncio.wait_for(self._wake.wait(), timeout=3 * self.settings.resync_s)
            except asyncio.TimeoutError:
                self._resync = True
            self._wake.clear()
            delay = 0.0
            for _ in range(self.settings.max_rounds_per_wake):
                result = await self.reconcile_once()
                if result.errors:
                    delay = self.settings.retry_s
                if not result.actions:
                    break
            if delay:
                # Transient errors: come back soon, but let a wake-up in between cut the wait.
                asyncio.get_running_loop().call_later(delay, self.wake, True)

    async def _poll(self, pods: list[PodState]) -> int:
        assert self.pool is not None and self.token is not None
        errors = 0

        async def one(pod: PodState) -> None:
            nonlocal errors
            try:
                inv = await self.workers.inventory(self.url_of(pod, self.pool.admin_port), self.token)
            except WorkerError as exc:
                errors += 1
                log.debug("inventory of %s failed: %s", pod.name, exc)
                self.inventories.pop(pod.name, None)
                self.loaded.pop(pod.name, None)
                return
            self.inventories[pod.name] = inv
            self.loaded[pod.name] = resident(inv)
            pool_state.note_digests(self.digests, inv)

        await asyncio.gather(*(one(p) for p in pods))
        return errors

    async def reconcile_once(self) -> RoundResult:
        async with self._round_lock:
            return await self._reconcile_once()

    async def _reconcile_once(self) -> RoundResult:
        result = RoundResult()
        if self.pool is None or self.token is None:
            if self.pool_known:  # deleted or invalid; unknown yet: the pool handler has not run
                await self._write_statuses(None, set(), reason="PoolNotFound", message=f"LoraPool {self.name} not found")
            return result
        pool = self.pool
        live = [p for p in self.pods.values() if p.ip and (p.ready or p.draining)]
        for gone in set(self.inventories) - {p.name for p in live}:
            self.inventories.pop(gone, None)
            self.loaded.pop(gone, None)
        to_poll = live if self._resync else [p for p in live if p.name not in self.inventories]
        self._resync = False
        if to_poll:
            result.errors += await self._poll(to_poll)
        for record in self.adapters.values():
            if record.failure is None:
                try:
                    check_against_pool(record.spec, pool)
                except SpecError as exc:
                    record.failure = (exc.reason, str(exc))
        pool_state.check_loaded(self.adapters, self.inventories, self.loaded, pool.engine.max_lora_rank)

        wants = [
            placement.AdapterWant(r.spec.name, r.spec.min_replicas, r.spec.max_replicas, r.spec.pinned)
            for r in self.adapters.values()
            if r.failure is None
        ]
        views = [
            placement.PodView(
                p.name,
                self.inventories[p.name].max_cpu_loras if p.name in self.inventories else pool.engine.max_cpu_loras,
                ready=p.ready,
                draining=p.draining,
            )
            for p in live
        ]
        demand = await self._demand()
        settings = placement.PlacementSettings(requests_per_replica=pool.requests_per_replica)
        target = placement.assign(wants, views, demand, settings)
        in_use = pool_state.in_use(self.inventories, self.clock(), self.settings.idle_unload_s)
        loaded = {p: self.loaded[p] for p in self.inventories}
        actions = placement.plan(wants, views, loaded, demand, settings, in_use)
        result.actions = len(actions)
        if actions:
            result.errors += await self._execute(actions)
        await self._publish()
        refused = await self._write_statuses(target, {a.adapter for a in actions if a.kind == "load"})
        result.changed = bool(actions) or refused
        return result

    async def _demand(self) -> dict[str, float]:
        if self.store is None:
            return {}
        try:
            return await self.store.demand(self.settings.demand_window_s)
        except Exception as exc:  # the store is advisory: placement falls back to min replicas
            log.warning("placement store demand unavailable: %s", exc)
            return {}

    async def _execute(self, actions: list[placement.Action]) -> int:
        assert self.pool is not None and self.token is not None
        pool, token = self.pool, self.token
        errors = 0
        limits: dict[str, asyncio.Semaphore] = {}

        async def one(action: placement.Action) -> None:
            nonlocal errors
            pod = self.pods.get(action.pod)
            record = self.adapters.get(action.adapter)
            if pod is None or pod.ip is None:
                return
            url = self.url_of(pod, pool.admin_port)
            sem = limits.setdefault(action.pod, asyncio.Semaphore(self.settings.worker_concurrency))
            async with sem:
                try:
                    if action.kind == "load":
                        if record is None:
                            return
                        path = f"{pool.adapter_mount.rstrip('/')}/{record.spec.source}"
                        inv = await self.workers.load(url, token, action.adapter, path)
                        self.loaded.setdefault(action.pod, set()).add(action.adapter)
                        pool_state.note_digests(self.digests, inv)
                    else:
                        # Withdraw first: routers stop sending it here before the worker drops it.
                        # (A router still routing on an older poll gets the worker's 404 and retries.)
                        await self._record_residency(action.pod, action.adapter, None)
                        await self.workers.unload(url, token, action.adapter)
                        self.loaded.setdefault(action.pod, set()).discard(action.adapter)
                except LoadRefused as exc:
                    if record is not None:
                        record.failure = (exc.reason, exc.message)
                    return
                except WorkerError as exc:
                    errors += 1
                    log.info("%s %s on %s: %s", action.kind, action.adapter, action.pod, exc)
                    return
            if action.kind == "load":  # published only once the inventory shows it loaded
                await self._record_residency(action.pod, action.adapter, "cpu")

        unloads = [a for a in actions if a.kind == "unload"]
        loads = [a for a in actions if a.kind == "load"]
        await asyncio.gather(*(one(a) for a in unloads))
        await asyncio.gather(*(one(a) for a in loads))
        return errors

    async def _record_residency(self, pod: str, adapter: str, tier: str | None) -> None:
        if self.store is None:
            return
        try:
            await self.store.record_residency(pod, adapter, tier, self.settings.publish_ttl_s)
        except Exception as exc:  # advisory: the round's publish writes the whole residency again
            log.debug("placement store write failed: %s", exc)

    async def _publish(self) -> None:
        if self.store is None or self.pool is None:
            return
        try:
            for name, pod in self.pods.items():
                inv = self.inventories.get(name)
                if inv is None or not pod.ready or pod.draining or pod.ip is None:
                    continue
                tiers = {a.name: a.tier for a in inv.adapters}
                adapters = {n: tiers.get(n, "cpu") for n in self.loaded.get(name, ())}
                url = self.url_of(pod, self.pool.http_port)
                await self.store.publish_replica(name, url, self.pool.served_name, adapters, self.settings.publish_ttl_s)
            catalog = {
                r.spec.name: f"{self.pool.adapter_mount.rstrip('/')}/{r.spec.source}"
                for r in self.adapters.values()
                if r.failure is None
            }
            await self.store.set_catalog(catalog)
        except Exception as exc:  # the router keeps its last view; the next round publishes again
            log.warning("placement store publish failed: %s", exc)

    def ready_replicas(self, adapter: str) -> int:
        return pool_state.ready_replicas(self.pods, self.loaded, adapter)

    async def _write_statuses(
        self,
        target: placement.Assignment | None,
        loading: set[str],
        reason: str = "InsufficientCapacity",
        message: str = "",
    ) -> bool:
        writes = pool_state.status_writes(
            self.adapters, self.pods, self.inventories, self.loaded, self.digests, target, loading, reason, message
        )
        if writes:
            await self._patch_statuses(writes)
        await self._write_pool_status()
        return bool(writes)

    async def _patch_statuses(self, writes: list[tuple[AdapterRecord, dict[str, Any]]]) -> None:
        if self.kube is None:
            for record, new in writes:
                record.status = new
            return
        sem = asyncio.Semaphore(self.settings.status_concurrency)

        async def one(record: AdapterRecord, new: dict[str, Any]) -> None:
            path = KubeClient.path(API_VERSION, "loraadapters", self.namespace, record.spec.name, "status")
            async with sem:
                try:
                    await self.kube.patch(path, {"status": new})
                    record.status = new
                    # An upsert during the write (kopf's resume handler on restart, say) replaced the
                    # record with one built from the event's older status: the object has `new` all
                    # the same, so remember it there too, or the status is never rewritten.
                    current = self.adapters.get(record.spec.name)
                    if current is not None and current is not record:
                        current.status = new
                except NotFound:
                    pass  # deleted meanwhile
                except (KubeError, OSError) as exc:
                    log.warning("status of %s not written: %s", record.spec.name, exc)

        await asyncio.gather(*(one(r, s) for r, s in writes))

    async def _write_pool_status(self) -> None:
        if self.pool is None or self.kube is None:
            return
        new = pool_state.pool_status_of(self.pool, self.pods, self.adapters)
        if self.pool_status == new:
            return
        path = KubeClient.path(API_VERSION, "lorapools", self.namespace, self.name, "status")
        try:
            await self.kube.patch(path, {"status": new})
            self.pool_status = new
        except (KubeError, OSError) as exc:
            log.warning("pool status not written: %s", exc)

    # ---- finalizer support ---------------------------------------------------------------------

    async def unload_everywhere(self, adapter: str) -> list[str]:
        """Unload `adapter` from every ready worker; returns the pods where that is not yet verified.

        Pods that vanished or are not Ready count as unloaded: a restarted worker holds nothing, and
        the drift repair unloads any stray copy once it is back.
        """
        self.forget_adapter(adapter)
        async with self._round_lock:  # no round may load it again meanwhile
            if self.store is not None:
                try:  # first, so that no router cold-loads it back while the unloads run
                    await self.store.remove_catalog(adapter)
                except Exception as exc:
                    log.warning("placement store: %s not removed from the catalog: %s", adapter, exc)
            return await self._unload_everywhere(adapter)

    async def _unload_everywhere(self, adapter: str) -> list[str]:
        if self.pool is None or self.token is None:
            return []
        pending: list[str] = []

        async def one(pod: PodState) -> None:
            url = self.url_of(pod, self.pool.admin_port)
            try:
                inv = await self.workers.inventory(url, self.token)
                if adapter in resident(inv):
                    inv = await self.workers.unload(url, self.token, adapter)
                self.inventories[pod.name] = inv
                self.loaded[pod.name] = resident(inv)
            except WorkerError:
                pending.append(pod.name)

        await asyncio.gather(*(one(p) for p in self.pods.values() if p.ip and p.ready))
        if self.store is not None:
            for pod in self.pods:
                if pod not in pending:
                    try:
                        await self.store.record_residency(pod, adapter, None, self.settings.publish_ttl_s)
                    except Exception:
                        pass
        return sorted(pending)
