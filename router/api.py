"""The gateway: `create_app(settings)` builds the app; clients are made in its lifespan.

The proxied routes (`/v1/completions`, `/v1/chat/completions`, `/v1/responses`, vLLM's tokenizer
routes) are served by the pure-ASGI fast
path in `generate.py`, in front of FastAPI; this module has the rest (`/v1/models`, health, metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from lorafleet.placement_store import MemoryPlacementStore, PlacementStore, RedisPlacementStore
from lorafleet.protocol import ErrorResponse, response_not_kept
from lorafleet.router.admin_tokens import AdminTokens
from lorafleet.router.decisions import Decider
from lorafleet.router.discovery import (
    SA_DIR,
    Discovery,
    KubernetesDiscovery,
    StaticDiscovery,
    placement_scope,
)
from lorafleet.router.fleet import Fleet
from lorafleet.router.gateway import Gateway
from lorafleet.router.generate import ProxyRoutes, invalid_method
from lorafleet.router.load_lease import LoadLeases
from lorafleet.router.loader import AdapterLoader
from lorafleet.router.metrics import RouterMetrics
from lorafleet.router.placement import PlacementSync
from lorafleet.router.proxy import RetryBudget, upstream_session
from lorafleet.router.ratelimit import RateLimiter
from lorafleet.router.redis_guard import GuardedPlacementStore, redis_breaker
from lorafleet.router.scheduling.policies import POLICIES, Policy
from lorafleet.router.settings import RouterSettings
from lorafleet.router.tenants import TenantRegistry

log = logging.getLogger("lorafleet.router")


def error(
    status: int, message: str, type_: str, code: str | int | None = None, **headers: str
) -> JSONResponse:
    return JSONResponse(
        ErrorResponse.of(message, type_, code).model_dump(), status_code=status, headers=headers
    )


async def http_error(request: Request, exc: Exception) -> JSONResponse:
    """Routing errors (unknown path, wrong method) in OpenAI's envelope, worded as OpenAI does."""
    assert isinstance(exc, HTTPException)
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        message = f"Invalid URL ({where})"
    elif exc.status_code == 405:
        message = invalid_method(request.method, request.url.path)
    else:
        message = str(exc.detail)
    return error(exc.status_code, message, "invalid_request_error", **(exc.headers or {}))


async def internal_error(_request: Request, exc: Exception) -> JSONResponse:
    """A bug's 500 in the envelope too (Starlette re-raises it afterwards, so the server logs it)."""
    return error(500, f"internal error: {type(exc).__name__}", "server_error")


