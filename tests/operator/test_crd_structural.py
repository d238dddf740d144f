"""The CRDs as a real API server judges them (apiextensions.k8s.io/v1), and as users read them.

The structural-schema rules the API server enforces at CRD creation (a 422 otherwise), which
jsonschema does not know: every node has a type (unless int-or-string or preserve-unknown-fields),
`properties` and `additionalProperties` never side by side, list-map keys required scalars,
`metadata` restricted to name/generateName, no types or defaults inside anyOf/allOf/oneOf/not.
Then what `kubectl explain` shows: a description on every field. Then the conditions schema:
metav1.Condition's required fields, a bound, a list map keyed by type, and the operator's own
condition dicts accepted by it. The API objects themselves are checked against Kubernetes' own
apiextensions schema (kubernetes-validate) and the examples against the CRDs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from lorafleet.operator.status import AdapterObservation, Condition, adapter_status, render_conditions

ROOT = Path(__file__).resolve().parents[2]
PLURALS = ["loraadapters", "lorapools"]
JUNCTORS = ("anyOf", "allOf", "oneOf", "not")


def crd(plural: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "crds" / f"{plural}.lorafleet.dev.yaml").read_text())


def schema(plural: str) -> dict[str, Any]:
    return crd(plural)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def nodes(node: dict[str, Any], path: str = "", is_field: bool = True) -> Iterator[tuple[str, dict[str, Any], bool]]:
    """(path, node, is_field) for every schema node; is_field: a named property (what kubectl explain
    lists), at any depth, inside list items and maps too."""
    yield path or "<root>", node, is_field
    for name, sub in (node.get("properties") or {}).items():
        yield from nodes(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from nodes(node["items"], f"{path}[]", False)
    if isinstance(node.get("additionalProperties"), dict):
        yield from nodes(node["additionalProperties"], f"{path}{{}}", False)


def structural_errors(root: dict[str, Any]) -> list[str]:
    errors = []
    for path, node, _ in nodes(root):
        free = node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
        if not node.get("type") and not free:
            errors.append(f"{path}: no type")
        if "properties" in node and "additionalProperties" in node:
            errors.append(f"{path}: properties and additionalProperties side by side")
        if node.get("additionalProperties") is False:
            errors.append(f"{path}: additionalProperties: false")
        for junctor in JUNCTORS:
            subs = node.get(junctor)
            for sub in subs if isinstance(subs, list) else [subs] if subs else []:
                for key in ("description", "default", "nullable", "x-kubernetes-preserve-unknown-fields"):
                    if key in sub:
                        errors.append(f"{path}.{junctor}: {key} inside a logical junctor")
                if "type" in sub and not node.get("x-kubernetes-int-or-string"):
                    errors.append(f"{path}.{junctor}: type inside a logical junctor")
        if node.get("x-kubernetes-list-type") == "map":
            items = node.get("items") or {}
            for key in node.get("x-kubernetes-list-map-keys") or []:
                prop = (items.get("properties") or {}).get(key)
                if prop is None or prop.get("type") not in ("string", "integer", "boolean"):
                    errors.append(f"{path}: list-map key {key} is not a scalar property")
                elif key not in (items.get("required") or []) and "default" not in prop:
                    errors.append(f"{path}: list-map key {key} is neither required nor defaulted")
        if node.get("x-kubernetes-int-or-string") and "anyOf" in node:
            if node["anyOf"] != [{"type": "integer"}, {"type": "string"}]:
                errors.append(f"{path}: int-or-string anyOf must be [integer, string]")
    meta = root["properties"].get("metadata", {})
    if set(meta.get("properties") or {}) - {"name", "generateName"}:
        errors.append("metadata: only name and generateName may be restricted")
    if set(meta) - {"type", "properties"}:  # a description or default there is refused too
        errors.append(f"metadata: nothing but its type and name/generateName may be given, not {sorted(set(meta) - {'type', 'properties'})}")
    return errors


@pytest.mark.parametrize("plural", PLURALS)
def test_schema_is_structural(plural: str) -> None:
    assert structural_errors(schema(plural)) == []


def test_structural_check_catches_what_the_api_server_refuses() -> None:
    """The checker itself, on the mistakes a real API server refused (422) in earlier schemas."""
    bad = {"type": "object", "properties": {
        "spec": {"type": "object", "additionalProperties": False, "properties": {"a": {"type": "string"}}},
        "status": {"type": "object", "properties": {"conditions": {
            "type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"],
            "items": {"type": "object", "properties": {"type": {"type": "string"}}}}}},
        "untyped": {"description": "x"},
    }}
    errors = structural_errors(bad)
    assert any("side by side" in e for e in errors)
    assert any("neither required nor defaulted" in e for e in errors)
    assert any(e.startswith(".untyped: no type") for e in errors)


@pytest.mark.parametrize("plural", PLURALS)
def test_every_field_has_a_description(plural: str) -> None:
    """`kubectl explain <kind>.<field>` prints each field's description: none is blank. The root
    `metadata` may carry none (the API server refuses it there and describes ObjectMeta itself)."""
    missing = [path for path, node, is_field in nodes(schema(plural))
               if is_field and not str(node.get("description", "")).strip() and path != ".metadata"]
    assert missing == []


@pytest.mark.parametrize("plural", PLURALS)
def test_crd_object_is_valid_for_the_api_server(plural: str) -> None:
    kubernetes_validate.validate(crd(plural), "1.35", strict=True)


@pytest.mark.parametrize("plural", PLURALS)
def test_conditions_schema_is_metav1_condition(plural: str) -> None:
    conditions = schema(plural)["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert 0 < conditions["maxItems"] <= 32
    assert set(conditions["items"]["required"]) == {"type", "status", "lastTransitionTime", "reason", "message"}
    assert "observedGeneration" in schema(plural)["properties"]["status"]["properties"]


def _validator(plural: str) -> jsonschema.Validator:
    return jsonschema.Draft7Validator(schema(plural), format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER)


def test_operator_written_conditions_pass_the_schema() -> None:
    """What the operator writes (adapter statuses of every phase, a pool's Reconciled) is accepted."""
    observations = [
        AdapterObservation(3, desired=2, placed=2, ready=2, loading=False),
        AdapterObservation(3, desired=2, placed=1, ready=0, loading=True),
        AdapterObservation(3, desired=2, placed=0, ready=0, loading=False, placed_reason="PoolNotFound"),
        AdapterObservation(None, desired=0, placed=0, ready=0, loading=False, failure=("LoadRefused", "x" * 40000)),
        AdapterObservation(1, desired=1, placed=1, ready=1, loading=False, update_refused=("DigestMismatch", "")),
    ]
    adapter = {"apiVersion": "lorafleet.dev/v1alpha1", "kind": "LoraAdapter", "metadata": {"name": "a"},
               "spec": {"pool": "p", "source": "a"}}
    for obs in observations:
        errors = [e.message for e in _validator("loraadapters").iter_errors({**adapter, "status": adapter_status(obs, None)})]
        assert errors == [], obs
    pool = {"apiVersion": "lorafleet.dev/v1alpha1", "kind": "LoraPool", "metadata": {"name": "p"},
            "spec": {"model": {"path": "/m", "servedName": "m"}, "image": "w"}}
    status = {"conditions": render_conditions([Condition("Reconciled", True, "Reconciled", "")], None, 2),
              "observedGeneration": 2}
    assert [e.message for e in _validator("lorapools").iter_errors({**pool, "status": status})] == []
    # and the schema is not a rubber stamp: a condition without its reason is refused
    status["conditions"][0].pop("reason")
    assert not _validator("lorapools").is_valid({**pool, "status": status})


def _example_docs() -> list[dict[str, Any]]:
    docs = []
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


@pytest.mark.parametrize("doc", _example_docs(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_examples_are_accepted(doc: dict[str, Any]) -> None:
    plural = {"LoraPool": "lorapools", "LoraAdapter": "loraadapters"}[doc["kind"]]
    assert doc["apiVersion"] == "lorafleet.dev/v1alpha1"
    assert [e.message for e in _validator(plural).iter_errors(doc)] == []
