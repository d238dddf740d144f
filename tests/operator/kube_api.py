"""Kubernetes API server conventions that the test emulator (`kmock_harness`) reproduces.

Pure helpers, no emulator state: `Status` error responses with the reasons kubectl and kopf parse,
label selectors, server-side Tables for `kubectl get` (printer columns), and timestamps.
"""

from __future__ import annotations

import datetime
import re
from typing import Any

import aiohttp.web


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def age(ts: str | None) -> str:
    if not ts:
        return "<unknown>"
    then = datetime.datetime.strptime(ts, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
    s = int((datetime.datetime.now(datetime.timezone.utc) - then).total_seconds())
    return f"{s}s" if s < 120 else f"{s // 60}m"


_FILTER = re.compile(r'^(\w+)\[\?\(@\.(\w+)==["\'](.*?)["\']\)\]$')


def jsonpath(obj: Any, path: str) -> Any:
    """A printer column's JSONPath: dotted fields, and list filters like `conditions[?(@.type=="Ready")]`."""
    parts = re.findall(r'(?:[^.\[]+(?:\[[^\]]*\])?)', path.strip("."))
    for part in parts:
        if not isinstance(obj, dict):
            return None
        m = _FILTER.match(part)
        if m is None:
            obj = obj.get(part)
            continue
        key, field, value = m.groups()
        obj = next((item for item in obj.get(key) or () if isinstance(item, dict) and item.get(field) == value), None)
    return obj


def status_response(code: int, reason: str, message: str) -> aiohttp.web.Response:
    body = {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
            "code": code, "reason": reason, "message": message}
    return aiohttp.web.json_response(body, status=code)


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def matches_selector(obj: dict[str, Any], selector: str) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    for term in filter(None, selector.split(",")):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = term.split("=", 1)
            if labels.get(k) != v.lstrip("="):
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def table(printer_columns: list[dict[str, Any]] | None, items: list[dict[str, Any]], resource_version: str) -> dict[str, Any]:
    """A server-side Table of `items`: Name, then the CRD's printer columns (Age when it has none)."""
    columns = [{"name": "Name", "type": "string", "format": "name", "priority": 0,
                "description": "Name of the object."}]
    extra = printer_columns or [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
    for c in extra:
        columns.append({"name": c["name"], "type": c["type"] if c["type"] != "date" else "string",
                        "format": "", "priority": c.get("priority", 0), "description": c.get("description", "")})
    rows = []
    for obj in items:
        cells: list[Any] = [obj["metadata"]["name"]]
        for c in extra:
            value = jsonpath(obj, c["jsonPath"])
            cells.append(age(value) if c["type"] == "date" else ("" if value is None else value))
        rows.append({"cells": cells, "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                                                "metadata": obj["metadata"]}})
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": resource_version},
            "columnDefinitions": columns, "rows": rows}
