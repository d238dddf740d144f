"""All pools one operator reconciles: a `PoolReconciler` per (namespace, pool), created on demand."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lorafleet.operator.kube import KubeClient
from lorafleet.operator.pool_state import ReconcilerSettings, UrlOf, pod_url
from lorafleet.operator.reconciler import PoolReconciler
from lorafleet.operator.spec import AdapterSpec
from lorafleet.operator.worker_client import WorkerClient

log = logging.getLogger("lorafleet.operator")


@dataclass(slots=True)
class Fleet:
    """All pools this operator reconciles, keyed by (namespace, pool name)."""

    workers: WorkerClient
    kube: KubeClient | None
    store: Any | None
    settings: ReconcilerSettings = ReconcilerSettings()
    url_of: UrlOf = pod_url
    pools: dict[tuple[str, str], PoolReconciler] = field(default_factory=dict)
    adapter_pool: dict[tuple[str, str], str] = field(default_factory=dict)  # (ns, adapter) -> pool
    # adapter name -> {namespace: creationTimestamp}: every LoraAdapter that wants the name
    claims: dict[str, dict[str, str]] = field(default_factory=dict)
    started_at: float = field(default_factory=time.monotonic)

    def pool(self, namespace: str, name: str) -> PoolReconciler:
        key = (namespace, name)
        if key not in self.pools:
            self.pools[key] = PoolReconciler(
                namespace, name, self.workers, self.kube, self.store, self.settings, self.url_of
            )
        return self.pools[key]

    def upsert_adapter(
        self, spec: AdapterSpec, generation: int | None, status: Mapping[str, Any] | None, created: str | None = None
    ) -> None:
        key = (spec.namespace, spec.name)
        previous = self.adapter_pool.get(key)
        if previous is not None and previous != spec.pool:
            self.pool(spec.namespace, previous).forget_adapter(spec.name)
        self.adapter_pool[key] = spec.pool
        self.pool(spec.namespace, spec.pool).upsert_adapter(spec, generation, status)
        claims = self.claims.setdefault(spec.name, {})
        claims[spec.namespace] = created or claims.get(spec.namespace) or ""
        self._settle(spec.name)

    def _settle(self, name: str) -> None:
        """One LoraAdapter per name: clients and routers know adapters by name alone, across the
        namespaces this operator watches. The oldest claim serves (a restart keeps it so); the others
        are Failed, NameConflict, and served nowhere until it is deleted."""
        claims = self.claims.get(name) or {}
        if not claims:
            self.claims.pop(name, None)
            return
        winner = min(claims, key=lambda ns: (claims[ns] or "~", ns))  # an unknown age sorts last
        for namespace in claims:
            record = self.pool(namespace, self.adapter_pool[(namespace, name)]).adapters.get(name)
            if record is None:
                continue
            conflict = None if namespace == winner else (
                "NameConflict",
                f"adapter name {name!r} is served by LoraAdapter {winner}/{name}: adapter names are global "
                f"to the router; rename one (this one is placed once {winner}/{name} is deleted)",
            )
            if record.conflict != conflict:
                record.conflict = conflict
                self.pool(namespace, record.spec.pool).wake()

    def name_shared(self, namespace: str, name: str) -> bool:
        """Another namespace's LoraAdapter has this name (its catalog entry is not this one's to remove)."""
        return bool(set(self.claims.get(name, ())) - {namespace})

    async def remove_from_catalog(self, name: str) -> None:
        """For an adapter deleted before any pool reconciler knew it (its pool's does this itself)."""
        if self.store is not None:
            try:
                await self.store.remove_catalog(name)
            except Exception as exc:
                log.warning("placement store: %s not removed from the catalog: %s", name, exc)

    def drop_pool(self, namespace: str, name: str) -> None:
        """Forget everything about one pool: its reconciler and its adapters (a new term starts
        from the API server's objects, never from what an earlier term left in memory)."""
        self.pools.pop((namespace, name), None)
        for (ns, adapter), pool in list(self.adapter_pool.items()):
            if ns == namespace and pool == name:
                del self.adapter_pool[(ns, adapter)]
                self.claims.get(adapter, {}).pop(ns, None)
                self._settle(adapter)

    def forget_adapter(self, namespace: str, name: str) -> PoolReconciler | None:
        pool = self.adapter_pool.pop((namespace, name), None)
        if pool is None:
            return None
        reconciler = self.pool(namespace, pool)
        reconciler.forget_adapter(name)
        self.claims.get(name, {}).pop(namespace, None)
        self._settle(name)  # the next claim of the name, if any, is served now
        return reconciler
