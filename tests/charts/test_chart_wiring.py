"""charts/lorafleet's wiring: images and ports, Secrets and their keys, the Redis URL, the default
pool's admin token.
"""

from __future__ import annotations

import base64
from typing import Any

import pytest
import yaml

from tests.charts.conftest import CHART, VALUE_SETS, installed, manifests
from tests.charts.rendered import by_kind, container, env_of, one

pytestmark = pytest.mark.usefixtures("helm")


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
