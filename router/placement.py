"""Keeps the fleet's residency view fresh: poll workers, publish to the shared store, merge it back.

Failure mode: when the placement store (Redis) fails, routing continues on the last local view
(our own polls plus our own write-throughs), `lorafleet_router_placement_store_up` drops to 0 and
errors are counted; when it answers again every replica is republished (a resync).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Mapping

import httpx

from lorafleet.placement_store import PlacementStore, in_scope, replica_key, residency_of
from lorafleet.router.admin_tokens import AdminTokens
from lorafleet.router.discovery import Discovery
from lorafleet.router.fleet import Fleet, Replica
from lorafleet.router.metrics import RouterMetrics
from lorafleet.router.worker_kinds import detect_kind, fetch_inventory

log = logging.getLogger("lorafleet.router")


class PlacementSync:
    def __init__(
        self,
        fleet: Fleet,
        store: PlacementStore,
        discovery: Discovery,
        http: httpx.AsyncClient,
        metrics: RouterMetrics,
        ttl_s: float,
        catalog: dict[str, str],
        tokens: AdminTokens | None = None,
        static_catalog: Mapping[str, str] | None = None,
        scope: str = "",
    ) -> None:
        self.fleet = fleet
        # The store names replicas `scope/pod` (placement_store.replica_key): the namespace the
        # router discovers workers in, "" for static workers.
        self.scope = scope
        self.store = store
        self.discovery = discovery
        self.http = http
        self.metrics = metrics
        self.ttl_s = ttl_s
        # Shared with the loader and the gateway, updated in place: static entries + the store's.
        self.catalog = catalog
        self.static_catalog = dict(catalog if static_catalog is None else static_catalog)
        # Adapters deleted from the store's catalog (LoraAdapter deleted): not routable even while a
        # replica still reports them (the operator's unload is on its way), until they come back.
        self.retired: set[str] = set()
        # The inventory is on the workers' admin API (it lists adapter paths): the pool's token.
        self.tokens = tokens or AdminTokens()
        self.store_up = True
        self.demand: Counter[str] = Counter()  # requests per adapter since the last publish
        metrics.store_up.set(1)

    async def run(self, interval_s: float) -> None:
        while True:
            try:
                await self.sync_once()
            except Exception:  # the loop must survive anything; the next round retries
                log.exception("placement sync round failed")
            await asyncio.sleep(interval_s)

    async def sync_once(self) -> None:
        with contextlib.suppress(Exception):
            self.fleet.set_endpoints(await self.discovery.endpoints())
        await asyncio.gather(*(self._poll(r) for r in list(self.fleet.replicas.values())))
        await asyncio.gather(*(self._probe(r) for r in self.fleet.due_for_probe()))
        await self._exchange()

    async def _poll(self, replica: Replica) -> None:
        started = self.fleet.clock()
        headers = self.tokens.headers(replica.pool)
        try:
            if replica.kind is None:  # a bare URL: probed once, the answer kept
                replica.kind = await detect_kind(self.http, replica.admin_url, headers)
            inventory = await fetch_inventory(self.http, replica.kind, replica.admin_url, headers, replica.limits)
            replica.apply_poll(inventory, started)
        except httpx.TimeoutException:
            replica.poll_failed(timed_out=True)
        except (httpx.HTTPError, ValueError):
            replica.poll_failed(timed_out=False)

    async def _probe(self, replica: Replica) -> None:
        """An ejected replica whose cooldown ran out comes back if /health answers."""
        try:
            resp = await self.http.get(f"{replica.url}/health", timeout=1.0)
            if resp.status_code == 200:
                self.fleet.readmit(replica.name)
                return
        except httpx.HTTPError:
            pass
        replica.eject_until(self.fleet.clock() + self.fleet.cooldown_s)

    async def _exchange(self) -> None:
        """Publish our polls and demand, read everyone's residency and the catalog."""
        try:
            for replica in self.fleet.replicas.values():
                if replica.inventory is not None and replica.reachable:
                    await self.store.publish_replica(
                        replica_key(self.scope, replica.name),
                        replica.url,
                        replica.inventory.model,
                        residency_of(replica.inventory),
                        self.ttl_s,
                    )
            demand, self.demand = self.demand, Counter()
            await self.store.record_demand(demand)
            snapshot = in_scope(await self.store.snapshot(), self.scope)
            shared_catalog = await self.store.catalog()
        except Exception:
            self._store_failed("sync")
            return
        if not self.store_up:
            self.metrics.store_resyncs.inc()
            log.warning("placement store answers again: republished and resynced")
        self.store_up = True
        self.metrics.store_up.set(1)
        self.adopt_catalog(shared_catalog)
        for name, placement in snapshot.items():
            replica = self.fleet.replicas.get(name)
            if replica is not None:
                replica.set_shared(dict(placement.adapters))

    def adopt_catalog(self, shared: Mapping[str, str]) -> None:
        """The catalog is the static entries plus the store's; what left the store leaves the catalog."""
        merged = {**self.static_catalog, **shared}
        # An empty store catalog is more likely a Redis that lost its data than every adapter deleted:
        # drop the entries (no cold loads) but keep routing to where they still are.
        gone = self.catalog.keys() - merged.keys() if shared else set()
        self.retired = (self.retired | gone) - merged.keys()
        self.catalog.clear()  # in place, no await between: the loader and gateway share the dict
        self.catalog.update(merged)

    def known(self, adapter: str) -> bool:
        """In the catalog, or resident on a replica and not deleted (start-up adapters of a worker)."""
        if adapter in self.catalog:
            return True
        return adapter not in self.retired and any(
            adapter in r.residency() for r in self.fleet.replicas.values()
        )

    def _store_failed(self, op: str) -> None:
        self.metrics.store_errors.labels(op).inc()
        if self.store_up:
            log.warning("placement store unavailable: routing on the local view (fail-open)")
        self.store_up = False
        self.metrics.store_up.set(0)

    async def write_through(self, replica: Replica, adapter: str, tier: str | None) -> None:
        replica.note(
            adapter, tier, time.monotonic() if self.fleet.clock is time.monotonic else self.fleet.clock()
        )
        if not self.store_up:
            return  # the next successful round republishes everything
        try:
            await self.store.record_residency(replica_key(self.scope, replica.name), adapter, tier, self.ttl_s)
        except Exception:
            self._store_failed("write_through")
