"""A `worker_factory` for the test kubelet that runs the pod's container as a real `lorafleet worker`.

The container the operator built (operator/builders.py) is run as it is, with what a kubelet would
change on a node: the image's `lorafleet` entry point is this interpreter's, the pod's network is
its own loopback address (`--host 0.0.0.0` becomes the pod IP, so every pod keeps the pool's ports),
and the admin-token Secret volume is materialised as a file whose path replaces the mount path in
the arguments. An emptyDir mounted where this machine has no such folder (the fetch cache) is a
fresh folder of the pod's. Environment variables are resolved as a
kubelet does: `value`, or `valueFrom.secretKeyRef` read from the API's Secret (`secrets`; a missing
optional key is left unset, a missing required one fails the start). Other volumes are host paths:
the test points the pool's model path and adapter mount at the demo assets on this machine.

Each worker runs in its own session (process group) and dies with this process (PDEATHSIG); stop()
terminates the whole group, then kills what is left.
"""

from __future__ import annotations

import asyncio
import base64
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from lorafleet.local import process_group
from lorafleet.operator.builders import TOKEN_KEY

# Torch inside each worker would otherwise take every core; several workers share a small machine.
NODE_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1"}


class WorkerStartError(RuntimeError):
    pass


@dataclass(slots=True)
class RealWorker:
    """One running worker process (the pod's only container)."""

    pod: str
    ip: str
    http_port: int
    admin_port: int
    child: process_group.Child

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.http_port}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.ip}:{self.admin_port}"

    async def stop(self, grace_s: float = 5.0) -> None:
        # process_group.stop waits synchronously; the emulator and the operator share this loop.
        await asyncio.to_thread(process_group.stop, [self.child], grace_s)


def container_argv(template: dict[str, Any], ip: str, mounts: dict[str, Path]) -> list[str]:
    """The container's command line as this node runs it (see the module docstring)."""
    container = template["spec"]["containers"][0]
    command = list(container.get("command") or ["lorafleet"])
    if command[0] == "lorafleet":
        command = [sys.executable, "-m", "lorafleet", *command[1:]]
    args = list(container.get("args") or [])
    for i, arg in enumerate(args):
        if i > 0 and args[i - 1] in ("--host", "--admin-host") and arg == "0.0.0.0":
            args[i] = ip
        for mount_path, local in mounts.items():
            if arg == mount_path or arg.startswith(mount_path.rstrip("/") + "/"):
                args[i] = str(local) + arg[len(mount_path.rstrip("/")):]
    return command + args


@dataclass
class RealWorkerFactory:
    """`Kubelet(worker_factory=RealWorkerFactory(tmp_path))`: pod folders and logs go under `root`."""

    root: Path
    ready_timeout_s: float = 60.0
    started: list[RealWorker] = field(default_factory=list)
    # A Secret of the pod's namespace by name (the API's object, or None), for secretKeyRef env.
    secrets: Callable[[str], dict[str, Any] | None] | None = None

    async def __call__(self, pod: str, ip: str, http_port: int, admin_port: int, token: str,
                       template: dict[str, Any]) -> RealWorker:
        pod_dir = self.root / pod
        mounts = self._mount_secrets(template, pod_dir, token) | self._mount_empty_dirs(template, pod_dir)
        container = template["spec"]["containers"][0]
        env = {**os.environ, **NODE_ENV, **self._env(container, mounts)}
        argv = container_argv(template, ip, mounts)
        # Spawned from the event loop's thread on purpose: PDEATHSIG follows the thread that forked.
        child = process_group.spawn(pod, argv, pod_dir / "worker.log", env=env)
        worker = RealWorker(pod, ip, http_port, admin_port, child)
        self.started.append(worker)
        try:
            await self._wait_ready(worker)
        except BaseException:
            await worker.stop(grace_s=1.0)
            raise
        return worker

    @staticmethod
    def _mount_secrets(template: dict[str, Any], pod_dir: Path, token: str) -> dict[str, Path]:
        """The admin-token Secret volume as a folder with its one key, mode 0400 as the volume asks."""
        secret_volumes = {v["name"] for v in template["spec"].get("volumes", []) if "secret" in v}
        mounts: dict[str, Path] = {}
        for mount in template["spec"]["containers"][0].get("volumeMounts", []):
            if mount["name"] in secret_volumes:
                local = pod_dir / "volumes" / mount["name"]
                local.mkdir(parents=True, exist_ok=True)
                (local / TOKEN_KEY).write_text(token)
                (local / TOKEN_KEY).chmod(0o400)
                mounts[mount["mountPath"]] = local
        return mounts

    @staticmethod
    def _mount_empty_dirs(template: dict[str, Any], pod_dir: Path) -> dict[str, Path]:
        empty = {v["name"] for v in template["spec"].get("volumes", []) if "emptyDir" in v}
        mounts: dict[str, Path] = {}
        for mount in template["spec"]["containers"][0].get("volumeMounts", []):
            if mount["name"] in empty and not Path(mount["mountPath"]).exists():
                local = pod_dir / "volumes" / mount["name"]
                local.mkdir(parents=True, exist_ok=True)
                mounts[mount["mountPath"]] = local
        return mounts

    def _env(self, container: dict[str, Any], mounts: dict[str, Path]) -> dict[str, str]:
        out: dict[str, str] = {}
        for var in container.get("env", []):
            if "valueFrom" not in var:
                value = var.get("value", "")
                for mount_path, local in mounts.items():  # a path in a volume, as the container sees it
                    if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
                        value = str(local) + value[len(mount_path.rstrip("/")):]
                out[var["name"]] = value
                continue
            ref = var["valueFrom"].get("secretKeyRef")
            if ref is None:
                raise WorkerStartError(f"env {var['name']}: only value and secretKeyRef are emulated")
            secret = self.secrets(ref["name"]) if self.secrets is not None else None
            data = (secret or {}).get("data") or {}
            if ref["key"] in data:
                out[var["name"]] = base64.b64decode(data[ref["key"]]).decode()
            elif not ref.get("optional", False):
                raise WorkerStartError(f"CreateContainerConfigError: Secret {ref['name']} has no key {ref['key']}")
        return out

    async def _wait_ready(self, worker: RealWorker) -> None:
        """What the readiness probe (`GET /ready` on the http port) decides before the pod is Ready."""
        deadline = time.monotonic() + self.ready_timeout_s
        async with httpx.AsyncClient(timeout=2.0) as http:
            while True:
                if not worker.child.alive():
                    raise WorkerStartError(f"worker {worker.pod} exited ({worker.child.process.returncode}):\n"
                                           f"{worker.child.log_tail()}")
                try:
                    if (await http.get(f"{worker.url}/ready")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise WorkerStartError(f"worker {worker.pod} not ready in {self.ready_timeout_s}s:\n"
                                           f"{worker.child.log_tail()}")
                await asyncio.sleep(0.1)

    def leftovers(self) -> list[int]:
        """Pids of started workers whose process group still exists (orphans, after stop)."""
        alive = []
        for worker in self.started:
            try:
                os.killpg(worker.child.pid, 0)
            except ProcessLookupError:
                continue
            except PermissionError:
                pass
            alive.append(worker.child.pid)
        return alive
