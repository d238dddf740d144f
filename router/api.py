"""The gateway: `create_app(settings)` builds the FastAPI app; clients are made in its lifespan.

Request path: authenticate → parse and cap → resolve model/adapters and check the tenant may use
them → tenant limits → schedule (pure policy) → load if cold (single flight) → forward (retry
before the first byte) → relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from lorafleet.placement_store import MemoryPlacementStore, PlacementStore, RedisPlacementStore
from lorafleet.protocol import (
    HEADER_REPLICA,
    HEADER_ROUTE_REASON,
    HEADER_TENANT,
    ErrorResponse,
    LoraAdapterRef,
)
from lorafleet.router.admin_tokens import AdminTokens
from lorafleet.router.discovery import SA_DIR, Discovery, KubernetesDiscovery, StaticDiscovery
from lorafleet.router.fleet import Fleet, Replica
from lorafleet.router.loader import AdapterLoader, LoadFailed
from lorafleet.router.metrics import RouterMetrics
from lorafleet.router.placement import PlacementSync
from lorafleet.router.proxy import (
    RetryBudget,
    UpstreamFailed,
    downstream_headers,
    relay_stream,
    send_once,
    upstream_headers,
)
from lorafleet.router.ratelimit import Lease, Limited, RateLimiter
from lorafleet.router.scheduling.policies import POLICIES, Policy
from lorafleet.router.scheduling.types import Decision, NoEndpoint, RequestInfo
from lorafleet.router.settings import RouterSettings
from lorafleet.router.tenants import Tenant, TenantRegistry

log = logging.getLogger("lorafleet.router")


@dataclass(slots=True)
class Gateway:
    """Everything a request handler needs; built in the lifespan, stored on `app.state.gateway`."""

    settings: RouterSettings
    http: httpx.AsyncClient
    fleet: Fleet
    sync: PlacementSync
    loader: AdapterLoader
    limiter: RateLimiter
    tenants: TenantRegistry
    policy: Policy
    budget: RetryBudget
    metrics: RouterMetrics
    catalog: dict[str, str]


def error(
    status: int, message: str, type_: str, code: str | int | None = None, **headers: str
) -> JSONResponse:
    return JSONResponse(
        ErrorResponse.of(message, type_, code).model_dump(), status_code=status, headers=headers
    )


def _model_not_found(model: object) -> JSONResponse:
    return error(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        "invalid_request_error",
        "model_not_found",
    )


def create_app(settings: RouterSettings, *, store: PlacementStore | None = None) -> FastAPI:
    """`store` overrides the one `settings` describes (tests; `lorafleet up` with embedded state)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics = RouterMetrics.create()
        http = httpx.AsyncClient(
            timeout=httpx.Timeout(
                settings.read_timeout_s, connect=settings.connect_timeout_s, pool=settings.connect_timeout_s
            ),
            limits=httpx.Limits(
                max_connections=settings.max_connections, max_keepalive_connections=settings.max_connections
            ),
        )
        redis_client = None
        placement: PlacementStore
        if store is not None:
            placement = store
        elif settings.redis_url:
            import redis.asyncio as aioredis

            # Short socket timeouts: Redis trouble must cost a request milliseconds, not seconds.
            redis_client = aioredis.Redis.from_url(
                settings.redis_url, socket_timeout=0.25, socket_connect_timeout=0.25, decode_responses=True
            )
            placement = RedisPlacementStore(redis_client, settings.redis_prefix)
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
        sync = PlacementSync(
            fleet, placement, discovery, http, metrics, settings.placement_ttl_s, catalog, tokens
        )
        with contextlib.suppress(Exception):
            await placement.set_catalog(catalog)
        gateway = Gateway(
            settings=settings,
            http=http,
            fleet=fleet,
            sync=sync,
            loader=AdapterLoader(http, sync, metrics, catalog, tokens, settings.load_timeout_s),
            limiter=RateLimiter(redis_client, metrics, settings.redis_prefix),
            tenants=tenants,
            policy=_make_policy(settings),
            budget=RetryBudget(settings.retry_budget_ratio, settings.retry_budget_min_per_s),
            metrics=metrics,
            catalog=catalog,
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
            if k8s_http is not None:
                await k8s_http.aclose()
            with contextlib.suppress(Exception):
                await placement.close()

    app = FastAPI(
        title="lorafleet router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.include_router(router)
    return app


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
    up = [v.name for v in gw.fleet.views() if v.healthy and not v.ejected]
    return JSONResponse({"ready": bool(up), "replicas": up}, status_code=200 if up else 503)


@router.get("/metrics")
async def metrics(gw: GatewayDep) -> Response:
    return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(request: Request, gw: GatewayDep) -> JSONResponse:
    tenant = gw.tenants.authenticate(request.headers.get("authorization"))
    if tenant is None:
        return error(401, "Invalid API key.", "invalid_request_error", "invalid_api_key")
    bases = sorted(m for m in gw.fleet.base_models() if tenant.may_use_model(m))
    adapters = set(gw.catalog)
    for replica in gw.fleet.replicas.values():
        adapters.update(a for a in replica.residency() if a not in gw.sync.retired)
    parent = bases[0] if len(bases) == 1 else None
    data: list[dict[str, Any]] = [
        {"id": m, "object": "model", "created": 0, "owned_by": "lorafleet"} for m in bases
    ]
    data += [
        {"id": a, "object": "model", "created": 0, "owned_by": "lorafleet", "parent": parent}
        for a in sorted(adapters)
        if tenant.may_use_adapter(a)
    ]
    return JSONResponse({"object": "list", "data": data})


@router.post("/v1/completions")
async def completions(request: Request, gw: GatewayDep) -> Response:
    return await generate(request, gw, "/v1/completions")


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, gw: GatewayDep) -> Response:
    return await generate(request, gw, "/v1/chat/completions")


async def _read_body(request: Request, limit: int) -> bytes | None:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _check_caps(payload: dict, s: RouterSettings) -> str | None:
    for field in ("max_tokens", "max_completion_tokens"):
        value = payload.get(field)
        if value is not None and (not isinstance(value, int) or value < 0 or value > s.max_tokens_cap):
            return f"`{field}` must be an integer in [0, {s.max_tokens_cap}]"
    n = payload.get("n")
    if n is not None and (not isinstance(n, int) or n < 1 or n > s.max_n):
        return f"`n` must be an integer in [1, {s.max_n}]"
    return None


def _resolve(payload: dict, gw: Gateway) -> tuple[str, tuple[str, ...]] | None:
    """(base model, adapters) for the request's `model` / `lora_adapters`, or None if unknown."""
    model = payload.get("model")
    if not isinstance(model, str):
        return None
    bases = gw.fleet.base_models()
    if model in bases:
        refs = [LoraAdapterRef.model_validate(r) for r in payload.get("lora_adapters") or []]
        adapters = tuple(dict.fromkeys(r.name for r in refs))
        known = all(_adapter_known(a, gw) for a in adapters)
        return (model, adapters) if known else None
    if not _adapter_known(model, gw):
        return None
    holders = [
        r.inventory.model for r in gw.fleet.replicas.values() if r.inventory and model in r.residency()
    ]
    base = holders[0] if holders else (sorted(bases)[0] if bases else "")
    return base, (model,)


def _adapter_known(name: str, gw: Gateway) -> bool:
    return gw.sync.known(name)


async def generate(request: Request, gw: GatewayDep, path: str) -> Response:
    started = time.perf_counter()
    tenant = gw.tenants.authenticate(request.headers.get("authorization"))
    if tenant is None:
        return error(401, "Invalid API key.", "invalid_request_error", "invalid_api_key")
    body = await _read_body(request, gw.settings.max_body_bytes)
    if body is None:
        return error(
            413, f"Request body larger than {gw.settings.max_body_bytes} bytes.", "invalid_request_error"
        )
    try:
        payload = json.loads(body)
        if not isinstance(payload, dict):
            raise ValueError("not an object")
    except ValueError:
        return error(400, "Request body must be a JSON object.", "invalid_request_error")
    problem = _check_caps(payload, gw.settings)
    if problem:
        return error(400, problem, "invalid_request_error")
    try:
        resolved = _resolve(payload, gw)
    except ValidationError as exc:
        return error(
            400,
            f"invalid `lora_adapters`: {exc.errors()[0]['msg']}",
            "invalid_request_error",
            param="lora_adapters",
        )
    if resolved is None:
        return _model_not_found(payload.get("model"))
    base, adapters = resolved
    # Another tenant's adapter answers exactly like an unknown one: no existence oracle.
    if not tenant.may_use_model(base) or not all(tenant.may_use_adapter(a) for a in adapters):
        return _model_not_found(payload.get("model"))
    adapter_label = "+".join(adapters) or "(base)"
    try:
        lease = await gw.limiter.acquire(tenant)
    except Limited as exc:
        gw.metrics.requests.labels(tenant.name, adapter_label, "429").inc()
        return error(
            429,
            f"Tenant limit reached: {exc.limit}.",
            "rate_limit_error",
            **{"Retry-After": str(exc.retry_after_s)},
        )
    for a in adapters:
        gw.sync.demand[a] += 1
    gw.budget.deposit()
    req = RequestInfo(base, adapters)
    stream = bool(payload.get("stream"))
    excluded: set[str] = set()
    waited = 0.0  # load waits and upstream time are not the router's own latency
    last = "no replica available"
    for attempt in range(gw.settings.max_attempts):
        if attempt > 0 and not gw.budget.try_spend():
            last = "retry budget exhausted"
            break
        try:
            decision = gw.policy.schedule(req, gw.fleet.views(exclude=excluded))
        except NoEndpoint as exc:
            last = str(exc)
            break
        replica = gw.fleet.replicas[decision.endpoint.name]
        gw.metrics.routes.labels(decision.reason).inc()
        _claim(replica, adapters)
        t0 = time.perf_counter()
        try:
            await _prepare(gw, replica, decision, adapters)
            headers = upstream_headers(request.headers, {HEADER_TENANT: tenant.name})
            response = await send_once(gw.http, replica.url + path, body, headers, stream)
        except (LoadFailed, UpstreamFailed) as exc:
            waited += time.perf_counter() - t0
            _release(gw, replica, adapters)
            unreachable = getattr(exc, "unreachable", False)
            if gw.fleet.record_failure(replica.name, unreachable):
                gw.metrics.ejections.labels(replica.name).inc()
                log.warning(
                    "ejected replica %s after %d failures", replica.name, gw.settings.eject_after_failures
                )
            excluded.add(replica.name)
            last = f"{replica.name}: {exc}"
            gw.metrics.retries.labels(getattr(exc, "reason", "load")).inc()
            continue
        gw.fleet.record_success(replica.name)
        waited += time.perf_counter() - t0
        out_headers = downstream_headers(
            response.headers, {HEADER_REPLICA: replica.name, HEADER_ROUTE_REASON: decision.reason}
        )
        status = str(response.status_code)
        if not stream:
            await _finish(gw, replica, adapters, lease, tenant, adapter_label, status)
            gw.metrics.added_latency.observe(max(0.0, time.perf_counter() - started - waited))
            return Response(response.content, response.status_code, out_headers)
        gw.metrics.added_latency.observe(max(0.0, time.perf_counter() - started - waited))

        async def on_close(ok: bool, replica: Replica = replica, status: str = status) -> None:
            await _finish(
                gw, replica, adapters, lease, tenant, adapter_label, status if ok else "stream_error"
            )

        media = response.headers.get("content-type", "text/event-stream")
        return StreamingResponse(
            relay_stream(response, on_close), response.status_code, out_headers, media_type=media
        )
    await lease.release()
    gw.metrics.requests.labels(tenant.name, adapter_label, "503").inc()
    return error(
        503, f"No replica could serve the request ({last}).", "service_unavailable", **{"Retry-After": "1"}
    )


def _claim(replica: Replica, adapters: tuple[str, ...]) -> None:
    replica.inflight += 1
    for a in adapters:
        replica.inflight_by_adapter[a] += 1


def _release(gw: Gateway, replica: Replica, adapters: tuple[str, ...]) -> None:
    replica.inflight = max(0, replica.inflight - 1)
    for a in adapters:
        replica.inflight_by_adapter[a] -= 1
        if replica.inflight_by_adapter[a] <= 0:
            del replica.inflight_by_adapter[a]
            if a in replica.transient and a not in replica.loading:
                replica.transient.discard(a)  # not admitted to the cache: give the slot back
                asyncio.get_running_loop().create_task(gw.loader.unload(replica, a))


async def _prepare(gw: Gateway, replica: Replica, decision: Decision, adapters: tuple[str, ...]) -> None:
    """Make room (admission victims), then load what is missing — or join a load under way."""
    pending = tuple(a for a in adapters if a in decision.needs_load or a in replica.loading)
    if not pending:
        return
    victims = [v for v in decision.admission.unload_before if replica.inflight_by_adapter.get(v, 0) == 0]
    if victims:
        await asyncio.gather(*(gw.loader.unload(replica, v) for v in victims))
    for a in decision.needs_load:
        if decision.admission.admit:
            replica.transient.discard(a)
        else:
            replica.transient.add(a)
    await gw.loader.ensure(replica, pending)


async def _finish(
    gw: Gateway,
    replica: Replica,
    adapters: tuple[str, ...],
    lease: Lease,
    tenant: Tenant,
    adapter_label: str,
    status: str,
) -> None:
    _release(gw, replica, adapters)
    await lease.release()
    gw.metrics.requests.labels(tenant.name, adapter_label, status).inc()
