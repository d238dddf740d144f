"""A LoraPool's optional node-wide fetch cache (`spec.sources.nodeCache`): off by default (each
worker's own emptyDir, admitted under Pod Security `restricted`); on, the workers' cache is a
hostPath folder of the node, which `restricted` (and `baseline`) refuse, as the CRD, the chart and
the docs say. The CRD's schema, the operator's parser and the pod it builds agree; through the
operator (kmock tier) the pool's Deployment carries the hostPath."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from lorafleet.operator import sources
from lorafleet.operator.builders import WORKER_UID, pod_template
from lorafleet.operator.spec import SpecError, parse_pool
from tests.operator.conftest import Kubectl, OperatorRunner, eventually
from tests.operator.kmock_harness import PatchedEmulator
from tests.operator.pod_security import restricted_violations

ROOT = Path(__file__).resolve().parents[2]
POOL = {"model": {"path": "/models/m", "servedName": "m"}, "image": "w:1"}
NODE_DIR = "/var/cache/lorafleet-adapters"


def pool(**source_fields: Any):
    return parse_pool("default", "p", {**POOL, "sources": {"allowedBuckets": ["b-1"], **source_fields}})


def pool_schema() -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "crds" / "lorapools.lorafleet.dev.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def cache_of(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    container = spec["containers"][0]
    volume = next(v for v in spec["volumes"] if v["name"] == sources.CACHE_VOLUME)
    mount = next(m for m in container["volumeMounts"] if m["name"] == sources.CACHE_VOLUME)
    env = {e["name"]: e.get("value") for e in container["env"]}
    return volume, mount, env


def test_off_by_default_each_worker_has_an_emptydir_and_passes_restricted() -> None:
    spec = pod_template(pool())["spec"]
    volume, mount, env = cache_of(spec)
    assert "emptyDir" in volume and "hostPath" not in volume
    assert env["LORAFLEET_ADAPTER_CACHE_DIR"] == mount["mountPath"] == sources.CACHE_MOUNT
    assert restricted_violations(spec) == []


def test_node_cache_mounts_the_nodes_folder_which_restricted_refuses() -> None:
    p = pool(nodeCache={"hostPath": NODE_DIR + "/"}, cacheBytes=5 << 30)
    spec = pod_template(p)["spec"]
    volume, mount, env = cache_of(spec)
    assert volume == {"name": sources.CACHE_VOLUME, "hostPath": {"path": NODE_DIR, "type": "DirectoryOrCreate"}}
    assert env["LORAFLEET_ADAPTER_CACHE_DIR"] == mount["mountPath"] == sources.CACHE_MOUNT
    assert env["LORAFLEET_ADAPTER_CACHE_BYTES"] == str(5 << 30)  # the whole node folder's bound
    # The only thing restricted refuses is that volume: the rest of the pod keeps its hardening.
    assert restricted_violations(spec) == [f"volume {sources.CACHE_VOLUME}: type ['hostPath'] not allowed"]
    assert spec["securityContext"]["runAsUser"] == WORKER_UID


@pytest.mark.parametrize("raw", [
    {"hostPath": "relative/dir"}, {"hostPath": "/"}, {"hostPath": "/var/../etc"}, {"hostPath": ""}, {}, "/var/x",
])
def test_bad_node_cache_is_refused_by_the_crd_and_the_operator(raw: Any) -> None:
    with pytest.raises(SpecError) as info:
        pool(nodeCache=raw)
    assert info.value.reason == "InvalidSpec" and "nodeCache" in str(info.value)
    obj = {"apiVersion": "lorafleet.dev/v1alpha1", "kind": "LoraPool", "metadata": {"name": "p"},
           "spec": {**POOL, "sources": {"nodeCache": raw}}}
    schema_ok = jsonschema.Draft7Validator(pool_schema()).is_valid(obj)
    node_cache = pool_schema()["properties"]["spec"]["properties"]["sources"]["properties"]["nodeCache"]
    cel = node_cache["x-kubernetes-validations"][0]["rule"]
    assert cel.startswith("!self.hostPath.matches(")
    cel_refuses = isinstance(raw, dict) and re.search(cel.split("'")[1], raw.get("hostPath", "")) is not None
    assert not schema_ok or cel_refuses, raw


def test_a_good_node_cache_passes_the_crd() -> None:
    obj = {"apiVersion": "lorafleet.dev/v1alpha1", "kind": "LoraPool", "metadata": {"name": "p"},
           "spec": {**POOL, "sources": {"nodeCache": {"hostPath": NODE_DIR}}}}
    assert jsonschema.Draft7Validator(pool_schema()).is_valid(obj)


def test_the_crd_and_the_docs_say_which_pod_security_level_it_needs() -> None:
    node_cache = pool_schema()["properties"]["spec"]["properties"]["sources"]["properties"]["nodeCache"]
    for text in (node_cache["description"], (ROOT / "docs" / "kubernetes.md").read_text()):
        assert "hostPath" in text and "privileged" in text and "restricted" in text and "baseline" in text
        assert str(WORKER_UID) in text  # the folder must be writable by the workers' user
    assert "nodeCache" in (ROOT / "charts" / "lorafleet" / "values.yaml").read_text()


async def test_the_operator_builds_workers_on_the_nodes_folder(
    api: PatchedEmulator, kubectl: Kubectl, operator: OperatorRunner, tmp_path: Path,
) -> None:
    from tests.operator.test_e2e import apply, pool_manifest

    manifest = pool_manifest(tmp_path, replicas=2)
    manifest["spec"]["sources"] = {"allowedBuckets": ["b-1"], "nodeCache": {"hostPath": NODE_DIR}}
    await apply(kubectl, tmp_path, manifest)
    deployment = await eventually(lambda: api.get("apps/v1/deployments", "default", "pool"))
    volume, mount, env = cache_of(deployment["spec"]["template"]["spec"])
    assert volume["hostPath"] == {"path": NODE_DIR, "type": "DirectoryOrCreate"}
    assert env["LORAFLEET_ADAPTER_CACHE_DIR"] == mount["mountPath"]
    # Switched off again: the workers go back to their own emptyDir.
    del manifest["spec"]["sources"]["nodeCache"]
    await apply(kubectl, tmp_path, manifest)

    def emptydir() -> bool:
        got = api.get("apps/v1/deployments", "default", "pool")
        return "emptyDir" in cache_of(got["spec"]["template"]["spec"])[0]

    await eventually(emptydir)
