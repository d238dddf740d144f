"""Changing a LoraAdapter's source or sha256 in place (kopf against kmock, kubectl, fake workers):
the workers end up holding the new version, swapped in place (never unloaded), and the status says
which source and digest they hold; a version the workers refuse leaves the old one serving."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tests.operator.conftest import Kubectl, OperatorRunner, eventually
from tests.operator.fake_worker import write_adapter
from tests.operator.kmock_harness import PatchedEmulator
from tests.operator.kubelet import Kubelet
from tests.operator.test_e2e import adapter_manifest, apply, pool_manifest, status


def digest(folder: Path) -> str:
    return "sha256:" + hashlib.sha256((folder / "adapter_config.json").read_bytes()).hexdigest()


def copies(kubelet: Kubelet, name: str) -> set[str]:
    """The digests the workers hold for `name`."""
    return {p.worker.state.adapters[name].digest for p in kubelet.pods.values() if name in p.worker.state.adapters}


def unloads(kubelet: Kubelet, name: str) -> int:
    return sum(1 for p in kubelet.pods.values() for op, n in p.worker.state.calls if (op, n) == ("unload", name))


async def test_a_new_source_replaces_the_loaded_version(
    api: PatchedEmulator, kubectl: Kubectl, kubelet: Kubelet, operator: OperatorRunner, tmp_path: Path
) -> None:
    v1, v2 = write_adapter(tmp_path, "v1", rank=8), write_adapter(tmp_path, "v2", rank=4)
    await apply(kubectl, tmp_path, pool_manifest(tmp_path), adapter_manifest("a", 2, 2, source="v1"))
    await eventually(lambda: status(api, "a").get("phase") == "Ready" and copies(kubelet, "a") == {digest(v1)})
    assert status(api, "a")["source"] == "v1"
    await apply(kubectl, tmp_path, adapter_manifest("a", 2, 2, source="v2"))
    await eventually(lambda: copies(kubelet, "a") == {digest(v2)})
    await eventually(lambda: status(api, "a").get("source") == "v2" and status(api, "a").get("digest") == digest(v2))
    st = status(api, "a")
    assert (st["phase"], st["readyReplicas"]) == ("Ready", 2)
    assert unloads(kubelet, "a") == 0  # swapped in place: the adapter never left a worker


async def test_a_new_sha256_with_its_source_is_not_a_mismatch(
    api: PatchedEmulator, kubectl: Kubectl, kubelet: Kubelet, operator: OperatorRunner, tmp_path: Path
) -> None:
    """The old copy differs from the new sha256 because it is the old version, not a tampered one;
    and content replaced on the volume under the same source is reloaded once sha256 names it."""
    v1, v2 = write_adapter(tmp_path, "v1", rank=8), write_adapter(tmp_path, "v2", rank=4)
    pinned = {"sha256": digest(v1).removeprefix("sha256:")}
    await apply(kubectl, tmp_path, pool_manifest(tmp_path), adapter_manifest("a", source="v1", **pinned))
    await eventually(lambda: status(api, "a").get("phase") == "Ready")
    await apply(kubectl, tmp_path, adapter_manifest("a", source="v2", sha256=digest(v2).removeprefix("sha256:")))
    await eventually(lambda: copies(kubelet, "a") == {digest(v2)} and status(api, "a").get("digest") == digest(v2))
    assert status(api, "a")["phase"] == "Ready", status(api, "a")
    v3 = write_adapter(tmp_path, "v2", rank=16)  # new files, same folder
    await apply(kubectl, tmp_path, adapter_manifest("a", source="v2", sha256=digest(v3).removeprefix("sha256:")))
    await eventually(lambda: copies(kubelet, "a") == {digest(v3)} and status(api, "a").get("digest") == digest(v3))
    assert status(api, "a")["phase"] == "Ready", status(api, "a")
    assert unloads(kubelet, "a") == 0


async def test_a_refused_update_leaves_the_old_version_serving(
    api: PatchedEmulator, kubectl: Kubectl, kubelet: Kubelet, operator: OperatorRunner, tmp_path: Path
) -> None:
    """A failed rollout leaves the old version up, as a Deployment's does, and says so: Ready
    (the old version serves) with reason UpdateRefused, an Updated=False condition carrying the
    worker's reason, and status.source still the old one. Fixing the spec then rolls it out."""
    v1, v2 = write_adapter(tmp_path, "v1"), write_adapter(tmp_path, "v2", rank=4)
    await apply(kubectl, tmp_path, pool_manifest(tmp_path), adapter_manifest("a", source="v1"))
    await eventually(lambda: status(api, "a").get("phase") == "Ready")
    await apply(kubectl, tmp_path, adapter_manifest("a", source="v1-typo"))

    def refused() -> bool:
        conds = {c["type"]: c for c in status(api, "a").get("conditions", ())}
        return conds.get("Updated", {}).get("status") == "False" and conds["Ready"]["reason"] == "UpdateRefused"

    await eventually(refused)
    st = status(api, "a")
    conds = {c["type"]: c for c in st["conditions"]}
    assert st["phase"] == "Ready" and st["source"] == "v1" and st["readyReplicas"] == 1, st
    assert conds["Updated"]["reason"] == "LoadRefused" and "v1-typo" in conds["Updated"]["message"], conds
    assert "from source 'v1'" in conds["Ready"]["message"] and conds["Ready"]["status"] == "True"
    assert copies(kubelet, "a") == {digest(v1)} and unloads(kubelet, "a") == 0  # still served
    await apply(kubectl, tmp_path, adapter_manifest("a", source="v2"))
    await eventually(lambda: copies(kubelet, "a") == {digest(v2)} and status(api, "a").get("source") == "v2")
    await eventually(lambda: "Updated" not in {c["type"] for c in status(api, "a")["conditions"]}
                     and status(api, "a")["phase"] == "Ready")
