"""Pure builders and spec parsing: manifests from a PoolSpec, permanent spec errors."""

from __future__ import annotations

import pytest

from lorafleet.operator import builders
from lorafleet.operator.spec import POOL_LABEL, SpecError, check_against_pool, parse_adapter, parse_pool

POOL = {
    "model": {"path": "/models/llama", "servedName": "llama"},
    "image": "ghcr.io/lorafleet/worker:1",
    "replicas": 3,
    "resources": {"limits": {"nvidia.com/gpu": 1}},
    "engine": {"maxLoras": 4, "maxCpuLoras": 8, "maxLoraRank": 32, "device": "cuda"},
    "adapterVolume": {"claimName": "adapters", "mountPath": "/adapters"},
}


def test_deployment_wires_token_ports_flags_and_selector() -> None:
    pool = parse_pool("ns", "p", POOL)
    dep = builders.workload(pool)
    assert dep["kind"] == "Deployment" and dep["spec"]["replicas"] == 3
    assert dep["spec"]["selector"]["matchLabels"] == {POOL_LABEL: "p"}
    container = dep["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[args.index("--max-lora-rank") + 1] == "32"
    assert args[args.index("--admin-token-file") + 1] == "/var/run/lorafleet/admin/token"
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes["admin-token"]["secret"]["secretName"] == "p-admin-token"
    assert volumes["adapters"]["persistentVolumeClaim"]["claimName"] == "adapters"


def test_statefulset_service_pdb_secret() -> None:
    pool = parse_pool("ns", "p", {**POOL, "workloadKind": "StatefulSet"})
    assert builders.workload(pool)["kind"] == "StatefulSet"
    svc = builders.service(pool)
    assert svc["spec"]["clusterIP"] == "None" and {p["name"] for p in svc["spec"]["ports"]} == {"http", "admin"}
    assert builders.pod_disruption_budget(pool)["spec"]["maxUnavailable"] == 1
    secret = builders.token_secret(pool, "s3cret")
    assert builders.read_token(secret) == "s3cret"
    assert [m["kind"] for m in builders.pool_children(pool, "t")] == ["Secret", "StatefulSet", "Service", "PodDisruptionBudget"]


def test_builders_are_deterministic() -> None:
    pool = parse_pool("ns", "p", POOL)
    assert builders.pool_children(pool, "t") == builders.pool_children(pool, "t")


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ({"source": "a"}, "MissingPool"),
        ({"pool": "p"}, "MissingSource"),
        ({"pool": "p", "source": "ftp://host/a"}, "InvalidSource"),
        ({"pool": "p", "source": "s3://B/a"}, "InvalidSource"),
        ({"pool": "p", "source": "/etc/passwd"}, "SourceOutsideVolume"),
        ({"pool": "p", "source": "a/../../b"}, "SourceOutsideVolume"),
        ({"pool": "p", "source": "a", "replicas": {"min": 3, "max": 2}}, "InvalidReplicas"),
        ({"pool": "p", "source": "a", "sha256": "xyz"}, "InvalidDigest"),
    ],
)
def test_adapter_spec_errors(spec: dict, reason: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_adapter("ns", "a", spec)
    assert info.value.reason == reason


def test_rank_checked_against_pool() -> None:
    pool = parse_pool("ns", "p", POOL)
    check_against_pool(parse_adapter("ns", "a", {"pool": "p", "source": "a", "rank": 32}), pool)
    with pytest.raises(SpecError, match="exceeds"):
        check_against_pool(parse_adapter("ns", "a", {"pool": "p", "source": "a", "rank": 64}), pool)


def test_an_adapter_named_like_the_base_model_is_refused_before_any_load() -> None:
    pool = parse_pool("ns", "p", POOL)
    with pytest.raises(SpecError) as info:
        check_against_pool(parse_adapter("ns", "llama", {"pool": "p", "source": "a"}), pool)
    assert info.value.reason == "NameIsBaseModel"


@pytest.mark.parametrize(("patch", "field"), [
    ({"replicas": "3"}, "spec.replicas"),
    ({"replicas": -1}, "spec.replicas"),
    ({"engine": {"maxLoraRank": 1.5}}, "spec.engine.maxLoraRank"),
    ({"engine": {"device": "tpu"}}, "spec.engine.device"),
    ({"engine": []}, "spec.engine"),
    ({"ports": {"http": 70000}}, "spec.ports.http"),
    ({"adapterVolume": {"mountPath": "adapters"}}, "spec.adapterVolume.mountPath"),
    ({"placement": {"requestsPerReplica": 0}}, "spec.placement.requestsPerReplica"),
    ({"maxUnavailable": "half"}, "spec.maxUnavailable"),
])
def test_a_mistyped_pool_is_a_spec_error_naming_the_field(patch: dict, field: str) -> None:
    """Not a ValueError from int() that kopf retries forever, nor a Deployment the API refuses."""
    with pytest.raises(SpecError) as info:
        parse_pool("ns", "p", {**POOL, **patch})
    assert info.value.reason == "InvalidSpec" and field in str(info.value)


@pytest.mark.parametrize(("patch", "field"), [
    ({"replicas": {"min": "lots"}}, "spec.replicas.min"),
    ({"replicas": {"max": 0}}, "spec.replicas.max"),
    ({"replicas": [1, 2]}, "spec.replicas"),
    ({"rank": "8"}, "spec.rank"),
    ({"pinned": "false"}, "spec.pinned"),
    ({"tenants": "acme"}, "spec.tenants"),
    ({"pool": ["p"]}, "spec.pool"),
])
def test_a_mistyped_adapter_is_a_spec_error_naming_the_field(patch: dict, field: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_adapter("ns", "a", {"pool": "p", "source": "a", **patch})
    assert info.value.reason == "InvalidSpec" and field in str(info.value)


def test_pool_spec_errors() -> None:
    with pytest.raises(SpecError):
        parse_pool("ns", "p", {**POOL, "engine": {"maxLoras": 9, "maxCpuLoras": 8}})
    with pytest.raises(SpecError):
        parse_pool("ns", "p", {**POOL, "ports": {"http": 8000, "admin": 8000}})


def test_a_tool_call_parser_reaches_the_workers_flags() -> None:
    """spec.engine.toolCallParser becomes the worker's --enable-auto-tool-choice --tool-call-parser,
    which the worker's own CLI reads back; unset, neither flag is passed; another value is a spec error."""
    from lorafleet.worker.server.cli import build_parser, settings_from_args

    def args(engine: dict) -> list[str]:
        pool = parse_pool("ns", "p", {**POOL, "engine": {**POOL["engine"], **engine}})
        return builders.workload(pool)["spec"]["template"]["spec"]["containers"][0]["args"]

    from lorafleet.operator.spec import TOOL_CALL_PARSERS
    from lorafleet.worker.openai.tools import PARSERS

    assert set(TOOL_CALL_PARSERS) == set(PARSERS)  # the operator's list is the worker's
    for name in TOOL_CALL_PARSERS:
        with_parser = args({"toolCallParser": name})
        assert settings_from_args(build_parser().parse_args(with_parser[1:])).tool_call_parser == name
    assert "--tool-call-parser" not in args({}) and "--enable-auto-tool-choice" not in args({})
    with pytest.raises(SpecError, match="toolCallParser"):
        args({"toolCallParser": "granite"})


def test_a_reasoning_parser_reaches_the_workers_flags() -> None:
    """spec.engine.reasoningParser becomes the worker's --reasoning-parser, read back by the worker's
    CLI; unset, no flag; another value is a spec error."""
    from lorafleet.operator.spec import REASONING_PARSERS
    from lorafleet.worker.openai.reasoning import PARSERS
    from lorafleet.worker.server.cli import build_parser, settings_from_args

    def args(engine: dict) -> list[str]:
        pool = parse_pool("ns", "p", {**POOL, "engine": {**POOL["engine"], **engine}})
        return builders.workload(pool)["spec"]["template"]["spec"]["containers"][0]["args"]

    assert set(REASONING_PARSERS) == set(PARSERS)
    for name in REASONING_PARSERS:
        assert settings_from_args(build_parser().parse_args(args({"reasoningParser": name})[1:])).reasoning_parser == name
    assert "--reasoning-parser" not in args({})
    with pytest.raises(SpecError, match="reasoningParser"):
        args({"reasoningParser": "granite"})


@pytest.mark.parametrize(("engine", "per_request"), [
    ({"maxLoras": 1}, 1), ({"maxLoras": 3}, 3), ({"maxLoras": 8}, 4), ({}, 4),
    ({"maxLoras": 8, "maxLorasPerRequest": 2}, 2),
])
def test_max_loras_per_request_defaults_to_what_the_worker_takes(engine: dict, per_request: int) -> None:
    pool = parse_pool("ns", "p", {**POOL, "engine": {"maxCpuLoras": 8, **engine}})
    args = builders.worker_args(pool)
    assert args[args.index("--max-loras-per-request") + 1] == str(per_request)


def test_max_loras_per_request_above_max_loras_is_refused() -> None:
    with pytest.raises(SpecError, match="maxLorasPerRequest must be <= engine.maxLoras"):
        parse_pool("ns", "p", {**POOL, "engine": {"maxLoras": 2, "maxLorasPerRequest": 4}})
