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
    started_at: float = field(default_factory=time.monotonic)

    def pool(self, namespace: str, name: str) -> PoolReconciler:
        key = (namespace, name)
        if key not in self.pools:
            self.pools[key] = PoolReconciler(
                namespace, name, self.workers, self.kube, self.store, self.settings, self.url_of
            )
        return self.pools[key]

    def upsert_adapter(self, spec: AdapterSpec, generation: int | None, status: Mapping[str, Any] | None) -> None:
        key = (spec.namespace, spec.name)
        previous = self.adapter_pool.get(key)
        if previous is not None and previous != spec.pool:
            self.pool(spec.namespace, previous).forget_adapter(spec.name)
        self.adapter_pool[key] = spec.pool
        self.pool(spec.namespace, spec.pool).upsert_adapter(spec, generation, status)

    async def remove_from_catalog(self, name: str) -> None:
        """For an adapter deleted before any pool reconciler knew it (its pool's does this itself)."""
        if self.store is not None:
            try:
                await self.store.remove_catalog(name)
            except Exception as exc:
                log.warning("placement store: %s not removed from the catalog: %s", name, exc)

    def forget_adapter(self, namespace: str, name: str) -> PoolReconciler | None:
        pool = self.adapter_pool.pop((namespace, name), None)
        if pool is None:
            return None
        reconciler = self.pool(namespace, pool)
        reconciler.forget_adapter(name)
        return reconciler
