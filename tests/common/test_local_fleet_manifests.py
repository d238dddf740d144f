"""LoraAdapter manifests as `lorafleet adapters apply` validates them: table-driven, no processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafleet.local.manifests import ManifestError, adapter_schema, load_documents, parse_adapter_manifest

REPO = Path(__file__).resolve().parents[2]


def adapter(spec: dict | None = None, name: str = "sql-writer", **top) -> dict:
    doc = {
        "apiVersion": "lorafleet.dev/v1alpha1",
        "kind": "LoraAdapter",
        "metadata": {"name": name},
        "spec": {"pool": "llama", "source": "sql-writer"} if spec is None else spec,
    }
    return {**doc, **top}


def test_schema_is_read_from_the_crd() -> None:
    schema = adapter_schema()
    assert schema is not None and "spec" in schema["properties"]


def test_every_example_manifest_validates() -> None:
    docs = load_documents((REPO / "examples" / "adapters.yaml").read_text(), "examples/adapters.yaml")
    manifests = [parse_adapter_manifest(d) for d in docs if d["kind"] == "LoraAdapter"]
    assert [m.name for m in manifests] == ["sql-writer", "support-de", "summarizer"]
    support = manifests[1].parsed
    assert (support.min_replicas, support.max_replicas, support.pinned, support.tenants) == (2, 2, True, ("acme",))


def test_schema_defaults_are_applied() -> None:
    m = parse_adapter_manifest(adapter({"pool": "p", "source": "s", "replicas": {"min": 0}}))
    assert m.spec["replicas"] == {"min": 0, "max": 1}
    assert m.spec["pinned"] is False
    assert parse_adapter_manifest(adapter()).spec["replicas"] == {"min": 1, "max": 1}


@pytest.mark.parametrize(
    "doc, message",
    [
        (adapter(kind="LoraPool"), "is not LoraAdapter"),
        (adapter(apiVersion="lorafleet.dev/v1"), 'no matches for kind "LoraAdapter" in version "lorafleet.dev/v1"'),
        (adapter(metadata={}), "metadata.name: Required value"),
        (adapter(name="Sql_Writer"), "metadata.name: Invalid value"),
        (adapter({"source": "x"}), "spec.pool: Required value"),
        (adapter({"pool": "p"}), "spec.source: Required value"),
        (adapter({"pool": "p", "source": "s", "colour": "red"}), 'spec.colour: unknown field "spec.colour"'),
        (adapter({"pool": "p", "source": "s", "replicas": {"min": -1, "max": 1}}), "spec.replicas.min: Invalid value: -1"),
        (adapter({"pool": "p", "source": "s", "replicas": {"min": 1, "max": "2"}}), "spec.replicas.max: Invalid value: \"2\": must be of type integer"),
        (adapter({"pool": "p", "source": "s", "pinned": "yes"}), "spec.pinned: Invalid value: \"yes\": must be of type boolean"),
        (adapter({"pool": "p", "source": "s", "sha256": "abc"}), "spec.sha256: Invalid value"),
        (adapter({"pool": "p", "source": "s", "rank": 0}), "spec.rank: Invalid value: 0"),
        (adapter({"pool": "p", "source": "s", "tenants": ["a", "a"]}), "spec.tenants: Duplicate value"),
        # The CRD's CEL rules, re-checked by the operator's parse_adapter.
        (adapter({"pool": "p", "source": "s", "replicas": {"min": 3, "max": 2}}), "InvalidReplicas"),
        (adapter({"pool": "p", "source": "/etc/passwd"}), "SourceOutsideVolume"),
        (adapter({"pool": "p", "source": "a/../../b"}), "SourceOutsideVolume"),
        (adapter({"pool": "p", "source": "ftp://host/a"}), "not supported"),
    ],
)
def test_invalid_manifests_name_the_field(doc: dict, message: str) -> None:
    with pytest.raises(ManifestError) as info:
        parse_adapter_manifest(doc)
    assert message in str(info.value)


def test_yaml_errors_and_lists() -> None:
    with pytest.raises(ManifestError, match="not valid YAML"):
        load_documents("a: [", "f.yaml")
    with pytest.raises(ManifestError, match="document 1 is not a mapping"):
        load_documents("- a\n- b\n", "f.yaml")
    docs = load_documents("kind: List\nitems:\n  - {kind: LoraAdapter}\n  - {kind: LoraPool}\n---\n", "f.yaml")
    assert [d["kind"] for d in docs] == ["LoraAdapter", "LoraPool"]
