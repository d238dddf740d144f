"""Endpoint discovery: where the workers are. Static (local fleet) or the pods of a worker pool."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

import httpx

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class Discovery(Protocol):
    async def endpoints(self) -> list[tuple[str, str]]:
        """(replica name, base URL) pairs."""


def replica_name(url: str) -> str:
    parsed = urlparse(url)
    return parsed.netloc or url


class StaticDiscovery:
    def __init__(self, urls: Sequence[str]) -> None:
        self._eps = [(replica_name(u), u.rstrip("/")) for u in urls]

    async def endpoints(self) -> list[tuple[str, str]]:
        return list(self._eps)


class KubernetesDiscovery:
    """Ready pods matching a label selector, through the API server with the pod's service account.

    Needs RBAC `list pods` in the namespace. Replica name = pod name, so placement entries written by
    the operator (which knows pods by name) line up with the router's.
    """

    def __init__(self, http: httpx.AsyncClient, namespace: str, selector: str, port: int) -> None:
        self._http = http
        self._namespace = namespace
        self._selector = selector
        self._port = port

    async def endpoints(self) -> list[tuple[str, str]]:
        token = (SA_DIR / "token").read_text().strip()
        resp = await self._http.get(
            f"https://kubernetes.default.svc/api/v1/namespaces/{self._namespace}/pods",
            params={"labelSelector": self._selector},
            headers={"Authorization": f"Bearer {token}"},
        )
        resp.raise_for_status()
        return pods_to_endpoints(resp.json(), self._port)


def pods_to_endpoints(pod_list: dict, port: int) -> list[tuple[str, str]]:
    out = []
    for pod in pod_list.get("items", []):
        ip = pod.get("status", {}).get("podIP")
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in pod.get("status", {}).get("conditions", [])
        )
        if ip and ready and not pod.get("metadata", {}).get("deletionTimestamp"):
            out.append((pod["metadata"]["name"], f"http://{ip}:{port}"))
    return out
