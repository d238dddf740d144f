"""A LoraPool with spec.tensorParallelSize, applied with kubectl to the kmock API server: the operator's
Deployment gives each worker pod that many GPUs, a memory-backed /dev/shm and the flag; a GPU limit
that disagrees is refused with a condition naming both fields."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.operator.conftest import Kubectl, OperatorRunner, eventually
from tests.operator.kmock_harness import PatchedEmulator
from tests.operator.test_e2e import LP, apply, pool_manifest

pytestmark = pytest.mark.timeout(120)


async def test_tp_pool_deployment(api: PatchedEmulator, kubectl: Kubectl, operator: OperatorRunner,
                                  tmp_path: Path) -> None:
    pool = pool_manifest(tmp_path)
    pool["spec"] |= {"tensorParallelSize": 2, "resources": {"limits": {"memory": "300Gi"}}}
    pool["spec"]["engine"]["device"] = "cuda"
    await apply(kubectl, tmp_path, pool)
    dep = await eventually(lambda: api.get("apps/v1/deployments", "default", "pool"))
    spec = dep["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert c["resources"]["limits"] == {"memory": "300Gi", "nvidia.com/gpu": 2}
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in spec["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert c["args"][c["args"].index("--tensor-parallel-size") + 1] == "2"

    pool["metadata"]["name"] = "bad"
    pool["spec"]["resources"] = {"limits": {"nvidia.com/gpu": 1}}
    await apply(kubectl, tmp_path, pool)

    def refused() -> str | None:
        conditions = ((api.get(LP, "default", "bad") or {}).get("status") or {}).get("conditions") or []
        return next((c["message"] for c in conditions if "tensorParallelSize" in c.get("message", "")), None)

    message = await eventually(refused)
    assert "nvidia.com/gpu=1" in message
    assert api.get("apps/v1/deployments", "default", "bad") is None
