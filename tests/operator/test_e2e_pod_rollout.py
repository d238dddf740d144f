"""Worker pods that roll or go keep every Ready adapter served: a pool rollout (a new image: the
Deployment surges new pods and removes old ones), the same with the operator killed midway and a
standby taking over, and scale-downs. A watcher checks, every tick, what the routers would route
to: the pods their discovery takes (`router.discovery.pods_to_endpoints`: Ready, not terminating)
whose worker holds the adapter. At no tick may a Ready adapter have none.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lorafleet.operator.placement import rendezvous_score
from lorafleet.router.discovery import pods_to_endpoints
from tests.operator.conftest import Kubectl, OperatorRunner, eventually
from tests.operator.fake_worker import write_adapter
from tests.operator.kmock_harness import PatchedEmulator
from tests.operator.kubelet import Kubelet, template_hash
from tests.operator.test_e2e import adapter_manifest, apply, holders, pool_manifest, status
from tests.operator.test_peering import PEERING_CRDS, ThreadedOperator

COST = "controller.kubernetes.io/pod-deletion-cost"


def endpoints(api: PatchedEmulator) -> list[str]:
    """The worker pods a router's Kubernetes discovery routes to now."""
    return [e.name for e in pods_to_endpoints({"items": api.items("v1/pods", "default")}, 18000)]


@dataclass
class Watcher:
    """Every `tick_s`: each adapter must be held by a pod the routers route to. At the first gap it
    keeps the scene for the failure message: every pod's annotations, terminating, conditions and
    adapters, and each worker's load/unload calls of the first missing adapter."""

    api: PatchedEmulator
    kubelet: Kubelet
    adapters: list[str]
    tick_s: float = 0.02
    ticks: int = 0
    gaps: list[tuple[int, str]] = field(default_factory=list)  # (tick, adapter) with no serving copy
    first_served: dict[str, set[str]] = field(default_factory=dict)  # pod -> its adapters when it first served
    scene: dict[str, Any] = field(default_factory=dict)
    _workers: dict[str, Any] = field(default_factory=dict)  # every worker seen, gone ones included
    _task: asyncio.Task | None = None

    def check(self) -> None:
        self.ticks += 1
        served: set[str] = set()
        for pod in endpoints(self.api):
            running = self.kubelet.pods.get(pod)
            held = set(running.worker.state.adapters) if running is not None else set()
            self.first_served.setdefault(pod, held)
            served |= held
        self._workers |= {n: p.worker for n, p in self.kubelet.pods.items()}
        missing = [(self.ticks, a) for a in self.adapters if a not in served]
        if missing and not self.scene:
            first = missing[0][1]
            self.scene = {
                "pods": {o["metadata"]["name"]: (o["metadata"].get("annotations"), bool(o["metadata"].get("deletionTimestamp")),
                                                 [(c["type"], c["status"]) for c in o["status"]["conditions"]])
                         for o in self.api.items("v1/pods", "default")},
                "held": {n: sorted(w.state.adapters) for n, w in self._workers.items()},
                f"calls of {first}": {n: [c for c in w.state.calls if c[1] == first] for n, w in self._workers.items()},
            }
        self.gaps += missing

    async def _loop(self) -> None:
        while True:
            self.check()
            await asyncio.sleep(self.tick_s)

    def __enter__(self) -> Watcher:
        self.check()
        self._task = asyncio.create_task(self._loop())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


async def ready_pool(api: PatchedEmulator, kubectl: Kubectl, kubelet: Kubelet, tmp_path: Path,
                     names: list[str], replicas: int = 3, copies: dict[str, int] | None = None) -> None:
    for n in names:
        write_adapter(tmp_path, n)
    copies = copies or {}
    await apply(kubectl, tmp_path, pool_manifest(tmp_path, replicas=replicas),
                *(adapter_manifest(n, copies.get(n, 1), copies.get(n, 1)) for n in names))
    await eventually(lambda: all(status(api, n).get("phase") == "Ready" for n in names), timeout=30)
    await eventually(lambda: all(len(holders(kubelet, n)) == copies.get(n, 1) for n in names), timeout=30)
    await eventually(lambda: len(endpoints(api)) == replicas, timeout=10)


def rolled_out(api: PatchedEmulator, kubelet: Kubelet, before: set[str], replicas: int) -> bool:
    revision = template_hash(api.get("apps/v1/deployments", "default", "pool")["spec"]["template"])
    pods = set(kubelet.pods)
    return (not pods & before and len(pods) == replicas
            and all(p.revision == revision for p in kubelet.pods.values()) and len(endpoints(api)) == replicas)


