"""LoraPool / LoraAdapter specs as frozen dataclasses, parsed from the custom resources' dicts.

The CRD schema (crds/) rejects most mistakes at `kubectl apply`; `parse_*` re-check what the
operator relies on, because objects may predate a schema change or come from a lax API server.
A `SpecError` is permanent: the object is marked Failed and not retried until it changes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

GROUP = "lorafleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
POOL_LABEL = f"{GROUP}/pool"

_SHA256 = re.compile(r"^[a-f0-9]{64}$")


class SpecError(ValueError):
    """A manifest the operator cannot act on; `reason` is the CamelCase condition reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class EngineSpec:
    max_loras: int = 4
    max_cpu_loras: int = 16
    max_lora_rank: int = 64
    max_loras_per_request: int = 4
    device: str = "cuda"
    dtype: str = "auto"


@dataclass(frozen=True, slots=True)
class PoolSpec:
    namespace: str
    name: str
    image: str
    model_path: str
    served_name: str
    model_claim: str | None = None
    replicas: int = 2
    workload_kind: str = "Deployment"
    image_pull_policy: str = "IfNotPresent"
    resources: Mapping[str, Mapping[str, Any]] | None = None
    engine: EngineSpec = EngineSpec()
    adapter_claim: str | None = None
    adapter_mount: str = "/adapters"
    http_port: int = 8000
    admin_port: int = 8001
    requests_per_replica: float = 5.0
    max_unavailable: int | str = 1

    @property
    def token_secret(self) -> str:
        return f"{self.name}-admin-token"

    @property
    def selector(self) -> dict[str, str]:
        return {POOL_LABEL: self.name}


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    namespace: str
    name: str
    pool: str
    source: str
    sha256: str | None = None
    rank: int | None = None
    min_replicas: int = 1
    max_replicas: int = 1
    pinned: bool = False
    tenants: tuple[str, ...] = ()


def parse_pool(namespace: str, name: str, spec: Mapping[str, Any]) -> PoolSpec:
    model = spec.get("model") or {}
    if not spec.get("image"):
        raise SpecError("MissingImage", "spec.image is required")
    if not model.get("path") or not model.get("servedName"):
        raise SpecError("MissingModel", "spec.model.path and spec.model.servedName are required")
    engine_raw = spec.get("engine") or {}
    engine = EngineSpec(
        max_loras=int(engine_raw.get("maxLoras", 4)),
        max_cpu_loras=int(engine_raw.get("maxCpuLoras", 16)),
        max_lora_rank=int(engine_raw.get("maxLoraRank", 64)),
        max_loras_per_request=int(engine_raw.get("maxLorasPerRequest", 4)),
        device=str(engine_raw.get("device", "cuda")),
        dtype=str(engine_raw.get("dtype", "auto")),
    )
    if engine.max_loras > engine.max_cpu_loras:
        raise SpecError("InvalidEngine", "engine.maxLoras must be <= engine.maxCpuLoras")
    volume = spec.get("adapterVolume") or {}
    ports = spec.get("ports") or {}
    pool = PoolSpec(
        namespace=namespace,
        name=name,
        image=str(spec["image"]),
        model_path=str(model["path"]),
        served_name=str(model["servedName"]),
        model_claim=model.get("claimName"),
        replicas=int(spec.get("replicas", 2)),
        workload_kind=str(spec.get("workloadKind", "Deployment")),
        image_pull_policy=str(spec.get("imagePullPolicy", "IfNotPresent")),
        resources=spec.get("resources"),
        engine=engine,
        adapter_claim=volume.get("claimName"),
        adapter_mount=str(volume.get("mountPath", "/adapters")),
        http_port=int(ports.get("http", 8000)),
        admin_port=int(ports.get("admin", 8001)),
        requests_per_replica=float((spec.get("placement") or {}).get("requestsPerReplica", 5.0)),
        max_unavailable=spec.get("maxUnavailable", 1),
    )
    if pool.http_port == pool.admin_port:
        raise SpecError("InvalidPorts", "ports.http and ports.admin must differ")
    if pool.workload_kind not in ("Deployment", "StatefulSet"):
        raise SpecError("InvalidWorkloadKind", f"workloadKind {pool.workload_kind!r} is not Deployment or StatefulSet")
    return pool


def parse_adapter(namespace: str, name: str, spec: Mapping[str, Any]) -> AdapterSpec:
    pool = spec.get("pool")
    source = spec.get("source")
    if not pool:
        raise SpecError("MissingPool", "spec.pool is required")
    if not source or not isinstance(source, str):
        raise SpecError("MissingSource", "spec.source is required")
    if "://" in source:
        raise SpecError("SourceNotAllowed", f"remote source {source!r} is not allow-listed; put it on the pool's volume")
    if source.startswith("/") or ".." in source.split("/"):
        raise SpecError("SourceOutsideVolume", f"source {source!r} must be relative to the adapter volume, without '..'")
    replicas = spec.get("replicas") or {}
    lo, hi = int(replicas.get("min", 1)), int(replicas.get("max", 1))
    if lo < 0 or hi < 1 or lo > hi:
        raise SpecError("InvalidReplicas", f"replicas.min ({lo}) must be between 0 and replicas.max ({hi})")
    sha = spec.get("sha256")
    if sha is not None and not _SHA256.match(str(sha)):
        raise SpecError("InvalidDigest", "sha256 must be 64 lowercase hex digits")
    rank = spec.get("rank")
    return AdapterSpec(
        namespace=namespace,
        name=name,
        pool=str(pool),
        source=source,
        sha256=sha,
        rank=int(rank) if rank is not None else None,
        min_replicas=lo,
        max_replicas=hi,
        pinned=bool(spec.get("pinned", False)),
        tenants=tuple(spec.get("tenants") or ()),
    )


def check_against_pool(adapter: AdapterSpec, pool: PoolSpec) -> None:
    """Checks that need the pool; raise before any load so nothing is evicted for a doomed adapter."""
    if adapter.rank is not None and adapter.rank > pool.engine.max_lora_rank:
        raise SpecError(
            "RankTooHigh",
            f"rank {adapter.rank} exceeds pool {pool.name}'s maxLoraRank {pool.engine.max_lora_rank}",
        )


def digest_matches(expected_hex: str | None, reported: str) -> bool:
    """Workers report "sha256:<hex>"; the manifest holds the bare hex."""
    return expected_hex is None or reported.removeprefix("sha256:") == expected_hex
