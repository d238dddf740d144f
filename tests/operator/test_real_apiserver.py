"""The real-API-server tier: CRDs, chart and operator against a real kube-apiserver, etcd and
kube-controller-manager (`tests/operator/real_cluster.py`; skipped without `KUBEBUILDER_ASSETS`).

One control plane per module. What a user does is done the user's way: `kubectl apply
--server-side`, `kubectl explain`, the real Helm engine installing the chart into a namespace that
enforces PodSecurity `restricted`, and the operator running as the chart's ServiceAccount with a
token from TokenRequest. The audit log is then read for every 403 and 422 the operator got.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import TESTS_PATH
from tests.operator.conftest import OperatorRunner, eventually
from tests.operator.fake_worker import write_adapter
from tests.operator.kubelet import fake_worker_factory
from tests.operator.real_cluster import ADMIN_TOKEN, RealCluster, RealKubelet, assets, kubectl, skip_reason

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "lorafleet"
HELM_RUNNER = ROOT / "tests" / "charts" / "helm_emulator.py"
GROUP = "lorafleet.dev"

pytestmark = pytest.mark.skipif(assets() is None, reason=skip_reason())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    bin_dir = assets()
    assert bin_dir is not None
    c = RealCluster.start(tmp_path_factory.mktemp("cluster"), bin_dir)
    try:
        kubectl(c.admin_kubeconfig, "apply", "--server-side", "-f", str(ROOT / "crds"))
        for crd in ("loraadapters", "lorapools"):
            kubectl(c.admin_kubeconfig, "wait", "--for=condition=Established", f"crd/{crd}.{GROUP}", "--timeout=60s")
        yield c
    finally:
        c.stop()


def restricted_namespace(cluster: RealCluster, name: str) -> None:
    kubectl(cluster.admin_kubeconfig, "apply", "-f", "-", stdin=json.dumps({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": name, "labels": {"pod-security.kubernetes.io/enforce": "restricted",
                                              "pod-security.kubernetes.io/enforce-version": "latest"}}}))


def helm_install(cluster: RealCluster, namespace: str, values: dict[str, Any], release: str = "lf") -> dict[str, Any]:
    job = {"op": "install", "chart": str(CHART), "values": values, "namespace": namespace, "release": release,
           "kubeconfig": cluster.kubeconfig(ADMIN_TOKEN, namespace)}
    env = {**os.environ, "HELM_DRIVER": "memory",
           "PYTHONPATH": os.pathsep.join(filter(None, [TESTS_PATH, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(HELM_RUNNER), json.dumps(job)], env=env, capture_output=True,
                          text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def get(cluster: RealCluster, path: str) -> dict[str, Any] | None:
    with cluster.client() as c:
        r = c.get(path)
    if r.status_code == 404:
        return None
    r.raise_for_status()
    return r.json()


def undescribed(schema: dict[str, Any], path: str = "") -> list[str]:
    """Every property of an OpenAPI v3 schema without a description."""
    out = []
    for name, prop in (schema.get("properties") or {}).items():
        here = f"{path}.{name}"
        if not prop.get("description"):
            out.append(here)
        out += undescribed(prop, here)
        if isinstance(prop.get("items"), dict):
            out += undescribed(prop["items"], here + "[]")
        if isinstance(prop.get("additionalProperties"), dict):
            out += undescribed(prop["additionalProperties"], here + "{}")
    return out


def test_crds_served_with_every_description(cluster: RealCluster) -> None:
    # The CRDs applied server-side in the fixture; the server's published schema is what explain reads.
    doc = get(cluster, f"/openapi/v3/apis/{GROUP}/v1alpha1")
    assert doc is not None
    schemas = doc["components"]["schemas"]
    for kind in ("LoraAdapter", "LoraPool"):
        name = next(k for k in schemas if k.endswith(f".{kind}"))
        missing = [p for p in undescribed(schemas[name]) if not p.startswith(".metadata")]
        assert missing == [], f"{kind} fields without a description: {missing}"
    # kubectl reads the published OpenAPI, which follows a new CRD by a few seconds.
    deadline = time.monotonic() + 60
    while (proc := kubectl(cluster.admin_kubeconfig, "explain", "loraadapter.spec.replicas", check=False)).returncode:
        assert time.monotonic() < deadline, proc.stderr
        time.sleep(1)
    out = proc.stdout
    assert "min" in out and "max" in out and "DESCRIPTION" in out.upper()


def test_examples_accepted_and_bad_manifests_refused_with_the_crd_message(cluster: RealCluster) -> None:
    for example in sorted((ROOT / "examples").glob("*.yaml")):
        kubectl(cluster.admin_kubeconfig, "apply", "--dry-run=server", "-f", str(example))
    bad = {
        "replicas.min must be <= replicas.max": {"pool": "p", "source": "a", "replicas": {"min": 3, "max": 1}},
        "source must be relative to the pool's adapter volume": {"pool": "p", "source": "/etc/passwd"},
    }
    for message, spec in bad.items():
        doc = {"apiVersion": f"{GROUP}/v1alpha1", "kind": "LoraAdapter", "metadata": {"name": "bad"}, "spec": spec}
        proc = kubectl(cluster.admin_kubeconfig, "apply", "--dry-run=server", "-f", "-", stdin=json.dumps(doc),
                       check=False)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    pool = {"apiVersion": f"{GROUP}/v1alpha1", "kind": "LoraPool", "metadata": {"name": "bad"},
            "spec": {"model": {"path": "/m", "servedName": "m"}, "image": "w:1",
                     "sources": {"nodeCache": {"hostPath": "/var/cache/../../etc"}}}}
    proc = kubectl(cluster.admin_kubeconfig, "apply", "--dry-run=server", "-f", "-", stdin=json.dumps(pool), check=False)
    assert proc.returncode != 0 and "nodeCache.hostPath may not hold '..'" in proc.stderr, proc.stderr
    pool["spec"]["sources"]["nodeCache"]["hostPath"] = "/var/cache/lorafleet-adapters"
    kubectl(cluster.admin_kubeconfig, "apply", "--dry-run=server", "-f", "-", stdin=json.dumps(pool))


def pods_created(cluster: RealCluster, namespace: str) -> tuple[dict[str, int], list[str]]:
    """Pods per owning ReplicaSet's Deployment, and the ReplicaSets' FailedCreate messages."""
    pods = get(cluster, f"/api/v1/namespaces/{namespace}/pods")["items"]
    per: dict[str, int] = {}
    for pod in pods:
        for ref in pod["metadata"].get("ownerReferences", []):
            per[ref["name"].rsplit("-", 1)[0]] = per.get(ref["name"].rsplit("-", 1)[0], 0) + 1
    events = get(cluster, f"/api/v1/namespaces/{namespace}/events")["items"]
    failed = [e["message"] for e in events if e.get("reason") == "FailedCreate"]
    return per, failed


@pytest.mark.parametrize("default_pool", [False, True], ids=["no-pool", "default-pool"])
def test_helm_install_in_a_restricted_namespace(cluster: RealCluster, default_pool: bool) -> None:
    ns = f"helm-{'pool' if default_pool else 'bare'}"
    restricted_namespace(cluster, ns)
    values = {"defaultPool": {"enabled": default_pool}}
    result = helm_install(cluster, ns, values)
    assert result["ok"], result.get("error")
    deployments = [d["metadata"]["name"] for d in get(cluster, f"/apis/apps/v1/namespaces/{ns}/deployments")["items"]]
    assert deployments, "the chart created no Deployment"
    # Every Deployment's pods pass PodSecurity restricted: the ReplicaSets create them.
    want = {d: 1 for d in deployments}

    def all_created() -> bool:
        per, failed = pods_created(cluster, ns)
        assert not failed, failed
        return all(per.get(d, 0) >= n for d, n in want.items())

    deadline = time.monotonic() + 60
    while not all_created():
        assert time.monotonic() < deadline, pods_created(cluster, ns)
        time.sleep(0.5)
    if default_pool:
        assert get(cluster, f"/apis/{GROUP}/v1alpha1/namespaces/{ns}/lorapools/default") is not None


def operator_info(cluster: RealCluster, namespace: str, account: str) -> Any:
    import kopf

    token = cluster.service_account_token(namespace, account)
    return kopf.ConnectionInfo(server=cluster.url, ca_path=str(cluster.ca), token=token, default_namespace=namespace)


def pool_doc(root: Path, replicas: int) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/v1alpha1", "kind": "LoraPool", "metadata": {"name": "pool"},
            "spec": {"model": {"path": "/models/tiny", "servedName": "tiny"}, "image": "lorafleet/worker:test",
                     "replicas": replicas,
                     "engine": {"maxLoras": 2, "maxCpuLoras": 8, "maxLoraRank": 16, "device": "cpu"},
                     "adapterVolume": {"mountPath": str(root)}, "ports": {"http": 18000, "admin": 18001}}}


def adapter_doc(name: str, copies: int) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/v1alpha1", "kind": "LoraAdapter", "metadata": {"name": name},
            "spec": {"pool": "pool", "source": name, "replicas": {"min": copies, "max": copies}}}


async def operator_namespace(cluster: RealCluster, ns: str) -> str:
    """A restricted namespace with the chart installed in it -> the operator's ServiceAccount name."""
    restricted_namespace(cluster, ns)
    result = await asyncio.to_thread(helm_install, cluster, ns, {})
    assert result["ok"], result.get("error")
    return next(o["metadata"]["name"] for o in yaml.safe_load_all(result["manifest"])
                if o and o["kind"] == "ServiceAccount" and "operator" in o["metadata"]["name"])


