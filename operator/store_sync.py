"""What the routers read from the placement store (mixed into `PoolReconciler`): each serving
worker's adapters and the catalog of adapters and their paths, published every round; a copy's
residency recorded at once as it is loaded or unloaded; an adapter's catalog entry removed when it
is deleted. The store is advisory: a failed write is logged and the next round writes again.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from lorafleet.placement_store import replica_key

if TYPE_CHECKING:
    from lorafleet.operator.pool_state import AdapterRecord, PodState, ReconcilerSettings, UrlOf
    from lorafleet.operator.spec import PoolSpec
    from lorafleet.protocol import AdapterInventory

log = logging.getLogger("lorafleet.operator")


class StoreSync:
    """The placement-store half of `PoolReconciler`; every attribute is the reconciler's."""

    __slots__ = ()
    if TYPE_CHECKING:
        namespace: str
        store: Any | None
        settings: ReconcilerSettings
        url_of: UrlOf
        pool: PoolSpec | None
        adapters: dict[str, AdapterRecord]
        pods: dict[str, PodState]
        inventories: dict[str, AdapterInventory]
        loaded: dict[str, set[str]]

        def _target_path(self, record: AdapterRecord) -> str: ...

    async def _record_residency(self, pod: str, adapter: str, tier: str | None) -> None:
        if self.store is None:
            return
        try:
            await self.store.record_residency(replica_key(self.namespace, pod), adapter, tier, self.settings.publish_ttl_s)
        except Exception as exc:  # advisory: the round's publish writes the whole residency again
            log.debug("placement store write failed: %s", exc)

    async def _publish(self) -> None:
        if self.store is None or self.pool is None:
            return
        try:
            for name, pod in self.pods.items():
                inv = self.inventories.get(name)
                if inv is None or not pod.in_service:
                    continue
                tiers = {a.name: a.tier for a in inv.adapters}
                adapters = {n: tiers.get(n, "cpu") for n in self.loaded.get(name, ())}
                url = self.url_of(pod, self.pool.http_port)
                await self.store.publish_replica(replica_key(self.namespace, name), url, self.pool.served_name, adapters,
                                                 self.settings.publish_ttl_s)
            catalog = {r.spec.name: self._target_path(r) for r in self.adapters.values() if r.problem is None}
            await self.store.set_catalog(catalog)
        except Exception as exc:  # the router keeps its last view; the next round publishes again
            log.warning("placement store publish failed: %s", exc)

    async def _remove_catalog(self, name: str) -> None:
        if self.store is None:
            return
        try:
            await self.store.remove_catalog(name)
        except Exception as exc:  # routers keep the entry until the next publish without it
            log.warning("placement store: %s not removed from the catalog: %s", name, exc)