async def test_rollout_keeps_a_serving_copy_of_every_adapter_at_every_tick(
    api: PatchedEmulator, kubectl: Kubectl, kubelet: Kubelet, operator: OperatorRunner, tmp_path: Path,
) -> None:
    names = [f"a{i}" for i in range(12)]  # one copy each: every old pod holds adapters no other pod has
    await ready_pool(api, kubectl, kubelet, tmp_path, names)
    before = set(kubelet.pods)
    with Watcher(api, kubelet, names) as watch:
        await kubectl("patch", "lorapool", "pool", "--type=merge", "-p", '{"spec": {"image": "lorafleet/worker:v2"}}')
        await eventually(lambda: rolled_out(api, kubelet, before, 3), timeout=60)
        await eventually(lambda: all(status(api, n).get("phase") == "Ready" for n in names), timeout=20)
    assert watch.ticks > 50
    assert watch.gaps == [], f"adapters with no serving copy: {watch.gaps[:10]} ({len(watch.gaps)} in all) {watch.scene}"
    # Routers never saw a new pod before it held adapters (its readiness gate held it back).
    new = {p: held for p, held in watch.first_served.items() if p not in before}
    assert len(new) == 3 and all(new.values()), new
    await eventually(lambda: sorted(n for p in kubelet.pods.values() for n in p.worker.state.adapters) == sorted(names))


async def test_rollout_continues_safely_after_the_operator_is_killed_and_a_standby_takes_over(
    api: PatchedEmulator, kubectl: Kubectl, kubelet: Kubelet, tmp_path: Path,
) -> None:
    api.declare_crd(yaml.safe_load((PEERING_CRDS / "kopfpeerings.kopf.dev.yaml").read_text()))
    await api.put_object("kopf.dev/v1/kopfpeerings", {
        "apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "lorafleet", "namespace": "default"},
    })
    active, standby = ThreadedOperator(api, priority=200), ThreadedOperator(api, priority=100)
    names = [f"h{i}" for i in range(12)]
    try:
        await active.start()
        await standby.start()
        await ready_pool(api, kubectl, kubelet, tmp_path, names)
        before = set(kubelet.pods)
        with Watcher(api, kubelet, names) as watch:
            await kubectl("patch", "lorapool", "pool", "--type=merge", "-p", '{"spec": {"image": "lorafleet/worker:v2"}}')
            # Midway: one old pod gone, the next new pod waiting at its gate.
            await eventually(lambda: len(before & set(kubelet.pods)) == 2 and len(kubelet.pods) > 3, timeout=60, interval=0.02)
            await active.kill()
            await eventually(lambda: rolled_out(api, kubelet, before, 3), timeout=60)
            await eventually(lambda: all(status(api, n).get("phase") == "Ready" for n in names), timeout=20)
        assert watch.gaps == [], f"adapters with no serving copy: {watch.gaps[:10]} ({len(watch.gaps)} in all) {watch.scene}"
        assert getattr(standby.memo, "fleet", None) is not None and standby.memo.fleet.pools, "the standby took over"
        await eventually(lambda: sorted(n for p in kubelet.pods.values() for n in p.worker.state.adapters) == sorted(names))
    finally:
        await standby.kill()
        await active.kill()


async def test_rollout_waits_while_no_operator_runs_and_a_new_one_finishes_it(
    api: PatchedEmulator, kubectl: Kubectl, kubelet: Kubelet, operator: OperatorRunner, tmp_path: Path,
) -> None:
    names = [f"k{i}" for i in range(12)]
    await ready_pool(api, kubectl, kubelet, tmp_path, names)
    before = set(kubelet.pods)
    with Watcher(api, kubelet, names) as watch:
        await kubectl("patch", "lorapool", "pool", "--type=merge", "-p", '{"spec": {"image": "lorafleet/worker:v2"}}')
        await eventually(lambda: len(before & set(kubelet.pods)) == 2 and len(kubelet.pods) > 3, timeout=60, interval=0.02)
        await operator.kill()
        await asyncio.sleep(0.5)  # a gate the operator set as it was killed takes effect
        stalled = set(kubelet.pods)
        assert before & stalled, "the rollout finished before the operator was killed"
        await asyncio.sleep(2.0)
        # No gate opens without an operator: the Deployment removes no other old pod.
        assert set(kubelet.pods) == stalled
        await operator.start()
        await eventually(lambda: rolled_out(api, kubelet, before, 3), timeout=60)
        await eventually(lambda: all(status(api, n).get("phase") == "Ready" for n in names), timeout=20)
    assert watch.gaps == [], f"adapters with no serving copy: {watch.gaps[:10]} ({len(watch.gaps)} in all) {watch.scene}"
    await eventually(lambda: sorted(n for p in kubelet.pods.values() for n in p.worker.state.adapters) == sorted(names))


