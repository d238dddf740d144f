"""The CRDs' schemas (crds/), checked with jsonschema the way the API server applies them at
`kubectl apply` (CEL rules aside): what they refuse up front, and that the operator's own checks
(`operator/spec.py`) agree with them, so an object the API server accepts is one the operator can
build workers for."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from lorafleet.operator.spec import POOL_NAME_MAX, SpecError, parse_pool

ROOT = Path(__file__).resolve().parents[2]


def schema(plural: str) -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "crds" / f"{plural}.lorafleet.dev.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def accepts(plural: str, obj: dict[str, Any]) -> bool:
    return jsonschema.Draft7Validator(schema(plural)).is_valid(obj)


POOL_SPEC = {"model": {"path": "/models/m", "servedName": "m"}, "image": "w:1"}


def pool(name: str = "llama", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "lorafleet.dev/v1alpha1", "kind": "LoraPool", "metadata": {"name": name},
            "spec": {**POOL_SPEC, **spec}}


@pytest.mark.parametrize(("name", "valid"), [
    ("llama", True), ("llama-3-8b", True), ("a" * POOL_NAME_MAX, True),
    ("llama.v2", False),  # a Service name is an RFC 1035 label: no dots
    ("3llama", False),  # nor a leading digit
    ("a" * (POOL_NAME_MAX + 1), False),  # a StatefulSet's revision label would pass 63 characters
    ("llama-", False),
])
def test_pool_names_are_ones_the_workers_objects_can_take(name: str, valid: bool) -> None:
    assert accepts("lorapools", pool(name)) is valid
    try:  # an object from before the schema had the rule: the operator refuses the same names
        parse_pool("ns", name, POOL_SPEC)
        parsed = True
    except SpecError as exc:
        assert exc.reason == "InvalidName"
        parsed = False
    assert parsed is valid


@pytest.mark.parametrize(("value", "valid"), [
    (0, True), (1, True), ("25%", True), ("100%", True),
    (-1, False), ("abc", False), ("150%", False), ("1", False),
])
def test_pool_max_unavailable_is_a_count_or_a_percentage(value: Any, valid: bool) -> None:
    assert accepts("lorapools", pool(maxUnavailable=value)) is valid
    try:
        parse_pool("ns", "llama", {**POOL_SPEC, "maxUnavailable": value})
        parsed = True
    except SpecError:
        parsed = False
    assert parsed is valid


def _resolve(node: dict[str, Any] | None, path: str) -> dict[str, Any] | None:
    """The schema node a printer column's JSONPath reads (`conditions[?(...)]` steps into the items)."""
    for part in re.findall(r"[^.\[]+(?:\[[^\]]*\])?", path.strip(".")):
        if node is None:
            return None
        if part == "metadata":
            return {"type": "object"}  # the API server's, not the CRD's
        name, _, selector = part.partition("[")
        node = node.get("properties", {}).get(name)
        if selector and node is not None:
            node = node.get("items")
    return node


@pytest.mark.parametrize("plural", ["loraadapters", "lorapools"])
def test_printer_columns_read_fields_the_schema_has(plural: str) -> None:
    crd = yaml.safe_load((ROOT / "crds" / f"{plural}.lorafleet.dev.yaml").read_text())
    version = crd["spec"]["versions"][0]
    columns = version["additionalPrinterColumns"]
    assert {"Phase", "Ready", "Reason"} <= {c["name"] for c in columns}
    for column in columns:
        node = _resolve(version["schema"]["openAPIV3Schema"], column["jsonPath"])
        assert node is not None, f"{plural}: column {column['name']} reads {column['jsonPath']}, which the schema lacks"
