"""Admin routes (bearer token): load and unload adapters with vLLM's request shapes, and the
`GET /v1/adapters` inventory the router and the operator read.

Load: `lora_name` may not be the base model's served name (`model` naming it means the base).
`lora_path` must resolve (realpath, so `..` and symlinks are followed first) inside
`--adapter-root`; a relative path is taken relative to it. The folder is validated and read in a
thread before anything is evicted. Same name and same content → 200 (`created: false`); same name
and different content → 409 (unless `load_inplace` and no request uses the old version). Identical
loads that arrive together are read once (single flight per name and path).

`lora_path` may also be `s3://BUCKET/PREFIX` (worker/lora/sources.py): the folder is fetched into
the worker's adapter cache first, in a thread (worker/lora/fetch.py), then read and validated like a
local one; `hf://OWNER/NAME[/SUBFOLDER][@REVISION]` likewise, from the Hugging Face Hub. Other
schemes are refused. An optional
`sha256` pins the content: a different digest is refused (reason `DigestMismatch`) before serving.

Unload: new requests for the name get 404 at once; requests already in flight finish with the old
weights, which are freed when the last one ends (the inventory stops listing the name at once).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Request
from fastapi.routing import APIRoute

from lorafleet.protocol import (
    REASON_IN_USE,
    AdapterInfo,
    AdapterInventory,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
)
from lorafleet.worker.lora.adapter import AdapterError, LoraWeights
from lorafleet.worker.lora.registry import AdapterConflict
from lorafleet.worker.lora.sources import HubSource, LocalSource, S3Source, Source, parse_source
from lorafleet.worker.server.errors import ApiError, from_engine
from lorafleet.worker.server.runtime import WorkerRuntime

log = logging.getLogger("lorafleet.worker.server.admin")


def require_admin(request: Request, authorization: Annotated[str | None, Header()] = None) -> WorkerRuntime:
    runtime: WorkerRuntime = request.app.state.runtime
    if not runtime.admin_token.check(authorization):
        # Say why without echoing what was presented.
        why = "the admin API is disabled: start the worker with --admin-token-file" \
            if not runtime.admin_token.enabled else "missing or wrong admin bearer token"
        raise ApiError(401, why)
    return runtime


class AdminRoute(APIRoute):
    """Authenticates before FastAPI reads the body: its handler parses and validates the body before
    any dependency runs, so a dependency alone would answer a bad body's 400 to a caller without a
    token (and tell it the API's shape)."""

    def get_route_handler(self):  # noqa: ANN201 - Starlette's handler type
        handler = super().get_route_handler()

        async def authenticated(request: Request):  # noqa: ANN202
            require_admin(request, request.headers.get("authorization"))
            return await handler(request)

        return authenticated


Admin = Annotated[WorkerRuntime, Depends(require_admin)]
router = APIRouter(route_class=AdminRoute)


def _require_loading(adapter_root: str | None) -> None:
    if adapter_root is None:
        raise ApiError(403, "runtime adapter loading is disabled: start the worker with --adapter-root",
                       param="lora_path", reason="loading_disabled")


def resolve_adapter_path(lora_path: str, adapter_root: str | None) -> str:
    """The real path of `lora_path`, refused unless it lies inside the adapter root."""
    _require_loading(adapter_root)
    if "\0" in lora_path:
        raise ApiError(400, "lora_path contains a NUL byte", param="lora_path", reason="path_outside_root")
    root = os.path.realpath(adapter_root)
    candidate = lora_path if os.path.isabs(lora_path) else os.path.join(root, lora_path)
    real = os.path.realpath(candidate)
    if os.path.commonpath([root, real]) != root or real == root:
        raise ApiError(400, f"lora_path {lora_path!r} resolves outside the adapter root", param="lora_path",
                       reason="path_outside_root")
    return real


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraAdapterRequest, runtime: Admin) -> dict:
    runtime.require_engine()
    base = runtime.settings.model_name
    if body.lora_name == base:  # such an adapter could never be asked for
        raise ApiError(400, f"lora_name {base!r} is the base model's name; choose another", param="lora_name",
                       reason="base_model_name")
    source = resolve_source(body.lora_path, runtime.settings.adapter_root)
    want = None if body.sha256 is None else "sha256:" + body.sha256.lower().removeprefix("sha256:")
    key = (body.lora_name, str(source), body.load_inplace, want)
    task = runtime.loads.get(key)
    if task is None:
        task = asyncio.create_task(_load(runtime, body.lora_name, source, body.load_inplace, want))
        runtime.loads[key] = task
        task.add_done_callback(lambda _t: runtime.loads.pop(key, None))
    try:
        created = await asyncio.shield(task)  # callers that joined a load under way share its result
    except AdapterError as exc:
        if exc.reason == "unavailable":  # the store or the Hub kept failing: worth a retry later
            raise ApiError(503, str(exc), param="lora_path", reason=exc.reason) from None
        raise from_engine(exc) from None
    except Exception as exc:  # noqa: BLE001 - adapter problems are 4xx
        raise from_engine(exc) from None
    return {"status": "ok", "lora_name": body.lora_name, "created": created,
            "message": f"adapter {body.lora_name!r} {'loaded' if created else 'already loaded with this content'}"}


def resolve_source(lora_path: str, adapter_root: str | None) -> Source:
    """`lora_path` parsed: a local path resolved inside the adapter root (`resolve_adapter_path`),
    an s3:// or hf:// source as given (runtime loads must be enabled all the same); others refused."""
    try:
        source = parse_source(lora_path)
    except AdapterError as exc:
        raise ApiError(400, str(exc), param="lora_path", reason=exc.reason) from None
    if isinstance(source, S3Source | HubSource):
        _require_loading(adapter_root)
        return source
    return LocalSource(resolve_adapter_path(lora_path, adapter_root))