async def test_operator_as_the_charts_service_account(cluster: RealCluster, tmp_path: Path) -> None:
    ns = "op"
    account = await operator_namespace(cluster, ns)
    user = f"system:serviceaccount:{ns}:{account}"
    for name in ("a1", "a2"):
        write_adapter(tmp_path, name)
    admin = cluster.kubeconfig(ADMIN_TOKEN, ns)
    (tmp_path / "admin.kubeconfig").write_text(admin)

    def apply(*docs: dict[str, Any]) -> None:
        kubectl(tmp_path / "admin.kubeconfig", "apply", "-f", "-", stdin=yaml.safe_dump_all(docs))

    def adapter(name: str) -> dict[str, Any]:
        return get(cluster, f"/apis/{GROUP}/v1alpha1/namespaces/{ns}/loraadapters/{name}") or {}

    def phase(name: str) -> str | None:
        return (adapter(name).get("status") or {}).get("phase")

    runner = OperatorRunner(None, namespaces=(ns,), info=operator_info(cluster, ns, account))
    async with RealKubelet(cluster, ns, fake_worker_factory) as kubelet:
        await runner.start()
        try:
            await asyncio.to_thread(apply, pool_doc(tmp_path, 2), adapter_doc("a1", 1), adapter_doc("a2", 2))
            await eventually(lambda: phase("a1") == "Ready" and phase("a2") == "Ready", timeout=90)
            held = lambda n: sum(n in w.state.adapters for _, w in kubelet.workers.values())  # noqa: E731
            await eventually(lambda: held("a2") == 2)
            # Rescale: the Deployment follows the pool, the ReplicaSet the Deployment.
            await asyncio.to_thread(apply, pool_doc(tmp_path, 3))
            await eventually(lambda: len(kubelet.workers) == 3, timeout=60)
            # Delete an adapter: unloaded everywhere.
            await asyncio.to_thread(kubectl, tmp_path / "admin.kubeconfig", "delete", "loraadapter", "a1")
            await eventually(lambda: held("a1") == 0 and not adapter("a1"), timeout=60)
            # Delete the pool: the garbage collector removes its children.
            await asyncio.to_thread(kubectl, tmp_path / "admin.kubeconfig", "delete", "lorapool", "pool")
            await eventually(lambda: get(cluster, f"/apis/apps/v1/namespaces/{ns}/deployments/pool") is None
                             and get(cluster, f"/api/v1/namespaces/{ns}/services/pool") is None, timeout=90)
            await eventually(lambda: not kubelet.workers, timeout=60)
        finally:
            await runner.kill()
    assert not kubelet.errors, kubelet.errors
    collected = [e for e in cluster.audit() if e["verb"] == "delete"
                 and e.get("user", {}).get("username") == "system:serviceaccount:kube-system:generic-garbage-collector"
                 and e.get("objectRef", {}).get("resource") == "deployments"]
    assert collected, "the garbage collector removed no Deployment of the pool"
    refused = [f"{e['verb']} {e.get('requestURI')} -> {e['responseStatus']['code']}"
               for e in cluster.audit() if e.get("user", {}).get("username") == user
               and e.get("responseStatus", {}).get("code") in (403, 422)]
    assert refused == [], refused
    assert any(e.get("user", {}).get("username") == user for e in cluster.audit()), "the operator made no call"


