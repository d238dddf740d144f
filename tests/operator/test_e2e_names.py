"""Adapter names are global to the router (clients say `model="sql-writer"`, no namespace): two
LoraAdapters of one name in two watched namespaces (kopf against kmock, one kubelet per namespace)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import yaml

from tests.operator.conftest import Kubectl, OperatorRunner, eventually
from tests.operator.fake_worker import write_adapter
from tests.operator.kmock_harness import PatchedEmulator
from tests.operator.kubelet import Kubelet
from tests.operator.test_e2e import LA, adapter_manifest, pool_manifest

NAMESPACES = ("default", "team-a")


def status(api: PatchedEmulator, namespace: str, name: str) -> dict[str, Any]:
    return (api.get(LA, namespace, name) or {}).get("status") or {}


def holders(kubelet: Kubelet, name: str) -> list[str]:
    return [p.name for p in kubelet.pods.values() if name in p.worker.state.adapters]


async def apply_in(kubectl: Kubectl, tmp_path: Path, namespace: str, *docs: dict[str, Any]) -> None:
    path = tmp_path / f"apply-{namespace}-{id(docs)}.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    await kubectl("apply", "--validate=false", "-n", namespace, "-f", str(path))


async def test_one_adapter_per_name_across_namespaces(api: PatchedEmulator, kubectl: Kubectl, tmp_path: Path) -> None:
    api.add_namespace("team-a")
    write_adapter(tmp_path, "sql")
    operator = OperatorRunner(api, namespaces=NAMESPACES)
    async with Kubelet(api, namespace="default") as ours, Kubelet(api, namespace="team-a") as theirs:
        await operator.start()
        try:
            for ns in NAMESPACES:
                await apply_in(kubectl, tmp_path, ns, pool_manifest(tmp_path))
            await apply_in(kubectl, tmp_path, "default", adapter_manifest("sql"))
            await eventually(lambda: status(api, "default", "sql").get("phase") == "Ready")
            await asyncio.sleep(1.1)  # creation timestamps have whole seconds: team-a's is later
            await apply_in(kubectl, tmp_path, "team-a", adapter_manifest("sql"))
            await eventually(lambda: status(api, "team-a", "sql").get("phase") == "Failed")
            validated = next(c for c in status(api, "team-a", "sql")["conditions"] if c["type"] == "Validated")
            assert validated["reason"] == "NameConflict" and "default/sql" in validated["message"], validated
            assert holders(theirs, "sql") == [] and len(holders(ours, "sql")) == 1

            # An operator restart keeps the older one serving, whichever it sees first.
            await operator.kill()
            await operator.start()
            await asyncio.sleep(2)
            assert status(api, "default", "sql")["phase"] == "Ready" and status(api, "team-a", "sql")["phase"] == "Failed"
            assert holders(theirs, "sql") == [] and len(holders(ours, "sql")) == 1

            # The name is free again: team-a's adapter is placed, without anyone touching it.
            await kubectl("delete", "loraadapter", "sql", "-n", "default", "--wait=false")
            await eventually(lambda: status(api, "team-a", "sql").get("phase") == "Ready", timeout=20)
            assert holders(ours, "sql") == [] and len(holders(theirs, "sql")) == 1
        finally:
            await operator.kill()
