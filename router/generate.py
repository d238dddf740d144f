"""The proxied routes, `/v1/completions`, `/v1/chat/completions` and `/v1/responses` (and vLLM's
`/tokenize` and `/detokenize`), as a pure-ASGI fast path.

Request path: authenticate → read and cap the body → resolve model/adapters and check the tenant may
use them → tenant limits → schedule (pure policy) → load if cold (single flight) → forward (retry
before the first byte) → relay. From the forward on, a client that disconnects cancels the upstream
request (uvicorn's `send` does not raise once the client is gone: `receive` says so).

`ProxyRoutes` is the outermost ASGI app and takes these routes straight from the ASGI scope: no
middleware, routing table, dependency injection or Request/Response objects on the hot path
(together several times the router's own work per request). Everything else (`/v1/models`,
`/metrics`, ...) goes on to FastAPI. A stream is relayed by `router/relay.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import ValidationError
from starlette.datastructures import State
from starlette.types import Receive, Scope, Send

from lorafleet.protocol import (
    HEADER_REPLICA,
    HEADER_ROUTE_REASON,
    HEADER_TENANT,
    ErrorResponse,
    field_path,
)
from lorafleet.router.fleet import Replica
from lorafleet.router.loader import LoadFailed
from lorafleet.router.proxy import (
    StreamBroken,
    UpstreamFailed,
    downstream_headers,
    send_once,
    upstream_headers,
)
from lorafleet.router.ratelimit import Lease, Limited
from lorafleet.router.relay import AsgiReply, ClientGone, Reply
from lorafleet.router.request_fields import UnknownModel, check_fields, resolve
from lorafleet.router.scheduling.types import Decision, NoEndpoint, RequestInfo
from lorafleet.router.tenants import Tenant
from lorafleet.router.upstream import Aborted
from lorafleet.router.worker_kinds import replicas_of_kind, request_body, request_headers, vllm_can_serve

if TYPE_CHECKING:
    from fastapi import FastAPI

    from lorafleet.router.gateway import Gateway

log = logging.getLogger("lorafleet.router")

PROXIED = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"})
# vLLM's tokenizer routes: any replica of the base answers (adapters do not change the tokenizer),
# so they are scheduled as base-model requests, load nothing, and reach the worker naming the base.
TOKENIZER_PATHS = frozenset({"/tokenize", "/detokenize"})
_JSON = (b"content-type", b"application/json")
CLIENT_GONE = "499"  # the requests metric's status for a client that left (nginx's code)
T = TypeVar("T")


class ProxyRoutes:
    """The outermost ASGI app: the proxied paths are served here (POST only), the rest by `app`
    (FastAPI, whose middleware and routing stay off the proxied requests' path).

    A bug in a proxied request answers 500 in the API's error envelope when nothing was sent
    yet, then propagates to the server (which logs it), as FastAPI's error middleware does."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    @property
    def state(self) -> State:
        return self.app.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in PROXIED:
            await self.app(scope, receive, send)
            return
        try:
            if scope["method"] == "POST":
                await generate(self.app.state.gateway, scope, receive, send)
            else:
                message = invalid_method(scope["method"], scope["path"])
                await respond_error(AsgiReply(scope, receive, send), 405, message, "invalid_request_error",
                                    headers={"Allow": "POST"})
        except Exception as exc:
            with contextlib.suppress(Exception):  # the response had started: only the server can end it
                await respond_error(AsgiReply(scope, receive, send), 500, f"internal error: {type(exc).__name__}",
                                    "server_error")
            raise


def invalid_method(method: str, path: str) -> str:
    """OpenAI's wording for a method a path does not take."""
    return f"Invalid method for URL ({method} {path})"


# ---- responses ---------------------------------------------------------------------------------
# A reply is where a request's answer goes: `router/relay.py`'s `AsgiReply` (any ASGI server) or
# `router/fast_http.py`'s request (the router's own protocol). Each has `respond(status, headers,
# body)` (a whole answer; `headers` without its content-length), `relay(upstream, headers,
# responses_api)` (a stream) and `gone_future()` (done when the client's connection is lost).


async def respond_error(
    reply: Reply,
    status: int,
    message: str,
    type_: str,
    code: str | int | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> None:
    body = error_body(message, type_, code, param)
    extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await reply.respond(status, [_JSON, *extra], body)


def error_body(message: str, type_: str, code: str | int | None = None, param: str | None = None) -> bytes:
    """The API's error envelope."""
    return json.dumps(ErrorResponse.of(message, type_, code, param).model_dump()).encode()


async def refuse_as_worker(reply: Reply, message: str, param: str | None) -> None:
    """A 400 the router makes in the worker's place (a field the worker would refuse): the worker's
    envelope word for word, `type` and `code` too, whichever of the two refuses."""
    body = json.dumps(ErrorResponse.as_worker(400, message, param).model_dump()).encode()
    await reply.respond(400, [_JSON], body)


async def model_not_found(reply: Reply, model: str, param: str | None = None) -> None:
    await respond_error(
        reply,
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        "invalid_request_error",
        "model_not_found",
        param,
    )


# ---- parsing -----------------------------------------------------------------------------------


def header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for k, v in headers:
        if k == name:  # ASGI servers lower-case header names
            return v.decode("latin-1")
    return None


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes | None:
    """The request body, or None when it is larger than `limit` (declared or actual)."""
    declared = header(scope["headers"], b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def unless_gone(work: Coroutine[Any, Any, T], gone: asyncio.Future[None]) -> T:
    """`work`'s result, unless the client disconnects first: then `work` is cancelled (closing its
    upstream request, which makes the worker abort) and ClientGone is raised."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.wait((task,))  # let its cleanup run
        raise ClientGone
    finally:
        task.cancel()  # no-op once done; stops it when this request itself is cancelled


_DECODER = json.JSONDecoder()  # json.loads' own, without its keyword handling
_JSON_SPACE = " \t\n\r"


def json_value(body: bytes) -> Any:
    """`json.loads(body)` (its value, or a ValueError), with its encoding sniffing skipped for the
    usual body: one starting with `{` and a second byte that is not NUL is UTF-8 to
    `json.detect_encoding` too; and nothing to skip before it, so only what follows is checked."""
    if body.startswith(b"{") and len(body) > 1 and body[1]:
        text = body.decode("utf-8", "surrogatepass")
        value, end = _DECODER.raw_decode(text)
        if end != len(text) and (rest := text[end:].lstrip(_JSON_SPACE)):
            raise json.JSONDecodeError("Extra data", text, len(text) - len(rest))  # as `json.loads`
        return value
    return json.loads(body)


# ---- the request -------------------------------------------------------------------------------


async def generate(gw: Gateway, scope: Scope, receive: Receive, send: Send) -> None:
    """A proxied request under an ASGI server: authenticate, read the body, then `proxy`."""
    reply = AsgiReply(scope, receive, send)
    tenant = gw.tenants.authenticate(header(scope["headers"], b"authorization"))
    if tenant is None:
        return await unauthorized(reply)
    limit = gw.settings.max_body_bytes
    try:
        body = await read_body(scope, receive, limit)
    except ClientGone:
        return
    if body is None:
        return await too_large(reply, limit)
    await proxy(gw, scope["path"], scope["headers"], tenant, body, reply)


async def answer(gw: Gateway, path: str, headers: list[tuple[bytes, bytes]], body: bytes | None, reply: Reply) -> None:
    """A proxied request whose body was read by the server (None: larger than the limit)."""
    tenant = gw.tenants.authenticate(header(headers, b"authorization"))
    if tenant is None:
        return await unauthorized(reply)
    if body is None:
        return await too_large(reply, gw.settings.max_body_bytes)
    await proxy(gw, path, headers, tenant, body, reply)


async def unauthorized(reply: Reply) -> None:
    await respond_error(reply, 401, "Invalid API key.", "invalid_request_error", "invalid_api_key")


async def too_large(reply: Reply, limit: int) -> None:
    await respond_error(reply, 413, f"Request body larger than {limit} bytes.", "invalid_request_error")


async def proxy(gw: Gateway, path: str, client_headers: list[tuple[bytes, bytes]], tenant: Tenant, body: bytes,
                reply: Reply) -> None:
    """The request from its parse on: checks, limits, schedule, forward (with retries), answer."""
    started = time.perf_counter()
    try:
        payload = json_value(body)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser's stack
        payload = None
    if not isinstance(payload, dict):
        return await respond_error(reply, 400, "Request body must be a JSON object.", "invalid_request_error")
    tokenizing = path in TOKENIZER_PATHS
    model = payload.get("model")
    if model is None and tokenizing and len(bases := gw.fleet.base_models()) == 1:
        model = payload["model"] = next(iter(bases))  # optional there, as in vLLM, when one base is served
    if model is None:
        return await respond_error(reply, 400, "`model` is required.", "invalid_request_error", param="model")
    if not isinstance(model, str):
        message = "model: Input should be a valid string"
        return await refuse_as_worker(reply, message, "model")
    problem = check_fields(payload, gw.settings, path)
    if problem:
        return await refuse_as_worker(reply, problem[1], problem[0])
    try:
        base, adapters = resolve(payload, gw)
    except ValidationError as exc:  # named as the worker names it: lora_adapters.0.scale
        first = exc.errors()[0]
        param = field_path(first["loc"], "lora_adapters")
        message = f"{param}: {first['msg']}" if first["loc"] else f"invalid `lora_adapters`: {first['msg']}"
        return await refuse_as_worker(reply, message, param)
    except UnknownModel as exc:
        return await model_not_found(reply, exc.name, exc.param)
    # Another tenant's adapter answers exactly like an unknown one: no existence oracle.
    if not tenant.may_use_model(base):
        return await model_not_found(reply, model)
    for denied in adapters:
        if not tenant.may_use_adapter(denied):
            return await model_not_found(reply, denied, None if denied == model else "lora_adapters")
    if tokenizing:
        adapters = ()
        body = json.dumps({**payload, "model": base}).encode()
    allowed = gw.fleet.max_loras_per_request(base) if len(adapters) > 1 else None
    if allowed is not None and len(adapters) > allowed:  # refused before any load is spent on it
        message = (f"{len(adapters)} adapters requested; the workers serving {base!r} allow "
                   f"max_loras_per_request={allowed}")
        return await refuse_as_worker(reply, message, "lora_adapters")
    adapter_label = "+".join(adapters) or "(base)"
    try:
        lease = await gw.limiter.acquire(tenant)
    except Limited as exc:
        gw.metrics.count_request(tenant, adapter_label, "429")
        return await respond_error(
            reply,
            429,
            f"Tenant limit reached: {exc.limit}.",
            "rate_limit_error",
            headers={"Retry-After": str(exc.retry_after_s)},
        )
    for a in adapters:
        gw.sync.demand[a] += 1
    gw.budget.deposit()
    req = RequestInfo(base, adapters)
    stream = bool(payload.get("stream"))
    # In a fleet of mixed workers, those taking fewer adapters per request than this one names.
    excluded: set[str] = gw.fleet.too_narrow(len(adapters)) if len(adapters) > 1 else set()
    if not vllm_can_serve(payload):  # a composition vLLM has no field for
        excluded |= replicas_of_kind(gw.fleet.replicas.values(), "vllm")
    # Adapters a worker was started with that the catalog lacks: no cold load can place them.
    unloadable = [a for a in adapters if not gw.loader.can_load(a)]
    waited = 0.0  # load waits and upstream time are not the router's own latency
    why: list[str] = []  # each attempt's failure, then why no attempt followed: all of it in the 503
    gone = reply.gone_future()
    try:
        for attempt in range(gw.settings.max_attempts):
            if attempt > 0 and not gw.budget.try_spend():
                why.append("retry budget exhausted")
                break
            lacking = {r.name for r in gw.fleet.replicas.values()
                       if any(a not in r.residency() for a in unloadable)} if unloadable else set()
            try:
                decision = gw.decider.schedule(req, excluded | lacking)
            except NoEndpoint as exc:
                why.append(str(exc))
                why += [f"adapter {a!r} is not in the catalog: only a replica holding it can serve it" for a in unloadable]
                break
            replica = gw.fleet.replicas[decision.endpoint.name]
            gw.metrics.count_route(decision.reason)
            gw.fleet.claim(replica, adapters)
            t0 = time.perf_counter()
            try:
                if decision.needs_load or replica.loading:
                    await unless_gone(prepare(gw, replica, decision, adapters), gone)
                headers = upstream_headers(client_headers, {HEADER_TENANT: tenant.name})
                if replica.kind == "vllm":  # the pool's token (a file's stat per lookup): only vLLM takes it here
                    headers.update(request_headers(replica.kind, gw.sync.tokens.headers(replica.pool)))
                url = replica.url + path
                sent = request_body(replica.kind, payload, body, adapters)
                upstream = await send_once(gw.upstream, url, sent, headers, stream, adapters, gone)
            except (ClientGone, Aborted):
                return await finish(gw, replica, adapters, lease, tenant, adapter_label, CLIENT_GONE)
            except (LoadFailed, UpstreamFailed) as exc:
                waited += time.perf_counter() - t0
                release(gw, replica, adapters)
                why.append(f"{replica.name}: {exc}")
                gw.metrics.retries.labels(getattr(exc, "reason", "load")).inc()
                if isinstance(exc, UpstreamFailed) and exc.missing:
                    # Stale routing, not a failing replica: the adapter left it after our last view
                    # (the operator moved it, the worker evicted it). Schedule again on the truth: a
                    # replica that holds it, else a cold load (this replica stays a candidate).
                    now = gw.fleet.clock()
                    for a in exc.missing:
                        replica.note(a, None, now)
                    continue
                # A load the replica refused or took too long over says nothing of its health:
                # another replica is tried, but only a fault counts towards ejecting this one.
                fault = isinstance(exc, UpstreamFailed) or exc.replica_fault
                if fault and gw.fleet.record_failure(replica.name, exc.unreachable):
                    gw.metrics.ejections.labels(replica.name).inc()
                    log.warning(
                        "ejected replica %s after %d failures", replica.name, gw.settings.eject_after_failures
                    )
                excluded.add(replica.name)
                continue
            except BaseException:  # a bug, or this request cancelled: give back what it holds
                await finish(gw, replica, adapters, lease, tenant, adapter_label, "500")
                raise
            gw.fleet.record_success(replica.name)
            waited += time.perf_counter() - t0
            out_headers = downstream_headers(
                upstream.raw_headers, {HEADER_REPLICA: replica.name, HEADER_ROUTE_REASON: decision.reason}
            )
            status = str(upstream.status)
            gw.metrics.added_latency.observe(max(0.0, time.perf_counter() - started - waited))
            if upstream.response is None:
                await finish(gw, replica, adapters, lease, tenant, adapter_label, status)
                return await reply.respond(upstream.status, out_headers, upstream.body)
            try:  # a client that leaves closes the exchange (send_once's `gone`): Aborted
                await reply.relay(upstream, out_headers, path == "/v1/responses")
            except (StreamBroken, OSError):  # upstream broke (the client got an SSE error) or send failed
                status = "stream_error"
            except Aborted:
                status = CLIENT_GONE
            finally:
                upstream.response.close()  # mid-stream, this makes the worker abort
                await finish(gw, replica, adapters, lease, tenant, adapter_label, status)
            return
    finally:
        gone.cancel()
    await lease.release()
    gw.metrics.count_request(tenant, adapter_label, "503")
    await respond_error(
        reply,
        503,
        f"No replica could serve the request ({'; then '.join(why) or 'no replica available'}).",
        "service_unavailable",
        headers={"Retry-After": "1"},
    )


def release(gw: Gateway, replica: Replica, adapters: tuple[str, ...]) -> None:
    for a in gw.fleet.release(replica, adapters):
        if a in replica.transient and a not in replica.loading:
            replica.transient.discard(a)  # not admitted to the cache: give the slot back
            asyncio.get_running_loop().create_task(gw.loader.unload(replica, a))


async def prepare(gw: Gateway, replica: Replica, decision: Decision, adapters: tuple[str, ...]) -> None:
    """Make room (admission victims), then load what is missing — or join a load under way.

    Cancelled when the client leaves (`unless_gone`): only the wait ends. The unloads run on, as
    do the loads (their own tasks, `AdapterLoader.ensure`), which other requests may be sharing."""
    pending = tuple(a for a in adapters if a in decision.needs_load or a in replica.loading)
    if not pending:
        return
    victims = [v for v in decision.admission.unload_before if replica.inflight_by_adapter.get(v, 0) == 0]
    if victims:
        await asyncio.shield(asyncio.gather(*(gw.loader.unload(replica, v) for v in victims)))
    for a in decision.needs_load:
        if decision.admission.admit:
            replica.transient.discard(a)
        else:
            replica.transient.add(a)
    await gw.loader.ensure(replica, pending)


async def finish(
    gw: Gateway,
    replica: Replica,
    adapters: tuple[str, ...],
    lease: Lease,
    tenant: Tenant,
    adapter_label: str,
    status: str,
) -> None:
    release(gw, replica, adapters)
    await lease.release()
    gw.metrics.count_request(tenant, adapter_label, status)
