"""defaultPool.tensorParallelSize: the chart writes it into the LoraPool and leaves the GPU limit to the
operator, whose builders then give each worker pod that many GPUs."""

from __future__ import annotations

import pytest

from lorafleet.operator import builders
from lorafleet.operator.spec import parse_pool
from tests.charts.conftest import manifests, run_helm
from tests.charts.rendered import by_kind

pytestmark = pytest.mark.usefixtures("helm")


@pytest.mark.parametrize("tp", [1, 4])
def test_default_pool_tensor_parallel(tp: int) -> None:
    result = run_helm("install", {"defaultPool": {"enabled": True, "tensorParallelSize": tp}})
    assert result["ok"], result.get("error")
    (pool,) = by_kind(manifests(result), "LoraPool")
    spec = pool["spec"]
    assert spec.get("tensorParallelSize", 1) == tp
    limits = builders.workload(parse_pool("default", pool["metadata"]["name"], spec))[
        "spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == tp
    assert limits["memory"] == "40Gi"