async def test_rollout_keeps_a_serving_copy_of_every_adapter(cluster: RealCluster, tmp_path: Path) -> None:
    """A pool's image changes with single-copy adapters placed: the real Deployment controller rolls
    the pods (surge 1, readiness gates, pod-deletion-cost), and at every tick each adapter is held by
    a pod the API reports Ready (what the router routes to)."""
    ns = "roll"
    account = await operator_namespace(cluster, ns)
    names = [f"r{i}" for i in range(4)]
    for name in names:
        write_adapter(tmp_path, name)
    (tmp_path / "admin.kubeconfig").write_text(cluster.kubeconfig(ADMIN_TOKEN, ns))

    def apply(*docs: dict[str, Any]) -> None:
        kubectl(tmp_path / "admin.kubeconfig", "apply", "-f", "-", stdin=yaml.safe_dump_all(docs))

    def ready_pods() -> set[str]:
        pods = get(cluster, f"/api/v1/namespaces/{ns}/pods?labelSelector=app.kubernetes.io/component%3Dworker")
        return {p["metadata"]["name"] for p in pods["items"] if not p["metadata"].get("deletionTimestamp")
                and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))}

    def served(kubelet: RealKubelet) -> dict[str, bool]:
        ready = ready_pods()
        return {n: any(n in w.state.adapters for pod, (_, w) in list(kubelet.workers.items()) if pod in ready)
                for n in names}

    def images() -> set[str]:
        pods = get(cluster, f"/api/v1/namespaces/{ns}/pods?labelSelector=app.kubernetes.io/component%3Dworker")
        return {p["spec"]["containers"][0]["image"] for p in pods["items"]}

    runner = OperatorRunner(None, namespaces=(ns,), info=operator_info(cluster, ns, account))
    async with RealKubelet(cluster, ns, fake_worker_factory) as kubelet:
        await runner.start()
        try:
            await asyncio.to_thread(apply, pool_doc(tmp_path, 2), *(adapter_doc(n, 1) for n in names))
            await eventually(lambda: all(served(kubelet).values()), timeout=90)
            rolled = pool_doc(tmp_path, 2)
            rolled["spec"]["image"] = "lorafleet/worker:next"
            await asyncio.to_thread(apply, rolled)
            gaps: list[str] = []
            deadline = time.monotonic() + 120
            while images() != {"lorafleet/worker:next"} or len(ready_pods()) < 2:
                assert time.monotonic() < deadline, f"rollout unfinished: {images()}, ready {ready_pods()}"
                now = await asyncio.to_thread(served, kubelet)
                gaps += [n for n, ok in now.items() if not ok]
                await asyncio.sleep(0.1)
            await eventually(lambda: all(served(kubelet).values()), timeout=30)
        finally:
            await runner.kill()
    assert gaps == [], f"adapters without a Ready copy during the rollout: {sorted(set(gaps))}"
    costs = [e for e in cluster.audit() if e.get("objectRef", {}).get("resource") == "pods"
             and e.get("objectRef", {}).get("subresource") == "status" and e["verb"] == "patch"
             and e.get("user", {}).get("username", "").endswith(f":{account}")]
    assert costs, "the operator opened no readiness gate through pods/status"


