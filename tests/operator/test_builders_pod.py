"""The worker pod the operator builds: Pod Security `restricted`, the admin token readable by the
worker's user, the model path, and the pool's pod fields passed through."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from lorafleet.operator import builders
from lorafleet.operator.spec import SpecError, parse_pool
from tests.operator.pod_security import restricted_violations
from tests.operator.test_crd_structural import ROOT, _validator

BASE = {"model": {"path": "/models/llama", "servedName": "llama", "claimName": "models"}, "image": "w:1"}
FULL = {
    **BASE,
    "nodeSelector": {"nvidia.com/gpu.product": "H100"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                            "labelSelector": {"matchLabels": {"lorafleet.dev/pool": "p"}}}}]}},
    "priorityClassName": "inference",
    "runtimeClassName": "nvidia",
    "imagePullSecrets": [{"name": "regcred"}],
    "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "40Gi"}, "requests": {"cpu": "4"}},
    "env": [{"name": "HF_HUB_OFFLINE", "value": "1"},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
    "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
                {"name": "cache", "persistentVolumeClaim": {"claimName": "cache"}}],
    "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}, {"name": "cache", "mountPath": "/cache", "readOnly": True}],
}


def pod(spec: dict[str, Any]) -> dict[str, Any]:
    return builders.workload(parse_pool("ns", "p", spec))["spec"]["template"]["spec"]


@pytest.mark.parametrize("spec", [BASE, FULL, {**BASE, "workloadKind": "StatefulSet"},
                                  {"model": {"path": "/opt/m", "servedName": "m"}, "image": "w"},
                                  {**FULL, "server": {"kind": "vllm"}}])
def test_worker_pod_passes_restricted(spec: dict[str, Any]) -> None:
    assert restricted_violations(pod(spec)) == []


def test_restricted_check_refuses_what_admission_refuses() -> None:
    """The checker is not a rubber stamp: a pod as the operator built it before (no pod securityContext)."""
    bad = copy.deepcopy(pod(BASE))
    del bad["securityContext"]
    bad["containers"][0]["securityContext"] = {"allowPrivilegeEscalation": False}
    found = " ".join(restricted_violations(bad))
    assert "runAsNonRoot" in found and "seccompProfile" in found and "drop ALL" in found
    bad = copy.deepcopy(pod(BASE))
    bad["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    assert restricted_violations(bad)


def _readable(mode: int, uid: int, gid: int, groups: set[int], owner: int, group: int) -> bool:
    """POSIX read permission of a file (owner, group, mode) for a process (uid, gid, groups)."""
    if uid == owner:
        return bool(mode & 0o400)
    if group == gid or group in groups:
        return bool(mode & 0o040)
    return bool(mode & 0o004)


def test_admin_token_is_readable_by_the_workers_user() -> None:
    """The kubelet writes a Secret volume's files as root with the group fsGroup and defaultMode."""
    spec = pod(BASE)
    sc = spec["securityContext"]
    volume = next(v for v in spec["volumes"] if v["name"] == "admin-token")
    mode = volume["secret"]["defaultMode"]
    uid, gid = sc["runAsUser"], sc["runAsGroup"]
    assert uid != 0
    assert _readable(mode, uid, gid, {sc["fsGroup"]}, owner=0, group=sc["fsGroup"])
    assert not mode & 0o007, "others (any other user in the pod) must not read the token"
    assert not _readable(0o400, uid, gid, {sc["fsGroup"]}, owner=0, group=sc["fsGroup"])  # the old mode


@pytest.mark.parametrize(("path", "claim", "expected"), [
    ("/models/Llama-3.1-8B-Instruct", "models", "/models/Llama-3.1-8B-Instruct"),
    ("Llama-3.1-8B-Instruct", "models", "/models/Llama-3.1-8B-Instruct"),
    ("/Llama-3.1-8B-Instruct", "models", "/models/Llama-3.1-8B-Instruct"),
    ("/models", "models", "/models"),
    ("/opt/model", None, "/opt/model"),
    ("/models/m", None, "/models/m"),
])
def test_model_path_is_never_doubled(path: str, claim: str | None, expected: str) -> None:
    model = {"path": path, "servedName": "m"} | ({"claimName": claim} if claim else {})
    args = pod({"model": model, "image": "w"})["containers"][0]["args"]
    assert args[args.index("--model") + 1] == expected


def test_example_pool_model_path() -> None:
    example = yaml.safe_load((ROOT / "examples" / "pool.yaml").read_text())
    args = pod(example["spec"])["containers"][0]["args"]
    assert args[args.index("--model") + 1] == example["spec"]["model"]["path"]


def test_pool_pod_fields_reach_the_worker_pods() -> None:
    spec = pod(FULL)
    container = spec["containers"][0]
    assert spec["nodeSelector"] == FULL["nodeSelector"]
    assert spec["tolerations"] == FULL["tolerations"]
    assert spec["affinity"] == FULL["affinity"]
    assert spec["priorityClassName"] == "inference" and spec["runtimeClassName"] == "nvidia"
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert container["resources"] == FULL["resources"]
    assert container["env"] == FULL["env"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["shm"] == FULL["volumes"][0] and volumes["cache"] == FULL["volumes"][1]
    assert {"admin-token", "adapters", "model"} <= volumes.keys()
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["shm"]["mountPath"] == "/dev/shm" and mounts["cache"]["readOnly"] is True
    # and the CRD's schema accepts the same spec
    obj = {"apiVersion": "lorafleet.dev/v1alpha1", "kind": "LoraPool", "metadata": {"name": "p"}, "spec": FULL}
    assert [e.message for e in _validator("lorapools").iter_errors(obj)] == []


def test_unset_pod_fields_are_absent() -> None:
    spec = pod(BASE)
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName", "runtimeClassName", "imagePullSecrets"):
        assert key not in spec
    assert "env" not in spec["containers"][0]


@pytest.mark.parametrize(("patch", "words"), [
    ({"volumes": [{"name": "adapters", "emptyDir": {}}]}, "operator's own volume names"),
    ({"volumes": [{"name": "x", "emptyDir": {}}, {"name": "x", "emptyDir": {}}]}, "unique"),
    ({"volumeMounts": [{"name": "nope", "mountPath": "/x"}]}, "not in spec.volumes"),
    ({"volumes": [{"name": "x", "emptyDir": {}}], "volumeMounts": [{"name": "x", "mountPath": "/adapters"}]},
     "operator mounts"),
    ({"volumes": [{"name": "x", "emptyDir": {}}], "volumeMounts": [{"name": "x", "mountPath": "/models/"}]},
     "operator mounts"),
    ({"env": [{"value": "1"}]}, "env[0].name"),
    ({"tolerations": "nvidia"}, "tolerations"),
    ({"nodeSelector": {"a": 1}}, "nodeSelector"),
])
def test_bad_pod_fields_are_spec_errors(patch: dict[str, Any], words: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_pool("ns", "p", {**BASE, **patch})
    assert err.value.reason == "InvalidSpec" and words in str(err.value)


def test_vllm_pool_pods_get_the_pool_pod_fields_and_model_path() -> None:
    spec = pod({**FULL, "server": {"kind": "vllm"}})
    assert spec["runtimeClassName"] == "nvidia" and spec["tolerations"] == FULL["tolerations"]
    container = spec["containers"][0]
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in container["env"]
    assert {m["name"] for m in container["volumeMounts"]} >= {"shm", "cache"}
    assert container["args"][container["args"].index("--model") + 1] == "/models/llama"