def create_app(settings: RouterSettings, *, store: PlacementStore | None = None) -> ProxyRoutes:
    """`store` overrides the one `settings` describes (tests; `lorafleet up` with embedded state)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics = RouterMetrics.create(tenant_names=settings.metrics_token_file is not None)
        http = httpx.AsyncClient(
            timeout=httpx.Timeout(
                settings.read_timeout_s, connect=settings.connect_timeout_s, pool=settings.connect_timeout_s
            ),
            limits=httpx.Limits(
                max_connections=settings.max_connections, max_keepalive_connections=settings.max_connections
            ),
        )
        redis_client = None
        breaker = None
        placement: PlacementStore
        if store is not None:
            placement = store
        elif settings.redis_url:
            import redis.asyncio as aioredis

            # Short socket timeouts: Redis trouble must cost a request milliseconds, not seconds;
            # the breaker makes a hung Redis cost nothing once it has noticed (redis_guard.py).
            redis_client = aioredis.Redis.from_url(
                settings.redis_url, socket_timeout=0.25, socket_connect_timeout=0.25, decode_responses=True
            )
            breaker = redis_breaker(redis_client, metrics, settings.redis_timeout_s,
                                    settings.redis_breaker_failures, settings.redis_breaker_cooldown_s)
            placement = GuardedPlacementStore(RedisPlacementStore(redis_client, settings.redis_prefix), breaker)
        else:
            placement = MemoryPlacementStore()
        if settings.tenants_file is not None:
            tenants = TenantRegistry.from_file(settings.tenants_file)
        else:
            tenants = TenantRegistry.open_mode()
            log.warning("no --tenants-file: running OPEN (no API keys; every adapter usable by anyone)")
        discovery: Discovery
        k8s_http = None
        if settings.discovery == "kubernetes":
            k8s_http = httpx.AsyncClient(verify=str(SA_DIR / "ca.crt"), timeout=5.0)
            discovery = KubernetesDiscovery(
                k8s_http,
                settings.k8s_namespace,
                settings.k8s_selector,
                settings.k8s_port,
                settings.k8s_admin_port,
            )
        else:
            discovery = StaticDiscovery(settings.workers)
        fleet = Fleet(settings.replica_capacity, settings.eject_after_failures, settings.eject_cooldown_s)
        catalog = dict(settings.lora_modules)
        tokens = AdminTokens(settings.admin_token_file, settings.admin_token_dir, settings.admin_token)
        scope = settings.placement_scope
        if scope is None:
            scope = placement_scope(settings.k8s_namespace) if settings.discovery == "kubernetes" else ""
        sync = PlacementSync(
            fleet, placement, discovery, http, metrics, settings.placement_ttl_s, catalog, tokens, scope=scope
        )
        with contextlib.suppress(Exception):
            await placement.set_catalog(catalog)
        upstream = upstream_session(
            settings.max_connections, settings.connect_timeout_s, settings.read_timeout_s
        )
        gateway = Gateway(
            settings=settings,
            http=http,
            upstream=upstream,
            fleet=fleet,
            sync=sync,
            loader=AdapterLoader(
                http, sync, metrics, catalog, tokens, settings.load_timeout_s,
                leases=LoadLeases(redis_client, breaker, settings.redis_prefix) if redis_client else None,
            ),
            limiter=RateLimiter(redis_client, metrics, settings.redis_prefix, breaker=breaker),
            tenants=tenants,
            decider=Decider.of(fleet, lambda: _make_policy(settings), settings.verify_index, metrics.index_checks),
            budget=RetryBudget(settings.retry_budget_ratio, settings.retry_budget_min_per_s),
            metrics=metrics,
            catalog=catalog,
            metrics_token=AdminTokens(file=settings.metrics_token_file),
        )
        app.state.gateway = gateway
        with contextlib.suppress(Exception):
            await asyncio.wait_for(sync.sync_once(), timeout=5.0)
        task = asyncio.create_task(sync.run(settings.poll_interval_s))
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            await http.aclose()
            await upstream.close()
            if k8s_http is not None:
                await k8s_http.aclose()
            with contextlib.suppress(Exception):
                await placement.close()

    app = FastAPI(
        title="lorafleet router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.include_router(router)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
    return ProxyRoutes(app)  # its `state` is the FastAPI app's


def _make_policy(settings: RouterSettings) -> Policy:
    if settings.policy not in POLICIES:
        raise ValueError(f"unknown policy {settings.policy!r}; choose from {', '.join(POLICIES)}")
    return POLICIES[settings.policy]()


def get_gateway(request: Request) -> Gateway:
    return request.app.state.gateway


GatewayDep = Annotated[Gateway, Depends(get_gateway)]
router = APIRouter()


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready")
async def ready(gw: GatewayDep) -> JSONResponse:
    """Unauthenticated (probes): how many replicas serve, never which (their addresses)."""
    up = sum(1 for v in gw.fleet.views() if v.healthy and not v.ejected)
    return JSONResponse({"ready": bool(up), "replicas": up}, status_code=200 if up else 503)


@router.get("/metrics")
async def metrics(request: Request, gw: GatewayDep) -> Response:
    if gw.settings.metrics_token_file is not None:
        expected = gw.metrics_token.for_pool(None)
        presented = request.headers.get("authorization", "")
        scheme, _, token = presented.partition(" ")
        if not expected or scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), expected):
            return error(401, "/metrics needs the metrics bearer token.", "invalid_request_error",
                         "invalid_api_key", **{"WWW-Authenticate": "Bearer"})
    return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/responses/{response_id}")
@router.delete("/v1/responses/{response_id}")
@router.get("/v1/responses/{response_id}/input_items")
@router.post("/v1/responses/{response_id}/cancel")
async def stored_response(response_id: str, request: Request, gw: GatewayDep) -> JSONResponse:
    """The Responses API's routes on stored responses: the workers store none, and this is their
    404 (the worker's error object: the router answers in their place)."""
    if gw.tenants.authenticate(request.headers.get("authorization")) is None:
        return error(401, "Invalid API key.", "invalid_request_error", "invalid_api_key")
    body = ErrorResponse.as_worker(404, response_not_kept(response_id), "response_id").model_dump()
    return JSONResponse(body, status_code=404)


@router.get("/v1/models")
async def list_models(request: Request, gw: GatewayDep) -> JSONResponse:
    tenant = gw.tenants.authenticate(request.headers.get("authorization"))
    if tenant is None:
        return error(401, "Invalid API key.", "invalid_request_error", "invalid_api_key")
    served = gw.fleet.base_models()
    bases = sorted(m for m in served if tenant.may_use_model(m))
    created = int(time.time())  # the listing's time, as the worker (and vLLM) stamp their model cards
    data: list[dict[str, Any]] = [
        {"id": m, "object": "model", "created": created, "owned_by": "lorafleet"} for m in bases
    ]
    for adapter, parent in sorted(adapter_bases(gw, served).items()):
        # Listed only where the tenant may use both the adapter and the base it serves on: what a
        # request for it would be allowed (request_fields.resolve picks the same base).
        if tenant.may_use_adapter(adapter) and tenant.may_use_model(parent):
            data.append({"id": adapter, "object": "model", "created": created, "owned_by": "lorafleet",
                         "parent": parent or None})
    return JSONResponse({"object": "list", "data": data})


def adapter_bases(gw: Gateway, served: set[str]) -> dict[str, str]:
    """Each routable adapter -> the base model it serves on: a replica's holding it, else the
    fleet's first base (where a catalog adapter would be loaded); "" while no replica has answered."""
    found: dict[str, str] = {}
    for replica in gw.fleet.replicas.values():
        if replica.inventory is None:
            continue
        for a in replica.residency():
            if a not in gw.sync.retired:
                found.setdefault(a, replica.inventory.model)
    fallback = min(served) if served else ""
    for a in gw.catalog:
        found.setdefault(a, fallback)
    return found
