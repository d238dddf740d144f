"""charts/lorafleet's RBAC: exactly what the operator and router call, bound to the accounts they run as."""

from __future__ import annotations

from typing import Any

import pytest

from tests.charts.conftest import VALUE_SETS, installed, manifests
from tests.charts.rendered import by_kind, container, one

pytestmark = pytest.mark.usefixtures("helm")

# What router/discovery.py calls (GET .../namespaces/<ns>/pods). The operator's rules are derived
# from its calls in tests/operator/test_rbac_from_calls.py; here: the same rules in every scope.
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
    # The namespaced rules, as test_rbac_from_calls derives them for the default values.
    expected = grants(next(r for r in by_kind(manifests(installed("default")), "Role")
                           if r["metadata"]["name"].endswith("-operator")))
    assert ("kopf.dev", "kopfpeerings") not in expected
    if peering:
        expected |= {("kopf.dev", "clusterkopfpeerings" if cluster else "kopfpeerings"): {"list", "watch", "patch"}}
    if cluster:
        assert grants(one(objs, "ClusterRole", "-operator-default")) == expected
    else:
        assert not by_kind(objs, "ClusterRole") and not by_kind(objs, "ClusterRoleBinding")
        watched = values.get("operator", {}).get("watchNamespaces") or ["default"]
        roles = [r for r in by_kind(objs, "Role") if r["metadata"]["name"].endswith("-operator")]
        assert sorted(r["metadata"]["namespace"] for r in roles) == sorted(watched)
        for role in roles:
            assert grants(role) == expected
    for role in [r for r in by_kind(objs, "Role") if r["metadata"]["name"].endswith("-router")]:
        assert grants(role) == ROUTER_NEEDS
    # Every binding names a ServiceAccount the pods actually run as.
    accounts = {o["metadata"]["name"] for o in by_kind(objs, "ServiceAccount")}
    used = {w["spec"]["template"]["spec"].get("serviceAccountName") for w in by_kind(objs, "Deployment")}
    assert used <= accounts
    for binding in by_kind(objs, "RoleBinding") + by_kind(objs, "ClusterRoleBinding"):
        assert {s["name"] for s in binding["subjects"]} <= accounts
        roles = by_kind(objs, binding["roleRef"]["kind"])
        assert binding["roleRef"]["name"] in {r["metadata"]["name"] for r in roles}


def test_router_discovers_workers_in_every_watched_namespace(render: Any) -> None:
    """The router lists pods in each namespace the operator makes workers in (scope=namespace), with
    a Role there; its --k8s-namespace names the same namespaces."""
    name, _, objs = render
    values = VALUE_SETS[name]
    if not values.get("router", {}).get("enabled", True):
        return
    arg = next(a for a in container(one(objs, "Deployment", "-router"))["args"] if a.startswith("--k8s-namespace="))
    discovered = arg.split("=", 1)[1].split(",")
    roles = sorted(r["metadata"]["namespace"] for r in by_kind(objs, "Role") if r["metadata"]["name"].endswith("-router"))
    assert sorted(discovered) == roles
    operator = values.get("operator", {})
    if operator.get("scope", "namespace") == "namespace" and not values.get("router", {}).get("discoveryNamespaces"):
        assert sorted(discovered) == sorted(operator.get("watchNamespaces") or ["default"])
