"""`create_app(settings)`: the worker's FastAPI app(s). The engine is built in the lifespan.

The model loads in a background thread after the server is up, so `/health` (live) answers at
once and `/ready` turns 200 when the model and the `--lora-modules` adapters are loaded. With
`--admin-port`, `create_apps` returns a second app holding only the admin routes; both share one
`WorkerRuntime`, which the public app's lifespan owns.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from lorafleet.protocol import field_path
from lorafleet.worker.server.admin import router as admin_router
from lorafleet.worker.server.api import probes
from lorafleet.worker.server.api import router as public_router
from lorafleet.worker.server.auth import ApiKeyGuard
from lorafleet.worker.server.errors import ApiError, error_response
from lorafleet.worker.server.event_stream import WorkerApp
from lorafleet.worker.server.responses_route import router as responses_router
from lorafleet.worker.server.runtime import WorkerRuntime
from lorafleet.worker.server.settings import WorkerSettings
from lorafleet.worker.server.tokenize_routes import router as tokenize_router

log = logging.getLogger("lorafleet.worker")


def create_apps(settings: WorkerSettings) -> tuple[FastAPI, FastAPI | None]:
    """The public app, and the admin app when `admin_port` is set (else admin routes are public-port)."""
    runtime = WorkerRuntime.create(settings)
    separate = settings.admin_port is not None
    public = _build(runtime, public=True, admin=not separate, owns_runtime=True)
    admin = _build(runtime, public=False, admin=True, owns_runtime=False) if separate else None
    return public, admin


def create_app(settings: WorkerSettings) -> FastAPI:
    """One app with the public and the admin routes (use `create_apps` for a separate admin port)."""
    runtime = WorkerRuntime.create(settings)
    return _build(runtime, public=True, admin=True, owns_runtime=True)


def _build(runtime: WorkerRuntime, public: bool, admin: bool, owns_runtime: bool) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if owns_runtime:
            await runtime.start()
        try:
            yield
        finally:
            if owns_runtime:
                await runtime.stop()

    app = WorkerApp(title="lorafleet worker", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.runtime = runtime
    if public:
        app.include_router(public_router)
        app.include_router(tokenize_router)
        app.include_router(responses_router)
    if admin:
        app.include_router(admin_router)
    if not public:  # the admin port answers probes too
        app.include_router(probes)
    keys = runtime.settings.api_keys
    if public and keys:  # vLLM's --api-key; the admin routes keep their own token
        app.add_middleware(ApiKeyGuard, keys=keys, exempt={r.path for r in admin_router.routes} if admin else ())
    _install_error_handlers(app)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError):
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return error_response(exc.status, exc.message, exc.param, exc.reason, headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc.errors(), request.headers.get("content-type"))
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, exc: Exception):
        log.exception("internal error")
        return error_response(500, f"internal error: {type(exc).__name__}")


def validation_message(errors: Sequence[Any], content_type: str | None) -> tuple[str, str | None]:
    """The first validation error as `(message, param)`, `param` being its dotted field path.

    A body not sent as `application/json` is not parsed (FastAPI's strict content type: a browser
    may send text/plain or a form cross-site without a CORS preflight), so the body as a whole
    fails, as "Input should be a valid dictionary"; say what to send instead.
    """
    first = errors[0] if errors else {}
    loc = tuple(first.get("loc", ()))
    if loc == ("body",) and not _is_json(content_type):
        sent = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
        return f"the request body must be JSON sent with Content-Type: application/json ({sent} was sent)", None
    if loc == ("body",) and first.get("type") == "missing":
        return "the request body is empty: send a JSON object", None
    if first.get("type") == "json_invalid":  # its loc's number is where in the body the parse failed
        at = loc[1] if len(loc) > 1 else "?"
        reason = (first.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON ({reason}{': ' if reason else ''}at character {at})", None
    where = field_path(p for p in loc if p != "body")
    msg = str(first.get("msg", "invalid request"))
    return (f"{where}: {msg}" if where else msg), where or None


def _is_json(content_type: str | None) -> bool:
    media = (content_type or "").split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))
