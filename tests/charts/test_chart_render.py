"""charts/lorafleet through the real Helm engine: lint, install into kmock, check what it created.

Every value set (the defaults and each ci/*-values.yaml) is linted and installed once into a fresh
emulator with HELM_DRIVER=memory; the checks below read the rendered manifest.
"""

from __future__ import annotations

import base64
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.charts.conftest import CHART, ROOT, VALUE_SETS, installed, manifests, run_helm

pytestmark = pytest.mark.usefixtures("helm")
NAMES = sorted(VALUE_SETS)
ERROR = 3  # Helm lint severity: 1 info, 2 warning, 3 error


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    found = [o for o in by_kind(objs, kind) if o["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} *{name_suffix}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def container(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]["containers"][0]


def env_of(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c.get("env", [])}


def expand(args: list[str], env: dict[str, dict[str, Any]]) -> list[str]:
    """Kubernetes' $(VAR) expansion, with placeholders for values that come from Secrets."""
    def value(m: re.Match[str]) -> str:
        e = env.get(m.group(1))
        assert e is not None, f"$({m.group(1)}) is used but not defined in env"
        return e.get("value", f"<{m.group(1)}>")
    return [re.sub(r"\$\(([A-Z_]+)\)", value, a) for a in args]


@pytest.fixture(params=NAMES)
def render(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    result = installed(request.param)
    assert result["ok"], f"helm install with {request.param} values failed: {result.get('error')}"
    return request.param, result, manifests(result)


# ---- lint and install --------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_lint(name: str) -> None:
    out = run_helm("lint", VALUE_SETS[name])
    assert out["ok"], out.get("error")
    errors = [m for m in out["result"]["Messages"] if m["Severity"] >= ERROR]
    if errors or out["result"]["Errors"]:
        # helm-sdkpy drops lint error texts ({}); an install shows the message.
        raise AssertionError(f"helm lint found errors in {[m['Path'] for m in errors]}: "
                             f"{run_helm('install', VALUE_SETS[name]).get('error')}")


def test_install_creates_every_rendered_object(render: Any) -> None:
    name, result, objs = render
    assert result["status"] == "deployed"
    stored = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in result["objects"]}
    for o in objs:
        key = (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])
        assert key in stored, f"{key} rendered but not in the emulator"
    crds = {o["metadata"]["name"] for o in result["objects"] if o["kind"] == "CustomResourceDefinition"}
    assert crds == {
        "lorapools.lorafleet.dev", "loraadapters.lorafleet.dev", "kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev",
    }
    assert "loraadapters" in result["notes"].lower() and "/v1/completions" in result["notes"]


# ---- valid Kubernetes objects ------------------------------------------------------------------

CRD_KINDS = {
    "LoraPool": "lorapools.lorafleet.dev.yaml",
    "KopfPeering": "peering/kopfpeerings.kopf.dev.yaml",
    "ClusterKopfPeering": "peering/clusterkopfpeerings.kopf.dev.yaml",
}
# Third-party kinds (Prometheus Operator, Gateway API): schemas not bundled; checked structurally.
FOREIGN = {"ServiceMonitor": "monitoring.coreos.com/v1", "HTTPRoute": "gateway.networking.k8s.io/v1"}


def test_objects_are_valid_kubernetes(render: Any) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    jsonschema = pytest.importorskip("jsonschema")
    _, _, objs = render
    for o in objs:
        label = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] in CRD_KINDS:
            crd = yaml.safe_load((ROOT / "crds" / CRD_KINDS[o["kind"]]).read_text())
            jsonschema.validate(o, crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
        elif o["kind"] in FOREIGN:
            assert o["apiVersion"] == FOREIGN[o["kind"]] and o["spec"], label
        else:
            try:
                kv.validate(o, "1.30", strict=True)
            except kv.ValidationError as exc:
                raise AssertionError(f"{label}: {exc}") from exc
        assert set(o["metadata"]["labels"]) >= {"app.kubernetes.io/name", "app.kubernetes.io/instance"}, label


# ---- RBAC --------------------------------------------------------------------------------------

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


# ---- images, ports, secrets, flags -------------------------------------------------------------

def test_images_and_ports_are_wired(render: Any) -> None:
    name, _, objs = render
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    image = f"ghcr.io/lorafleet/control-plane:{chart['appVersion']}"
    for w in by_kind(objs, "Deployment"):
        c = container(w)
        assert c["image"] == image, w["metadata"]["name"]
        named = {p["name"] for p in c.get("ports", [])}
        for probe in ("readinessProbe", "livenessProbe"):
            if probe in c:
                assert c[probe]["httpGet"]["port"] in named
    for svc in by_kind(objs, "Service"):
        target = [w for w in by_kind(objs, "Deployment") + by_kind(objs, "StatefulSet")
                  if svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(target) == 1, f"Service {svc['metadata']['name']} selects {len(target)} workloads"
        ports = {p["name"] for p in container(target[0])["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports
    for pool in by_kind(objs, "LoraPool"):
        assert pool["spec"]["image"] == f"ghcr.io/lorafleet/worker:{chart['appVersion']}"


def _secret_keys(objs: list[dict[str, Any]]) -> dict[str, set[str]]:
    return {s["metadata"]["name"]: set(s.get("data", {})) | set(s.get("stringData", {})) for s in by_kind(objs, "Secret")}


def test_secrets_are_wired(render: Any) -> None:
    name, _, objs = render
    values = VALUE_SETS[name]
    external = {values.get("redis", {}).get("auth", {}).get("existingSecret"),
                values.get("tenants", {}).get("existingSecret"),
                values.get("router", {}).get("adminTokenSecret")} - {None, ""}
    keys = _secret_keys(objs)
    refs = []
    for w in by_kind(objs, "Deployment") + by_kind(objs, "StatefulSet"):
        spec = w["spec"]["template"]["spec"]
        for e in container(w).get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                refs.append((ref["name"], ref["key"]))
        for v in spec.get("volumes", []):
            if "secret" in v:
                items = v["secret"].get("items") or [{"key": k} for k in keys.get(v["secret"]["secretName"], [])]
                refs += [(v["secret"]["secretName"], i["key"]) for i in items]
    assert refs or name == "minimal", "no Secret is used (minimal runs open, without Redis)"
    for secret, key in refs:
        if secret in external:
            continue
        assert secret in keys, f"{secret} is referenced but neither rendered nor configured as existing"
        assert key in keys[secret], f"{secret} has no key {key}"
    for s in by_kind(objs, "Secret"):
        for value in s.get("data", {}).values():
            assert base64.b64decode(value, validate=True)


def test_redis_url_reaches_operator_and_router(render: Any) -> None:
    name, _, objs = render
    mode = VALUE_SETS[name].get("redis", {}).get("mode", "bundled")
    for w in by_kind(objs, "Deployment"):
        env = env_of(container(w))
        if mode == "none":
            assert "LORAFLEET_REDIS_URL" not in env
            continue
        names = [e["name"] for e in container(w)["env"]]
        url = env["LORAFLEET_REDIS_URL"]["value"]
        assert names.index("REDIS_PASSWORD") < names.index("LORAFLEET_REDIS_URL"), "$(REDIS_PASSWORD) must come first"
        assert ":$(REDIS_PASSWORD)@" in url
        if mode == "bundled":
            svc = one(objs, "Service", "-redis")
            assert url == f"redis://:$(REDIS_PASSWORD)@{svc['metadata']['name']}.default.svc:6379/0"
        else:
            assert url == "rediss://:$(REDIS_PASSWORD)@redis.data.svc:6380/2"


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


def test_default_pool_token_is_the_one_the_router_mounts() -> None:
    result = installed("full")
    objs = manifests(result)
    pool = one(objs, "LoraPool")
    token = one(objs, "Secret", f"{pool['metadata']['name']}-admin-token")
    router = one(objs, "Deployment", "-router")
    vols = {v["name"]: v for v in router["spec"]["template"]["spec"]["volumes"]}
    sources = [s["secret"] for s in vols["admin-tokens"]["projected"]["sources"]]
    assert sources[0]["name"] == token["metadata"]["name"] and sources[0]["optional"] is False
    assert all(s["optional"] for s in sources[1:]), "pools made later by the operator may lack a Secret yet"
    assert len(base64.b64decode(token["data"]["token"])) >= 32


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


# ---- values refused ----------------------------------------------------------------------------

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
], ids=["enum", "unknown-key", "scope", "hash", "ha-without-peering", "replicas-without-redis", "external-no-host",
        "open-and-keys", "same-ports", "bad-pool-name"])
def test_bad_values_are_refused_with_a_message(helm: None, values: dict[str, Any], message: str) -> None:
    out = run_helm("install", values)
    assert not out["ok"], f"{values} was accepted"
    assert message in out["error"], out["error"]


def test_router_args_quote_nothing_unsafe() -> None:
    """Args are single tokens: a value with spaces would split differently than it reads."""
    for name in NAMES:
        for w in by_kind(manifests(installed(name)), "Deployment"):
            for a in container(w)["args"]:
                assert shlex.split(a) == [a] or a == "", a


def test_generated_secrets_survive_an_upgrade() -> None:
    """The Redis password and the default pool's admin token are generated once (`lookup`)."""
    out = run_helm("upgrade", VALUE_SETS["full"])
    assert out["ok"], out.get("error")
    generated = ["lf-lorafleet-redis", "llama-admin-token"]
    for name in generated:
        assert out["before"][name], name
        assert out["after"][name] == out["before"][name], f"{name} changed on upgrade"
