"""spec.tensorParallelSize: the worker pod gets one GPU per rank, a memory-backed /dev/shm for NCCL
and the flag (our worker and stock vLLM alike); the schema and the operator refuse the same values."""

from __future__ import annotations

from typing import Any

import pytest

from lorafleet.operator import builders
from lorafleet.operator.spec import SpecError, parse_pool
from lorafleet.worker.server.cli import build_parser
from tests.operator.test_crds import accepts, pool

POOL: dict[str, Any] = {
    "model": {"path": "/models/llama-70b", "servedName": "llama"},
    "image": "ghcr.io/lorafleet/worker:1",
    "resources": {"limits": {"memory": "400Gi"}},
    "engine": {"maxLoras": 8, "maxCpuLoras": 32, "device": "cuda"},
}


def _pod(spec: dict[str, Any]) -> dict[str, Any]:
    return builders.workload(parse_pool("ns", "p", spec))["spec"]["template"]["spec"]


@pytest.mark.parametrize("server", [None, {"kind": "vllm"}])
def test_tp4_pod_has_four_gpus_shm_and_the_flag(server) -> None:
    spec = {**POOL, "tensorParallelSize": 4} | ({"server": server} if server else {})
    pod = _pod(spec)
    c = pod["containers"][0]
    assert c["resources"]["limits"] == {"memory": "400Gi", "nvidia.com/gpu": 4}
    shm = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert shm == [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    args = c["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "4"
    if server is None:  # the worker's own parser takes the flags the operator writes
        assert build_parser().parse_args(args[1:]).tensor_parallel_size == 4
    assert POOL["resources"] == {"limits": {"memory": "400Gi"}}  # the spec is not edited in place


def test_tp1_pod_is_unchanged() -> None:
    default, explicit = _pod(POOL), _pod({**POOL, "tensorParallelSize": 1})
    assert default == explicit
    assert "--tensor-parallel-size" not in default["containers"][0]["args"]
    assert all(v["name"] != "dshm" for v in default["volumes"])
    assert "nvidia.com/gpu" not in default["containers"][0]["resources"]["limits"]


def test_cpu_pool_gets_shm_but_no_gpus() -> None:
    pod = _pod({**POOL, "tensorParallelSize": 2, "engine": {**POOL["engine"], "device": "cpu"}})
    assert "nvidia.com/gpu" not in pod["containers"][0]["resources"]["limits"]
    assert any(v["name"] == "dshm" for v in pod["volumes"])


def test_a_gpu_limit_that_disagrees_is_refused_by_name() -> None:
    spec = {**POOL, "tensorParallelSize": 4, "resources": {"limits": {"nvidia.com/gpu": 2}}}
    with pytest.raises(SpecError, match="tensorParallelSize=4"):
        parse_pool("ns", "p", spec)
    assert _pod({**spec, "resources": {"limits": {"nvidia.com/gpu": 4}}})["containers"][0]["resources"]["limits"] == {
        "nvidia.com/gpu": 4}


def test_a_user_mount_on_dev_shm_clashes() -> None:
    spec = {**POOL, "tensorParallelSize": 2, "volumes": [{"name": "s", "emptyDir": {}}],
            "volumeMounts": [{"name": "s", "mountPath": "/dev/shm"}]}
    with pytest.raises(SpecError, match="/dev/shm"):
        parse_pool("ns", "p", spec)


@pytest.mark.parametrize(("value", "valid"), [(1, True), (2, True), (8, True), (16, True), (0, False), (17, False),
                                              ("2", False)])
def test_schema_and_operator_agree(value: Any, valid: bool) -> None:
    assert accepts("lorapools", pool(tensorParallelSize=value)) is valid
    try:
        parse_pool("ns", "llama", {**POOL, "tensorParallelSize": value})
        parsed = True
    except SpecError:
        parsed = False
    assert parsed is valid
