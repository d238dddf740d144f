"""The operator against awkward input (kopf against kmock, kubectl, fake workers): what the CRD
schema cannot stop (objects from before a schema change, or a lax API server) and what only the
operator can judge shows as a status condition; one bad object never holds up the others."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tests.operator.conftest import Kubectl, OperatorRunner, eventually
from tests.operator.fake_worker import write_adapter
from tests.operator.kmock_harness import PatchedEmulator
from tests.operator.kubelet import Kubelet
from tests.operator.test_e2e import LP, adapter_manifest, apply, holders, pool_manifest, status


def condition(st: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in st.get("conditions") or [] if c["type"] == kind), {})


def pool_status(api: PatchedEmulator) -> dict[str, Any]:
    return (api.get(LP, "default", "pool") or {}).get("status") or {}


async def test_a_mistyped_adapter_fails_alone(
    api: PatchedEmulator, kubectl: Kubectl, kubelet: Kubelet, operator: OperatorRunner, tmp_path: Path
) -> None:
    """Wrong types are a Failed status naming the field, not an exception kopf retries every minute;
    and the pool's loop, which lists every adapter of the pool at its start, runs for the others."""
    write_adapter(tmp_path, "good")
    bad = adapter_manifest("bad")
    bad["spec"]["replicas"] = {"min": "lots", "max": 2}
    flag = adapter_manifest("flag", source="good")
    flag["spec"]["pinned"] = "false"  # a string: bool("false") would be True
    await apply(kubectl, tmp_path, bad, flag, adapter_manifest("good"))  # before the pool: its loop lists them
    await apply(kubectl, tmp_path, pool_manifest(tmp_path))
    await eventually(lambda: status(api, "good").get("phase") == "Ready")
    for name, field in (("bad", "spec.replicas.min"), ("flag", "spec.pinned")):
        await eventually(lambda n=name: status(api, n).get("phase") == "Failed")
        validated = condition(status(api, name), "Validated")
        assert validated["status"] == "False" and validated["reason"] == "InvalidSpec", validated
        assert field in validated["message"], validated
    assert holders(kubelet, "bad") == [] and holders(kubelet, "flag") == []
    # `kubectl get` says why, `-o wide` what to fix.
    rows = {line.split()[0]: line.split() for line in (await kubectl("get", "lora")).splitlines()[1:]}
    assert rows["bad"][1:3] == ["pool", "Failed"] and rows["bad"][-2] == "InvalidSpec", rows["bad"]
    assert rows["good"][-2] == "Loaded", rows["good"]
    wide = next(line for line in (await kubectl("get", "lora", "bad", "-o", "wide")).splitlines() if line.startswith("bad"))
    assert "spec.replicas.min must be an integer" in wide, wide


async def test_a_deleted_pool_leaves_its_adapters_pending(
    api: PatchedEmulator, kubectl: Kubectl, kubelet: Kubelet, operator: OperatorRunner, tmp_path: Path
) -> None:
    """Not Ready with the count of workers that are gone: Pending, and the reason says why."""
    write_adapter(tmp_path, "orphan")
    await apply(kubectl, tmp_path, pool_manifest(tmp_path), adapter_manifest("orphan"))
    await eventually(lambda: status(api, "orphan").get("phase") == "Ready")
    await kubectl("delete", "lorapool", "pool", "--wait=false")
    await eventually(lambda: api.get(LP, "default", "pool") is None)
    await eventually(lambda: status(api, "orphan").get("phase") == "Pending")
    st = status(api, "orphan")
    assert st["readyReplicas"] == 0
    ready = condition(st, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "PoolNotFound"), ready
    assert "LoraPool pool not found" in ready["message"]
    # The pool comes back: so does the adapter.
    await apply(kubectl, tmp_path, pool_manifest(tmp_path))
    await eventually(lambda: status(api, "orphan").get("phase") == "Ready", timeout=20)


async def test_a_fixed_pool_drops_its_failure(
    api: PatchedEmulator, kubectl: Kubectl, kubelet: Kubelet, operator: OperatorRunner, tmp_path: Path
) -> None:
    """An invalid spec shows Failed with its reason; once fixed, neither the phase nor the
    condition keeps saying so (the phase was cached as already written before the failure)."""
    write_adapter(tmp_path, "a")
    await apply(kubectl, tmp_path, pool_manifest(tmp_path), adapter_manifest("a"))
    await eventually(lambda: pool_status(api).get("phase") == "Ready" and status(api, "a").get("phase") == "Ready")
    assert condition(pool_status(api), "Reconciled")["status"] == "True"
    broken = pool_manifest(tmp_path)
    broken["spec"]["ports"] = {"http": 18000, "admin": 18000}
    await apply(kubectl, tmp_path, broken)
    await eventually(lambda: pool_status(api).get("phase") == "Failed")
    reconciled = condition(pool_status(api), "Reconciled")
    assert (reconciled["status"], reconciled["reason"]) == ("False", "InvalidPorts"), reconciled
    header, row = (line.split() for line in (await kubectl("get", "lorapool")).splitlines()[:2])
    assert dict(zip(header, row))["REASON"] == "InvalidPorts" and dict(zip(header, row))["PHASE"] == "Failed"
    await eventually(lambda: condition(status(api, "a"), "Placed").get("reason") == "PoolInvalid")
    await apply(kubectl, tmp_path, pool_manifest(tmp_path))
    await eventually(lambda: pool_status(api).get("phase") == "Ready")
    reconciled = condition(pool_status(api), "Reconciled")
    assert (reconciled["status"], reconciled["reason"]) == ("True", "Reconciled"), reconciled
    await eventually(lambda: status(api, "a").get("phase") == "Ready")
    await asyncio.sleep(1.5)  # a few resyncs: nothing writes the failure back
    assert pool_status(api).get("phase") == "Ready"


async def test_workers_objects_the_api_refuses_show_on_the_pool_without_a_retry_storm(
    api: PatchedEmulator, kubectl: Kubectl, kubelet: Kubelet, operator: OperatorRunner, tmp_path: Path
) -> None:
    """A refusal is on the pool's status. 422 (what this spec builds is invalid) waits for a new
    spec rather than being retried every few seconds (each retry a warning Event); 403 (a quota,
    RBAC) may pass, so it is retried, with backoff."""
    api.refuse_creates["services"] = (422, "Invalid", 'Service "pool" is invalid: metadata.name: Invalid value')
    await apply(kubectl, tmp_path, pool_manifest(tmp_path))
    await eventually(lambda: condition(pool_status(api), "Reconciled").get("reason") == "ChildrenNotApplied")
    assert pool_status(api).get("phase") == "Failed"
    assert "metadata.name: Invalid value" in condition(pool_status(api), "Reconciled")["message"]
    await asyncio.sleep(6)  # more than the 5 s retry a transient error gets
    assert api.create_attempts["services"] == 1
    # A quota: retried with backoff, and the pool says why meanwhile; it recovers once the quota allows.
    api.refuse_creates["services"] = (403, "Forbidden", 'services "pool" is forbidden: exceeded quota')
    await apply(kubectl, tmp_path, pool_manifest(tmp_path, replicas=3))
    await eventually(lambda: "exceeded quota" in condition(pool_status(api), "Reconciled").get("message", ""))
    del api.refuse_creates["services"]
    await eventually(lambda: condition(pool_status(api), "Reconciled").get("status") == "True", timeout=20)
    await eventually(lambda: pool_status(api).get("phase") == "Ready")
