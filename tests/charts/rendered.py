"""Queries over a rendered chart's objects: by kind, one by name suffix, a workload's container and
its env, and Kubernetes' $(VAR) expansion of args."""

from __future__ import annotations

import re
from typing import Any


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    found = [o for o in by_kind(objs, kind) if o["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} *{name_suffix}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def container(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]["containers"][0]


def env_of(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c.get("env", [])}


def expand(args: list[str], env: dict[str, dict[str, Any]]) -> list[str]:
    """Kubernetes' $(VAR) expansion, with placeholders for values that come from Secrets."""
    def value(m: re.Match[str]) -> str:
        e = env.get(m.group(1))
        assert e is not None, f"$({m.group(1)}) is used but not defined in env"
        return e.get("value", f"<{m.group(1)}>")
    return [re.sub(r"\$\(([A-Z_]+)\)", value, a) for a in args]
