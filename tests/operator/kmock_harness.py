"""kmock's KubernetesEmulator, patched where kopf and kubectl need a more faithful API server.

Gaps covered (kmock 0.8):
- `GET /api/v1/namespaces[/<name>]` (and its watch) crashes its path parser: namespaces are served
  here, so kopf's namespace scanning works too.
- objects get no uid/resourceVersion/creationTimestamp/generation: set on create, bumped on writes
  (generation only when `spec` changes, as for CRDs with a status subresource).
- create answers 200: 201 here. PUT (replace) is served. JSON-patch lists and merge patches both.
- lists lack kind/apiVersion; `/api/v1` discovery reports groupVersion "/v1".
- error reasons are free text: NotFound / AlreadyExists / Conflict, which kubectl and kopf parse.
- no garbage collection: deleting an owner deletes its dependents (ownerReferences by uid).
- a `default` Namespace exists; CRDs from crds/ are registered for discovery (kind, short names,
  namespaced, verbs, status subresource) and their printer columns are rendered as server-side
  Tables for `kubectl get`.
Not covered: watch streams keep kmock's octet-stream content type (kopf does not mind); namespaces
added after the start are not announced on the namespace watch (in-process tests run kopf with
`settings.scanning.disabled = True` and exact namespace names); no admission (CEL, schema) — the
CRD schema is tested separately. The API's own conventions (Status errors, label selectors,
Tables) are in `kube_api`; watch streams, which resume from a resourceVersion, in `kube_watch`.
Knob: `refuse_creates` fails creates of a resource as admission would (a quota, a webhook, a field
the real API server validates), and `create_attempts` counts the creates asked for.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import uuid
from collections.abc import Iterable
from dataclasses import replace as answered
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
import yaml
from kmock._internal import dicts, enums, rendering

from tests.operator.kube_api import ApiError, matches_selector, now, status_response, table
from tests.operator.kube_audit import Call, Policy, is_admin, owner_finalizer_calls, parse
from tests.operator.kube_watch import WatchLog, watch_unchanging

ROOT = Path(__file__).resolve().parents[2]
CRD_DIR = ROOT / "crds"

ALL_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]

BUILTINS: dict[str, dict[str, Any]] = {
    "v1/namespaces": {"kind": "Namespace", "namespaced": False, "shortnames": {"ns"}},
    "apiextensions.k8s.io/v1/customresourcedefinitions": {"kind": "CustomResourceDefinition", "namespaced": False,
                                                          "shortnames": {"crd"}},
    "v1/pods": {"kind": "Pod", "namespaced": True, "shortnames": {"po"}, "subresources": {"status"}},
    "v1/services": {"kind": "Service", "namespaced": True, "shortnames": {"svc"}},
    "v1/secrets": {"kind": "Secret", "namespaced": True},
    "v1/events": {"kind": "Event", "namespaced": True, "shortnames": {"ev"}},
    "apps/v1/deployments": {"kind": "Deployment", "namespaced": True, "shortnames": {"deploy"}, "subresources": {"status", "scale"}},
    "apps/v1/statefulsets": {"kind": "StatefulSet", "namespaced": True, "shortnames": {"sts"}, "subresources": {"status"}},
    "policy/v1/poddisruptionbudgets": {"kind": "PodDisruptionBudget", "namespaced": True, "shortnames": {"pdb"}},
    "events.k8s.io/v1/events": {"kind": "Event", "namespaced": True},
}


@attrs.define(kw_only=True)
class PatchedEmulator(kmock.KubernetesEmulator):
    _rv: Any = attrs.field(factory=lambda: itertools.count(1), init=False)
    _kinds: dict[Any, str] = attrs.field(factory=dict, init=False)
    _columns: dict[Any, list[dict[str, Any]]] = attrs.field(factory=dict, init=False)
    _namespaces: dict[str, dict[str, Any]] = attrs.field(factory=dict, init=False)
    _write_lock: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)
    writes: dict[tuple[str, str, str], int] = attrs.field(factory=dict, init=False)  # (plural, ns, name) -> writes
    # plural -> (code, reason, message): creates of that resource are refused, as admission would
    # (a quota, a policy webhook, a field the real API server validates and kmock does not).
    refuse_creates: dict[str, tuple[int, str, str]] = attrs.field(factory=dict, init=False)
    create_attempts: dict[str, int] = attrs.field(factory=dict, init=False)  # plural -> creates asked for
    _watch: WatchLog = attrs.field(factory=WatchLog, init=False)
    # The audit log: every resource request (kube_audit.Call, with its answer's code), and the RBAC
    # in force (None: everything allowed; a Policy: 403 for what its Roles do not grant).
    audit: list[Call] = attrs.field(factory=list, init=False)
    policy: Policy | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        kmock.KubernetesEmulator.__attrs_post_init__(self)
        for key, info in BUILTINS.items():
            self.declare(key, **info)
        for path in sorted(CRD_DIR.glob("*.yaml")):
            self.declare_crd(yaml.safe_load(path.read_text()))
        self.add_namespace("default")

    # ---- setup ---------------------------------------------------------------------------------

    def declare(self, key: str, *, kind: str, namespaced: bool, shortnames: Iterable[str] = (),
                subresources: Iterable[str] = (), columns: list[dict[str, Any]] | None = None,
                singular: str | None = None) -> None:
        resource = kmock.resource(key)
        self.resources[resource] = kmock.ResourceInfo(
            kind=kind, namespaced=namespaced, singular=singular or kind.lower(), verbs=set(ALL_VERBS),
            shortnames=set(shortnames), subresources=set(subresources),
        )
        self._kinds[resource] = kind
        if columns:
            self._columns[resource] = columns

    def declare_crd(self, crd: dict[str, Any]) -> None:
        spec = crd["spec"]
        for version in spec["versions"]:
            self.declare(
                f"{spec['group']}/{version['name']}/{spec['names']['plural']}",
                kind=spec["names"]["kind"],
                namespaced=spec["scope"] == "Namespaced",
                shortnames=spec["names"].get("shortNames", ()),
                subresources=(version.get("subresources") or {}).keys(),
                columns=version.get("additionalPrinterColumns"),
                singular=spec["names"].get("singular"),
            )

    def add_namespace(self, name: str) -> None:
        self._namespaces[name] = {
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "uid": str(uuid.uuid4()), "resourceVersion": str(next(self._rv)),
                         "creationTimestamp": now()},
            "status": {"phase": "Active"},
        }

    def get(self, resource: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        key = (kmock.resource(resource), namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return self.objects[key].raw

    def items(self, resource: str, namespace: str | None = None) -> list[dict[str, Any]]:
        res = kmock.resource(resource)
        return [
            obj.raw for (r, ns, _), obj in list(self.objects.items())
            if r == res and not obj.deleted and (namespace is None or ns == namespace)
        ]

    # ---- direct (in-process) writes, used by the test kubelet ---------------------------------

    async def put_object(self, resource: str, body: dict[str, Any]) -> dict[str, Any]:
        res = kmock.resource(resource)
        meta = body["metadata"]
        key = (res, meta.get("namespace"), meta["name"])
        async with self._write_lock:
            if key in self.objects and not self.objects[key].deleted:
                return await self._patch(res, key, body, replace=True)
            return await self._create(res, key, body)

    async def patch_object(self, resource: str, namespace: str | None, name: str, patch: Any) -> dict[str, Any]:
        res = kmock.resource(resource)
        async with self._write_lock:
            return await self._patch(res, (res, namespace, name), patch)

    async def delete_object(self, resource: str, namespace: str | None, name: str) -> None:
        res = kmock.resource(resource)
        async with self._write_lock:
            await self._delete(res, (res, namespace, name))

    # ---- the HTTP surface ----------------------------------------------------------------------

    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        parsed = parse(raw.method, raw.path, dict(raw.query))
        if parsed is None:
            return await self._serve(raw)
        agent = raw.headers.get("User-Agent", "")
        calls = [Call(*parsed, agent)]
        if raw.method in ("POST", "PATCH", "PUT") and raw.can_read_body:
            try:
                body = json.loads(await raw.read() or b"null")
            except ValueError:
                body = None
            plurals = {(r.group or "", kind): r.plural for r, kind in self._kinds.items()}
            calls += owner_finalizer_calls(body, plurals, parsed[3], agent)
        if self.policy is not None and not is_admin(agent):
            denied = [c for c in calls if not self.policy.allows(c)]
            if denied:
                self.audit += [answered(c, code=403) for c in calls]
                c = denied[0]
                return status_response(403, "Forbidden", f'{c.resource} is forbidden: cannot {c.verb} resource '
                                       f'"{c.resource}" in API group "{c.group}" in the namespace "{c.namespace}"')
        start = len(self.audit)  # entries are only appended: this slice stays this request's
        self.audit += calls  # code 0 until answered (a watch is answered when its stream ends)
        response = await self._serve(raw)
        self.audit[start:start + len(calls)] = [answered(c, code=response.status) for c in calls]
        return response

    async def _serve(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        m = re.fullmatch(r"/api/v1/namespaces(?:/([^/]+))?/?", raw.path)
        if m and raw.method == "GET" and raw.query.get("watch") != "true":
            return self._serve_namespaces(m.group(1))
        if m and raw.method == "GET" and m.group(1) is None:
            return await watch_unchanging(raw, self._namespaces)
        return await kmock.KubernetesEmulator.__call__(self, raw)

    def _serve_namespaces(self, name: str | None) -> aiohttp.web.Response:
        if name is None:
            return aiohttp.web.json_response({
                "apiVersion": "v1", "kind": "NamespaceList",
                "metadata": {"resourceVersion": str(next(self._rv))}, "items": list(self._namespaces.values()),
            })
        if name not in self._namespaces:
            return status_response(404, "NotFound", f'namespaces "{name}" not found')
        return aiohttp.web.json_response(self._namespaces[name])

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        if request.action == enums.action.WATCH and res in self._kinds:
            return await self._watch.stream(request, self.items)
        if res is None or request.action in (enums.action.LIST, enums.action.WATCH, enums.action.FETCH):
            if request.action in (enums.action.LIST, enums.action.FETCH) and res in self._kinds:
                return self._serve_read(request)
            return await kmock.KubernetesEmulator._handle(self, request)
        method = str(getattr(request.method, "value", request.method)).upper()
        if res not in self._kinds:
            return status_response(404, "NotFound", f"the server could not find the requested resource ({res})")
        async with self._write_lock:
            try:
                if method == "POST" and request.name is None:
                    body = dict(request.data or {})
                    meta = body.setdefault("metadata", {})
                    meta.setdefault("namespace", request.namespace)
                    if not meta.get("name") and meta.get("generateName"):
                        meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
                    key = (res, request.namespace or meta.get("namespace"), meta.get("name"))
                    return aiohttp.web.json_response(await self._create(res, key, body), status=201)
                key = (res, request.namespace, request.name)
                if method == "PATCH":
                    patch = request.data if request.data is not None else json.loads(request.text or "{}")
                    kind = request.headers.get("Content-Type", "") or request.headers.get("content-type", "")
                    if "strategic-merge-patch" in kind:
                        patch = strategic_conditions(self.objects[key].raw if key in self.objects else {}, patch)
                    return aiohttp.web.json_response(await self._patch(res, key, patch, sub=request.subresource))
                if method == "PUT":
                    return aiohttp.web.json_response(
                        await self._patch(res, key, request.data, replace=True, sub=request.subresource))
                if method == "DELETE":
                    return aiohttp.web.json_response(await self._delete(res, key))
            except ApiError as exc:
                return status_response(exc.code, exc.reason, exc.message)
        return status_response(405, "MethodNotAllowed", f"{method} is not supported here")

    def _serve_read(self, request: rendering.Request) -> aiohttp.web.Response:
        res = request.resource
        kind = self._kinds[res]
        api_version = f"{res.group}/{res.version}" if res.group else res.version
        if request.action == enums.action.FETCH:
            key = (res, request.namespace, request.name)
            if key not in self.objects or self.objects[key].deleted:
                plural = res.plural
                return status_response(404, "NotFound", f'{plural}.{res.group} "{request.name}" not found')
            items = [self.objects[key].raw]
        else:
            selector = request.params.get("labelSelector")
            items = [
                obj.raw for (r, ns, _), obj in list(self.objects.items())
                if r == res and not obj.deleted and (request.namespace is None or ns == request.namespace)
            ]
            if selector:
                items = [o for o in items if matches_selector(o, selector)]
        accept = request.headers.get("Accept", "") or request.headers.get("accept", "")
        if "as=Table" in accept:
            return aiohttp.web.json_response(table(self._columns.get(res), items, str(next(self._rv))))
        if request.action == enums.action.FETCH:
            return aiohttp.web.json_response(items[0])
        return aiohttp.web.json_response({
            "apiVersion": api_version, "kind": f"{kind}List",
            "metadata": {"resourceVersion": str(next(self._rv))}, "items": items,
        })

    async def _serve_version(self, request: rendering.Request) -> Any:  # fixes groupVersion "/v1"
        payload = await kmock.KubernetesEmulator._serve_version(self, request)
        if isinstance(payload, dict) and payload.get("groupVersion", "").startswith("/"):
            payload["groupVersion"] = payload["groupVersion"][1:]
        return payload

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        if isinstance(exc, kmock.KubernetesError):
            reason = {404: "NotFound", 409: "AlreadyExists"}.get(exc.status, exc.reason or "InternalError")
            return status_response(exc.status, reason, exc.message or reason)
        return await kmock.KubernetesEmulator._render_error(self, exc)

    # ---- object mutations (under _write_lock) -------------------------------------------------

    def _count(self, key: Any) -> None:
        res, ns, name = key
        k = (res.plural, ns or "", name or "")
        self.writes[k] = self.writes.get(k, 0) + 1

    async def _emit(self, res: Any, kind: str, raw: dict[str, Any]) -> None:
        if kind == "DELETED":
            raw = {**raw, "metadata": {**raw["metadata"], "resourceVersion": str(next(self._rv))}}
        await self._watch.append(res, kind, raw)

    def _fill(self, res: Any, body: dict[str, Any]) -> None:
        body.setdefault("apiVersion", f"{res.group}/{res.version}" if res.group else res.version)
        body.setdefault("kind", self._kinds[res])

    async def _create(self, res: Any, key: Any, body: dict[str, Any]) -> dict[str, Any]:
        self.create_attempts[res.plural] = self.create_attempts.get(res.plural, 0) + 1
        if res.plural in self.refuse_creates:
            raise ApiError(*self.refuse_creates[res.plural])
        if not key[2]:
            raise ApiError(422, "Invalid", "metadata.name is required")
        if key in self.objects and not self.objects[key].deleted:
            raise ApiError(409, "AlreadyExists", f'{res.plural} "{key[2]}" already exists')
        body = json.loads(json.dumps(body))
        self._fill(res, body)
        meta = body.setdefault("metadata", {})
        meta.update(uid=str(uuid.uuid4()), resourceVersion=str(next(self._rv)), creationTimestamp=now(), generation=1)
        if key[1]:
            meta["namespace"] = key[1]
        if key in self.objects:
            self.objects[key].create(body)
        else:
            self.objects[key] = body
        self._count(key)
        await self._emit(res, "ADDED", body)
        return body

    async def _patch(self, res: Any, key: Any, patch: Any, *, replace: bool = False, sub: str | None = None) -> dict[str, Any]:
        if key not in self.objects or self.objects[key].deleted:
            raise ApiError(404, "NotFound", f'{res.plural} "{key[2]}" not found')
        obj = self.objects[key]
        old = obj.raw
        if replace:
            new = json.loads(json.dumps(patch))
            new.setdefault("metadata", {})
            for k in ("uid", "creationTimestamp", "generation", "deletionTimestamp"):
                if k in old["metadata"]:
                    new["metadata"].setdefault(k, old["metadata"][k])
            if sub == "status":
                new = {**old, "status": new.get("status")}
        elif isinstance(patch, list):
            try:
                new = jsonpatch.apply_patch(json.loads(json.dumps(old)), patch)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                # A failed `test` of resourceVersion: kopf expects 422 and retries on the next cycle.
                raise ApiError(422, "Invalid", f"the JSON patch did not apply: {exc}") from exc
        else:
            if sub == "status":
                patch = {"status": (patch or {}).get("status"), "metadata": (patch or {}).get("metadata")}
                patch = {k: v for k, v in patch.items() if v is not None}
            new = dict(dicts.patch_dict(json.loads(json.dumps(old)), patch or {}))
        self._fill(res, new)
        meta = new.setdefault("metadata", {})
        meta["resourceVersion"] = str(next(self._rv))
        if new.get("spec") != old.get("spec"):
            meta["generation"] = int(old["metadata"].get("generation", 1)) + 1
        obj.create(new)
        self._count(key)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            await self._remove(res, key)
        else:
            await self._emit(res, "MODIFIED", obj.raw)
        return new

    async def _delete(self, res: Any, key: Any) -> dict[str, Any]:
        if key not in self.objects or self.objects[key].deleted:
            raise ApiError(404, "NotFound", f'{res.plural} "{key[2]}" not found')
        obj = self.objects[key]
        raw = obj.raw
        self._count(key)
        if raw["metadata"].get("finalizers"):
            if not raw["metadata"].get("deletionTimestamp"):
                obj.patch({"metadata": {"deletionTimestamp": now(), "resourceVersion": str(next(self._rv))}})
                await self._emit(res, "MODIFIED", obj.raw)
            return obj.raw
        await self._remove(res, key)
        return raw

    async def _remove(self, res: Any, key: Any) -> None:
        obj = self.objects[key]
        raw = obj.raw
        obj.delete()
        await self._emit(res, "DELETED", raw)
        # Garbage collection: dependents of the removed owner go too (background propagation).
        uid = raw["metadata"].get("uid")
        for dep_key, dep in list(self.objects.items()):
            if dep.deleted:
                continue
            refs = dep.raw["metadata"].get("ownerReferences") or []
            if any(r.get("uid") == uid for r in refs):
                await self._delete(dep_key[0], dep_key)


def strategic_conditions(current: dict[str, Any], patch: Any) -> Any:
    """A strategic merge patch as a merge patch: `status.conditions` merge by `type` (their patch
    strategy on built-in kinds) instead of replacing the list. The only list it is used for here."""
    conditions = ((patch or {}).get("status") or {}).get("conditions") if isinstance(patch, dict) else None
    if conditions is None:
        return patch
    merged = {c.get("type"): c for c in (current.get("status") or {}).get("conditions") or []}
    for c in conditions:
        merged[c.get("type")] = {**merged.get(c.get("type"), {}), **c}
    return {**patch, "status": {**patch["status"], "conditions": list(merged.values())}}


def kubeconfig(url: str) -> str:
    return yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": url}}],
        "users": [{"name": "kmock", "user": {"token": "kmock"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": "default"}}],
    })
