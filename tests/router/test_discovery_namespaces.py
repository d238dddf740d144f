"""Kubernetes discovery across the namespaces the operator watches (`--k8s-namespace a,b`):
endpoints named `namespace/pod`, the placement store's scope empty, so the router's replica keys
are the operator's (`placement_store.replica_key(namespace, pod)`)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from lorafleet.placement_store import replica_key
from lorafleet.router import discovery
from lorafleet.router.discovery import KubernetesDiscovery, placement_scope


def pod(name: str, ip: str) -> dict:
    return {"metadata": {"name": name, "labels": {"lorafleet.dev/pool": "p"}},
            "spec": {"containers": [{"ports": [{"name": "admin", "containerPort": 8001}]}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}


PODS = {"default": [pod("p-0", "10.0.0.1")], "team-a": [pod("p-0", "10.0.1.1"), pod("p-1", "10.0.1.2")]}


async def endpoints(namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list, list[str]]:
    (tmp_path / "token").write_text("sa-token\n")
    monkeypatch.setattr(discovery, "SA_DIR", tmp_path)
    asked: list[str] = []

    def serve(request: httpx.Request) -> httpx.Response:
        assert request.headers["Authorization"] == "Bearer sa-token"
        ns = request.url.path.split("/")[4]
        asked.append(ns)
        return httpx.Response(200, json={"items": PODS.get(ns, [])})

    async with httpx.AsyncClient(transport=httpx.MockTransport(serve)) as http:
        return await KubernetesDiscovery(http, namespace, "lorafleet.dev/pool", 8000).endpoints(), asked


async def test_one_namespace_keeps_pod_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    eps, asked = await endpoints("team-a", tmp_path, monkeypatch)
    assert asked == ["team-a"] and [e.name for e in eps] == ["p-0", "p-1"]
    assert placement_scope("team-a") == "team-a"


async def test_several_namespaces_name_pods_by_namespace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    eps, asked = await endpoints("default, team-a", tmp_path, monkeypatch)
    assert asked == ["default", "team-a"]
    assert [(e.name, e.admin_url) for e in eps] == [
        ("default/p-0", "http://10.0.0.1:8001"), ("team-a/p-0", "http://10.0.1.1:8001"),
        ("team-a/p-1", "http://10.0.1.2:8001")]
    scope = placement_scope("default,team-a")
    # the operator's keys for those pods are the router's
    assert [replica_key(scope, e.name) for e in eps] == [
        replica_key("default", "p-0"), replica_key("team-a", "p-0"), replica_key("team-a", "p-1")]
