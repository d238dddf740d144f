"""Fixtures for the Helm chart tests: the real Helm engine (helm-sdkpy) run against kmock.

helm-sdkpy declares Python >= 3.12 but works on 3.11; CI installs it with
`pip install --ignore-requires-python helm-sdkpy`. Without it, the tests that need Helm skip
with that command as the reason; the static checks (CRD copies, values comments, schema) still run.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import TESTS_PATH

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "lorafleet"
RUNNER = Path(__file__).with_name("helm_emulator.py")
CI_VALUES = sorted(CHART.glob("ci/*-values.yaml"))
# "default" = the chart's own values.yaml; the rest are the ci/*-values.yaml files.
VALUE_SETS = {"default": {}} | {p.name.removesuffix("-values.yaml"): yaml.safe_load(p.read_text()) for p in CI_VALUES}
NAMES = sorted(VALUE_SETS)
# Namespaces the ci values name besides the release namespace (operator.watchNamespaces).
EXTRA_NAMESPACES = ["team-a"]

HELM_MISSING = "helm-sdkpy not installed: pip install --ignore-requires-python helm-sdkpy"


def helm_available() -> bool:
    try:  # find, not import: loading the Go library here would be wasted (the runner does it)
        return importlib.util.find_spec("helm_sdkpy") is not None
    except (ImportError, ValueError):
        return False


@pytest.fixture(scope="session")
def helm() -> None:
    if not helm_available():
        pytest.skip(HELM_MISSING)


def run_helm(op: str, values: dict[str, Any], namespace: str = "default") -> dict[str, Any]:
    job = {"op": op, "chart": str(CHART), "values": values, "namespace": namespace,
           "extra_namespaces": EXTRA_NAMESPACES, "release": "lf"}
    # The runner imports tests.operator.* by package path, through the root conftest's link.
    env = {**os.environ, "HELM_DRIVER": "memory",
           "PYTHONPATH": os.pathsep.join(filter(None, [TESTS_PATH, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(RUNNER), json.dumps(job)], env=env, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"helm runner failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@functools.cache
def _install_cached(name: str) -> str:
    return json.dumps(run_helm("install", VALUE_SETS[name]))


def installed(name: str) -> dict[str, Any]:
    """Install value set `name` into a fresh emulator (once per session); the result dict."""
    return json.loads(_install_cached(name))


def manifests(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The rendered objects of an install, CRDs excluded (Helm applies those from crds/ separately)."""
    return [doc for doc in yaml.safe_load_all(result["manifest"]) if doc]


@pytest.fixture(params=NAMES)
def render(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    """Each value set installed (once per session): (its name, the install result, the rendered objects)."""
    result = installed(request.param)
    assert result["ok"], f"helm install with {request.param} values failed: {result.get('error')}"
    return request.param, result, manifests(result)
