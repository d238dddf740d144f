"""An audit log and RBAC for the emulator: every API request as the (verb, group, resource,
namespace) an RBAC authorizer sees, and the `<owner>/finalizers` update that the
OwnerReferencesPermissionEnforcement admission plugin demands when a write sets
`blockOwnerDeletion` on an owner reference.

The permissions a component needs are derived from what it actually called during a run, and
compared with the chart's Roles; with a `Policy` installed the emulator answers 403 Forbidden, as
a real API server does, to anything a Role does not grant (requests from kubectl, the test's own
admin, are let through).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

_CORE = re.compile(r"^/api/v1(?:/namespaces/(?P<ns>[^/]+))?/(?P<rest>.+)$")
_GROUP = re.compile(r"^/apis/(?P<group>[^/]+)/(?P<version>[^/]+)(?:/namespaces/(?P<ns>[^/]+))?/(?P<rest>.+)$")


@dataclass(frozen=True, slots=True)
class Call:
    verb: str
    group: str
    resource: str  # plural, or plural/subresource
    namespace: str | None
    agent: str
    code: int = 0  # the answer's status code (0: not answered yet)


def parse(method: str, path: str, query: dict[str, str]) -> tuple[str, str, str, str | None] | None:
    """(verb, group, resource, namespace) of a resource request; None for discovery and non-resource URLs."""
    path = path.rstrip("/")
    if path == "/api/v1/namespaces" or re.fullmatch(r"/api/v1/namespaces/[^/]+", path):
        group, ns, parts = "", None, path.split("/")[3:]
    else:
        m = _CORE.match(path) or _GROUP.match(path)
        if m is None:
            return None
        group = m.groupdict().get("group") or ""
        ns = m.group("ns")
        parts = m.group("rest").split("/")
    if not parts or not parts[0]:
        return None
    resource, name = parts[0], parts[1] if len(parts) > 1 else None
    sub = parts[2] if len(parts) > 2 else None
    method = method.upper()
    if method == "GET":
        verb = "get" if name else ("watch" if query.get("watch") in ("true", "1") else "list")
    elif method == "POST":
        verb = "create"
    elif method == "PATCH":
        verb = "patch"
    elif method == "PUT":
        verb = "update"
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    else:
        return None
    return verb, group, f"{resource}/{sub}" if sub else resource, ns


def owner_finalizer_calls(body: Any, plurals: dict[tuple[str, str], str], namespace: str | None,
                          agent: str) -> list[Call]:
    """OwnerReferencesPermissionEnforcement: setting blockOwnerDeletion on a reference to an owner
    needs `update` on that owner's `finalizers` subresource."""
    meta = body.get("metadata") if isinstance(body, dict) else None
    out = []
    for ref in (meta or {}).get("ownerReferences") or []:
        if not ref.get("blockOwnerDeletion"):
            continue
        api_version = str(ref.get("apiVersion", ""))
        group = api_version.split("/")[0] if "/" in api_version else ""
        plural = plurals.get((group, str(ref.get("kind"))))
        if plural:
            out.append(Call("update", group, f"{plural}/finalizers", namespace, agent))
    return out


def needed(calls: Iterable[Call]) -> dict[tuple[str, str], set[str]]:
    """{(apiGroup, resource): verbs} for an RBAC rule set that allows exactly these calls."""
    out: dict[tuple[str, str], set[str]] = {}
    for c in calls:
        out.setdefault((c.group, c.resource), set()).add(c.verb)
    return out


def grants(rules: list[dict[str, Any]]) -> dict[tuple[str, str], set[str]]:
    """{(apiGroup, resource): verbs} of Role/ClusterRole rules (wildcards and resourceNames refused)."""
    out: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"], rule
        assert not rule.get("resourceNames") and not rule.get("nonResourceURLs"), rule
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                out.setdefault((group, res), set()).update(rule["verbs"])
    return out


@dataclass(slots=True)
class Policy:
    """Namespace -> the grants of the Roles bound there, plus cluster-wide grants (ClusterRole)."""

    namespaced: dict[str, dict[tuple[str, str], set[str]]] = field(default_factory=dict)
    cluster: dict[tuple[str, str], set[str]] = field(default_factory=dict)

    def allows(self, call: Call) -> bool:
        key = (call.group, call.resource)
        if call.verb in self.cluster.get(key, set()):
            return True
        return call.namespace is not None and call.verb in self.namespaced.get(call.namespace, {}).get(key, set())


def is_admin(agent: str) -> bool:
    """The test's own requests (kubectl), which play the cluster admin."""
    return agent.startswith("kubectl")
