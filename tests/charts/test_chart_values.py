"""charts/lorafleet's values: switches that add or drop objects, and values the schema and templates refuse."""

from __future__ import annotations

from typing import Any

import pytest

from tests.charts.conftest import VALUE_SETS, installed, manifests, run_helm
from tests.charts.rendered import by_kind, container, one

pytestmark = pytest.mark.usefixtures("helm")


def test_peering_objects_follow_scope() -> None:
    """HA: the chart creates the peering object the operator replicas share (kopf does not)."""
    full = manifests(installed("full"))
    peerings = by_kind(full, "KopfPeering")
    assert {p["metadata"]["namespace"] for p in peerings} == {"default", "team-a"}
    assert {p["metadata"]["name"] for p in peerings} == {VALUE_SETS["full"]["operator"]["peering"].get("name", "lorafleet")}
    c = container(one(full, "Deployment", "-operator"))
    assert f"--peering={peerings[0]['metadata']['name']}" in c["args"]
    assert not by_kind(manifests(installed("default")), "KopfPeering")
    cluster = run_helm("install", {"operator": {"scope": "cluster", "replicas": 2, "peering": {"enabled": True}}})
    assert cluster["ok"], cluster.get("error")
    objs = manifests(cluster)
    assert [p["metadata"]["name"] for p in by_kind(objs, "ClusterKopfPeering")] == ["lorafleet"]
    assert not by_kind(objs, "KopfPeering")


def test_optional_objects_follow_their_switches() -> None:
    full, minimal = manifests(installed("full")), manifests(installed("minimal"))
    for kind in ("Ingress", "HorizontalPodAutoscaler", "ServiceMonitor", "LoraPool"):
        assert by_kind(full, kind) and not by_kind(minimal, kind), kind
    assert "replicas" not in one(full, "Deployment", "-router")["spec"], "the HPA owns replicas"
    assert not by_kind(minimal, "StatefulSet") and not by_kind(minimal, "ConfigMap")
    external = manifests(installed("external-redis"))
    assert by_kind(external, "HTTPRoute") and not by_kind(external, "StatefulSet")
    assert one(manifests(installed("default")), "StatefulSet", "-redis")


@pytest.mark.parametrize(("values", "message"), [
    ({"redis": {"mode": "sentinel"}}, "/redis/mode"),
    ({"router": {"replicaz": 3}}, "additional properties 'replicaz' not allowed"),
    ({"operator": {"scope": "everything"}}, "/operator/scope"),
    ({"tenants": {"list": [{"name": "acme", "apiKeySha256": ["not-a-hash"]}]}}, "apiKeySha256"),
    ({"operator": {"replicas": 2}}, "needs operator.peering.enabled"),
    ({"redis": {"mode": "none"}}, "needs redis.mode bundled or external"),
    ({"redis": {"mode": "external"}}, "needs redis.external.host"),
    ({"tenants": {"open": True, "existingSecret": "t"}}, "contradicts"),
    ({"router": {"workerAdminPort": 8000}}, "must differ"),
    ({"router": {"adminTokenPools": ["Bad_Name"]}}, "adminTokenPools"),
    # A pool name the LoraPool CRD refuses (its Service name is an RFC 1035 label, at most 52 long).
    ({"defaultPool": {"enabled": True, "name": "3llama"}}, "/defaultPool/name"),
    ({"defaultPool": {"enabled": True, "name": "l" * 53}}, "/defaultPool/name"),
    ({"router": {"replicas": -1}}, "/router/replicas"),
    ({"image": {"worker": {"pullPolicy": "always"}}}, "/image/worker/pullPolicy"),
    ({"router": {"podDisruptionBudget": {"maxUnavailable": "most"}}}, "/router/podDisruptionBudget/maxUnavailable"),
    ({"router": {"ingress": {"enabled": True, "hosts": []}}}, "needs at least one router.ingress.hosts"),
    ({"tenants": {"list": [{"name": "a", "apiKeySha256": ["a" * 64]}, {"name": "b", "apiKeySha256": ["a" * 64]}]}},
     "listed twice"),
], ids=["enum", "unknown-key", "scope", "hash", "ha-without-peering", "replicas-without-redis", "external-no-host",
        "open-and-keys", "same-ports", "bad-pool-name", "pool-name-digit", "pool-name-long", "negative-replicas",
        "pull-policy", "pdb", "ingress-without-hosts", "shared-key-hash"])
def test_bad_values_are_refused_with_a_message(helm: None, values: dict[str, Any], message: str) -> None:
    out = run_helm("install", values)
    assert not out["ok"], f"{values} was accepted"
    assert message in out["error"], out["error"]
