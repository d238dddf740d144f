"""What a production install expects of charts/lorafleet beyond rendering: the router survives node
drains (PodDisruptionBudget), every long-running container has probes the kubelet can call, and
NOTES.txt tells the truth about the values chosen."""

from __future__ import annotations

from typing import Any

import pytest

from tests.charts.conftest import VALUE_SETS, installed, manifests, run_helm
from tests.charts.rendered import by_kind, container, one

pytestmark = pytest.mark.usefixtures("helm")


def _selects(selector: dict[str, str], workload: dict[str, Any]) -> bool:
    return selector.items() <= workload["spec"]["template"]["metadata"]["labels"].items()


def test_a_router_with_several_replicas_has_a_disruption_budget(render: Any) -> None:
    name, _, objs = render
    router = one(objs, "Deployment", "-router")
    values = VALUE_SETS[name].get("router", {})
    several = values.get("autoscaling", {}).get("enabled") or router["spec"].get("replicas", 2) > 1
    budgets = [b for b in by_kind(objs, "PodDisruptionBudget") if _selects(b["spec"]["selector"]["matchLabels"], router)]
    if not several:
        assert not budgets, "one replica: a budget would only block drains"
        return
    assert len(budgets) == 1, [b["metadata"]["name"] for b in budgets]
    spec = budgets[0]["spec"]
    assert spec["maxUnavailable"] == 1 and "minAvailable" not in spec
    others = [w for w in by_kind(objs, "Deployment") + by_kind(objs, "StatefulSet") if w is not router]
    assert not [w["metadata"]["name"] for w in others if _selects(spec["selector"]["matchLabels"], w)]


def test_the_router_budget_follows_its_values() -> None:
    objs = manifests(run_helm("install", {"router": {"podDisruptionBudget": {"maxUnavailable": "50%"}}}))
    assert one(objs, "PodDisruptionBudget", "-router")["spec"]["maxUnavailable"] == "50%"
    objs = manifests(run_helm("install", {"router": {"podDisruptionBudget": {"enabled": False}}}))
    assert not by_kind(objs, "PodDisruptionBudget")


def test_every_long_running_container_has_probes_on_its_own_ports(render: Any) -> None:
    _, _, objs = render
    for w in by_kind(objs, "Deployment") + by_kind(objs, "StatefulSet"):
        c = container(w)
        label = w["metadata"]["name"]
        assert "livenessProbe" in c and ("readinessProbe" in c or "startupProbe" in c), label
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        for kind in ("livenessProbe", "readinessProbe", "startupProbe"):
            probe = c.get(kind)
            if probe is None:
                continue
            action = probe.get("httpGet") or probe.get("tcpSocket")
            assert action["port"] in ports, f"{label} {kind} calls port {action['port']}, not one it serves"


def test_the_operators_probe_calls_the_endpoint_its_flags_serve(render: Any) -> None:
    """kopf serves /healthz only where --liveness says: probe, port and flag must agree."""
    cli = pytest.importorskip("lorafleet.operator.cli")
    _, _, objs = render
    c = container(one(objs, "Deployment", "-operator"))
    endpoint = cli.operator_kwargs(cli.build_parser().parse_args(
        [a for a in c["args"][1:] if "$(" not in a]))["liveness_endpoint"]
    assert endpoint, "the operator serves no health endpoint"
    host_port, _, path = endpoint.removeprefix("http://").partition("/")
    host, _, port = host_port.partition(":")
    assert host == "0.0.0.0", "the kubelet calls the pod IP"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for kind in ("livenessProbe", "startupProbe"):
        probe = c[kind]["httpGet"]
        assert ports[probe["port"]] == int(port) and probe["path"] == f"/{path}", (kind, probe, endpoint)


def test_notes_speak_of_the_admin_token_only_when_the_router_has_none() -> None:
    """The default pool, or pools listed in router.adminTokenPools, give the router its tokens."""
    warning = "no worker admin token"
    assert warning in installed("default")["notes"]
    assert warning not in installed("full")["notes"]  # a default pool and adminTokenPools
    assert warning not in run_helm("install", {"router": {"adminTokenPools": ["llama"]}})["notes"]
    assert warning not in installed("external-redis")["notes"]  # adminTokenSecret


def test_notes_follow_the_way_the_router_is_exposed() -> None:
    route = installed("external-redis")  # an HTTPRoute with a hostname
    assert "LORAFLEET_URL=http://llm.example.com" in route["notes"]
    assert "port-forward" not in route["notes"]
    off = run_helm("install", {"router": {"enabled": False}})
    assert off["ok"], off.get("error")
    assert "/v1/completions" not in off["notes"] and "router.enabled=false" in off["notes"]
    assert "examples/" not in installed("default")["notes"], "a chart user has no checkout of the repository"
    assert "kind: LoraPool" in installed("default")["notes"]


def test_workers_admin_port_is_closed_in_every_watched_namespace() -> None:
    """The operator makes workers in each namespace it watches; each gets the admin-port policy,
    open only to this release's operator and router pods, in the release namespace."""
    objs = manifests(installed("full"))
    watched = VALUE_SETS["full"]["operator"]["watchNamespaces"]
    policies = by_kind(objs, "NetworkPolicy")
    assert sorted(p["metadata"]["namespace"] for p in policies) == sorted(watched)
    components = {"operator", "router"}
    for policy in policies:
        (admin,) = [r for r in policy["spec"]["ingress"] if any(p["port"] == "admin" for p in r["ports"])]
        peers = admin["from"]
        assert {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in peers} == components
        for peer in peers:  # a pod selector alone would mean pods of the policy's own namespace
            assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "default"}, policy
        # The public port: the router (above) and the metrics scraper; no rule without peers (= any pod).
        assert all(rule.get("from") for rule in policy["spec"]["ingress"]), policy
        public = [r for r in policy["spec"]["ingress"] if r is not admin]
        assert [r["from"] for r in public] == [VALUE_SETS["full"].get("networkPolicy", {}).get(
            "scraperFrom", [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}])]
