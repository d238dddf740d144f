"""kopf operator against the patched kmock emulator, kubectl, the test kubelet and fake workers."""

from __future__ import annotations

import asyncio
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
    # Pods come up one by one, so an adapter may move once (make-before-break) before it settles.
    await eventually(lambda: [len(holders(kubelet, n)) for n in ("a1", "a2", "a3")] == [1, 2, 3])
    # Status follows the inventories one round later (a move briefly shows 3 ready copies of a2).
    await eventually(lambda: status(api, "a2").get("readyReplicas") == 2)
    conds = {c["type"]: c["status"] for c in status(api, "a2")["conditions"]}
    assert conds == {"Validated": "True", "Placed": "True", "Ready": "True"}
    out = await kubectl("get", "loraadapters")
    header = out.splitlines()[0].split()
    assert header == ["NAME", "POOL", "PHASE", "READY", "REPLICAS", "REASON", "AGE"]
    assert any(line.split()[:6] == ["a2", "pool", "Ready", "2", "2", "Loaded"] for line in out.splitlines())
    assert "a1" in await kubectl("get", "lora")  # short name
    # The pool's children exist, owned by the pool.
    pool_uid = api.get(LP, "default", "pool")["metadata"]["uid"]
    for res, name in (("apps/v1/deployments", "pool"), ("v1/services", "pool"),
                      ("policy/v1/poddisruptionbudgets", "pool"), ("v1/secrets", "pool-admin-token")):
        child = api.get(res, "default", name)
        assert child is not None, res
        assert child["metadata"]["ownerReferences"][0]["uid"] == pool_uid


async def test_scale_up_down_and_delete_unloads_everywhere(
    api: PatchedEmulator, kubectl: Kubectl, kubelet: Kubelet, operator: OperatorRunner, tmp_path: Path
) -> None:
    write_adapter(tmp_path, "s1")
    await apply(kubectl, tmp_path, pool_manifest(tmp_path, replicas=3), adapter_manifest("s1", 1, 1))
    await eventually(lambda: status(api, "s1").get("readyReplicas") == 1)
    await apply(kubectl, tmp_path, adapter_manifest("s1", 3, 3))
    await eventually(lambda: len(holders(kubelet, "s1")) == 3 and status(api, "s1").get("phase") == "Ready")
    await apply(kubectl, tmp_path, adapter_manifest("s1", 1, 1))
    await eventually(lambda: len(holders(kubelet, "s1")) == 1 and status(api, "s1").get("readyReplicas") == 1)
    await kubectl("delete", "loraadapter", "s1", "--wait=false")
    await eventually(lambda: api.get(LA, "default", "s1") is None)  # finalizer released
    assert holders(kubelet, "s1") == []


async def test_invalid_adapter_fails_with_reason_while_others_proceed(
    api: PatchedEmulator, kubectl: Kubectl, kubelet: Kubelet, operator: OperatorRunner, tmp_path: Path
) -> None:
    write_adapter(tmp_path, "good")
    write_adapter(tmp_path, "too-wide", rank=64)  # pool maxLoraRank is 16
    write_adapter(tmp_path, "tampered")
    docs = [
        pool_manifest(tmp_path),
        adapter_manifest("good"),
        adapter_manifest("too-wide"),  # the worker refuses it (rank) -> Failed, LoadRefused
        adapter_manifest("declared-wide", rank=32, source="good"),  # refused before any load
        adapter_manifest("tampered", sha256="0" * 64),  # loaded, digest differs -> unloaded, Failed
        adapter_manifest("missing"),  # no such directory -> LoadRefused
    ]
    docs[3]["spec"]["source"] = "good"
    await apply(kubectl, tmp_path, *docs)
    await eventually(lambda: status(api, "good").get("phase") == "Ready")
    expected = {"too-wide": "LoadRefused", "declared-wide": "RankTooHigh", "tampered": "DigestMismatch",
                "missing": "LoadRefused"}
    for name, reason in expected.items():
        await eventually(lambda n=name: status(api, n).get("phase") == "Failed")
        validated = next(c for c in status(api, name)["conditions"] if c["type"] == "Validated")
        assert validated["reason"] == reason, (name, validated)
    await eventually(lambda: holders(kubelet, "tampered") == [])
    # Failed once, no retry storm: the refused adapter is not retried round after round.
    calls = sum(1 for p in kubelet.pods.values() for op, n in p.worker.state.calls if n == "too-wide")
    await asyncio.sleep(2.5)  # > 2 resync periods
    assert sum(1 for p in kubelet.pods.values() for op, n in p.worker.state.calls if n == "too-wide") == calls


