"""Static checks of charts/lorafleet (no Helm needed): CRD source, values comments, schema, dashboard."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "lorafleet"
SCHEMA = json.loads((CHART / "values.schema.json").read_text())


def test_chart_crds_are_the_crds_folder() -> None:
    """One source: the chart's crds/ is a link to the top-level crds/ (ours and kopf's peering CRDs,
    which Helm installs from the chart's crds/ too), so no copy can drift."""
    link = CHART / "crds"
    assert link.is_symlink(), "charts/lorafleet/crds must be a symlink to ../../crds"
    assert link.resolve() == (ROOT / "crds").resolve()
    names = {str(p.relative_to(ROOT / "crds")) for p in (ROOT / "crds").rglob("*.yaml")}
    assert {"lorapools.lorafleet.dev.yaml", "loraadapters.lorafleet.dev.yaml",
            "peering/kopfpeerings.kopf.dev.yaml", "peering/clusterkopfpeerings.kopf.dev.yaml"} <= names


def _schema_leaves(schema: dict[str, Any], prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """Paths of values that are not objects described property by property (those carry a comment)."""
    props = schema.get("properties")
    # An object whose keys are all optional (e.g. resources) is one value with one comment.
    if schema.get("type") != "object" or not props or not schema.get("required"):
        return {prefix}
    return set().union(*(_schema_leaves(sub, (*prefix, key)) for key, sub in props.items()))


def _key_lines(text: str) -> list[tuple[tuple[str, ...], str]]:
    """(path, previous non-blank line) for every mapping key of values.yaml, by indentation."""
    out, stack, previous = [], [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        m = re.match(r"^( *)([A-Za-z0-9_.-]+):( |$)", line)
        if m and not stripped.startswith("#"):
            indent = len(m.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, m.group(2)))
            out.append((tuple(k for _, k in stack), previous))
        if not stripped.startswith("- ") or stripped.startswith("#"):
            previous = stripped
    return out


def test_every_value_has_a_comment() -> None:
    leaves = _schema_leaves(SCHEMA)
    lines = _key_lines((CHART / "values.yaml").read_text())
    missing = [".".join(path) for path, prev in lines if path in leaves and not prev.startswith("#")]
    assert not missing, f"values without a comment line above them: {missing}"
    documented = {path for path, _ in lines}
    assert leaves <= documented, f"schema leaves missing from values.yaml: {sorted(leaves - documented)}"


def _objects(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = []
    if schema.get("type") == "object" and "properties" in schema:
        out.append((path or "<root>", schema))
        for key, sub in schema["properties"].items():
            out += _objects(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        out += _objects(schema["items"], f"{path}[]")
    return out


def test_schema_is_strict() -> None:
    for path, obj in _objects(SCHEMA):
        assert obj.get("additionalProperties") is False, f"{path}: additionalProperties must be false"
        assert "required" in obj, f"{path}: must say which keys are required"
    props = SCHEMA["properties"]
    assert props["operator"]["properties"]["scope"]["enum"] == ["namespace", "cluster"]
    assert props["redis"]["properties"]["mode"]["enum"] == ["bundled", "external", "none"]


def test_default_values_satisfy_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.validate(values, SCHEMA)
    for path in CHART.glob("ci/*-values.yaml"):
        merged = _merge(values, yaml.safe_load(path.read_text()))
        jsonschema.validate(merged, SCHEMA)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _exported_series() -> set[str]:
    """Every series name the worker and the router export (Prometheus text names)."""
    from lorafleet.router.metrics import RouterMetrics
    from lorafleet.worker.server.metrics import WorkerMetrics

    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    names = set()
    for registry in (WorkerMetrics("m", 4).registry, RouterMetrics.create().registry):
        for family in registry.collect():
            names.update(family.name + s for s in suffixes.get(family.type, [""]))
    return names


def test_dashboard_uses_only_exported_metrics() -> None:
    pytest.importorskip("lorafleet.router.metrics", reason="router not present")
    pytest.importorskip("torch", reason="worker metrics import the engine (torch)")
    dashboard = json.loads((CHART / "dashboards" / "lorafleet.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = set()
    for expr in exprs:
        # metric names: vllm:..., lorafleet:..., lorafleet_router_...; not functions or labels
        used.update(re.findall(r"\b((?:vllm|lorafleet):[a-z_:]+|lorafleet_router_[a-z_]+)", expr))
    exported = _exported_series()
    assert used, "dashboard has no queries"
    assert used <= exported, f"dashboard queries series nobody exports: {sorted(used - exported)}"
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("residency", "hits", "time to first token", "deferred", "cold loads"):
        assert topic in titles, f"dashboard lacks a {topic!r} panel"


@pytest.mark.parametrize("dockerfile", ["worker.Dockerfile", "control-plane.Dockerfile"])
def test_dockerfiles_copy_every_package_folder(dockerfile: str) -> None:
    """setup.py maps `lorafleet.*` onto top-level folders; an image missing one fails to install."""
    text = (ROOT / "docker" / dockerfile).read_text()
    folders = set(re.findall(r'"lorafleet(?:\.\w+)?": "(\w+)"', (ROOT / "setup.py").read_text()))
    copied = set(re.findall(r"^COPY (\w+) \./\1$", text, re.M))
    assert folders and folders <= copied, f"{dockerfile} does not COPY {sorted(folders - copied)}"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    repo = values["image"]["worker" if dockerfile.startswith("worker") else "controlPlane"]["repository"]
    assert f"-t {repo}:" in text, f"{dockerfile}'s build line should tag {repo}"
