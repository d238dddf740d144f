"""kopf operator against the patched kmock emulator, kubectl, the test kubelet and fake workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.operator.conftest import Kubectl, OperatorRunner, eventually
from tests.operator.fake_worker import write_adapter
from tests.operator.kmock_harness import PatchedEmulator
from tests.operator.kubelet import Kubelet

LA = "lorafleet.dev/v1alpha1/loraadapters"
LP = "lorafleet.dev/v1alpha1/lorapools"


def pool_manifest(root: Path, replicas: int = 2, max_cpu_loras: int = 8) -> dict[str, Any]:
    return {
        "apiVersion": "lorafleet.dev/v1alpha1", "kind": "LoraPool", "metadata": {"name": "pool"},
        "spec": {
            "model": {"path": "/models/tiny", "servedName": "tiny"},
            "image": "lorafleet/worker:test", "replicas": replicas,
            "engine": {"maxLoras": 2, "maxCpuLoras": max_cpu_loras, "maxLoraRank": 16, "device": "cpu"},
            "adapterVolume": {"mountPath": str(root)},
            "ports": {"http": 18000, "admin": 18001},
        },
    }


def adapter_manifest(name: str, lo: int = 1, hi: int = 1, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "lorafleet.dev/v1alpha1", "kind": "LoraAdapter", "metadata": {"name": name},
        "spec": {"pool": "pool", "source": name, "replicas": {"min": lo, "max": hi}, **spec},
    }


async def apply(kubectl: Kubectl, tmp_path: Path, *docs: dict[str, Any]) -> None:
    path = tmp_path / f"apply-{id(docs)}.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    await kubectl("apply", "--validate=false", "-f", str(path))


def status(api: PatchedEmulator, name: str) -> dict[str, Any]:
    obj = api.get(LA, "default", name) or {}
    return obj.get("status") or {}


def holders(kubelet: Kubelet, name: str) -> list[str]:
    return sorted(p.name for p in kubelet.pods.values() if name in p.worker.state.adapters)


async def test_adapters_ready_on_k_pods_and_kubectl_columns(
    api: PatchedEmulator, kubectl: Kubectl, kubelet: Kubelet, operator: OperatorRunner, tmp_path: Path
) -> None:
    for name in ("a1", "a2", "a3"):
        write_adapter(tmp_path, name)
    await apply(kubectl, tmp_path, pool_manifest(tmp_path, replicas=3),
                adapter_manifest("a1"), adapter_manifest("a2", 2, 2), adapter_manifest("a3", 3, 3))
    await eventually(lambda: all(status(api, n).get("phase") == "Ready" for n in ("a1", "a2", "a3")), timeout=20)
    assert [len(holders(kubelet, n)) for n in ("a1", "a2", "a3")] == [1, 2, 3]
    assert status(api, "a2")["readyReplicas"] == 2
    conds = {c["type"]: c["status"] for c in status(api, "a2")["conditions"]}
    assert conds == {"Validated": "True", "Placed": "True", "Ready": "True"}
    out = await kubectl("get", "loraadapters")
    header = out.splitlines()[0].split()
    assert header == ["NAME", "POOL", "PHASE", "READY", "REPLICAS", "AGE"]
    assert any(line.split()[:5] == ["a2", "pool", "Ready", "2", "2"] for line in out.splitlines())
    assert "a1" in await kubectl("get", "lora")  # short name
    # The pool's children exist, owned by the pool.
    pool_uid = api.get(LP, "default", "pool")["metadata"]["uid"]
    for res, name in (("apps/v1/deployments", "pool"), ("v1/services", "pool"),
                      ("policy/v1/poddisruptionbudgets", "pool"), ("v1/secrets", "pool-admin-token")):
        child = api.get(res, "default", name)
        assert child is not None, res
        assert child["metadata"]["ownerReferences"][0]["uid"] == pool_uid
