"""charts/lorafleet's command lines: the operator's and router's args parse with their real CLIs and
select the workers as the operator labels them.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest

from tests.charts.conftest import NAMES, VALUE_SETS, installed, manifests
from tests.charts.rendered import by_kind, container, env_of, expand, one

pytestmark = pytest.mark.usefixtures("helm")


def test_operator_flags_parse(render: Any) -> None:
    cli = pytest.importorskip("lorafleet.operator.cli")
    name, _, objs = render
    c = container(one(objs, "Deployment", "-operator"))
    assert c["command"] == ["lorafleet"] and c["args"][0] == "operator"
    args = cli.build_parser().parse_args(expand(c["args"][1:], env_of(c)))
    values = VALUE_SETS[name].get("operator", {})
    if values.get("scope") == "cluster":
        assert args.all_namespaces and not args.namespace
    else:
        assert args.namespace == (values.get("watchNamespaces") or ["default"])
    assert (args.peering is not None) == values.get("peering", {}).get("enabled", False)


def test_router_flags_parse_and_tenants_load(render: Any, tmp_path: Path) -> None:
    cli = pytest.importorskip("lorafleet.router.cli")
    tenants_mod = pytest.importorskip("lorafleet.router.tenants")
    name, _, objs = render
    c = container(one(objs, "Deployment", "-router"))
    assert c["command"] == ["lorafleet"] and c["args"][0] == "router"
    args = cli.build_parser().parse_args(expand(c["args"][1:], env_of(c)))
    values = VALUE_SETS[name]
    assert args.discovery == "kubernetes" and args.host == "0.0.0.0"
    assert args.port == c["ports"][0]["containerPort"]
    assert (args.redis_url is None) == (values.get("redis", {}).get("mode") == "none")
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    if values.get("tenants", {}).get("open"):
        assert args.tenants_file is None
    else:
        assert str(args.tenants_file.parent) in mounts
        secret = one(objs, "Secret", "-tenants") if not values.get("tenants", {}).get("existingSecret") else None
        if secret is not None:
            path = tmp_path / "tenants.yaml"
            path.write_text(secret["stringData"][args.tenants_file.name])
            registry = tenants_mod.TenantRegistry.from_file(path)
            expected = {t["name"] for t in values.get("tenants", {}).get("list", [])}
            assert {t.name for t in registry.by_key_hash.values()} == expected
            assert not registry.open
    if args.admin_token_file is not None:
        assert str(args.admin_token_file.parent) in mounts
    assert args.k8s_admin_port == values.get("router", {}).get("workerAdminPort", 8001)
    pools = list(values.get("router", {}).get("adminTokenPools", []))
    if values.get("defaultPool", {}).get("enabled"):
        pools.insert(0, values["defaultPool"].get("name", "default"))
    volumes = {v["name"]: v for v in one(objs, "Deployment", "-router")["spec"]["template"]["spec"]["volumes"]}
    if not pools:
        assert args.admin_token_dir is None
    else:
        # One file per pool, named by the pool: what the router looks up by the pod's pool label.
        assert mounts[str(args.admin_token_dir)] == "admin-tokens"
        sources = [src["secret"] for src in volumes["admin-tokens"]["projected"]["sources"]]
        assert [(s["name"], s["items"]) for s in sources] == [
            (f"{p}-admin-token", [{"key": "token", "path": p}]) for p in dict.fromkeys(pools)
        ]


def test_workers_are_selected_as_the_operator_labels_them(render: Any) -> None:
    """NetworkPolicy, ServiceMonitor and router discovery select the pods operator/builders.py makes."""
    builders = pytest.importorskip("lorafleet.operator.builders")
    from lorafleet.operator.spec import PoolSpec

    name, _, objs = render
    pool = PoolSpec(namespace="default", name="llama", image="w", model_path="/m", served_name="m")
    pod = builders.pod_template(pool)
    worker_labels = pod["metadata"]["labels"]
    worker_ports = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    router = container(one(objs, "Deployment", "-router"))
    selector = next(a.split("=", 1)[1] for a in router["args"] if a.startswith("--k8s-selector="))
    assert dict(kv.split("=") for kv in selector.split(",")).items() <= worker_labels.items()
    port = next(a.split("=", 1)[1] for a in router["args"] if a.startswith("--k8s-port="))
    assert int(port) == pool.http_port
    admin_port = next(a.split("=", 1)[1] for a in router["args"] if a.startswith("--k8s-admin-port="))
    assert int(admin_port) == pool.admin_port
    for lorapool in by_kind(objs, "LoraPool"):
        assert lorapool["spec"]["ports"] == {"http": pool.http_port, "admin": pool.admin_port}
    for np in by_kind(objs, "NetworkPolicy"):
        assert np["spec"]["podSelector"]["matchLabels"].items() <= worker_labels.items()
        admin_rules = [r for r in np["spec"]["ingress"] if any(p["port"] == "admin" for p in r["ports"])]
        assert len(admin_rules) == 1, "exactly one rule may open the admin port"
        allowed = [peer["podSelector"]["matchLabels"] for peer in admin_rules[0]["from"]]
        pods = {w["metadata"]["name"]: w["spec"]["template"]["metadata"]["labels"] for w in by_kind(objs, "Deployment")}
        reach = {n for n, labels in pods.items() if any(sel.items() <= labels.items() for sel in allowed)}
        assert reach == {d["metadata"]["name"] for d in by_kind(objs, "Deployment")
                         if d["metadata"]["name"].endswith(("-operator", "-router"))}
        assert {p["port"] for r in np["spec"]["ingress"] for p in r["ports"]} <= worker_ports
    for sm in by_kind(objs, "ServiceMonitor"):
        if sm["metadata"]["name"].endswith("-workers"):
            service = builders.service(pool)
            assert sm["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
            assert {e["port"] for e in sm["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    has_np = VALUE_SETS[name].get("networkPolicy", {}).get("enabled", True)
    assert bool(by_kind(objs, "NetworkPolicy")) == has_np


def test_router_args_quote_nothing_unsafe() -> None:
    """Args are single tokens: a value with spaces would split differently than it reads."""
    for name in NAMES:
        for w in by_kind(manifests(installed(name)), "Deployment"):
            for a in container(w)["args"]:
                assert shlex.split(a) == [a] or a == "", a
