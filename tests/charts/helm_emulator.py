"""Run the real Helm engine (PyPI helm-sdkpy) against the kmock Kubernetes emulator, in a subprocess.

Usage: `python helm_emulator.py JOB_JSON` → prints one JSON result on stdout.
  job = {"op": "lint" | "install", "chart": DIR, "values": {...}, "namespace": NS, "release": NAME}
  With "kubeconfig" (its text) in the job, "install" goes to that API server instead of an emulator.

Why a subprocess: helm-sdkpy is a Go shared library, and Go reads the environment once, from the
process's initial environ, so `HELM_DRIVER=memory` (release records kept in memory rather than as
Secrets, which Helm writes as protobuf that kmock cannot decode) must be set before Python starts.
The emulator runs inside the same subprocess, so the test process stays synchronous.

`helm lint` through helm-sdkpy takes no values, so linting a values file copies the chart and merges
the values into its values.yaml (what `helm lint -f` does, minus null-deletes, unused here).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

# Kinds the chart creates that the operator's emulator helper does not declare.
EXTRA_KINDS: dict[str, tuple[str, bool]] = {
    "v1/configmaps": ("ConfigMap", True),
    "v1/serviceaccounts": ("ServiceAccount", True),
    "rbac.authorization.k8s.io/v1/roles": ("Role", True),
    "rbac.authorization.k8s.io/v1/rolebindings": ("RoleBinding", True),
    "rbac.authorization.k8s.io/v1/clusterroles": ("ClusterRole", False),
    "rbac.authorization.k8s.io/v1/clusterrolebindings": ("ClusterRoleBinding", False),
    "networking.k8s.io/v1/networkpolicies": ("NetworkPolicy", True),
    "networking.k8s.io/v1/ingresses": ("Ingress", True),
    "autoscaling/v2/horizontalpodautoscalers": ("HorizontalPodAutoscaler", True),
    "monitoring.coreos.com/v1/servicemonitors": ("ServiceMonitor", True),
    "gateway.networking.k8s.io/v1/httproutes": ("HTTPRoute", True),
    "kopf.dev/v1/kopfpeerings": ("KopfPeering", True),
    "kopf.dev/v1/clusterkopfpeerings": ("ClusterKopfPeering", False),
}


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


async def lint(helm: Any, config: Any, chart: Path, values: dict[str, Any]) -> dict[str, Any]:
    import yaml

    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / chart.name
        shutil.copytree(chart, copy)
        if values:
            merged = deep_merge(yaml.safe_load((copy / "values.yaml").read_text()), values)
            (copy / "values.yaml").write_text(yaml.safe_dump(merged, sort_keys=False))
        try:
            result = await helm.Lint(config).run(str(copy))
        except helm.HelmError as exc:
            return {"ok": False, "error": str(exc)}
    return {"ok": True, "result": result}


async def install(helm: Any, config: Any, emulator: Any, job: dict[str, Any]) -> dict[str, Any]:
    try:
        release = await helm.Install(config).run(
            job.get("release", "lf"), str(job["chart"]), values=job.get("values") or None, wait=False, timeout=60
        )
    except helm.HelmError as exc:
        return {"ok": False, "error": str(exc)}
    objects = [obj.raw for obj in emulator.objects.values() if not obj.deleted]
    return {"ok": True, "manifest": release.get("manifest", ""), "notes": release.get("info", {}).get("notes", ""),
            "status": release.get("info", {}).get("status"), "objects": objects}


async def install_then_upgrade(helm: Any, config: Any, emulator: Any, job: dict[str, Any]) -> dict[str, Any]:
    """Install, then upgrade with the same values: the Secrets' data before and after."""
    def secrets() -> dict[str, Any]:
        return {o.raw["metadata"]["name"]: o.raw.get("data") for o in emulator.objects.values()
                if not o.deleted and o.raw.get("kind") == "Secret"}

    first = await install(helm, config, emulator, job)
    if not first["ok"]:
        return first
    before = secrets()
    try:
        await helm.Upgrade(config).run(job.get("release", "lf"), str(job["chart"]), values=job.get("values") or None,
                                       wait=False, timeout=60)
    except helm.HelmError as exc:
        return {"ok": False, "error": str(exc)}
    return {"ok": True, "before": before, "after": secrets()}


async def main(job: dict[str, Any]) -> dict[str, Any]:
    import helm_sdkpy as helm
    import kmock

    from tests.operator.kmock_harness import PatchedEmulator, kubeconfig

    namespace = job.get("namespace", "default")
    if job.get("kubeconfig"):  # a real API server (tests/operator/real_cluster.py): no emulator
        config = helm.Configuration(namespace=namespace, kubeconfig=job["kubeconfig"])
        try:
            release = await helm.Install(config).run(job.get("release", "lf"), str(job["chart"]),
                                                     values=job.get("values") or None, wait=False, timeout=120)
        except helm.HelmError as exc:
            return {"ok": False, "error": str(exc)}
        return {"ok": True, "manifest": release.get("manifest", ""), "status": release.get("info", {}).get("status")}
    async with PatchedEmulator() as emulator, kmock.Server(emulator):
        for key, (kind, namespaced) in EXTRA_KINDS.items():
            emulator.declare(key, kind=kind, namespaced=namespaced)
        for ns in {namespace, *job.get("extra_namespaces", [])}:
            emulator.add_namespace(ns)
        config = helm.Configuration(namespace=namespace, kubeconfig=kubeconfig(str(emulator.url).rstrip("/")))
        if job["op"] == "lint":
            return await lint(helm, config, Path(job["chart"]), job.get("values") or {})
        if job["op"] == "upgrade":
            return await install_then_upgrade(helm, config, emulator, job)
        return await install(helm, config, emulator, job)


if __name__ == "__main__":
    if os.environ.get("HELM_DRIVER") != "memory":
        sys.exit("run with HELM_DRIVER=memory in the environment (see the module docstring)")
    print(json.dumps(asyncio.run(main(json.loads(sys.argv[1])))))
