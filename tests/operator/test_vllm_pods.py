"""`spec.server` of a LoraPool and the vLLM pods built from it (pure: spec in, manifests out)."""

from __future__ import annotations

import pytest

from lorafleet.operator import builders
from lorafleet.operator.spec import SpecError, check_against_pool, parse_adapter, parse_pool
from tests.operator.test_builders import POOL

VLLM = {**POOL, "image": "vllm/vllm-openai:v0.32.0", "engine": {**POOL["engine"], "dtype": "bfloat16"},
        "server": {"kind": "vllm", "args": ["--gpu-memory-utilization", "0.85"],
                   "env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}]}}


def test_a_pool_without_server_is_our_worker_as_before() -> None:
    pool = parse_pool("ns", "p", POOL)
    assert pool.server.kind == "lorafleet" and pool.admin_port == 8001
    container = builders.workload(pool)["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["lorafleet"] and container["args"][0] == "worker"


def test_vllm_pod_has_lora_flags_runtime_updates_and_the_key_from_the_secret() -> None:
    pool = parse_pool("ns", "p", VLLM)
    assert pool.admin_port == pool.http_port == 8000
    template = builders.workload(pool)["spec"]["template"]
    assert template["metadata"]["labels"]["lorafleet.dev/worker-kind"] == "vllm"
    assert template["metadata"]["labels"]["lorafleet.dev/pool"] == "p"
    container = template["spec"]["containers"][0]
    args = container["args"]
    flags = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
    assert flags["--max-loras"] == "4" and flags["--max-cpu-loras"] == "8" and flags["--max-lora-rank"] == "32"
    assert flags["--served-model-name"] == "llama" and flags["--port"] == "8000" and flags["--dtype"] == "bfloat16"
    assert "--enable-lora" in args and args[-2:] == ["--gpu-memory-utilization", "0.85"]
    env = {e["name"]: e for e in container["env"]}
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]["value"] == "True"
    assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "p-admin-token", "key": "token"}
    assert env["VLLM_LOGGING_LEVEL"]["value"] == "DEBUG"
    assert not any("token" in a.lower() or "key" in a.lower() for a in args)  # no secret on the command line
    assert [p["name"] for p in container["ports"]] == ["http"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    assert [p["name"] for p in builders.service(pool)["spec"]["ports"]] == ["http"]


@pytest.mark.parametrize("server,needle", [
    ({"kind": "sglang"}, "spec.server.kind"),
    ({"kind": "vllm", "args": ["--max-loras", "9"]}, "--max-loras"),
    ({"kind": "vllm", "args": ["--api-key=x"]}, "--api-key"),
    ({"kind": "vllm", "env": [{"name": "VLLM_API_KEY", "value": "x"}]}, "VLLM_API_KEY"),
    ({"kind": "vllm", "env": [{"value": "x"}]}, "spec.server.env[0]"),
    ({"kind": "vllm", "args": "--enforce-eager"}, "spec.server.args"),
    ({"image": "x"}, "kind vllm"),
    ("vllm", "spec.server must be an object"),
])
def test_bad_server_specs_are_permanent_errors_naming_the_field(server, needle) -> None:
    with pytest.raises(SpecError) as err:
        parse_pool("ns", "p", {**POOL, "server": server})
    assert needle in str(err.value) and err.value.reason == "InvalidSpec"


def test_a_vllm_pool_cannot_verify_digests() -> None:
    pool = parse_pool("ns", "p", VLLM)
    check_against_pool(parse_adapter("ns", "a", {"pool": "p", "source": "a"}), pool)
    with pytest.raises(SpecError) as err:
        check_against_pool(parse_adapter("ns", "a", {"pool": "p", "source": "a", "sha256": "0" * 64}), pool)
    assert err.value.reason == "DigestUnverifiable"


@pytest.mark.parametrize(("server", "valid"), [
    ({"kind": "vllm", "image": "vllm/vllm-openai:v0.32.0", "args": ["--enforce-eager"],
      "env": [{"name": "A", "value": "1"}]}, True),
    ({"kind": "lorafleet"}, True),
    ({"kind": "sglang"}, False),
    ({"kind": "vllm", "args": [3]}, False),
    ({"kind": "vllm", "env": [{"value": "1"}]}, False),
])
def test_the_crd_schema_takes_spec_server(server, valid) -> None:
    from tests.operator.test_crds import accepts, pool

    assert accepts("lorapools", pool(server=server)) is valid
    assert accepts("lorapools", pool())  # manifests without it stay valid


def test_an_unknown_server_field_is_not_in_the_schema() -> None:
    """A structural schema cannot forbid unknown fields (no additionalProperties: false beside
    properties); the API server's strict field validation, kubectl's default, refuses them."""
    from tests.operator.test_crds import schema

    assert "flags" not in schema("lorapools")["properties"]["spec"]["properties"]["server"]["properties"]
