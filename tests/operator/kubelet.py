"""A test "kubelet": turns the emulator's worker Deployments into running workers and Pod objects.

Each pod gets its own loopback address 127.N.x.y (so every worker can use the pool's ports), a
worker started with the pool's admin token (read from the Secret the pod mounts), and a Pod object
with podIP and a Ready condition. Scale-down marks the pod terminating first (deletionTimestamp),
then deletes it after `grace_s`, as a real kubelet would.

`worker_factory(pod_name, ip, http_port, admin_port, token, template) -> handle` starts a worker and
returns once it is ready; the default starts the FastAPI fake worker in-process, `real_worker.py`
runs the real `lorafleet worker` process. A handle has `async stop()`. Pods of one sync start
together, as a ReplicaSet's would.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.operator.fake_worker import FakeWorker, FakeWorkerState
from tests.operator.kmock_harness import PatchedEmulator

WorkerFactory = Callable[[str, str, int, int, str, dict[str, Any]], Awaitable[Any]]

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


@dataclass(slots=True)
class RunningPod:
    name: str
    ip: str
    worker: Any
    deployment: str


@dataclass
class Kubelet:
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
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await asyncio.gather(*(p.worker.stop() for p in self.pods.values()), return_exceptions=True)
        self.pods.clear()

    def workers_of(self, deployment: str) -> list[Any]:
        return [p.worker for p in self.pods.values() if p.deployment == deployment]

    async def _loop(self) -> None:
        while True:
            try:
                await self.sync()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep the kubelet alive; tests see the effect, not a crash
                self.errors.append(f"{type(exc).__name__}: {exc}")
                print(f"kubelet: {self.errors[-1]}")
            await asyncio.sleep(self.period_s)

    async def sync(self) -> None:
        deployments = {d["metadata"]["name"]: d for d in self.api.items("apps/v1/deployments", self.namespace)}
        for name, pod in list(self.pods.items()):
            if pod.deployment not in deployments:
                await self.kill(name)
        for dname, deployment in deployments.items():
            want = int(deployment["spec"].get("replicas", 1))
            mine = sorted(n for n, p in self.pods.items() if p.deployment == dname
                          and not self._terminating(n))
            for name in mine[want:]:
                asyncio.create_task(self._terminate(name))
            started = await asyncio.gather(*(self._start(deployment) for _ in range(want - len(mine))),
                                           return_exceptions=True)
            for failure in (r for r in started if isinstance(r, Exception)):
                self.errors.append(f"{type(failure).__name__}: {failure}")
                print(f"kubelet: {self.errors[-1]}")

    def _terminating(self, name: str) -> bool:
        obj = self.api.get("v1/pods", self.namespace, name)
        return obj is None or bool(obj["metadata"].get("deletionTimestamp"))

    async def _start(self, deployment: dict[str, Any]) -> None:
        template = deployment["spec"]["template"]
        container = template["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        secret_name = next(v["secret"]["secretName"] for v in template["spec"]["volumes"] if "secret" in v)
        secret = self.api.get("v1/secrets", self.namespace, secret_name)
        if secret is None:
            return  # mount would fail: the pod stays ContainerCreating until the Secret exists
        token = base64.b64decode(secret["data"]["token"]).decode()
        dname = deployment["metadata"]["name"]
        name = f"{dname}-{next(self._counter)}"
        ip = next_ip()
        worker = await self.worker_factory(name, ip, ports["http"], ports["admin"], token, template)
        self.pods[name] = RunningPod(name, ip, worker, dname)
        owner = {"apiVersion": "apps/v1", "kind": "Deployment", "name": dname,
                 "uid": deployment["metadata"]["uid"], "controller": True}
        await self.api.put_object("v1/pods", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": self.namespace,
                         "labels": dict(template["metadata"]["labels"]), "ownerReferences": [owner]},
            "spec": template["spec"],
            "status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True"}]},
        })

    async def _terminate(self, name: str) -> None:
        if self.api.get("v1/pods", self.namespace, name) is not None:
            await self.api.patch_object("v1/pods", self.namespace, name,
                                        {"metadata": {"deletionTimestamp": "2000-01-01T00:00:00Z"}})
        await asyncio.sleep(self.grace_s)
        await self.kill(name)

    async def kill(self, name: str) -> None:
        """The pod and its worker vanish at once (node loss, OOM-kill, scale-down end)."""
        pod = self.pods.pop(name, None)
        if pod is not None:
            await pod.worker.stop()
        if self.api.get("v1/pods", self.namespace, name) is not None:
            await self.api.delete_object("v1/pods", self.namespace, name)
