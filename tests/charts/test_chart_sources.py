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
