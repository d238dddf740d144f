"""Router settings: one frozen value built by the CLI (or a test) and handed to `create_app`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Literal

from lorafleet.connection_guard import ConnectionLimits
from lorafleet.protocol import MAX_N


@dataclass(frozen=True, slots=True)
class RouterSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    # Endpoint discovery: a static list of workers, or the pods of a worker pool. A static entry is
    # `URL[,admin=URL][,pool=NAME]` (see `discovery.parse_worker`).
    discovery: Literal["static", "kubernetes"] = "static"
    workers: tuple[str, ...] = ()
    k8s_namespace: str = "default"
    k8s_selector: str = "app.kubernetes.io/component=worker"
    k8s_port: int = 8000
    # The workers' admin port; None: the pod's container port named `admin`, else k8s_port.
    k8s_admin_port: int | None = None
    # None: in-process placement state and rate limits (one router process only).
    redis_url: str | None = None
    redis_prefix: str = "lorafleet"
    # Every Redis call on a request's path runs under redis_timeout_s (background ones 5x that);
    # this many failures in a row open the circuit breaker, and a ping probes it every cooldown.
    redis_timeout_s: float = 0.1
    redis_breaker_failures: int = 3
    redis_breaker_cooldown_s: float = 1.0
    # The store names replicas `scope/name` (placement_store.replica_key); None: the k8s namespace
    # with kubernetes discovery, "" with static workers (`lorafleet up` sets its reconciler's).
    placement_scope: str | None = None
    # None: open mode (no API keys), for local use; the router says so at start-up.
    tenants_file: Path | None = None
    # Adapter catalog for static mode: name -> source path as the workers see it.
    lora_modules: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # Admin-API bearer tokens: a file per pool in admin_token_dir, else admin_token_file, else
    # admin_token; files are re-read when they change (see `admin_tokens.py`).
    admin_token: str | None = None
    admin_token_file: Path | None = None
    admin_token_dir: Path | None = None
    # A bearer token /metrics requires (Prometheus: `authorization: {credentials_file: ...}`); with
    # it, tenant labels are names; without it /metrics is open and tenants appear as opaque labels.
    metrics_token_file: Path | None = None
    policy: str = "lorafleet"
    # Decide every request with the plain policy too and count disagreements with the indexed one.
    verify_index: bool = False
    load_factor: float = 1.25
    # Placement polling: each worker's GET /v1/adapters, published to the store with this TTL.
    poll_interval_s: float = 1.0
    placement_ttl_s: float = 10.0
    # Upstream timeouts and caps.
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 600.0
    load_timeout_s: float = 60.0
    max_connections: int = 1000
    max_body_bytes: int = 1 << 20
    max_tokens_cap: int = 8192
    max_n: int = MAX_N  # choices per prompt; at most the workers' MAX_N
    # Retries: attempts per request, and a fleet-wide budget (share of requests, plus a floor/s).
    max_attempts: int = 3
    retry_budget_ratio: float = 0.2
    retry_budget_min_per_s: float = 5.0
    # Ejection: after this many consecutive failures, out for the cooldown, then probed.
    eject_after_failures: int = 3
    eject_cooldown_s: float = 5.0
    replica_capacity: int = 64  # concurrent sequences a worker runs; normalises load scores
    # The proxied routes served by the router's own protocol on uvicorn's httptools parser
    # (`router/fast_http.py`: no ASGI scope, cycle or messages per request); False: every request
    # through plain uvicorn and the ASGI app (`--http-server uvicorn`), the same answers at more CPU.
    fast_http: bool = True
    # Client connections: head/body deadlines, keep-alive, per-client and total caps.
    connection_limits: ConnectionLimits = ConnectionLimits()