async def _load(runtime: WorkerRuntime, name: str, source: Source, inplace: bool, want: str | None) -> bool:
    """One physical load (counted in `lorafleet:lora_admin_loads_total` by result)."""
    path = str(source)
    try:
        created = await _read_and_register(runtime, name, source, inplace, want)
    except Exception as exc:  # noqa: BLE001 - counted, then mapped to 4xx by the caller
        reason = getattr(exc, "reason", None) or type(exc).__name__
        runtime.metrics.admin_loads.labels(reason).inc()
        log.warning("load of %s from %s refused: %s", name, path, exc)
        raise
    runtime.metrics.admin_loads.labels("loaded" if created else "already_loaded").inc()
    return created


async def _read_and_register(runtime: WorkerRuntime, name: str, source: Source, inplace: bool,
                             want: str | None) -> bool:
    engine = runtime.require_engine()
    registry = engine.engine.registry
    if isinstance(source, LocalSource):
        return await _register_folder(runtime, name, str(source), source, inplace, want)
    # Fetched (or found in the cache) in a thread, then read as a local folder. The folder is leased
    # until registered (no other fetch's eviction removes it meanwhile); after that the registry's
    # paths protect it (a CPU-cache eviction re-reads from there).
    loaded = await engine.call(lambda: {e.path for e in registry.entries.values()})
    path = await asyncio.to_thread(runtime.fetcher.fetch, source, engine.engine.config.max_adapter_bytes,
                                   lambda: loaded)
    try:
        return await _register_folder(runtime, name, path, source, inplace, want)
    finally:
        runtime.fetcher.release(path)


async def _register_folder(runtime: WorkerRuntime, name: str, path: str, source: Source, inplace: bool,
                           want: str | None) -> bool:
    engine = runtime.require_engine()
    registry = engine.engine.registry
    # Validate and read off the engine thread: nothing is evicted before this succeeds.
    weights: LoraWeights = await asyncio.to_thread(registry.read, path)
    if want is not None:
        got = await asyncio.to_thread(lambda: weights.digest.value)
        if got != want:
            raise AdapterError("DigestMismatch", f"digest mismatch for {source}: expected {want}, got {got}")
    old = registry.entries.get(name)
    if old is not None:  # comparing contents needs both digests: wait for them here, not on the engine thread
        await asyncio.to_thread(lambda: (weights.digest.value, old.digest.value))

    def register() -> bool:
        old = registry.entries.get(name)
        if inplace and old is not None and not old.removed and old.digest.value != weights.digest.value:
            if old.in_flight:
                raise AdapterConflict(REASON_IN_USE, f"adapter {name!r} has {old.in_flight} requests in flight; "
                                      "load the new version under a new name")
            registry.unregister(name)
        _entry, created = registry.register(name, weights)
        return created

    created = await engine.call(register)
    if created:
        shown = weights.digest.value[:19] if weights.digest.ready else "digest still hashing"
        log.info("loaded adapter %s (rank %d, %s) from %s", name, weights.max_rank, shown, source)
    return created


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, runtime: Admin) -> dict:
    engine = runtime.require_engine()

    def unload() -> int:
        entry = engine.engine.registry.unregister(body.lora_name)  # AdapterNotFound -> 404
        return entry.in_flight

    try:
        in_flight = await engine.call(unload)
    except AdapterError as exc:
        raise from_engine(exc) from None
    log.info("unloaded adapter %s (%d requests still finishing with it)", body.lora_name, in_flight)
    return {"status": "ok", "lora_name": body.lora_name, "requests_in_flight": in_flight,
            "message": f"adapter {body.lora_name!r} unloaded"}


@router.get("/v1/adapters")
async def adapters(runtime: Admin) -> AdapterInventory:
    engine = runtime.require_engine()
    s = runtime.settings

    def inventory() -> AdapterInventory | list:
        e = engine.engine
        reg = e.registry
        # A digest still hashing is never joined here, on the engine thread (it would stall every
        # request's steps for the hash, ~0.1 s per 80 MiB): the caller waits for it and asks again.
        hashing = [reg.entries[n].digest for n in reg.names() if not reg.entries[n].digest.ready]
        if hashing:
            return hashing
        now = reg.clock()

        def idle(last_used: float | None) -> float | None:
            return None if last_used is None else round(max(0.0, now - last_used), 3)

        infos = [
            AdapterInfo(name=n, tier=reg.tier(n), rank=reg.entries[n].rank, alpha=reg.entries[n].alpha,
                        digest=reg.entries[n].digest.value, path=reg.entries[n].path,
                        requests_in_flight=reg.entries[n].in_flight, pinned=reg.entries[n].pinned,
                        last_used=reg.entries[n].last_used, idle_s=idle(reg.entries[n].last_used))
            for n in reg.names()
        ]
        return AdapterInventory(
            model=s.model_name, max_loras=e.config.max_loras, max_cpu_loras=e.config.max_cpu_loras,
            max_lora_rank=e.config.max_lora_rank, max_loras_per_request=e.config.max_loras_per_request,
            num_requests_running=len(e.scheduler.running), num_requests_waiting=len(e.scheduler.waiting),
            kv_cache_usage=e.blocks.usage(), adapters=infos,
        )

    # Digests still hashing (an adapter loaded in the last ~0.1 s) are waited for off the engine thread.
    while True:
        answer = await engine.call(inventory)
        if isinstance(answer, AdapterInventory):
            return answer
        await asyncio.to_thread(lambda pending=answer: [d.value for d in pending])
