"""Per-pool reconcile loop: observe workers, plan placement, load/unload, publish, write status.

No kopf here: the kopf handlers feed it (adapters, pods, the pool spec) and wake it; a kopf daemon
runs `run()` and a kopf timer calls `wake(resync=True)` so drift is repaired level-triggered even
when nothing changes in Kubernetes.

One loop per pool, not one per adapter: placement is pool-wide (capacity is shared), and a loop
that polls each worker once per round scales to thousands of adapters with a handful of requests.
The records it keeps, and the pure read-outs of them (verification, readiness, statuses), are in
`pool_state`; the status writes to the API in `status_writer`; how a changed adapter is rolled out
(reloads, canaries, refused updates) in `rollout`; worker pods that roll or go in `pod_roll`; what
the routers read from the placement store in `store_sync`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lorafleet.operator import placement, pool_state, status_writer
from lorafleet.operator.kube import KubeClient
from lorafleet.operator.pod_roll import PodRoll
from lorafleet.operator.pool_state import (
    AdapterRecord,
    PodState,
    ReconcilerSettings,
    RoundResult,
    UrlOf,
    pod_url,
)
from lorafleet.operator.rollout import Rollout
from lorafleet.operator.sources import is_remote
from lorafleet.operator.spec import AdapterSpec, PoolSpec, SpecError, check_against_pool
from lorafleet.operator.store_sync import StoreSync
from lorafleet.operator.worker_client import (
    LoadRefused,
    WorkerClient,
    WorkerError,
    fetch_retry,
    resident,
)
from lorafleet.protocol import AdapterInventory

# Failure reasons that depend on the pool's spec (maxLoraRank, served name, sources), not the adapter's alone.
POOL_FAILURES = frozenset({"RankTooHigh", "NameIsBaseModel", "SourceNotAllowed", "CredentialsNotOnPool",
                           "SourceUnsupported"})

log = logging.getLogger("lorafleet.operator")


@dataclass(slots=True)
class PoolReconciler(Rollout, PodRoll, StoreSync):
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
    pool_problem: tuple[str, str] | None = None  # (reason, message) while the pool is deleted or invalid
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
    _crashes: int = 0  # rounds in a row that raised: their retries back off
    # (pod, adapter) copies of a new version loaded beside a busy old one (`_load_spare`): kept by
    # the placement, as copies in use are, until the old one is drained.
    _spares: set[tuple[str, str]] = field(default_factory=set)
    # pod -> its deletion cost and gate as this term wrote them: newer than a pod event still queued.
    _marks: dict[str, dict[str, Any]] = field(default_factory=dict)

    # ---- inputs from the handlers -------------------------------------------------------------

    def set_pool(self, pool: PoolSpec | None, token: str | None, problem: tuple[str, str] | None = None) -> None:
        """The pool's spec (None: deleted, or invalid with `problem` = (reason, message))."""
        if pool != self.pool:  # failures judged against the old pool are judged again against this one
            for record in self.adapters.values():
                if record.failure is not None and record.failure[0] in POOL_FAILURES:
                    record.failure = None
        self.pool, self.token, self.pool_known = pool, token, True
        self.pool_problem = None if pool is not None else problem or ("PoolNotFound", f"LoraPool {self.name} not found")
        self.pool_status = None  # the handler may have written the phase meanwhile (Failed): write it again
        self.wake(resync=True)

    async def pool_deleted(self) -> None:
        """The LoraPool is gone (its workers go with it): its adapters read Pending, PoolNotFound, and
        leave the router's catalog, so that no router cold-loads them on another pool's workers.

        Runs one round itself: the pool's daemon, which runs the loop, has stopped with the pool.
        """
        self.set_pool(None, None)
        async with self._round_lock:
            self.pods.clear()
            self.inventories.clear()
            self.loaded.clear()
            for name, record in list(self.adapters.items()):
                if record.conflict is None:  # else the name's catalog entry is another namespace's adapter's
                    await self._remove_catalog(name)
            await self._reconcile_once()

    def upsert_adapter(self, spec: AdapterSpec, generation: int | None, status: Mapping[str, Any] | None) -> None:
        old = self.adapters.get(spec.name)
        record = AdapterRecord(spec, generation, dict(status) if status else None)
        record.succeed(old)
        self.adapters[spec.name] = record
        # New content: the round polls every worker first, so it sees every copy of the old one.
        self.wake(resync=record.outdated or (old is not None and old.spec.sha256 != spec.sha256))

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
        for record in self.adapters.values():
            record.verified.pop(name, None)  # a pod of that name again is a new worker
            record.busy_since.pop(name, None)
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
                try:
                    result = await self.reconcile_once()
                except Exception:  # a bug or an unforeseen answer must not stop the pool's loop
                    self._crashes += 1
                    delay = min(self.settings.retry_s * 2 ** min(self._crashes, 6), 60.0)
                    log.exception("pool %s/%s: reconcile round failed; retrying in %.0f s", self.namespace, self.name, delay)
                    break
                self._crashes = 0
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
            if self.pool_known and self.pool_problem is not None:  # deleted or invalid; unknown yet: no handler ran
                await self._write_statuses(None, set(), reason=self.pool_problem[0], message=self.pool_problem[1])
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
        pool_state.sync_verified(self.adapters, self.inventories)
        pool_state.check_loaded(self.adapters, self.inventories, self.loaded, pool.engine.max_lora_rank)
        result.errors += await self._probe_refused()
        stale = pool_state.stale_copies(self.adapters, self.inventories)
        if stale:
            result.errors += await self._reload(stale)
            stale = pool_state.stale_copies(self.adapters, self.inventories)
        stale_names = {name for _, name in stale}
        if len(self.inventories) == len(live):  # every worker seen: no copy of an older source is left
            for record in self.adapters.values():
                if record.outdated and not record.update_refused and record.spec.name not in stale_names:
                    record.outdated = False

        wants = [
            placement.AdapterWant(r.spec.name, r.spec.min_replicas, r.spec.max_replicas, r.spec.pinned)
            for r in self.adapters.values()
            if r.problem is None
        ]
        live = [self.pods[p.name] for p in live if p.name in self.pods]  # as they are now, after the awaits
        leaving = self._retiring()
        views = [
            placement.PodView(
                p.name,
                # vLLM does not report its --max-cpu-loras: the pool's engine spec set it
                self.inventories[p.name].max_cpu_loras if p.name in self.inventories and pool.server.kind != "vllm"
                else pool.engine.max_cpu_loras,
                ready=p.ready,
                draining=p.draining or p.name in leaving,  # retiring: keeps serving until emptied
                serving=p.in_service,
            )
            for p in live
        ]
        demand = await self._demand()
        settings = placement.PlacementSettings(requests_per_replica=pool.requests_per_replica)
        target = placement.assign(wants, views, demand, settings)
        in_use = pool_state.in_use(self.inventories, self.clock(), self.settings.idle_unload_s)
        # A spare stays while its copy is listed and an old copy of that adapter is still being replaced.
        self._spares = {(pod, name) for pod, name in self._spares
                        if pool_state.info_of(self.inventories.get(pod), name) is not None and name in stale_names}
        for pod, name in self._spares:
            in_use.setdefault(pod, set()).add(name)
        # Old versions being replaced are the rollout's (reload, drain), not the placement's: it
        # neither counts nor unloads them, so a new version's copy beside a busy old one stays.
        loaded = pool_state.without({p: self.loaded[p] for p in self.inventories}, stale)
        actions = [a for a in placement.plan(wants, views, loaded, demand, settings, in_use)
                   if (a.pod, a.adapter) not in stale]  # a load there is the rollout's reload
        result.actions = len(actions)
        if actions:
            result.errors += await self._execute(actions)
        result.errors += await self._roll_pods(target, leaving)
        await self._publish()
        # An old version still loaded (its reload is refused for now) is not a ready replica.
        loading = {a.adapter for a in actions if a.kind == "load"} | stale_names
        refused = await self._write_statuses(target, loading, current=pool_state.without(self.loaded, stale))
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
                        before = pool_state.info_of(self.inventories.get(action.pod), action.adapter)
                        # In place: this operator owns the name's content, so an old version the
                        # pod still lists (a disk-tier entry, a router's copy) is replaced, not a 409.
                        inv = await self.workers.load(url, token, action.adapter, self._target_path(record), inplace=True,
                                                      sha256=self._pin(record))
                        self._took(record, action.pod, inv, before)
                    else:
                        # Withdraw first: routers stop sending it here before the worker drops it.
                        # (A router still routing on an older poll gets the worker's 404 and retries.)
                        await self._record_residency(action.pod, action.adapter, None)
                        await self.workers.unload(url, token, action.adapter)
                        self.loaded.setdefault(action.pod, set()).discard(action.adapter)
                        if record is not None:
                            record.verified.pop(action.pod, None)
                except LoadRefused as exc:
                    if record is not None:
                        await self._refused(record, exc, url, action.pod)
                    return
                except WorkerError as exc:
                    errors += 1
                    retry = fetch_retry(exc) if action.kind == "load" and record is not None else None
                    if retry is not None:  # a remote source that keeps failing: said in its status
                        record.fetch_retrying = retry
                    log.info("%s %s on %s: %s", action.kind, action.adapter, action.pod, exc)
                    return
            if action.kind == "load":  # published only once the inventory shows it loaded
                await self._record_residency(action.pod, action.adapter, "cpu")

        unloads = [a for a in actions if a.kind == "unload"]
        loads = [a for a in actions if a.kind == "load"]
        await asyncio.gather(*(one(a) for a in unloads))
        await asyncio.gather(*(one(a) for a in loads))
        return errors

    def _note_copy(self, pod: str, inventory: AdapterInventory, name: str) -> None:
        """Put what `inventory` (a worker's answer to a load) says of `name` into the pod's cached
        inventory, leaving its other entries as the last poll saw them (loads run concurrently)."""
        info = pool_state.info_of(inventory, name)
        cached = self.inventories.get(pod)
        if cached is None:
            self.inventories[pod] = inventory
        elif info is not None:
            others = [a for a in cached.adapters if a.name != name]
            self.inventories[pod] = cached.model_copy(update={"adapters": [*others, info]})

    def _source_path(self, spec: AdapterSpec) -> str:
        """What the worker loads: a remote source as written (the worker fetches it), else the
        folder on the pool's adapter volume."""
        assert self.pool is not None
        if is_remote(spec.source):
            return spec.source
        return f"{self.pool.adapter_mount.rstrip('/')}/{spec.source}"

    def ready_replicas(self, adapter: str) -> int:
        return pool_state.ready_replicas(self.pods, self.loaded, adapter)

    async def _write_statuses(
        self,
        target: placement.Assignment | None,
        loading: set[str],
        reason: str = "InsufficientCapacity",
        message: str = "",
        current: dict[str, set[str]] | None = None,
    ) -> bool:
        loaded = self.loaded if current is None else current
        writes = pool_state.status_writes(
            self.adapters, self.pods, self.inventories, loaded, self.digests, target, loading, reason, message
        )
        if writes:
            await status_writer.patch_adapter_statuses(
                self.kube, self.namespace, self.adapters, writes, self.settings.status_concurrency
            )
        await self._write_pool_status()
        return bool(writes)

    async def _write_pool_status(self) -> None:
        if self.pool is None or self.kube is None:
            return
        new = pool_state.pool_status_of(self.pool, self.pods, self.adapters)
        if self.pool_status != new and await status_writer.patch_pool_status(self.kube, self.namespace, self.name, new):
            self.pool_status = new

    # ---- finalizer support ---------------------------------------------------------------------

    async def unload_everywhere(self, adapter: str, keep_catalog: bool = False) -> list[str]:
        """Unload `adapter` from every ready worker; returns the pods where that is not yet verified.

        Pods that vanished or are not Ready count as unloaded: a restarted worker holds nothing, and
        the drift repair unloads any stray copy once it is back. `keep_catalog`: the router's catalog
        entry of that name is another namespace's adapter's.
        """
        self.forget_adapter(adapter)
        async with self._round_lock:  # no round may load it again meanwhile
            if not keep_catalog:  # first, so that no router cold-loads it back while the unloads run
                await self._remove_catalog(adapter)
            return await self._unload_everywhere(adapter)

    async def _unload_everywhere(self, adapter: str) -> list[str]:
        if self.pool is None or self.token is None:
            return []
        pending: list[str] = []

        async def one(pod: PodState) -> None:
            url = self.url_of(pod, self.pool.admin_port)
            try:
                inv = await self.workers.inventory(url, self.token)
                if pool_state.info_of(inv, adapter) is not None:  # disk-tier entries too: a later adapter of that name must not find them
                    inv = await self.workers.unload(url, self.token, adapter)
                self.inventories[pod.name] = inv
                self.loaded[pod.name] = resident(inv)
            except WorkerError:
                pending.append(pod.name)

        await asyncio.gather(*(one(p) for p in self.pods.values() if p.ip and p.ready))
        for pod in self.pods:
            if pod not in pending:
                await self._record_residency(pod, adapter, None)
        return sorted(pending)
