"""charts/lorafleet's RBAC: exactly what the operator and router call, bound to the accounts they run as."""

from __future__ import annotations

from typing import Any

import pytest

from tests.charts.conftest import VALUE_SETS
from tests.charts.rendered import by_kind, one

pytestmark = pytest.mark.usefixtures("helm")

# What operator/ calls (kopf + operator/kube.py) and router/discovery.py; nothing more is granted.
OPERATOR_NEEDS = {
    ("lorafleet.dev", "lorapools"): {"get", "list", "watch", "patch"},
    ("lorafleet.dev", "loraadapters"): {"get", "list", "watch", "patch"},
    ("lorafleet.dev", "lorapools/status"): {"get", "patch"},
    ("lorafleet.dev", "loraadapters/status"): {"get", "patch"},
    ("", "pods"): {"get", "list", "watch"},
    ("", "services"): {"get", "create", "patch"},
    ("", "secrets"): {"get", "create"},
    ("apps", "deployments"): {"get", "create", "patch"},
    ("apps", "statefulsets"): {"get", "create", "patch"},
    ("policy", "poddisruptionbudgets"): {"get", "create", "patch"},
    ("", "events"): {"create"},
}
PEERING = {("kopf.dev", "kopfpeerings"): {"get", "list", "watch", "patch"}}
CLUSTER_EXTRA = {
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
    ("", "namespaces"): {"list", "watch"},
}
ROUTER_NEEDS = {("", "pods"): {"list"}}


def grants(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"], rule
        assert not rule.get("resourceNames") and not rule.get("nonResourceURLs"), rule
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                out.setdefault((group, res), set()).update(rule["verbs"])
    return out


def test_rbac_is_least_privilege(render: Any) -> None:
    name, _, objs = render
    values = VALUE_SETS[name]
    cluster = values.get("operator", {}).get("scope") == "cluster"
    peering = values.get("operator", {}).get("peering", {}).get("enabled", False)
    expected = dict(OPERATOR_NEEDS)
    if peering:
        expected |= {("kopf.dev", "clusterkopfpeerings" if cluster else "kopfpeerings"): PEERING[("kopf.dev", "kopfpeerings")]}
    if cluster:
        expected |= CLUSTER_EXTRA
        assert grants(one(objs, "ClusterRole", "-operator-default")) == expected
        assert [r["metadata"]["name"] for r in by_kind(objs, "Role")] == ["lf-lorafleet-router"]
    else:
        assert not by_kind(objs, "ClusterRole") and not by_kind(objs, "ClusterRoleBinding")
        watched = values.get("operator", {}).get("watchNamespaces") or ["default"]
        roles = [r for r in by_kind(objs, "Role") if r["metadata"]["name"].endswith("-operator")]
        assert sorted(r["metadata"]["namespace"] for r in roles) == sorted(watched)
        for role in roles:
            assert grants(role) == expected
    assert grants(one(objs, "Role", "-router")) == ROUTER_NEEDS
    # Every binding names a ServiceAccount the pods actually run as.
    accounts = {o["metadata"]["name"] for o in by_kind(objs, "ServiceAccount")}
    used = {w["spec"]["template"]["spec"].get("serviceAccountName") for w in by_kind(objs, "Deployment")}
    assert used <= accounts
    for binding in by_kind(objs, "RoleBinding") + by_kind(objs, "ClusterRoleBinding"):
        assert {s["name"] for s in binding["subjects"]} <= accounts
        roles = by_kind(objs, binding["roleRef"]["kind"])
        assert binding["roleRef"]["name"] in {r["metadata"]["name"] for r in roles}