async def test_drift_repair(
    api: PatchedEmulator, kubectl: Kubectl, kubelet: Kubelet, operator: OperatorRunner, tmp_path: Path
) -> None:
    for name in ("d1", "d2", "d3"):
        write_adapter(tmp_path, name)
    await apply(kubectl, tmp_path, pool_manifest(tmp_path, replicas=2),
                *(adapter_manifest(n, 2, 2) for n in ("d1", "d2", "d3")))
    await eventually(lambda: all(status(api, n).get("phase") == "Ready" for n in ("d1", "d2", "d3")))
    workers = kubelet.workers_of("pool")
    # 1. a worker restarts empty -> reloaded by the resync timer
    workers[0].state.restart()
    await eventually(lambda: len(workers[0].state.adapters) == 3)
    # 2. a worker evicts one adapter on its own
    workers[1].state.adapters.pop("d2")
    await eventually(lambda: "d2" in workers[1].state.adapters)
    # 3. someone loads a stray adapter by hand -> unloaded
    write_adapter(tmp_path, "stray")
    workers[1].state.adapters["stray"] = workers[1].state.adapters["d1"].model_copy(update={"name": "stray"})
    await eventually(lambda: "stray" not in workers[1].state.adapters)
    # 4. an unload that answers 200 but keeps the weights is not trusted
    workers[0].state.sticky_unload = True
    await kubectl("delete", "loraadapter", "d3", "--wait=false")
    await asyncio.sleep(1.5)
    assert api.get(LA, "default", "d3") is not None  # finalizer held: unload not verified on worker 0
    workers[0].state.sticky_unload = False
    await eventually(lambda: api.get(LA, "default", "d3") is None)
    assert all("d3" not in w.state.adapters for w in workers)


async def test_pool_scale_down_moves_only_the_leaving_pods_adapters(
    api: PatchedEmulator, kubectl: Kubectl, kubelet: Kubelet, operator: OperatorRunner, tmp_path: Path
) -> None:
    names = [f"m{i}" for i in range(12)]
    for n in names:
        write_adapter(tmp_path, n)
    await apply(kubectl, tmp_path, pool_manifest(tmp_path, replicas=3), *(adapter_manifest(n) for n in names))
    await eventually(lambda: all(status(api, n).get("phase") == "Ready" for n in names))
    await eventually(lambda: all(len(holders(kubelet, n)) == 1 for n in names))  # settled
    before = {n: holders(kubelet, n) for n in names}
    pods_before = set(kubelet.pods)
    await kubectl("patch", "lorapool", "pool", "--type=merge", "-p", '{"spec": {"replicas": 2}}')
    await eventually(lambda: len(kubelet.pods) == 2)
    await eventually(lambda: all(len(holders(kubelet, n)) == 1 for n in names))
    await eventually(lambda: all(status(api, n).get("phase") == "Ready" for n in names))
    after = {n: holders(kubelet, n) for n in names}
    gone = pods_before - set(kubelet.pods)  # the pod the scale-down removed (it may have held none)
    assert len(gone) == 1
    for n in names:
        if not set(before[n]) & gone:
            assert after[n] == before[n], n  # rendezvous: only the leaving pod's adapters move


async def test_operator_killed_mid_reconcile_converges(
    api: PatchedEmulator, kubectl: Kubectl, kubelet: Kubelet, operator: OperatorRunner, tmp_path: Path
) -> None:
    names = [f"k{i}" for i in range(20)]
    for n in names:
        write_adapter(tmp_path, n)
    await apply(kubectl, tmp_path, pool_manifest(tmp_path, replicas=2, max_cpu_loras=32),
                *(adapter_manifest(n) for n in names))
    await eventually(lambda: sum(len(p.worker.state.adapters) for p in kubelet.pods.values()) >= 5)
    await operator.kill()  # mid-reconcile: some loads done, statuses half written
    # While it is down: delete some adapters (finalizers hold them) and shrink another.
    for n in names[:5]:
        await kubectl("delete", "loraadapter", n, "--wait=false")
    await operator.start()
    await eventually(lambda: all(api.get(LA, "default", n) is None for n in names[:5]), timeout=20)
    await eventually(lambda: all(status(api, n).get("phase") == "Ready" for n in names[5:]), timeout=20)
    loaded = sorted(n for p in kubelet.pods.values() for n in p.worker.state.adapters)
    assert loaded == sorted(names[5:])  # no orphaned loads, nothing twice


async def test_operator_restart_keeps_ready_adapters_ready(
    api: PatchedEmulator, kubectl: Kubectl, kubelet: Kubelet, operator: OperatorRunner, tmp_path: Path
) -> None:
    """After a restart the operator lists the pool's pods before its first round, so adapters that
    are Ready stay Ready: no status write shows them Pending while the pod watch catches up."""
    names = ["r1", "r2", "r3"]
    for n in names:
        write_adapter(tmp_path, n)
    await apply(kubectl, tmp_path, pool_manifest(tmp_path), *(adapter_manifest(n) for n in names))
    await eventually(lambda: all(status(api, n).get("phase") == "Ready" for n in names), timeout=30)
    await operator.kill()
    seen = len(api._requests)
    await operator.start()
    await asyncio.sleep(3)  # several rounds and the resync
    writes = [
        (r.name, (r.data or {}).get("status") or {})
        for r in api._requests[seen:]
        if r.resource is not None and r.resource.plural == "loraadapters" and str(r.method).endswith("PATCH")
    ]
    flickers = [(name, st.get("phase"), [(c["type"], c["reason"]) for c in st.get("conditions") or []])
                for name, st in writes if st.get("phase") not in (None, "Ready")]
    assert not flickers, flickers
    assert all(status(api, n).get("phase") == "Ready" for n in names)
