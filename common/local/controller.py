"""The local fleet's control loop: the operator's own reconciler, fed from the run directory.

`lorafleet up` has no Kubernetes API server, so this module plays kopf's part: it reads applied
LoraAdapter specs from `desired/` (what `lorafleet adapters apply` writes), hands them to the
operator's `PoolReconciler` (placement by `lorafleet.operator.placement.plan`, verified loads and
unloads, digest and rank checks, status phases), wakes it on a timer like the kopf timer does, and
writes each adapter's status to `status.json` where `adapters apply` waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from lorafleet.local.run_dir import RunDir
from lorafleet.operator.pool_state import PodState, ReconcilerSettings, UrlOf
from lorafleet.operator.reconciler import PoolReconciler
from lorafleet.operator.spec import SpecError, parse_adapter

log = logging.getLogger("lorafleet.up")

NAMESPACE = "local"


def worker_urls(urls: dict[str, str]) -> UrlOf:
    """The reconciler's `url_of` for local workers: they share 127.0.0.1 on different ports (pods in
    a cluster share ports on different IPs), and each serves its admin API on its public port."""

    def url_of(pod: PodState, _port: int) -> str:
        return urls[pod.name]

    return url_of


@dataclass(slots=True)
class LocalController:
    reconciler: PoolReconciler
    run_dir: RunDir
    interval_s: float = 0.5
    resync_s: float = 2.0
    generations: dict[str, int] = field(default_factory=dict)  # adapter -> generation handed over
    uids: dict[str, str | None] = field(default_factory=dict)  # adapter -> the object's uid handed over
    _last_status: dict[str, Any] | None = None

    @staticmethod
    def settings() -> ReconcilerSettings:
        # Short periods: a local user applies a manifest and waits for it at the terminal.
        return ReconcilerSettings(resync_s=2.0, retry_s=0.5, publish_ttl_s=15.0)

    async def run(self, stopped: asyncio.Event) -> None:
        loop_task = asyncio.create_task(self.reconciler.run(stopped))
        since_resync = 0.0
        try:
            while not stopped.is_set():
                self.sync_desired()
                self.write_status()
                since_resync += self.interval_s
                if since_resync >= self.resync_s:  # level-triggered drift repair, as the kopf timer does
                    since_resync = 0.0
                    self.reconciler.wake(resync=True)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stopped.wait(), self.interval_s)
        finally:
            self.reconciler.wake()  # let its loop see `stopped`
            loop_task.cancel()
            with contextlib.suppress(BaseException):
                await loop_task

    def sync_desired(self) -> None:
        """Hand new, changed and deleted specs in `desired/` to the reconciler."""
        desired = self.run_dir.read_desired()
        for name, entry in desired.items():
            generation, uid = int(entry.get("generation", 1)), entry.get("uid")
            if self.generations.get(name) == generation and self.uids.get(name) == uid:
                continue
            record = self.reconciler.adapters.get(name)
            # Another object of this name (deleted and applied again between two polls), or a
            # Failed one applied again (a retry): judged afresh, nothing carried over from the old
            # record (its failure is kept across a spec it equals, as on a cluster).
            fresh = name in self.uids and self.uids[name] != uid or record is not None and record.failure is not None
            self.generations[name], self.uids[name] = generation, uid
            try:
                spec = parse_adapter(NAMESPACE, name, entry.get("spec") or {})
            except SpecError as exc:  # `apply` validates first; only a hand-edited file gets here
                log.warning("adapter %s: %s", name, exc)
                continue
            if fresh:
                self.reconciler.forget_adapter(name)
            self.reconciler.upsert_adapter(spec, generation, None)
        for name in set(self.generations) - set(desired):
            del self.generations[name]
            self.uids.pop(name, None)
            # The operator's finalizer path: unload everywhere, the store learns each unload.
            asyncio.get_running_loop().create_task(self.reconciler.unload_everywhere(name))

    def write_status(self) -> None:
        statuses: dict[str, Any] = {}
        for name, record in self.reconciler.adapters.items():
            status = dict(record.status or {"phase": "Pending"})
            status.setdefault("observedGeneration", None)
            statuses[name] = {"spec": _spec_json(record.spec), "generation": record.generation, "status": status,
                              "uid": self.uids.get(name)}
        if statuses != self._last_status:
            self.run_dir.write_status(statuses)
            self._last_status = statuses

    def placement(self) -> dict[str, list[str]]:
        """Adapter -> workers that hold it (verified by inventory)."""
        out: dict[str, list[str]] = {}
        for pod, names in sorted(self.reconciler.loaded.items()):
            for name in sorted(names):
                out.setdefault(name, []).append(pod)
        return out

    def phases(self) -> dict[str, str]:
        return {name: (r.status or {}).get("phase", "Pending") for name, r in self.reconciler.adapters.items()}


def _spec_json(spec: Any) -> dict[str, Any]:
    return {
        "pool": spec.pool,
        "source": spec.source,
        "replicas": {"min": spec.min_replicas, "max": spec.max_replicas},
        "pinned": spec.pinned,
    }
