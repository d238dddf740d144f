"""Endpoint discovery: where the workers are. Static (local fleet) or the pods of a worker pool.

A worker may serve its admin API (inventory, load/unload) on a port of its own (`lorafleet worker
--admin-port`, what the operator's pods do); an `Endpoint` carries both URLs and the worker's
LoraPool, whose admin token the router must present.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

import httpx

from lorafleet.vllm_inventory import VllmLimits

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# The operator labels every worker pod with its LoraPool (operator/spec.py POOL_LABEL); the router
# only reads it, so it names the label rather than importing the operator.
POOL_LABEL = "lorafleet.dev/pool"
ADMIN_PORT_NAME = "admin"
# A pod's server kind (`vllm` for a stock vLLM server, `lorafleet` for ours), as a label or an
# annotation; a pod without it is probed once (router/worker_kinds.py).
KIND_LABEL = "lorafleet.dev/worker-kind"
WORKER_KINDS = ("lorafleet", "vllm")
# `--worker` options and vLLM's flags that give a vLLM replica's limits its metrics do not report.
LIMIT_OPTIONS = {"max_loras": "--max-loras", "max_cpu_loras": "--max-cpu-loras", "max_lora_rank": "--max-lora-rank"}


@dataclass(frozen=True, slots=True)
class Endpoint:
    name: str
    url: str  # public API: generation, /health
    admin_url: str  # admin API: /v1/adapters, load/unload (== url when the worker serves both on one port)
    pool: str | None = None  # picks the admin token (one per LoraPool)
    kind: str | None = None  # "lorafleet" | "vllm"; None: probed once by the router
    limits: VllmLimits = VllmLimits()  # a vLLM replica's --max-loras/--max-cpu-loras/--max-lora-rank


class Discovery(Protocol):
    async def endpoints(self) -> list[Endpoint]: ...


def replica_name(url: str) -> str:
    parsed = urlparse(url)
    return parsed.netloc or url


def parse_worker(spec: str) -> Endpoint:
    """`[KIND=]URL[,admin=URL][,pool=NAME][,max_loras=N][,max_cpu_loras=N][,max_lora_rank=N]`: a
    `--worker` entry. KIND is `vllm` (a stock vLLM server) or `lorafleet`; without it the router probes
    the URL once. Without `admin=` the admin API is on URL. The max_* options give a vLLM server's
    flags of those names (vLLM's metrics do not report them; its defaults otherwise)."""
    first, *options = (part.strip() for part in spec.split(","))
    kind, sep, rest = first.partition("=")
    if sep and kind in WORKER_KINDS:
        first = rest
    elif sep and not first.startswith(("http://", "https://")):
        raise ValueError(f"--worker {spec!r}: the kind before = is one of {', '.join(WORKER_KINDS)}, got {kind!r}")
    else:
        kind = None
    url = first
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--worker {spec!r}: expected an http(s) URL first")
    fields: dict[str, str] = {}
    allowed = ("admin", "pool", *LIMIT_OPTIONS)
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in allowed or not value or key in fields:
            raise ValueError(f"--worker {spec!r}: options are {', '.join(o + '=' for o in allowed)}, got {option!r}")
        if key in LIMIT_OPTIONS and not (value.isdigit() and int(value) > 0):
            raise ValueError(f"--worker {spec!r}: {key} must be a positive integer, got {value!r}")
        fields[key] = value
    admin = fields.get("admin", url)
    if not admin.startswith(("http://", "https://")):
        raise ValueError(f"--worker {spec!r}: admin= must be an http(s) URL")
    url = url.rstrip("/")
    limits = VllmLimits(**{k: int(fields[k]) for k in LIMIT_OPTIONS if k in fields})
    return Endpoint(replica_name(url), url, admin.rstrip("/"), fields.get("pool"), kind, limits)


class StaticDiscovery:
    def __init__(self, workers: Sequence[str | Endpoint]) -> None:
        self._eps = [w if isinstance(w, Endpoint) else parse_worker(w) for w in workers]

    async def endpoints(self) -> list[Endpoint]:
        return list(self._eps)


def namespaces_of(namespace: str) -> list[str]:
    """`--k8s-namespace`: one namespace, or several separated by commas (those the operator watches)."""
    return [ns.strip() for ns in namespace.split(",") if ns.strip()]


def placement_scope(namespace: str) -> str:
    """The store's scope for `--k8s-namespace` (placement_store.replica_key): the namespace itself,
    or, across several, none, with each endpoint named `namespace/pod` as the operator names it."""
    names = namespaces_of(namespace)
    return names[0] if len(names) == 1 else ""


class KubernetesDiscovery:
    """Ready pods matching a label selector in one or more namespaces, through the API server with
    the pod's service account.

    Needs RBAC `list pods` in each namespace. Replica name = pod name (`namespace/pod` across several
    namespaces), so placement entries written by the operator (which knows pods by namespace and
    name) line up with the router's.
    """

    def __init__(
        self, http: httpx.AsyncClient, namespace: str, selector: str, port: int, admin_port: int | None = None
    ) -> None:
        self._http = http
        self._namespaces = namespaces_of(namespace)
        self._selector = selector
        self._port = port
        self._admin_port = admin_port

    async def endpoints(self) -> list[Endpoint]:
        token = (SA_DIR / "token").read_text().strip()
        out: list[Endpoint] = []
        for ns in self._namespaces:
            resp = await self._http.get(
                f"https://kubernetes.default.svc/api/v1/namespaces/{ns}/pods",
                params={"labelSelector": self._selector},
                headers={"Authorization": f"Bearer {token}"},
            )
            resp.raise_for_status()
            found = pods_to_endpoints(resp.json(), self._port, self._admin_port)
            if len(self._namespaces) > 1:
                found = [replace(e, name=f"{ns}/{e.name}") for e in found]
            out += found
        return out


def _named_port(pod: dict, name: str) -> int | None:
    for c in pod.get("spec", {}).get("containers", []):
        for p in c.get("ports", []):
            if p.get("name") == name and isinstance(p.get("containerPort"), int):
                return p["containerPort"]
    return None


def pods_to_endpoints(pod_list: dict, port: int, admin_port: int | None = None) -> list[Endpoint]:
    """Ready, not terminating pods. Admin port: `admin_port` if given, else the pod's container port
    named `admin` (the operator declares it, so pools with different ports work), else `port`."""
    out = []
    for pod in pod_list.get("items", []):
        status, meta = pod.get("status", {}), pod.get("metadata", {})
        ip = status.get("podIP")
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", [])
        )
        if not ip or not ready or meta.get("deletionTimestamp"):
            continue
        labels = meta.get("labels") or {}
        kind = labels.get(KIND_LABEL) or (meta.get("annotations") or {}).get(KIND_LABEL)
        kind = kind if kind in WORKER_KINDS else None
        admin = admin_port or _named_port(pod, ADMIN_PORT_NAME) or port
        if kind == "vllm":
            admin = port  # vLLM serves its LoRA endpoints on its one port
        pool = labels.get(POOL_LABEL)
        host = f"[{ip}]" if ":" in ip else ip  # IPv6 pod IPs
        out.append(Endpoint(meta["name"], f"http://{host}:{port}", f"http://{host}:{admin}", pool, kind,
                            _vllm_limits(pod) if kind == "vllm" else VllmLimits()))
    return out


def _vllm_limits(pod: dict) -> VllmLimits:
    """A vLLM pod's LoRA limits, read from its first container's command line (`--max-loras 4` or
    `--max-loras=4`)."""
    containers = pod.get("spec", {}).get("containers") or [{}]
    argv = [str(a) for a in (containers[0].get("command") or []) + (containers[0].get("args") or [])]
    found: dict[str, int] = {}
    for i, arg in enumerate(argv):
        for key, flag in LIMIT_OPTIONS.items():
            value = arg.partition("=")[2] if arg.startswith(flag + "=") else (
                argv[i + 1] if arg == flag and i + 1 < len(argv) else None)
            if value is not None and value.isdigit() and int(value) > 0:
                found[key] = int(value)
    return VllmLimits(**found)
