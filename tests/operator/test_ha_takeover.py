"""HA failover with stale memory: an operator that led before, was paused by a peer of higher
priority, and takes over again when that peer dies, must act on the API server's state, not on
what it remembered from its earlier term: an adapter deleted meanwhile stays unloaded, a rescale
made meanwhile stays."""

from __future__ import annotations

import asyncio
from pathlib import Path

import yaml

from tests.operator.conftest import Kubectl, eventually
from tests.operator.fake_worker import write_adapter
from tests.operator.kmock_harness import PatchedEmulator
from tests.operator.kubelet import Kubelet
from tests.operator.test_e2e import LA, adapter_manifest, apply, holders, pool_manifest, status
from tests.operator.test_peering import PEERING_CRDS, ThreadedOperator


async def test_a_former_leader_takes_over_from_the_api_server_not_its_memory(
    api: PatchedEmulator, kubectl: Kubectl, kubelet: Kubelet, tmp_path: Path,
) -> None:
    api.declare_crd(yaml.safe_load((PEERING_CRDS / "kopfpeerings.kopf.dev.yaml").read_text()))
    await api.put_object("kopf.dev/v1/kopfpeerings", {
        "apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "lorafleet", "namespace": "default"},
    })
    first, second = ThreadedOperator(api, priority=100), ThreadedOperator(api, priority=200)
    try:
        # Term 1: `first` leads alone and loads both adapters.
        await first.start()
        for name in ("keep", "gone"):
            write_adapter(tmp_path, name)
        await apply(kubectl, tmp_path, pool_manifest(tmp_path, replicas=3),
                    adapter_manifest("keep", 1, 1), adapter_manifest("gone", 1, 1))
        await eventually(lambda: all(status(api, n).get("phase") == "Ready" for n in ("keep", "gone")), timeout=30)
        assert first.memo.fleet.pools, "the first term's memory"

        # Term 2: `second` (higher priority) takes the lead; `first` pauses, keeping its memory.
        await second.start()
        await eventually(lambda: getattr(second.memo, "fleet", None) is not None
                         and bool(second.memo.fleet.pools), timeout=30)
        await apply(kubectl, tmp_path, adapter_manifest("keep", 3, 3))  # a rescale
        await kubectl("delete", "loraadapter", "gone", "--wait=false")  # a deletion
        await eventually(lambda: api.get(LA, "default", "gone") is None, timeout=30)
        await eventually(lambda: len(holders(kubelet, "keep")) == 3 and not holders(kubelet, "gone"), timeout=30)

        # Term 3: `second` dies; `first` takes over again.
        await second.kill()
        await eventually(lambda: (api.get("kopf.dev/v1/kopfpeerings", "default", "lorafleet") or {})
                         .get("status", {}).keys() <= {first_id(api)}, timeout=30)
        for _ in range(40):  # resync is 1 s: many rounds of the new term
            await asyncio.sleep(0.25)
            assert holders(kubelet, "gone") == [], "the deleted adapter was loaded again"
            assert len(holders(kubelet, "keep")) == 3, "the rescale was undone"
        assert status(api, "keep").get("desiredReplicas") == 3
    finally:
        await second.kill()
        await first.kill()


def first_id(api: PatchedEmulator) -> str:
    """The surviving peer's keep-alive key (the one with priority 100)."""
    peers = (api.get("kopf.dev/v1/kopfpeerings", "default", "lorafleet") or {}).get("status") or {}
    return next((k for k, v in peers.items() if (v or {}).get("priority") == 100), "")
