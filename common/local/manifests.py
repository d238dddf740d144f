"""LoraAdapter manifests for the local fleet: parsed and validated the way `kubectl apply` would be.

Validation runs the CRD's own `openAPIV3Schema` (read from `crds/`, so it cannot drift from what
the API server enforces): types, required fields, unknown fields (kubectl's strict field
validation), patterns, lengths, bounds and enums, with schema defaults applied. The CRD's CEL rules
(`x-kubernetes-validations`) are the checks `lorafleet.operator.spec.parse_adapter` re-does, so
that function runs next. Messages follow the API server's shape: `spec.replicas.min: Invalid value`.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from lorafleet.operator.spec import API_VERSION, AdapterSpec, SpecError, parse_adapter

KIND = "LoraAdapter"
CRD_FILE = Path(__file__).resolve().parents[2] / "crds" / "loraadapters.lorafleet.dev.yaml"
# Kinds a manifest file for the cluster may also hold; the local fleet has its own single pool.
IGNORED_KINDS = {"LoraPool"}


class ManifestError(ValueError):
    """A document that would not pass `kubectl apply`; the message names the field."""


@dataclass(frozen=True, slots=True)
class AdapterManifest:
    name: str
    spec: dict[str, Any]  # the validated spec, schema defaults applied
    parsed: AdapterSpec


@cache
def adapter_schema() -> dict[str, Any] | None:
    """The CRD's schema, or None where the CRD file is not shipped (a non-editable install)."""
    try:
        crd = yaml.safe_load(CRD_FILE.read_text())
    except OSError:
        return None
    for version in crd["spec"]["versions"]:
        if f"{crd['spec']['group']}/{version['name']}" == API_VERSION:
            return version["schema"]["openAPIV3Schema"]
    return None


def load_documents(text: str, source: str) -> list[dict[str, Any]]:
    """Every non-empty YAML document (a `kind: List` is flattened), each a mapping."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ManifestError(f"{source}: not valid YAML: {exc}") from None
    out: list[dict[str, Any]] = []
    for i, doc in enumerate(docs):
        if not isinstance(doc, dict):
            raise ManifestError(f"{source}: document {i + 1} is not a mapping")
        if doc.get("kind") == "List" and isinstance(doc.get("items"), list):
            out.extend(doc["items"])
        else:
            out.append(doc)
    return out


def parse_adapter_manifest(doc: dict[str, Any]) -> AdapterManifest:
    """Validate one LoraAdapter document; raises `ManifestError` with the API server's wording."""
    kind, api_version = doc.get("kind"), doc.get("apiVersion")
    if kind != KIND:
        raise ManifestError(f"kind {kind!r} is not {KIND}")
    if api_version != API_VERSION:
        raise ManifestError(f'no matches for kind "{KIND}" in version "{api_version}" (want {API_VERSION})')
    metadata = doc.get("metadata")
    name = metadata.get("name") if isinstance(metadata, dict) else None
    if not name:
        raise ManifestError("metadata.name: Required value: name is required")
    doc = copy.deepcopy(doc)
    schema = adapter_schema()
    if schema is not None:
        errors = validate(doc, schema, "")
        if errors:
            raise ManifestError(f'The {KIND} "{name}" is invalid: ' + "; ".join(errors))
    spec = doc.get("spec")
    if not isinstance(spec, dict):
        raise ManifestError(f'The {KIND} "{name}" is invalid: spec: Required value')
    try:
        parsed = parse_adapter(str(metadata.get("namespace") or "default"), str(name), spec)
    except SpecError as exc:
        raise ManifestError(f'The {KIND} "{name}" is invalid: spec: {exc} ({exc.reason})') from None
    return AdapterManifest(str(name), spec, parsed)


_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
}


def validate(value: Any, schema: dict[str, Any], path: str) -> list[str]:
    """Structural validation of `value` (defaults are filled in place); returns error strings."""
    where = path or "<root>"
    expected = schema.get("type")
    if expected is not None:
        ok = isinstance(value, _TYPES[expected]) and not (expected in ("integer", "number") and isinstance(value, bool))
        if not ok:
            return [f"{where}: Invalid value: {_show(value)}: must be of type {expected}"]
    errors: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        allowed = ", ".join(f'"{v}"' for v in schema["enum"])
        errors.append(f"{where}: Unsupported value: {_show(value)}: supported values: {allowed}")
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(f"{where}: Invalid value: {_show(value)}: should be at least {schema['minLength']} chars long")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{where}: Too long: may not be longer than {schema['maxLength']}")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{where}: Invalid value: {_show(value)}: should match '{schema['pattern']}'")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{where}: Invalid value: {value}: should be greater than or equal to {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{where}: Invalid value: {value}: should be less than or equal to {schema['maximum']}")
    if isinstance(value, list):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{where}: Too many: {len(value)}: must have at most {schema['maxItems']} items")
        items = schema.get("items")
        for i, item in enumerate(value):
            if items is not None:
                errors += validate(item, items, f"{path}[{i}]")
        if schema.get("x-kubernetes-list-type") == "set" and len(set(map(repr, value))) != len(value):
            errors.append(f"{where}: Duplicate value: list-type set")
    if isinstance(value, dict):
        errors += _validate_object(value, schema, path)
    return errors


def _validate_object(value: dict[str, Any], schema: dict[str, Any], path: str) -> list[str]:
    props: dict[str, Any] = schema.get("properties") or {}
    errors: list[str] = []
    for key, sub in props.items():
        if key not in value and "default" in sub:
            value[key] = copy.deepcopy(sub["default"])
    for key in schema.get("required") or ():
        if key not in value:
            errors.append(f"{_join(path, key)}: Required value")
    open_object = schema.get("x-kubernetes-preserve-unknown-fields") or (props == {} and "additionalProperties" not in schema)
    for key, item in value.items():
        if key in props:
            errors += validate(item, props[key], _join(path, key))
        elif not open_object and path != "metadata":
            errors.append(f'{_join(path, key)}: unknown field "{_join(path, key)}"')
    return errors


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _show(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)
