"""The chart's default pool with remote adapter sources: values reach the LoraPool's spec.sources and
serviceAccountName, the workers' ServiceAccount carries the cloud-role annotation, and what the
operator builds from that pool references the credentials Secret by name only."""

from __future__ import annotations

import pytest

from lorafleet.operator.builders import pod_template
from lorafleet.operator.spec import parse_pool
from tests.charts.conftest import installed, manifests, run_helm
from tests.charts.rendered import one

pytestmark = pytest.mark.usefixtures("helm")


def test_default_pool_sources_and_service_account() -> None:
    objs = manifests(installed("full"))
    raw = one(objs, "LoraPool")
    name = raw["metadata"]["name"]
    assert raw["spec"]["sources"] == {"credentialsSecretRef": {"name": "adapter-store"},
                                      "allowedBuckets": ["team-adapters"], "allowedHubOwners": ["my-org"],
                                      "cacheBytes": 10737418240}
    account = one(objs, "ServiceAccount", f"{name}-worker")
    assert raw["spec"]["serviceAccountName"] == account["metadata"]["name"]
    assert account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].endswith(":role/adapters-read")
    assert account["automountServiceAccountToken"] is False

    pool = parse_pool(raw["metadata"]["namespace"], name, raw["spec"])
    spec = pod_template(pool)["spec"]
    assert spec["serviceAccountName"] == f"{name}-worker"
    refs = {e["valueFrom"]["secretKeyRef"]["name"] for e in spec["containers"][0]["env"] if "valueFrom" in e}
    assert refs == {"adapter-store"}
    assert not any(o["kind"] == "Secret" and o["metadata"]["name"] == "adapter-store" for o in objs)


def test_default_pool_without_sources_serves_its_volume_only() -> None:
    objs = manifests(run_helm("install", {"defaultPool": {"enabled": True}}))
    raw = one(objs, "LoraPool")
    assert "sources" not in raw["spec"] and "serviceAccountName" not in raw["spec"]
    assert not any(o["kind"] == "ServiceAccount" and o["metadata"]["name"].endswith("-worker") for o in objs)


def test_default_pool_node_cache_is_off_unless_a_folder_is_given() -> None:
    from tests.operator.pod_security import restricted_violations

    values = {"defaultPool": {"enabled": True, "sources": {"enabled": True, "allowedBuckets": ["b-1"]}}}
    raw = one(manifests(run_helm("install", values)), "LoraPool")
    assert "nodeCache" not in raw["spec"]["sources"]
    spec = pod_template(parse_pool(raw["metadata"]["namespace"], raw["metadata"]["name"], raw["spec"]))["spec"]
    assert restricted_violations(spec) == []

    values["defaultPool"]["sources"]["nodeCache"] = {"hostPath": "/var/cache/lorafleet-adapters"}
    raw = one(manifests(run_helm("install", values)), "LoraPool")
    assert raw["spec"]["sources"]["nodeCache"] == {"hostPath": "/var/cache/lorafleet-adapters"}
    spec = pod_template(parse_pool(raw["metadata"]["namespace"], raw["metadata"]["name"], raw["spec"]))["spec"]
    cache = next(v for v in spec["volumes"] if v["name"] == "adapter-cache")
    assert cache["hostPath"] == {"path": "/var/cache/lorafleet-adapters", "type": "DirectoryOrCreate"}
    # The one thing Pod Security restricted refuses: the namespace must be privileged (docs/kubernetes.md).
    assert restricted_violations(spec) == ["volume adapter-cache: type ['hostPath'] not allowed"]


def test_values_schema_refuses_a_relative_node_cache_folder() -> None:
    out = run_helm("install", {"defaultPool": {"enabled": True, "sources": {
        "enabled": True, "nodeCache": {"hostPath": "var/cache"}}}})
    assert not out["ok"] and "/defaultPool/sources/nodeCache/hostPath" in out["error"], out
