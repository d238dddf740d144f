"""Every pod the chart runs, and every worker pod the operator builds for its default pool, is
admitted in a namespace labelled `pod-security.kubernetes.io/enforce: restricted`."""

from __future__ import annotations

from typing import Any

import pytest

from lorafleet.operator import builders
from lorafleet.operator.spec import parse_pool
from tests.charts.rendered import by_kind
from tests.operator.pod_security import pod_templates, restricted_violations

pytestmark = pytest.mark.usefixtures("helm")


def test_every_chart_pod_passes_restricted(render: Any) -> None:
    _, _, objs = render
    templates = pod_templates(objs)
    assert templates, "no workload rendered"
    for label, spec in templates:
        assert restricted_violations(spec) == [], label


def test_default_pool_workers_pass_restricted(render: Any) -> None:
    _, _, objs = render
    for pool in by_kind(objs, "LoraPool"):
        spec = builders.workload(parse_pool(pool["metadata"]["namespace"], pool["metadata"]["name"], pool["spec"]))
        assert restricted_violations(spec["spec"]["template"]["spec"]) == [], pool["metadata"]["name"]


def test_default_pool_pod_fields_reach_the_pool(render: Any) -> None:
    name, _, objs = render
    from tests.charts.conftest import VALUE_SETS

    given = (VALUE_SETS[name].get("defaultPool") or {}).get("pod") or {}
    for pool in by_kind(objs, "LoraPool"):
        for key, value in given.items():
            assert pool["spec"][key] == value, key
        spec = builders.workload(parse_pool("ns", pool["metadata"]["name"], pool["spec"]))["spec"]["template"]["spec"]
        if "runtimeClassName" in given:
            assert spec["runtimeClassName"] == given["runtimeClassName"]
