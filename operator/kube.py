"""A small async Kubernetes client (httpx) for the writes kopf does not do for us.

kopf patches only the object a handler runs for; the reconciler also writes the status of many
LoraAdapters, and creates the pool's children. Credentials come from kopf's own login helpers, so
in-cluster service accounts and kubeconfigs behave exactly as for kopf.
"""

from __future__ import annotations

import base64
import ssl
import tempfile
from typing import Any

import httpx

MERGE_PATCH = "application/merge-patch+json"
# Built-in kinds only: lists merge by their key (a pod condition by its `type`) instead of being replaced.
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


class KubeError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason


class NotFound(KubeError):
    pass


class Conflict(KubeError):
    pass


def _tls(info: Any) -> ssl.SSLContext | bool:
    if getattr(info, "insecure", False):
        return False
    ctx = ssl.create_default_context()
    if info.ca_path:
        ctx.load_verify_locations(cafile=info.ca_path)
    elif info.ca_data:
        data = info.ca_data if isinstance(info.ca_data, str) else info.ca_data.decode()
        if "BEGIN CERTIFICATE" not in data:
            data = base64.b64decode(data).decode()
        ctx.load_verify_locations(cadata=data)
    if info.certificate_path and info.private_key_path:
        ctx.load_cert_chain(info.certificate_path, info.private_key_path)
    elif info.certificate_data and info.private_key_data:
        with tempfile.NamedTemporaryFile("wb") as cert, tempfile.NamedTemporaryFile("wb") as key:
            for f, d in ((cert, info.certificate_data), (key, info.private_key_data)):
                raw = d if isinstance(d, bytes) else d.encode()
                f.write(raw if b"BEGIN" in raw else base64.b64decode(raw))
                f.flush()
            ctx.load_cert_chain(cert.name, key.name)
    return ctx


class KubeClient:
    def __init__(self, client: httpx.AsyncClient) -> None:
        self._http = client
        self.writes = 0  # API writes made (for the benchmark's writes-per-CR figure)

    @classmethod
    def from_connection_info(cls, info: Any, timeout_s: float = 30.0) -> KubeClient:
        headers = {"Authorization": f"Bearer {info.token}"} if getattr(info, "token", None) else {}
        auth = (info.username, info.password) if getattr(info, "username", None) else None
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        http = httpx.AsyncClient(
            base_url=info.server, headers=headers, auth=auth, verify=_tls(info), timeout=timeout_s, limits=limits
        )
        return cls(http)

    async def close(self) -> None:
        await self._http.aclose()

    @staticmethod
    def path(api_version: str, plural: str, namespace: str | None, name: str | None = None, sub: str | None = None) -> str:
        base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
        parts = [base]
        if namespace:
            parts.append(f"namespaces/{namespace}")
        parts.append(plural)
        if name:
            parts.append(name)
        if sub:
            parts.append(sub)
        return "/".join(parts)

    async def _request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        response = await self._http.request(method, path, **kwargs)
        if method != "GET":
            self.writes += 1
        if response.status_code < 400:
            return response.json() if response.content else {}
        try:
            body = response.json()
        except ValueError:
            body = {}
        reason, message = str(body.get("reason", "")), str(body.get("message", response.text[:200]))
        if response.status_code == 404:
            raise NotFound(404, reason, message)
        if response.status_code == 409:
            raise Conflict(409, reason, message)
        raise KubeError(response.status_code, reason, message)

    async def get(self, path: str) -> dict[str, Any]:
        return await self._request("GET", path)

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._request("POST", path, json=body)

    async def patch(self, path: str, body: dict[str, Any], content_type: str = MERGE_PATCH) -> dict[str, Any]:
        return await self._request("PATCH", path, json=body, headers={"Content-Type": content_type})

    async def delete(self, path: str) -> dict[str, Any]:
        return await self._request("DELETE", path)
