"""Worker pods leaving without taking an adapter to zero copies (mixed into `PoolReconciler`): each
round marks the pods to retire, opens the readiness gates of pods that may serve, writes the
pods' deletion costs, and lowers a held scale-down once the retiring pods are emptied. The
decisions are `retire`'s; this is their API writes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
from typing import TYPE_CHECKING, Any

from lorafleet.operator import retire
from lorafleet.operator.kube import STRATEGIC_MERGE_PATCH, KubeClient, KubeError, NotFound

if TYPE_CHECKING:
    from lorafleet.operator import placement
    from lorafleet.operator.pool_state import AdapterRecord, PodState
    from lorafleet.operator.spec import PoolSpec

log = logging.getLogger("lorafleet.operator")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _workload_path(pool: PoolSpec) -> str:
    return KubeClient.path("apps/v1", "deployments", pool.namespace, pool.name)


async def hold_scale_down(kube: KubeClient, manifest: dict[str, Any]) -> dict[str, Any]:
    """The pool's Deployment as built, but never with fewer replicas than it has now: a
    scale-down is lowered by the reconciler once the pods that go are emptied (`PodRoll`)."""
    if manifest["kind"] != "Deployment":
        return manifest
    meta = manifest["metadata"]
    try:
        current = await kube.get(KubeClient.path("apps/v1", "deployments", meta["namespace"], meta["name"]))
    except NotFound:
        return manifest
    have = int((current.get("spec") or {}).get("replicas") or 0)
    if have <= manifest["spec"]["replicas"]:
        return manifest
    return {**manifest, "spec": {**manifest["spec"], "replicas": have}}


class PodRoll:
    """The pod half of `PoolReconciler`; every attribute is the reconciler's."""

    __slots__ = ()
    if TYPE_CHECKING:
        namespace: str
        kube: KubeClient | None
        pool: PoolSpec | None
        adapters: dict[str, AdapterRecord]
        pods: dict[str, PodState]
        loaded: dict[str, set[str]]
        _marks: dict[str, dict[str, Any]]

    def _protected(self) -> set[str]:
        return {name for name, r in self.adapters.items() if r.problem is None}

    def _marked(self) -> dict[str, PodState]:
        """The pods with what this term wrote on them: a pod event sent before a write may arrive
        after it, and a pod that seems to lose its retiring cost would be replaced as the one to
        go while the Deployment is removing it."""
        for name, marks in list(self._marks.items()):
            if name not in self.pods or self.pods[name].uid != marks["uid"]:  # gone, or re-created
                del self._marks[name]
        return {n: dataclasses.replace(p, **{k: v for k, v in self._marks[n].items() if k != "uid"})
                if n in self._marks else p for n, p in self.pods.items()}

    def _mark(self, pod: str, **marks: Any) -> None:
        if pod in self.pods:
            self._marks.setdefault(pod, {"uid": self.pods[pod].uid}).update(marks)

    def _retiring(self) -> set[str]:
        """The pods to empty before they go (placement takes nothing new there)."""
        if self.kube is None or self.pool is None or self.pool.workload_kind != "Deployment":
            return set()
        return retire.retiring(self._marked(), self.pool.replicas, self.loaded, self._protected())

    async def _roll_pods(self, target: placement.Assignment, leaving: set[str]) -> int:
        """The round's pod writes; returns how many failed (retried next round)."""
        if self.kube is None or self.pool is None:
            return 0
        leaving = {p for p in leaving if p in self.pods}  # a pod may have gone while the round ran
        pods = self._marked()
        costs = retire.deletion_costs(pods, self.loaded, self._protected(), leaving)
        writes = [self._set_cost(p, c) for p, c in sorted(costs.items()) if p in pods and pods[p].cost != c]
        errors = sum(not ok for ok in await asyncio.gather(*writes))
        if errors:  # the ReplicaSet would remove pods by the costs they carry: only once they are these
            return errors
        pods = self._marked()
        opening = retire.gates_to_open(pods, self.loaded, target, leaving)
        errors = sum(not ok for ok in await asyncio.gather(*(self._open_gate(p) for p in sorted(opening))))
        if leaving and retire.evacuated(leaving, pods, self.loaded, target):
            errors += not await self._lower_replicas()
        return errors

    async def _write(self, what: str, call: Any) -> bool:
        try:
            await call
        except (KubeError, OSError) as exc:  # the pod went meanwhile, or the API server is away
            log.info("pool %s/%s: %s: %s", self.namespace, self.pool.name if self.pool else "?", what, exc)
            return False
        return True

    async def _open_gate(self, pod: str) -> bool:
        assert self.kube is not None
        condition = {"type": retire.GATE, "status": "True", "reason": "AdaptersLoaded", "lastTransitionTime": _now(),
                     "message": "the pod holds its adapters; pods leaving hold none that has no other copy"}
        path = KubeClient.path("v1", "pods", self.namespace, pod, "status")
        ok = await self._write(f"gate of {pod}", self.kube.patch(path, {"status": {"conditions": [condition]}},
                                                                 content_type=STRATEGIC_MERGE_PATCH))
        if ok:
            self._mark(pod, gate_open=True)
        return ok

    async def _set_cost(self, pod: str, cost: int) -> bool:
        assert self.kube is not None
        body = {"metadata": {"annotations": {retire.COST: str(cost)}}}
        ok = await self._write(f"deletion cost of {pod}", self.kube.patch(KubeClient.path("v1", "pods", self.namespace, pod), body))
        if ok:
            self._mark(pod, cost=cost)
        return ok

    async def _lower_replicas(self) -> bool:
        """A held scale-down goes ahead: the retiring pods are emptied."""
        assert self.kube is not None and self.pool is not None
        try:
            current = await self.kube.get(_workload_path(self.pool))
        except (KubeError, OSError) as exc:
            log.info("pool %s/%s: workload not read: %s", self.namespace, self.pool.name, exc)
            return False
        if int((current.get("spec") or {}).get("replicas") or 0) <= self.pool.replicas:
            return True
        return await self._write("scale-down", self.kube.patch(_workload_path(self.pool), {"spec": {"replicas": self.pool.replicas}}))
