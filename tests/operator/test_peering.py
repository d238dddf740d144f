"""HA by kopf peering: two operators share a KopfPeering, the higher priority one acts, and the
other takes over when it dies. Uses the shipped CRD (crds/peering/) against the emulator.

Each operator runs in its own thread and event loop: when a kopf operator is cancelled it cancels
every task of its loop created after it started, which would take the other operator down too.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.operator.conftest import ROOT, Kubectl, OperatorRunner, eventually
from tests.operator.fake_worker import write_adapter
from tests.operator.kmock_harness import PatchedEmulator
from tests.operator.kubelet import Kubelet
from tests.operator.test_e2e import adapter_manifest, apply, pool_manifest, status

PEERING_CRDS = ROOT / "crds" / "peering"


def test_peering_crds_are_what_kopf_looks_for() -> None:
    crds = {p.name: yaml.safe_load(p.read_text()) for p in PEERING_CRDS.glob("*.yaml")}
    assert set(crds) == {"kopfpeerings.kopf.dev.yaml", "clusterkopfpeerings.kopf.dev.yaml"}
    for file, crd in crds.items():
        spec = crd["spec"]
        assert crd["metadata"]["name"] == file.removesuffix(".yaml") == f"{spec['names']['plural']}.kopf.dev"
        assert spec["group"] == "kopf.dev" and [v["name"] for v in spec["versions"]] == ["v1"]
        status_schema = spec["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
        assert status_schema["x-kubernetes-preserve-unknown-fields"] is True  # kopf writes free-form keys
    assert crds["kopfpeerings.kopf.dev.yaml"]["spec"]["scope"] == "Namespaced"
    assert crds["clusterkopfpeerings.kopf.dev.yaml"]["spec"]["scope"] == "Cluster"


class ThreadedOperator:
    """An `OperatorRunner` in a thread of its own; `kill()` cancels it there, with no clean-up."""

    def __init__(self, api: PatchedEmulator, priority: int) -> None:
        self.runner = OperatorRunner(api, peering="lorafleet", priority=priority)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    @property
    def memo(self) -> Any:
        return self.runner.memo

    async def start(self) -> None:
        self.thread.start()
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.runner.start(), self.loop))

    async def kill(self) -> None:
        if not self.thread.is_alive():
            return
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.runner.kill(), self.loop))
        self.loop.call_soon_threadsafe(self.loop.stop)
        await asyncio.to_thread(self.thread.join, 10)


@pytest.fixture
async def peers(api: PatchedEmulator) -> AsyncIterator[tuple[ThreadedOperator, ThreadedOperator]]:
    api.declare_crd(yaml.safe_load((PEERING_CRDS / "kopfpeerings.kopf.dev.yaml").read_text()))
    await api.put_object("kopf.dev/v1/kopfpeerings", {
        "apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "lorafleet", "namespace": "default"},
    })
    active, standby = ThreadedOperator(api, priority=200), ThreadedOperator(api, priority=100)
    try:
        await active.start()
        await standby.start()
        yield active, standby
    finally:
        await standby.kill()
        await active.kill()


def pools_seen(runner: ThreadedOperator) -> int:
    fleet = getattr(runner.memo, "fleet", None)
    return len(fleet.pools) if fleet is not None else 0


async def test_one_operator_acts_and_the_standby_takes_over(
    api: PatchedEmulator, kubectl: Kubectl, kubelet: Kubelet, peers: tuple[ThreadedOperator, ThreadedOperator],
    tmp_path: Path,
) -> None:
    active, standby = peers
    await eventually(lambda: len((api.get("kopf.dev/v1/kopfpeerings", "default", "lorafleet") or {})
                                 .get("status") or {}) == 2)  # both keep-alives are in
    for name in ("h1", "h2"):
        write_adapter(tmp_path, name)
    await apply(kubectl, tmp_path, pool_manifest(tmp_path, replicas=1), adapter_manifest("h1"))
    await eventually(lambda: status(api, "h1").get("phase") == "Ready")
    assert pools_seen(active) == 1 and pools_seen(standby) == 0  # the standby is paused

    await active.kill()  # kopf drops its keep-alive on the way out; else the standby waits out the lifetime
    await apply(kubectl, tmp_path, adapter_manifest("h2"))
    await eventually(lambda: status(api, "h2").get("phase") == "Ready", timeout=20)
    assert pools_seen(standby) == 1
    assert sorted(kubelet.workers_of("pool")[0].state.adapters) == ["h1", "h2"]
