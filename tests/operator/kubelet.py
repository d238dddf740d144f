"""A test "kubelet": turns the emulator's worker Deployments into running workers and Pod objects.

Each pod gets its own loopback address 127.N.x.y (so every worker can use the pool's ports), a
worker started with the pool's admin token (read from the Secret the pod mounts), and a Pod object
with podIP, ContainersReady, and Ready once every readiness gate's condition is True (as the
kubelet computes it). Removing a pod marks it terminating first (deletionTimestamp), then deletes
it after `grace_s`, as a real kubelet would.

It also plays the Deployment and ReplicaSet controllers: a changed pod template is rolled out with
the Deployment's `maxSurge`/`maxUnavailable` (new pods first, an old one removed only while
enough pods are Ready), pods carry `pod-template-hash`, and the pods a scale-down removes are
ranked as the ReplicaSet controller does: not Ready first, then the lowest
`controller.kubernetes.io/pod-deletion-cost`, then the newest.

`worker_factory(pod_name, ip, http_port, admin_port, token, template) -> handle` starts a worker and
returns once it is ready; the default starts the FastAPI fake worker in-process, `real_worker.py`
runs the real `lorafleet worker` process. A handle has `async stop()`. Pods of one sync start
together, as a ReplicaSet's would.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import json
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kmock

from tests.operator.fake_worker import FakeWorker, FakeWorkerState
from tests.operator.kmock_harness import PatchedEmulator

WorkerFactory = Callable[[str, str, int, int, str, dict[str, Any]], Awaitable[Any]]

COST = "controller.kubernetes.io/pod-deletion-cost"

_ips = itertools.count(2)
# Per test process, so concurrent test runs on one machine do not bind the same pod addresses.
_NET = os.getpid() % 200 + 20


def next_ip() -> str:
    n = next(_ips)
    return f"127.{_NET}.{(n // 250) % 250 + 1}.{n % 250 + 2}"


def _arg(args: list[str], flag: str, default: str) -> str:
    return args[args.index(flag) + 1] if flag in args else default


async def fake_worker_factory(pod: str, ip: str, http_port: int, admin_port: int, token: str,
                              template: dict[str, Any]) -> FakeWorker:
    args = template["spec"]["containers"][0]["args"]
    state = FakeWorkerState(
        token=token,
        adapter_root=Path(_arg(args, "--adapter-root", "/adapters")),
        model=_arg(args, "--served-model-name", "base"),
        max_loras=int(_arg(args, "--max-loras", "4")),
        max_cpu_loras=int(_arg(args, "--max-cpu-loras", "16")),
        max_lora_rank=int(_arg(args, "--max-lora-rank", "64")),
    )
    worker = FakeWorker(state, ip, admin_port)
    await worker.start()
    return worker


def template_hash(template: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def _count(value: Any, default: int) -> int:
    return value if isinstance(value, int) else default


@dataclass(slots=True)
class RunningPod:
    name: str
    ip: str
    worker: Any
    deployment: str
    revision: str = ""
    order: int = 0  # creation order: the newest goes first among equals


class SyncLoop:
    """`sync()` every `period_s` as a task of the running loop, its failures kept in `errors` (the
    kubelet stays alive; tests see the effect, not a crash). For dataclasses with the fields
    `period_s`, `errors` and `_task`."""

    period_s: float
    errors: list[str]
    _task: asyncio.Task | None

    async def sync(self) -> None:
        raise NotImplementedError

    def _start_loop(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def _stop_loop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _loop(self) -> None:
        while True:
            try:
                await self.sync()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
                print(f"kubelet: {self.errors[-1]}")
            await asyncio.sleep(self.period_s)


@dataclass
class Kubelet(SyncLoop):
    api: PatchedEmulator
    namespace: str = "default"
    worker_factory: WorkerFactory = fake_worker_factory
    grace_s: float = 0.3
    period_s: float = 0.1
    pods: dict[str, RunningPod] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # workers that failed to start
    _counter: itertools.count = field(default_factory=itertools.count)
    _task: asyncio.Task | None = None

    async def __aenter__(self) -> Kubelet:
        self._start_loop()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._stop_loop()
        await asyncio.gather(*(p.worker.stop() for p in self.pods.values()), return_exceptions=True)
        self.pods.clear()

    def workers_of(self, deployment: str) -> list[Any]:
        return [p.worker for p in self.pods.values() if p.deployment == deployment]

    async def sync(self) -> None:
        deployments = {d["metadata"]["name"]: d for d in self.api.items("apps/v1/deployments", self.namespace)}
        for name, pod in list(self.pods.items()):
            if pod.deployment not in deployments:
                await self.kill(name)
        for deployment in deployments.values():
            await self._roll(deployment)
        await self._readiness()

    async def _roll(self, deployment: dict[str, Any]) -> None:
        """One step of the Deployment controller: surge new pods, remove old ones while enough are Ready."""
        dname, spec = deployment["metadata"]["name"], deployment["spec"]
        want = int(spec.get("replicas", 1))
        revision = template_hash(spec["template"])
        rolling = (spec.get("strategy") or {}).get("rollingUpdate") or {}
        surge, unavailable = _count(rolling.get("maxSurge"), 1), _count(rolling.get("maxUnavailable"), 0)
        mine = [n for n, p in self.pods.items() if p.deployment == dname and not self._terminating(n)]
        new = [n for n in mine if self.pods[n].revision == revision]
        old = [n for n in mine if n not in new]
        if old:
            create = max(0, min(want - len(new), want + surge - len(mine)))
            new_unavailable = sum(not self._ready(n) for n in new)
            removable = len(mine) - (want - unavailable) - new_unavailable
            leaving = self._rank(old)[:max(0, min(removable, len(old)))]
        else:
            create = max(0, want - len(new))
            leaving = self._rank(new)[:max(0, len(new) - want)]
        for name in leaving:
            await self._mark_terminating(name)
            asyncio.create_task(self._terminate(name))
        started = await asyncio.gather(*(self._start(deployment, revision) for _ in range(create)),
                                       return_exceptions=True)
        for failure in (r for r in started if isinstance(r, Exception)):
            self.errors.append(f"{type(failure).__name__}: {failure}")
            print(f"kubelet: {self.errors[-1]}")

    def _ready(self, name: str) -> bool:
        obj = self.api.get("v1/pods", self.namespace, name) or {}
        return any(c.get("type") == "Ready" and c.get("status") == "True"
                   for c in (obj.get("status") or {}).get("conditions") or [])

    def _rank(self, names: list[str]) -> list[str]:
        """The ReplicaSet controller's order for removal (the part that differs between these pods)."""
        def key(name: str) -> tuple[bool, int, int]:
            obj = self.api.get("v1/pods", self.namespace, name) or {}
            cost = (obj.get("metadata", {}).get("annotations") or {}).get(COST, "0")
            return (self._ready(name), int(cost), -self.pods[name].order)
        return sorted(names, key=key)

    async def _readiness(self) -> None:
        """Ready = containers ready and every readiness gate's condition True."""
        for name in list(self.pods):
            async with self.api._write_lock:
                obj = self.api.get("v1/pods", self.namespace, name)
                if obj is None:
                    continue
                conditions = (obj.get("status") or {}).get("conditions") or []
                status = {c.get("type"): c.get("status") for c in conditions}
                gates = [g["conditionType"] for g in obj["spec"].get("readinessGates") or []]
                ready = "True" if all(status.get(g) == "True" for g in gates) else "False"
                if status.get("Ready") != ready:
                    new = [c for c in conditions if c.get("type") != "Ready"] + [{"type": "Ready", "status": ready}]
                    key = (kmock.resource("v1/pods"), self.namespace, name)
                    await self.api._patch(key[0], key, {"status": {"conditions": new}})

    def _terminating(self, name: str) -> bool:
        obj = self.api.get("v1/pods", self.namespace, name)
        return obj is None or bool(obj["metadata"].get("deletionTimestamp"))

    async def _start(self, deployment: dict[str, Any], revision: str = "") -> None:
        template = deployment["spec"]["template"]
        container = template["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        secret_name = next(v["secret"]["secretName"] for v in template["spec"]["volumes"] if "secret" in v)
        secret = self.api.get("v1/secrets", self.namespace, secret_name)
        if secret is None:
            return  # mount would fail: the pod stays ContainerCreating until the Secret exists
        token = base64.b64decode(secret["data"]["token"]).decode()
        dname = deployment["metadata"]["name"]
        order = next(self._counter)
        name = f"{dname}-{order}"
        ip = next_ip()
        worker = await self.worker_factory(name, ip, ports["http"], ports["admin"], token, template)
        self.pods[name] = RunningPod(name, ip, worker, dname, revision, order)
        await self.put_pod(deployment, name, ip, revision)

    async def put_pod(self, deployment: dict[str, Any], name: str, ip: str, revision: str) -> None:
        """The Pod object of a started worker: running, containers ready, Ready unless it has readiness gates."""
        template = deployment["spec"]["template"]
        owner = {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment["metadata"]["name"],
                 "uid": deployment["metadata"]["uid"], "controller": True}
        gated = bool(template["spec"].get("readinessGates"))
        await self.api.put_object("v1/pods", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": self.namespace,
                         "labels": {**template["metadata"]["labels"], "pod-template-hash": revision},
                         "annotations": dict(template["metadata"].get("annotations") or {}),
                         "ownerReferences": [owner]},
            "spec": template["spec"],
            "status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "ContainersReady", "status": "True"},
                                      {"type": "Ready", "status": "False" if gated else "True"}]},
        })

    async def _mark_terminating(self, name: str) -> None:
        if self.api.get("v1/pods", self.namespace, name) is not None:
            await self.api.patch_object("v1/pods", self.namespace, name,
                                        {"metadata": {"deletionTimestamp": "2000-01-01T00:00:00Z"}})

    async def _terminate(self, name: str) -> None:
        await self._mark_terminating(name)
        await asyncio.sleep(self.grace_s)
        await self.kill(name)

    async def kill(self, name: str) -> None:
        """The pod and its worker vanish at once (node loss, OOM-kill, scale-down end)."""
        pod = self.pods.pop(name, None)
        if pod is not None:
            await pod.worker.stop()
        if self.api.get("v1/pods", self.namespace, name) is not None:
            await self.api.delete_object("v1/pods", self.namespace, name)
