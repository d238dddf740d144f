"""The chart's operator Role is derived from the operator's calls: a whole life cycle runs against
the emulator, whose audit log records every request the operator made (and the `finalizers`
updates its owner references need under OwnerReferencesPermissionEnforcement); the rendered Role
must grant exactly that — nothing missing, nothing more, no wildcard. Then the operator runs
under that Role alone (403 for anything else) and reaches its first reconcile without one 403.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.charts.conftest import helm_available, manifests, run_helm
from tests.operator.conftest import Kubectl, eventually
from tests.operator.fake_worker import write_adapter
from tests.operator.kmock_harness import PatchedEmulator
from tests.operator.kube_audit import Call, Policy, grants, is_admin, needed
from tests.operator.kubelet import Kubelet
from tests.operator.test_e2e import LP, adapter_manifest, apply, pool_manifest, status
from tests.operator.test_peering import PEERING_CRDS, ThreadedOperator

pytestmark = pytest.mark.skipif(not helm_available(), reason="helm-sdkpy not installed: "
                                "pip install --ignore-requires-python helm-sdkpy")


def operator_role(values: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    result = run_helm("install", values)
    assert result["ok"], result.get("error")
    roles = [o for o in manifests(result) if o["kind"] == "Role" and o["metadata"]["name"].endswith("-operator")
             and o["metadata"]["namespace"] == "default"]
    assert len(roles) == 1
    return grants(roles[0]["rules"])


def operator_calls(api: PatchedEmulator) -> list[Call]:
    return [c for c in api.audit if not is_admin(c.agent)]


async def lifecycle(api: PatchedEmulator, kubectl: Kubectl, kubelet: Kubelet, tmp_path: Path) -> None:
    """Pools, adapters Ready, rescale (pool and adapter), a refused child, an adapter and a pool deleted."""
    for name in ("r1", "r2"):
        write_adapter(tmp_path, name)
    sts = pool_manifest(tmp_path, replicas=1)
    sts["metadata"]["name"] = "sts"
    sts["spec"]["workloadKind"] = "StatefulSet"
    await apply(kubectl, tmp_path, pool_manifest(tmp_path, replicas=2), sts,
                adapter_manifest("r1"), adapter_manifest("r2", 1, 2))
    await eventually(lambda: all(status(api, n).get("phase") == "Ready" for n in ("r1", "r2")), timeout=30)
    await kubectl("patch", "lorapool", "pool", "--type=merge", "-p", '{"spec": {"replicas": 3}}')
    # the StatefulSet pool has no pods here: its ports and disruption budget change too (Service, PDB drift)
    await kubectl("patch", "lorapool", "sts", "--type=merge", "-p",
                  '{"spec": {"replicas": 2, "maxUnavailable": 0, "ports": {"http": 18010, "admin": 18011}}}')
    await apply(kubectl, tmp_path, adapter_manifest("r2", 2, 2))
    await eventually(lambda: (api.get("apps/v1/deployments", "default", "pool") or {}).get("spec", {}).get("replicas") == 3)
    await eventually(lambda: (api.get("apps/v1/statefulsets", "default", "sts") or {}).get("spec", {}).get("replicas") == 2)
    await eventually(lambda: (api.get("policy/v1/poddisruptionbudgets", "default", "sts") or {})
                     .get("spec", {}).get("maxUnavailable") == 0)
    await eventually(lambda: status(api, "r2").get("readyReplicas") == 2, timeout=20)
    # A child the API server refuses (admission): the pool says so.
    api.refuse_creates["statefulsets"] = (422, "Invalid", "spec.template: refused by a policy")
    bad = pool_manifest(tmp_path, replicas=1)
    bad["metadata"]["name"] = "bad"
    bad["spec"]["workloadKind"] = "StatefulSet"
    await apply(kubectl, tmp_path, bad)
    await eventually(lambda: ((api.get(LP, "default", "bad") or {}).get("status") or {}).get("phase") == "Failed")
    api.refuse_creates.clear()
    await kubectl("delete", "loraadapter", "r1", "--wait=false")
    await eventually(lambda: api.get("lorafleet.dev/v1alpha1/loraadapters", "default", "r1") is None, timeout=20)
    # A pool deleted (the one without running workers: the test kubelet runs Deployments only).
    await kubectl("delete", "lorapool", "sts", "--wait=false")
    await eventually(lambda: api.get(LP, "default", "sts") is None, timeout=20)


@pytest.mark.parametrize("peering", [False, True], ids=["standalone", "peering"])
async def test_operator_role_is_exactly_what_the_operator_calls(
    api: PatchedEmulator, kubectl: Kubectl, kubelet: Kubelet, tmp_path: Path, peering: bool,
) -> None:
    # In a thread of its own: a cancelled kopf operator cancels the tasks of its event loop.
    runner = ThreadedOperator(api, priority=100)
    runner.runner.peering = "lorafleet" if peering else None
    if peering:
        api.declare_crd(yaml.safe_load((PEERING_CRDS / "kopfpeerings.kopf.dev.yaml").read_text()))
        await api.put_object("kopf.dev/v1/kopfpeerings", {
            "apiVersion": "kopf.dev/v1", "kind": "KopfPeering",
            "metadata": {"name": "lorafleet", "namespace": "default"},
        })
    await runner.start()
    try:
        await lifecycle(api, kubectl, kubelet, tmp_path)
    finally:
        await runner.kill()
    calls = operator_calls(api)
    assert {c.namespace for c in calls} == {"default"}, "a call outside the watched namespace (a cluster-wide scan)"
    used = needed(calls)
    assert ("lorafleet.dev", "lorapools/finalizers") in used  # blockOwnerDeletion on the pool's children
    role = operator_role({"operator": {"peering": {"enabled": peering, "name": "lorafleet"}}})
    missing = {k: sorted(v - role.get(k, set())) for k, v in used.items() if v - role.get(k, set())}
    extra = {k: sorted(v - used.get(k, set())) for k, v in role.items() if v - used.get(k, set())}
    assert missing == {}, f"the operator calls what its Role does not grant: {missing}"
    assert extra == {}, f"the Role grants what the operator never calls: {extra}"


async def test_operator_under_its_role_reconciles_at_once_without_a_403(
    api: PatchedEmulator, kubectl: Kubectl, kubelet: Kubelet, tmp_path: Path,
) -> None:
    """Namespaced RBAC only (as the chart's ServiceAccount has): no cluster-wide request is tried,
    none is refused, so kopf's 403 back-off (1+1+2+3+5+8+13+21 s before it falls back) never
    delays the first reconcile. The bound is loose (a loaded CI machine); the time is printed,
    about 1-3 s here on a shared 2-core machine."""
    api.policy = Policy(namespaced={"default": operator_role({})})
    write_adapter(tmp_path, "f1")
    await apply(kubectl, tmp_path, pool_manifest(tmp_path, replicas=1), adapter_manifest("f1"))
    runner = ThreadedOperator(api, priority=100)
    runner.runner.peering = None
    started = time.monotonic()
    await runner.start()
    try:
        await eventually(lambda: (api.get(LP, "default", "pool") or {}).get("status", {}).get("conditions"),
                         timeout=30, interval=0.02)
        first = time.monotonic() - started
        await eventually(lambda: status(api, "f1").get("phase") == "Ready", timeout=20)
    finally:
        await runner.kill()
    denied = [c for c in api.audit if c.code == 403]
    print(f"first reconcile {first:.2f} s after start; audit: {len(api.audit)} requests, {len(denied)} denied")
    assert denied == []
    assert all(c.namespace == "default" for c in api.audit if not is_admin(c.agent)), "a cluster-wide request"
    assert first < 10.0, f"first reconcile {first:.2f}s after start"