def home(adapter: str, pods: list[str]) -> str:
    return max(pods, key=lambda p: rendezvous_score(adapter, p))


async def test_scale_down_removes_the_pod_whose_copies_exist_elsewhere_then_empties_the_next(
    api: PatchedEmulator, kubectl: Kubectl, kubelet: Kubelet, operator: OperatorRunner, tmp_path: Path,
) -> None:
    pods = ["pool-0", "pool-1", "pool-2"]  # the test kubelet's names for the first three pods
    # One-copy adapters placed off pool-0, so pool-0 holds only copies that other pods hold too. The
    # ReplicaSet would remove the newest pod (pool-2) if deletion costs did not say otherwise.
    solo = [n for n in (f"s{i}" for i in range(40)) if home(n, pods) != "pool-0"][:4]
    shared = ["d0", "d1"]  # on every pod
    names = solo + shared
    await ready_pool(api, kubectl, kubelet, tmp_path, names, copies={"d0": 3, "d1": 3})
    assert sorted(kubelet.pods) == pods
    placed = {n: holders(kubelet, n) for n in solo}
    assert all("pool-0" not in where for where in placed.values()), placed
    with Watcher(api, kubelet, names) as watch:
        await kubectl("patch", "lorapool", "pool", "--type=merge", "-p", '{"spec": {"replicas": 2}}')
        await eventually(lambda: sorted(kubelet.pods) == ["pool-1", "pool-2"] and len(endpoints(api)) == 2, timeout=30)
        assert {n: holders(kubelet, n) for n in solo} == placed, "a one-copy adapter moved"
        # Down to one pod: the one removed holds adapters no other pod has; they move first.
        await kubectl("patch", "lorapool", "pool", "--type=merge", "-p", '{"spec": {"replicas": 1}}')
        await eventually(lambda: len(kubelet.pods) == 1 and len(endpoints(api)) == 1, timeout=30)
        await eventually(lambda: all(len(holders(kubelet, n)) == 1 for n in names), timeout=20)
    assert watch.gaps == [], f"adapters with no serving copy: {watch.gaps[:10]} ({len(watch.gaps)} in all) {watch.scene}"
    await eventually(lambda: all(status(api, n).get("phase") == "Ready" for n in solo), timeout=10)
    assert all(status(api, n).get("readyReplicas") == 1 for n in shared)  # 3 wanted, 1 pod left: Degraded


async def test_scale_down_held_while_no_operator_runs_and_finished_by_the_next(
    api: PatchedEmulator, kubectl: Kubectl, kubelet: Kubelet, operator: OperatorRunner, tmp_path: Path,
) -> None:
    """The operator is killed once it has chosen the pods to go: a restarted one keeps the
    Deployment's replicas (the pool says fewer) until those pods are emptied, then lowers them."""
    names = [f"q{i}" for i in range(6)]  # they fit on one pod (maxCpuLoras 8)
    await ready_pool(api, kubectl, kubelet, tmp_path, names)
    deployment = lambda: api.get("apps/v1/deployments", "default", "pool")["spec"]["replicas"]  # noqa: E731
    with Watcher(api, kubelet, names) as watch:
        await kubectl("patch", "lorapool", "pool", "--type=merge", "-p", '{"spec": {"replicas": 1}}')
        retiring = lambda: [p["metadata"]["name"] for p in api.items("v1/pods", "default")  # noqa: E731
                            if (p["metadata"].get("annotations") or {}).get(COST) == "-1"]
        await eventually(lambda: len(retiring()) == 2, timeout=20, interval=0.01)
        await operator.kill()
        if deployment() == 3:  # killed before the pods were emptied: nothing goes while no operator runs
            await asyncio.sleep(1.5)
            assert deployment() == 3 and len(kubelet.pods) == 3
        await operator.start()
        await eventually(lambda: deployment() == 1 and len(kubelet.pods) == 1 and len(endpoints(api)) == 1, timeout=30)
        await eventually(lambda: all(len(holders(kubelet, n)) == 1 for n in names), timeout=20)
    assert watch.gaps == [], f"adapters with no serving copy: {watch.gaps[:10]} ({len(watch.gaps)} in all) {watch.scene}"
    assert all(status(api, n).get("phase") == "Ready" for n in names)
