"""A LoraPool with `spec.server.kind: vllm`: the operator builds stock vLLM pods and places adapters on
them through the same placement code (kopf against the kmock emulator; each pod a stand-in vLLM that
answers as vLLM 0.32 does, tests/operator/fake_vllm.py), and the router's Kubernetes discovery reads
those pods as vLLM replicas."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from lorafleet.router.discovery import pods_to_endpoints
from lorafleet.vllm_inventory import VllmLimits
from tests.operator.conftest import Kubectl, OperatorRunner, eventually
from tests.operator.fake_vllm import FakeVllm, FakeVllmState
from tests.operator.fake_worker import write_adapter
from tests.operator.kmock_harness import PatchedEmulator
from tests.operator.kubelet import Kubelet, RunningPod, next_ip
from tests.operator.test_e2e import adapter_manifest, apply, status

pytestmark = pytest.mark.timeout(120)


class VllmKubelet(Kubelet):
    """Starts a stand-in vLLM for each pod, configured only from the pod template: the API key from
    the env var's Secret reference, runtime updates from the env, the model name and max_loras from
    vLLM's flags."""

    async def _start(self, deployment: dict[str, Any], revision: str = "") -> None:
        template = deployment["spec"]["template"]
        container = template["spec"]["containers"][0]
        env = {e["name"]: e for e in container.get("env", [])}
        ref = env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"]
        secret = self.api.get("v1/secrets", self.namespace, ref["name"])
        if secret is None:
            return
        args = container["args"]
        state = FakeVllmState(
            api_key=base64.b64decode(secret["data"][ref["key"]]).decode(),
            model=args[args.index("--served-model-name") + 1],
            max_loras=int(args[args.index("--max-loras") + 1]),
            runtime_updates=env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", {}).get("value") == "True",
        )
        port = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]
        order = next(self._counter)
        name, ip = f"{deployment['metadata']['name']}-{order}", next_ip()
        server = FakeVllm(state, ip, port)
        await server.start()
        self.pods[name] = RunningPod(name, ip, server, deployment["metadata"]["name"], revision, order)
        await self.put_pod(deployment, name, ip, revision)


@pytest.fixture
async def vllm_kubelet(api: PatchedEmulator) -> AsyncIterator[VllmKubelet]:
    async with VllmKubelet(api) as k:
        yield k


def vllm_pool(root: Path, replicas: int = 2) -> dict[str, Any]:
    return {
        "apiVersion": "lorafleet.dev/v1alpha1", "kind": "LoraPool", "metadata": {"name": "pool"},
        "spec": {
            "model": {"path": "/models/tiny", "servedName": "tiny"},
            "image": "vllm/vllm-openai:v0.32.0", "replicas": replicas,
            "server": {"kind": "vllm", "args": ["--enforce-eager"], "env": [{"name": "VLLM_LOGGING_LEVEL", "value": "INFO"}]},
            "engine": {"maxLoras": 2, "maxCpuLoras": 3, "maxLoraRank": 16, "dtype": "float32"},
            "adapterVolume": {"mountPath": str(root)},
            "ports": {"http": 18000},
        },
    }


def holders(kubelet: Kubelet, name: str) -> list[str]:
    return sorted(p.name for p in kubelet.pods.values() if name in p.worker.state.adapters)


async def test_vllm_pool_gets_vllm_pods_and_its_adapters_placed(
    api: PatchedEmulator, kubectl: Kubectl, vllm_kubelet: VllmKubelet, operator: OperatorRunner, tmp_path: Path
) -> None:
    for name in ("a1", "a2", "a3"):
        write_adapter(tmp_path, name)
    await apply(kubectl, tmp_path, vllm_pool(tmp_path), adapter_manifest("a1"), adapter_manifest("a2", 2, 2),
                adapter_manifest("a3"))
    await eventually(lambda: all(status(api, n).get("phase") == "Ready" for n in ("a1", "a2", "a3")), timeout=30)
    await eventually(lambda: [len(holders(vllm_kubelet, n)) for n in ("a1", "a2", "a3")] == [1, 2, 1])
    assert "digest" not in status(api, "a1")  # vLLM reports none: none shown
    # no pod holds more than spec.engine.maxCpuLoras (vLLM does not report it: the pool's spec)
    assert all(len(p.worker.state.adapters) <= 3 for p in vllm_kubelet.pods.values())

    dep = api.get("apps/v1/deployments", "default", "pool")
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "vllm/vllm-openai:v0.32.0"
    assert container["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--enforce-eager" in container["args"] and "--api-key" not in container["args"]
    assert [p["name"] for p in api.get("v1/services", "default", "pool")["spec"]["ports"]] == ["http"]

    # the router's Kubernetes discovery: vLLM replicas, one port, limits from the pod's flags
    pods = {"items": api.items("v1/pods", "default")}
    endpoints = pods_to_endpoints(pods, 18000)
    assert len(endpoints) == 2
    for e in endpoints:
        assert e.kind == "vllm" and e.url == e.admin_url and e.pool == "pool"
        assert e.limits == VllmLimits(max_loras=2, max_cpu_loras=3, max_lora_rank=16)

    # deleting an adapter unloads it from vLLM, checked against vLLM's own listing
    await kubectl("delete", "loraadapter", "a2", "--wait=false")
    await eventually(lambda: holders(vllm_kubelet, "a2") == [])


async def test_a_digest_cannot_be_asked_of_a_vllm_pool(
    api: PatchedEmulator, kubectl: Kubectl, vllm_kubelet: VllmKubelet, operator: OperatorRunner, tmp_path: Path
) -> None:
    write_adapter(tmp_path, "a1")
    await apply(kubectl, tmp_path, vllm_pool(tmp_path, replicas=1), adapter_manifest("a1", sha256="0" * 64))
    await eventually(lambda: status(api, "a1").get("phase") == "Failed")
    reasons = {c["type"]: c.get("reason") for c in status(api, "a1").get("conditions", [])}
    assert "DigestUnverifiable" in reasons.values(), reasons
    assert holders(vllm_kubelet, "a1") == []
