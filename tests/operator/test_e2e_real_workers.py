"""The operator end to end with real `lorafleet worker` processes (CPU, demo assets) as the pods.

kopf against the emulator, `kubectl apply`, and the test kubelet running the worker Deployment the
operator built as real processes on their own loopback addresses (tests/operator/real_worker.py).
Every claim is checked on the workers themselves: `GET /v1/adapters` with the pool's admin token
from the generated Secret, and completions through the workers' OpenAI API.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lorafleet.operator.builders import read_token
from tests.operator.conftest import Kubectl, OperatorRunner, eventually
from tests.operator.kmock_harness import PatchedEmulator
from tests.operator.kubelet import Kubelet
from tests.operator.real_worker import RealWorker, RealWorkerFactory
from tests.operator.test_e2e import LA, adapter_manifest, apply, status

GOOD = ("sql", "chat", "poem")


@pytest.fixture
def adapter_root(tmp_path: Path, demo_adapters: dict[str, Path]) -> Path:
    """The pool's adapter volume: the demo adapters, and a DoRA folder the worker must refuse."""
    root = tmp_path / "adapters"
    for name in (*GOOD, "code"):  # code has rank 32, above the pool's maxLoraRank
        shutil.copytree(demo_adapters[name], root / name)
    shutil.copytree(demo_adapters["sql"], root / "dora")
    config = json.loads((root / "dora" / "adapter_config.json").read_text())
    (root / "dora" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    return root


@pytest.fixture
async def real_kubelet(api: PatchedEmulator, tmp_path: Path) -> AsyncIterator[Kubelet]:
    factory = RealWorkerFactory(tmp_path / "pods")
    async with Kubelet(api, worker_factory=factory, grace_s=0.5) as kubelet:
        yield kubelet
    assert factory.leftovers() == [], "worker processes outlived the test"


def pool_manifest(model: Path, root: Path, replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "lorafleet.dev/v1alpha1", "kind": "LoraPool", "metadata": {"name": "pool"},
        "spec": {
            "model": {"path": str(model), "servedName": "tiny"},
            "image": "lorafleet/worker:test", "replicas": replicas,
            "engine": {"maxLoras": 2, "maxLorasPerRequest": 2, "maxCpuLoras": 4, "maxLoraRank": 16,
                       "device": "cpu", "dtype": "float32"},
            "adapterVolume": {"mountPath": str(root)},
            "ports": {"http": 18000, "admin": 18001},
        },
    }


async def inventories(api: PatchedEmulator, kubelet: Kubelet) -> dict[str, set[str]]:
    """Pod -> adapters its worker reports, asked with the token from the pool's generated Secret."""
    token = read_token(api.get("v1/secrets", "default", "pool-admin-token"))
    out: dict[str, set[str]] = {}
    async with httpx.AsyncClient(timeout=5.0) as http:
        for pod in list(kubelet.pods.values()):
            worker: RealWorker = pod.worker
            response = await http.get(f"{worker.admin_url}/v1/adapters", headers={"Authorization": f"Bearer {token}"})
            response.raise_for_status()
            out[pod.name] = {a["name"] for a in response.json()["adapters"]}
    return out


def holders(inv: dict[str, set[str]], adapter: str) -> list[str]:
    return sorted(pod for pod, names in inv.items() if adapter in names)


def condition(api: PatchedEmulator, adapter: str, kind: str) -> dict[str, Any]:
    return next(c for c in status(api, adapter)["conditions"] if c["type"] == kind)


async def complete(worker: RealWorker, model: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30.0) as http:
        return await http.post(f"{worker.url}/v1/completions",
                               # ignore_eos: a sampled EOS must not end the request before its 4 tokens
                               json={"model": model, "prompt": "SELECT name FROM", "max_tokens": 4,
                                     "ignore_eos": True})


async def test_real_workers_load_serve_refuse_and_unload(
    api: PatchedEmulator, kubectl: Kubectl, real_kubelet: Kubelet, operator: OperatorRunner, tmp_path: Path,
    demo_model: Path, adapter_root: Path,
) -> None:
    kubelet = real_kubelet
    await apply(kubectl, tmp_path, pool_manifest(demo_model, adapter_root, replicas=2),
                adapter_manifest("sql", 2, 2), adapter_manifest("chat"), adapter_manifest("poem"),
                adapter_manifest("code"), adapter_manifest("dora"))

    # Ready on k pods, each load verified on the real worker's inventory.
    await eventually(lambda: len(kubelet.pods) == 2 or kubelet.errors, timeout=60)
    assert not kubelet.errors, kubelet.errors
    await eventually(lambda: all(status(api, n).get("phase") == "Ready" for n in GOOD), timeout=30)
    assert status(api, "sql")["readyReplicas"] == 2
    inv = await eventually(lambda: _settled(api, kubelet), timeout=20)
    assert len(holders(inv, "sql")) == 2
    assert len(holders(inv, "chat")) == 1 and len(holders(inv, "poem")) == 1

    # The invalid adapters fail with the worker's reason; nobody holds them.
    for name, words in (("code", "rank 32 exceeds max_lora_rank 16"), ("dora", "DoRA")):
        await eventually(lambda n=name: status(api, n).get("phase") == "Failed", timeout=15)
        validated = condition(api, name, "Validated")
        assert (validated["status"], validated["reason"]) == ("False", "LoadRefused"), validated
        assert words in validated["message"], validated
        assert holders(inv, name) == []

    # The workers serve each adapter where the operator placed it.
    workers = {p.name: p.worker for p in kubelet.pods.values()}
    for adapter in GOOD:
        for pod in holders(inv, adapter):
            response = await complete(workers[pod], adapter)
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["model"] == adapter and body["usage"]["completion_tokens"] == 4

    # Delete: unloaded from every real worker, then the finalizer lets the object go.
    await kubectl("delete", "loraadapter", "sql", "--wait=false")
    await eventually(lambda: api.get(LA, "default", "sql") is None, timeout=15)
    inv = await inventories(api, kubelet)
    assert holders(inv, "sql") == []
    assert len(holders(inv, "chat")) == 1 and len(holders(inv, "poem")) == 1  # the others stay
    for worker in workers.values():
        assert (await complete(worker, "sql")).status_code == 404


async def _settled(api: PatchedEmulator, kubelet: Kubelet) -> dict[str, set[str]] | None:
    """The inventories once each adapter sits on exactly its replica count (make-before-break done)."""
    inv = await inventories(api, kubelet)
    want = {"sql": 2, "chat": 1, "poem": 1, "code": 0, "dora": 0, "legal": 0}
    return inv if all(len(holders(inv, n)) == k for n, k in want.items()) else None


async def test_real_workers_drift_is_repaired(
    api: PatchedEmulator, kubectl: Kubectl, real_kubelet: Kubelet, operator: OperatorRunner, tmp_path: Path,
    demo_model: Path, adapter_root: Path, demo_adapters: dict[str, Path],
) -> None:
    kubelet = real_kubelet
    shutil.copytree(demo_adapters["legal"], adapter_root / "legal")
    await apply(kubectl, tmp_path, pool_manifest(demo_model, adapter_root, replicas=2),
                adapter_manifest("sql", 2, 2), adapter_manifest("chat"), adapter_manifest("poem"))
    await eventually(lambda: all(status(api, n).get("phase") == "Ready" for n in GOOD) or kubelet.errors, timeout=60)
    assert not kubelet.errors, kubelet.errors
    inv = await eventually(lambda: _settled(api, kubelet), timeout=20)
    token = read_token(api.get("v1/secrets", "default", "pool-admin-token"))
    workers = {p.name: p.worker for p in kubelet.pods.values()}
    chat_pod = holders(inv, "chat")[0]
    other = next(p for p in workers if p != chat_pod)

    async with httpx.AsyncClient(timeout=10.0, headers={"Authorization": f"Bearer {token}"}) as admin:
        # Someone unloads an adapter behind the operator's back, and loads one nobody asked for.
        r = await admin.post(f"{workers[chat_pod].admin_url}/v1/unload_lora_adapter", json={"lora_name": "chat"})
        assert r.status_code == 200, r.text
        r = await admin.post(f"{workers[other].admin_url}/v1/load_lora_adapter",
                             json={"lora_name": "legal", "lora_path": str(adapter_root / "legal")})
        assert r.status_code == 200, r.text
    # The resync timer reads the real inventories: chat comes back where it was, legal goes.
    inv = await eventually(lambda: _settled(api, kubelet), timeout=15)
    assert holders(inv, "chat") == [chat_pod] and holders(inv, "legal") == []

    # A pod is lost (its worker process with it): the replacement gets the adapters it must hold.
    await kubelet.kill(other)
    await eventually(lambda: len(kubelet.pods) == 2 or kubelet.errors, timeout=60)
    assert not kubelet.errors, kubelet.errors
    inv = await eventually(lambda: _settled(api, kubelet), timeout=20)
    assert other not in inv and len(holders(inv, "sql")) == 2
    await eventually(lambda: status(api, "sql").get("readyReplicas") == 2 and status(api, "sql")["phase"] == "Ready")