@pytest.mark.parametrize(("level", "admitted"), [("restricted", False), ("baseline", False), ("privileged", True)])
def test_node_cache_pods_need_a_privileged_namespace(cluster: RealCluster, level: str, admitted: bool) -> None:
    """The worker pod the operator builds with `spec.sources.nodeCache` (a hostPath), through the
    real PodSecurity admission: refused under restricted and baseline, as docs/kubernetes.md says."""
    from lorafleet.operator.builders import pod_template
    from lorafleet.operator.spec import parse_pool

    namespace = f"node-cache-{level}"
    kubectl(cluster.admin_kubeconfig, "apply", "-f", "-", stdin=json.dumps({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": namespace, "labels": {"pod-security.kubernetes.io/enforce": level,
                                                   "pod-security.kubernetes.io/enforce-version": "latest"}}}))
    # The pod's ServiceAccount, so that only PodSecurity has a say (the token controller may lag).
    kubectl(cluster.admin_kubeconfig, "apply", "-f", "-", stdin=json.dumps({
        "apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": namespace}}))
    spec = {"model": {"path": "/m", "servedName": "m"}, "image": "w:1",
            "sources": {"allowedBuckets": ["b"], "nodeCache": {"hostPath": "/var/cache/lorafleet-adapters"}}}
    template = pod_template(parse_pool(namespace, "p", spec))
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "worker", "namespace": namespace,
                                                           **template["metadata"]}, "spec": template["spec"]}
    proc = kubectl(cluster.admin_kubeconfig, "apply", "--dry-run=server", "-f", "-", stdin=json.dumps(pod), check=False)
    assert (proc.returncode == 0) == admitted, proc.stderr
    if not admitted:
        assert "hostPath" in proc.stderr and "adapter-cache" in proc.stderr, proc.stderr
